"""T5Config: shape and numerics of a T5 / flan-t5 encoder-decoder (HF T5Config field names).

`from_hf_dict` reads a T5ForConditionalGeneration config.json, `to_hf_dict` writes one; dtype,
param_dtype and remat_policy are native fields (as in ModelConfig). `from_model_block` reads
the run config's `config.model` block (family "t5", configs/common.py), `config_field` names
the config field behind a T5Config field (for validation lines).
"""

import dataclasses
import functools

import jax

from grpo_jax.models import remat as remat_lib

# HF's ACT2FN names; "gated-gelu" means the tanh approximation ("gelu_new"), plain "gelu" erf.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
}


# T5Config fields that config.model carries under the decoder-only name (same meaning); every
# other field lives in config.model.t5 under its own name.
SHARED_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_layers": "num_layers",
    "num_heads": "num_heads",
    "layer_norm_epsilon": "rms_norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "dtype": "dtype",
    "param_dtype": "param_dtype",
    "remat_policy": "remat_policy",
}


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Shape and numerics of a T5 encoder-decoder (HF T5Config field names)."""

  vocab_size: int = 256
  d_model: int = 64
  d_kv: int = 16
  d_ff: int = 128
  num_layers: int = 2  # encoder
  num_decoder_layers: int = 2
  num_heads: int = 4
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  tie_word_embeddings: bool = False  # the LM head is the shared embedding
  scale_decoder_outputs: bool = False  # decoder output * d_model**-0.5 before the LM head
  feed_forward_proj: str = "gated-gelu"  # or "relu" (original T5), "gated-silu", ...
  decoder_start_token_id: int = 0
  pad_token_id: int = 0
  eos_token_id: int = 1
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  remat_policy: str = "none"

  @property
  def gated(self) -> bool:
    return self.feed_forward_proj.startswith("gated-")

  @property
  def activation(self) -> str:
    return (
        "gelu_new"
        if self.feed_forward_proj == "gated-gelu"
        else self.feed_forward_proj.split("-")[-1]
    )

  def problems(self) -> list[tuple[str, str, str]]:
    """(field, why, fix) for every bad value; empty when the config is usable."""
    out = []
    for f in (
        "vocab_size",
        "d_model",
        "d_kv",
        "d_ff",
        "num_layers",
        "num_decoder_layers",
        "num_heads",
        "relative_attention_max_distance",
    ):
      if getattr(self, f) < 1:
        out.append((f, "must be >= 1", "give a positive size"))
    if self.relative_attention_num_buckets < 4:
      out.append(
          ("relative_attention_num_buckets", "needs >= 4 (2 directions x exact + log)", "e.g. 32")
      )
    if self.activation not in ACTIVATIONS or self.feed_forward_proj.count("-") > 1:
      out.append(
          (
              "feed_forward_proj",
              "unknown activation",
              f"use 'gated-gelu' (T5 v1.1) or 'relu' (T5); known: {', '.join(ACTIVATIONS)}",
          )
      )
    for f in ("param_dtype", "dtype"):
      if getattr(self, f) not in ("float32", "bfloat16", "float16"):
        out.append((f, "unknown dtype", "use float32, bfloat16 or float16"))
    if self.remat_policy not in remat_lib.POLICIES:
      out.append(
          ("remat_policy", "unknown remat policy", f"use one of {', '.join(remat_lib.POLICIES)}")
      )
    return out

  def validate(self) -> "T5Config":
    problems = self.problems()
    if problems:
      raise ValueError(
          "bad T5Config: "
          + "; ".join(f"{f}={getattr(self, f)!r}: {why} (fix: {fix})" for f, why, fix in problems)
      )
    return self

  @classmethod
  def from_hf_dict(cls, d: dict, **overrides) -> "T5Config":
    """From a T5ForConditionalGeneration config.json dict (+ native fields such as dtype).

    Older configs say `tie_word_embeddings` and imply the output scaling by it; transformers 5
    writes `scale_decoder_outputs` besides. Whether the head is tied is really a property of
    the weights: load_t5_hf decides it from the checkpoint (an lm_head.weight of its own)."""
    if d.get("model_type", "t5") != "t5":
      raise ValueError(
          f"config.json has model_type={d.get('model_type')!r}; T5Config reads "
          "T5 / flan-t5 (model_type 't5') configs"
      )
    tied = d.get("tie_word_embeddings", True)
    eos = d.get("eos_token_id", 1)
    pad = d.get("pad_token_id", 0)
    start = d.get("decoder_start_token_id")
    fields = dict(
        vocab_size=d["vocab_size"],
        d_model=d["d_model"],
        d_kv=d["d_kv"],
        d_ff=d["d_ff"],
        num_layers=d["num_layers"],
        num_decoder_layers=d.get("num_decoder_layers") or d["num_layers"],
        num_heads=d["num_heads"],
        relative_attention_num_buckets=d.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=d.get("relative_attention_max_distance", 128),
        layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-6),
        tie_word_embeddings=tied,
        scale_decoder_outputs=d.get("scale_decoder_outputs", tied),
        feed_forward_proj=d.get("feed_forward_proj", "relu"),
        decoder_start_token_id=pad if start is None else start,
        pad_token_id=pad,
        eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
    )
    return cls(**{**fields, **overrides}).validate()

  @classmethod
  def from_model_block(cls, m) -> "T5Config":
    """From config.model (a ConfigDict; not validated: see `problems`)."""
    fields = {f: m[name] for f, name in SHARED_FIELDS.items()}
    fields.update(
        {f.name: m.t5[f.name] for f in dataclasses.fields(cls) if f.name not in SHARED_FIELDS}
    )
    if not fields["num_decoder_layers"]:
      fields["num_decoder_layers"] = fields["num_layers"]
    if fields["scale_decoder_outputs"] is None:
      fields["scale_decoder_outputs"] = fields["tie_word_embeddings"]
    return cls(**fields)

  def to_hf_dict(self, torch_dtype: str = "float32") -> dict:
    return dict(
        architectures=["T5ForConditionalGeneration"],
        model_type="t5",
        is_encoder_decoder=True,
        vocab_size=self.vocab_size,
        d_model=self.d_model,
        d_kv=self.d_kv,
        d_ff=self.d_ff,
        num_layers=self.num_layers,
        num_decoder_layers=self.num_decoder_layers,
        num_heads=self.num_heads,
        relative_attention_num_buckets=self.relative_attention_num_buckets,
        relative_attention_max_distance=self.relative_attention_max_distance,
        layer_norm_epsilon=self.layer_norm_epsilon,
        feed_forward_proj=self.feed_forward_proj,
        tie_word_embeddings=self.tie_word_embeddings,
        scale_decoder_outputs=self.scale_decoder_outputs,
        decoder_start_token_id=self.decoder_start_token_id,
        pad_token_id=self.pad_token_id,
        eos_token_id=self.eos_token_id,
        torch_dtype=torch_dtype,
    )


def config_field(field: str) -> str:
  """The run-config field that sets T5Config `field`, e.g. d_model -> model.hidden_size."""
  return "model." + SHARED_FIELDS[field] if field in SHARED_FIELDS else "model.t5." + field
