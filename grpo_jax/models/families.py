"""Model families by their Hugging Face config.json: one registry entry per family.

    model = families.load_hf(path)        # the family config.json names, T5 included
    families.save_hf(model, path)         # the folder transformers loads back

An entry names the config.json `model_type`s and `architectures` it reads and the loader and
writer of its folders. Adding a family is one module with `load(path, dtype, **kw)` and
`save(model, path, **kw)` and one line in FAMILIES.
"""

import dataclasses
from typing import Callable

import jax.numpy as jnp

from grpo_jax.models.decoder import config as model_config
from grpo_jax.models.decoder import hf
from grpo_jax.models.t5 import hf as t5_hf
from grpo_jax.models.t5.model import T5


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  model_types: tuple[str, ...]
  architectures: tuple[str, ...]
  load: Callable  # (path, dtype, **kw) -> nnx.Module
  save: Callable  # (model, path, **kw)
  owns: Callable  # model -> bool: whether `save` writes this module


FAMILIES = (
    Family(
        "decoder (Qwen3, Qwen3-MoE, Llama 3, Gemma 2, Gemma 3)",
        tuple(model_config.HF_MODEL_TYPES),
        tuple(model_config.HF_ARCHITECTURES),
        hf.load_hf,
        hf.save_hf,
        lambda m: not isinstance(m, T5),
    ),
    Family(
        "t5 (T5 v1.1, flan-t5)",
        ("t5",),
        ("T5ForConditionalGeneration",),
        t5_hf.load_t5_hf,
        lambda m, path, **kw: t5_hf.save_t5_hf(m, None, path, **kw),
        lambda m: isinstance(m, T5),
    ),
)


def family_of(hf_config: dict, where: str = "config.json") -> Family:
  """The registry entry for a config.json (its model_type, else its architectures)."""
  model_type = hf_config.get("model_type", "")
  archs = hf_config.get("architectures") or []
  for f in FAMILIES:
    if model_type in f.model_types:
      return f
  for f in FAMILIES:
    if any(a in f.architectures for a in archs):
      return f
  known = "; ".join(f"{f.name}: model_type {', '.join(f.model_types)}" for f in FAMILIES)
  raise ValueError(
      f"{where}: unsupported architecture (model_type={model_type!r}, "
      f"architectures={archs}). Supported: {known}"
  )


def load_hf(path: str, dtype=jnp.float32, **kwargs):
  """A Hugging Face checkpoint folder of any registered family as its native module."""
  cfg = hf.read_hf_config(path)
  return family_of(cfg, f"{path}/config.json").load(path, dtype, **kwargs)


def save_hf(model, path: str, **kwargs):
  """`model` (any registered family's module) as a folder transformers loads."""
  for f in FAMILIES:
    if f.owns(model):
      return f.save(model, path, **kwargs)
  raise TypeError(f"no model family writes a {type(model).__name__}")
