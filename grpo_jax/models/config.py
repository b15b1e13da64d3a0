"""ModelConfig: one dataclass for Qwen3 dense and Llama 3 / 3.1 decoders, plus named presets.

Fields are plain values so `configs/common.py` can carry every one of them in `config.model`
(Llama-3 RoPE scaling is flattened into `rope_scaling_*`; factor 0 means no scaling).
Preset shapes are the published Hugging Face config.json values of each model.
"""
import dataclasses

from grpo_jax.models import remat

ARCHS = ("qwen3", "llama3")
# The names `remat.POLICIES` defines (a snapshot for importers; checks read POLICIES itself so
# a policy registered later is accepted too).
REMAT_POLICIES = tuple(remat.POLICIES)
DTYPES = ("float32", "bfloat16", "float16")
# How the training forward and the prefill attend (models/layers.py): "auto" = a fused
# (flash) kernel where the backend has one (GPU: cuDNN through jax.nn.dot_product_attention),
# else "xla"; "xla" = the masked einsum with its [.., T, S] f32 scores; "fused" = the fused path
# on every backend (on CPU it is jax.nn.dot_product_attention's XLA form: for tests).
ATTENTION_IMPLS = ("auto", "xla", "fused")

_HF_ARCH = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama3": ("LlamaForCausalLM", "llama")}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer."""
  arch: str = "qwen3"
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 1e6
  rope_scaling_factor: float = 0.0  # Llama-3 frequency scaling; 0 = none.
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qk_norm: bool = True  # Qwen3's per-head RMSNorm on q and k; Llama has none.
  attention_bias: bool = False
  max_position_embeddings: int = 40960
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype
  remat_policy: str = "none"
  scan_layers: bool = False
  attention_impl: str = "auto"

  def problems(self) -> list[tuple[str, str, str]]:
    """(field, why, fix) for every bad value; empty when the config is usable."""
    out = []
    if self.arch not in ARCHS:
      out.append(("arch", "unknown architecture", f"use one of {', '.join(ARCHS)}"))
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings"):
      if getattr(self, f) < 1:
        out.append((f, "must be >= 1", "give a positive size"))
    if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
      out.append(("num_kv_heads", f"must divide num_heads={self.num_heads} (grouped-query "
                  "attention)", "use a divisor of num_heads"))
    if self.head_dim % 2:
      out.append(("head_dim", "RoPE rotates pairs of dimensions", "use an even head_dim"))
    if self.rope_theta <= 0:
      out.append(("rope_theta", "must be > 0", "e.g. 1e6 (Qwen3) or 5e5 (Llama 3)"))
    if self.rope_scaling_factor < 0:
      out.append(("rope_scaling_factor", "must be >= 0", "0 disables Llama-3 scaling"))
    if self.rope_scaling_factor > 0 and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      out.append(("rope_high_freq_factor", "must exceed rope_low_freq_factor", "e.g. 4.0 and 1.0"))
    for f in ("param_dtype", "dtype"):
      if getattr(self, f) not in DTYPES:
        out.append((f, "unknown dtype", f"use one of {', '.join(DTYPES)}"))
    if self.attention_impl not in ATTENTION_IMPLS:
      out.append(("attention_impl", "unknown attention implementation",
                  f"use one of {', '.join(ATTENTION_IMPLS)}"))
    if self.remat_policy not in remat.POLICIES:
      out.append(("remat_policy", "unknown remat policy",
                  f"use one of {', '.join(remat.POLICIES)}"))
    return out

  def validate(self) -> "ModelConfig":
    problems = self.problems()
    if problems:
      raise ValueError("bad ModelConfig: " + "; ".join(
          f"{f}={getattr(self, f)!r}: {why} (fix: {fix})" for f, why, fix in problems))
    return self

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def num_params(self) -> int:
    d, f, h, k, hd, v = (self.hidden_size, self.intermediate_size, self.num_heads,
                         self.num_kv_heads, self.head_dim, self.vocab_size)
    attn = d * hd * (2 * h + 2 * k) + (2 * hd if self.qk_norm else 0)
    layer = attn + 3 * d * f + 2 * d
    return self.num_layers * layer + v * d * (1 if self.tie_embeddings else 2) + d

  # ------------------------------------------------------------------ HF config.json

  @classmethod
  def from_hf_config(cls, hf: dict, **overrides) -> "ModelConfig":
    """From a Hugging Face config.json dict (Qwen3ForCausalLM or LlamaForCausalLM)."""
    model_type = hf.get("model_type", "")
    archs = hf.get("architectures") or []
    if model_type == "qwen3" or "Qwen3ForCausalLM" in archs:
      arch = "qwen3"
    elif model_type == "llama" or "LlamaForCausalLM" in archs:
      arch = "llama3"
    else:
      raise ValueError(f"unsupported architecture: model_type={model_type!r}, architectures="
                       f"{archs}; grpo_jax's native decoder loads Qwen3ForCausalLM and "
                       "LlamaForCausalLM checkpoints")
    if hf.get("mlp_bias"):
      raise ValueError("unsupported: mlp_bias=true (no Llama-3 / Qwen3 checkpoint uses it)")
    heads = hf["num_attention_heads"]
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
    if rope_type not in ("default", "llama3"):
      raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
      if hf.get(key):  # Gemma-2 style; no Qwen3 / Llama checkpoint sets them
        raise ValueError(f"unsupported: {key}={hf[key]} (logit soft-capping; the native "
                         "Qwen3 / Llama decoder has none, so it would silently differ)")
    if arch == "qwen3" and hf.get("use_sliding_window"):
      raise ValueError("unsupported: Qwen3 sliding-window attention (use_sliding_window=true)")
    kw = dict(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
    )
    if rope_type == "llama3":
      kw.update(rope_scaling_factor=float(scaling["factor"]),
                rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                rope_original_max_position=int(scaling.get("original_max_position_embeddings",
                                                           8192)))
    kw.update(overrides)
    return cls(**kw).validate()

  def to_hf_config(self, torch_dtype: str = "float32") -> dict:
    hf_arch, model_type = _HF_ARCH[self.arch]
    hf = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "tie_word_embeddings": self.tie_embeddings,
        "attention_bias": self.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": self.max_position_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if self.arch == "llama3":
      hf["mlp_bias"] = False
      hf["rope_scaling"] = None
      if self.rope_scaling_factor > 0:
        hf["rope_scaling"] = {
            "rope_type": "llama3", "factor": self.rope_scaling_factor,
            "low_freq_factor": self.rope_low_freq_factor,
            "high_freq_factor": self.rope_high_freq_factor,
            "original_max_position_embeddings": self.rope_original_max_position}
    else:
      hf["use_sliding_window"] = False
      hf["sliding_window"] = None
      hf["rope_scaling"] = None
    return hf


def _qwen3(**kw):
  return ModelConfig(arch="qwen3", vocab_size=151936, num_kv_heads=8, head_dim=128,
                     rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True,
                     max_position_embeddings=40960, **kw)


PRESETS: dict[str, ModelConfig] = {
    # huggingface.co/Qwen/Qwen3-{0.6B,1.7B,4B,8B}/blob/main/config.json
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                         tie_embeddings=True),
    "qwen3-1.7b": _qwen3(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                         tie_embeddings=True),
    "qwen3-4b": _qwen3(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                       tie_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                       tie_embeddings=False),
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama3.1-8b": ModelConfig(
        arch="llama3", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
        rope_original_max_position=8192, rms_norm_eps=1e-5, tie_embeddings=False,
        qk_norm=False, max_position_embeddings=131072),
    # Test shapes.
    "tiny-qwen3": ModelConfig(arch="qwen3", vocab_size=97, hidden_size=64,
                              intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=24, rope_theta=10000.0, tie_embeddings=False,
                              max_position_embeddings=256),
    "tiny-llama3": ModelConfig(arch="llama3", vocab_size=101, hidden_size=64,
                               intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
                               head_dim=8, rope_theta=500000.0, rope_scaling_factor=8.0,
                               rope_original_max_position=32, rms_norm_eps=1e-5,
                               tie_embeddings=True, qk_norm=False, max_position_embeddings=256),
}
