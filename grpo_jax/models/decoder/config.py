"""ModelConfig: one dataclass for the decoder families (Qwen3 dense, Llama 3 / 3.1, Gemma 2,
Gemma 3 text); the named presets are in presets.py.

Fields are plain values so `configs/common.py` can carry every one of them in `config.model`
(Llama-3 RoPE scaling is flattened into `rope_scaling_*`; factor 0 means no scaling).
Preset shapes (presets.py) are the published Hugging Face config.json values of each model.

The architecture name fixes the layer's structure; the numbers stay fields:
  qwen3, llama3   pre-norm layers, RMSNorm w * x, SwiGLU
  gemma2, gemma3  RMSNorm (1 + w) * x in f32, a norm before and after attention and the MLP,
                  GeGLU (tanh GELU), embeddings scaled by sqrt(hidden_size); with the fields
                  query_pre_attn_scalar, attn/final_logit_softcap (Gemma 2), sliding_window +
                  sliding_window_pattern (local layers interleaved with global ones),
                  rope_local_theta (Gemma 3's local RoPE base), rope_linear_factor, qk_norm.
Mixture of experts (Qwen3-MoE, `num_experts` > 0; moe.py): layer i's MLP is a top-k routed
set of experts unless i is in `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0 (HF's
Qwen3MoeDecoderLayer), where it is the dense MLP of width intermediate_size.
"""

import dataclasses

from grpo_jax.models import remat

ARCHS = ("qwen3", "llama3", "gemma2", "gemma3")
GEMMA = ("gemma2", "gemma3")
# The names `remat.POLICIES` defines (a snapshot for importers; checks read POLICIES itself so
# a policy registered later is accepted too).
REMAT_POLICIES = tuple(remat.POLICIES)
DTYPES = ("float32", "bfloat16", "float16")
# How the training forward and the prefill attend (models/decoder/layers.py): "auto" = a fused
# (flash) kernel where the backend has one (GPU: cuDNN through jax.nn.dot_product_attention),
# else "xla"; "xla" = the masked einsum with its [.., T, S] f32 scores; "fused" = the fused path
# on every backend (on CPU it is jax.nn.dot_product_attention's XLA form: for tests).
ATTENTION_IMPLS = ("auto", "xla", "fused")

_HF_ARCH = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "llama3": ("LlamaForCausalLM", "llama"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# config.json model_type -> arch (Gemma 3's multimodal folders: their text_config is read).
HF_MODEL_TYPES = {
    "qwen3": "qwen3",
    "llama": "llama3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3",
}
HF_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3",
}


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
  # Gemma 2 / 3 (0 = off; any arch may set them, HF folders only carry them for Gemma):
  query_pre_attn_scalar: float = 0.0  # attention scale = this ** -0.5 (0: head_dim)
  attn_logit_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax
  final_logit_softcap: float = 0.0  # LM-head logits -> cap * tanh(logits / cap)
  sliding_window: int = 0  # local layers attend to the last `sliding_window` positions only
  sliding_window_pattern: int = 0  # layer i is global iff (i+1) % N == 0 (Gemma 2: 2, Gemma 3:
  #                                  6); 0: every layer local (when sliding_window > 0)
  rope_local_theta: float = 0.0  # the local layers' RoPE base (Gemma 3: 1e4); 0: rope_theta
  rope_linear_factor: float = 1.0  # linear RoPE scaling of the global layers (Gemma 3 4B+: 8)
  # Mixture of experts (Qwen3-MoE; 0 experts = every layer dense, nothing below is read):
  num_experts: int = 0
  num_experts_per_tok: int = 0  # k of the top-k router
  moe_intermediate_size: int = 0  # each expert's MLP width
  norm_topk_prob: bool = False  # the k gates renormalized to sum to 1 (HF's default: False)
  decoder_sparse_step: int = 1  # layer i routed iff (i + 1) % step == 0 ...
  mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those stay dense)

  def __post_init__(self):  # a list from config.json or a ConfigDict: hashable, one form
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

  @property
  def gemma(self) -> bool:
    """Gemma's layer structure: (1 + w) norms, pre- and post-norms, GeGLU, scaled embeddings."""
    return self.arch in GEMMA

  def layer_is_local(self, i: int) -> bool:
    """Whether layer i is a sliding-window (local) layer."""
    n = self.sliding_window_pattern
    return self.sliding_window > 0 and (n == 0 or (i + 1) % n != 0)

  @property
  def local_layers(self) -> tuple[bool, ...]:
    return tuple(self.layer_is_local(i) for i in range(self.num_layers))

  def layer_is_moe(self, i: int) -> bool:
    """Whether layer i's MLP is the routed experts (HF's Qwen3MoeDecoderLayer's rule)."""
    return (
        self.num_experts > 0
        and i not in self.mlp_only_layers
        and (i + 1) % max(self.decoder_sparse_step, 1) == 0
    )

  @property
  def moe_layers(self) -> tuple[bool, ...]:
    return tuple(self.layer_is_moe(i) for i in range(self.num_layers))

  def problems(self) -> list[tuple[str, str, str]]:
    """(field, why, fix) for every bad value; empty when the config is usable."""
    out = []
    if self.arch not in ARCHS:
      out.append(("arch", "unknown architecture", f"use one of {', '.join(ARCHS)}"))
    for f in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
    ):
      if getattr(self, f) < 1:
        out.append((f, "must be >= 1", "give a positive size"))
    if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
      out.append(
          (
              "num_kv_heads",
              f"must divide num_heads={self.num_heads} (grouped-query " "attention)",
              "use a divisor of num_heads",
          )
      )
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
      out.append(
          (
              "attention_impl",
              "unknown attention implementation",
              f"use one of {', '.join(ATTENTION_IMPLS)}",
          )
      )
    for f in (
        "query_pre_attn_scalar",
        "attn_logit_softcap",
        "final_logit_softcap",
        "sliding_window",
        "sliding_window_pattern",
        "rope_local_theta",
    ):
      if getattr(self, f) < 0:
        out.append((f, "must be >= 0", "0 turns it off"))
    if self.rope_linear_factor <= 0:
      out.append(("rope_linear_factor", "must be > 0", "1.0 = no linear RoPE scaling"))
    if self.remat_policy not in remat.POLICIES:
      out.append(
          ("remat_policy", "unknown remat policy", f"use one of {', '.join(remat.POLICIES)}")
      )
    return out + self._moe_problems()

  def _moe_problems(self) -> list[tuple[str, str, str]]:
    if self.num_experts < 0:
      return [("num_experts", "must be >= 0", "0 = dense MLPs, else the experts per layer")]
    if self.num_experts == 0:
      return []
    out = []
    if self.arch != "qwen3":
      out.append(("num_experts", f"MoE layers are Qwen3-MoE's, not {self.arch}'s", "arch=qwen3"))
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      out.append(
          (
              "num_experts_per_tok",
              f"the router picks k of num_experts={self.num_experts} experts",
              f"use 1..{self.num_experts}",
          )
      )
    if self.moe_intermediate_size < 1:
      out.append(("moe_intermediate_size", "must be >= 1", "give each expert's MLP width"))
    if self.decoder_sparse_step < 1:
      out.append(("decoder_sparse_step", "must be >= 1", "1 = every layer routed"))
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
    if bad:
      out.append(("mlp_only_layers", f"layers {bad} do not exist", f"use 0..{self.num_layers - 1}"))
    kinds = self.moe_layers
    if self.scan_layers and any(kinds) and not all(kinds):
      out.append(
          (
              "scan_layers",
              "the layer scan stacks one structure: dense and MoE layers mix here "
              "(mlp_only_layers / decoder_sparse_step)",
              "scan_layers=False",
          )
      )
    return out

  def validate(self) -> "ModelConfig":
    problems = self.problems()
    if problems:
      raise ValueError(
          "bad ModelConfig: "
          + "; ".join(f"{f}={getattr(self, f)!r}: {why} (fix: {fix})" for f, why, fix in problems)
      )
    return self

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def num_params(self) -> int:
    d, f, h, k, hd, v = (
        self.hidden_size,
        self.intermediate_size,
        self.num_heads,
        self.num_kv_heads,
        self.head_dim,
        self.vocab_size,
    )
    attn = d * hd * (2 * h + 2 * k) + (2 * hd if self.qk_norm else 0)
    layer = attn + (4 if self.gemma else 2) * d
    moe = self.num_experts * (3 * d * self.moe_intermediate_size + d)  # experts + router
    mlps = sum(moe if routed else 3 * d * f for routed in self.moe_layers)
    return self.num_layers * layer + mlps + v * d * (1 if self.tie_embeddings else 2) + d

  # ------------------------------------------------------------------ HF config.json

  @classmethod
  def from_hf_config(cls, hf: dict, **overrides) -> "ModelConfig":
    """From a Hugging Face config.json dict (Qwen3ForCausalLM, LlamaForCausalLM,
    Gemma2ForCausalLM, Gemma3ForCausalLM; a Gemma 3 multimodal folder's text_config)."""
    if hf.get("text_config") and hf.get("model_type") == "gemma3":
      hf = dict(hf["text_config"], model_type="gemma3_text")
    model_type = hf.get("model_type", "")
    archs = hf.get("architectures") or []
    arch = HF_MODEL_TYPES.get(model_type) or next(
        (HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None
    )
    if arch is None:
      raise ValueError(
          f"unsupported architecture: model_type={model_type!r}, architectures="
          f"{archs}; grpo_jax's native decoder loads "
          f"{', '.join(sorted(HF_ARCHITECTURES))} checkpoints"
      )
    if hf.get("mlp_bias"):
      raise ValueError("unsupported: mlp_bias=true (no Llama-3 / Qwen3 checkpoint uses it)")
    heads = hf["num_attention_heads"]
    n_layers = hf["num_hidden_layers"]
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    local_scaling = {}
    if "full_attention" in scaling:  # transformers 5: RoPE per layer type
      scaling, local_scaling = scaling["full_attention"], scaling.get("sliding_attention", {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
    local_theta = hf.get("rope_local_base_freq", local_scaling.get("rope_theta", 0.0))
    if rope_type not in ("default", "llama3", "linear"):
      raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3, linear)")
    if local_scaling.get("rope_type", "default") != "default":
      raise ValueError(
          f"unsupported: RoPE scaling {local_scaling['rope_type']!r} on the "
          "sliding-window layers (Gemma 3 scales only its global layers)"
      )
    softcaps = {
        k: float(hf.get(k) or 0.0) for k in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    if arch not in GEMMA:
      for key, cap in softcaps.items():
        if cap:  # no Qwen3 / Llama checkpoint sets them
          raise ValueError(
              f"unsupported: {key}={cap} on {arch} (logit soft-capping is read "
              "for Gemma folders only; otherwise it would silently differ)"
          )
    act = hf.get("hidden_act") or "silu"
    if arch not in GEMMA and act not in ("silu", "swish"):  # HF's ACT2FN: the same function
      raise ValueError(
          f"unsupported: hidden_act={act!r} for {arch} (the native MLP is SwiGLU, "
          "hidden_act='silu'; any other activation would silently differ)"
      )
    window = 0
    if arch in GEMMA or hf.get("use_sliding_window"):
      window = int(hf.get("sliding_window") or 0)
    if arch == "qwen3" and hf.get("use_sliding_window"):
      raise ValueError("unsupported: Qwen3 sliding-window attention (use_sliding_window=true)")
    pattern = _window_pattern(hf, n_layers, window)
    kw = dict(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA)),
        qk_norm=arch in ("qwen3", "gemma3"),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
    )
    if arch in GEMMA:
      act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
      if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"unsupported: hidden_activation={act!r} for {arch} (the native "
            "Gemma MLP is GeGLU with the tanh GELU, gelu_pytorch_tanh)"
        )
      kw.update(
          query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
          attn_logit_softcap=softcaps["attn_logit_softcapping"],
          final_logit_softcap=softcaps["final_logit_softcapping"],
          sliding_window=window,
          sliding_window_pattern=pattern,
          rope_local_theta=float(local_theta or 0.0),
      )
    moe_type = model_type == "qwen3_moe" or "Qwen3MoeForCausalLM" in archs
    if moe_type:  # transformers 5 writes num_local_experts, the Qwen releases num_experts
      kw.update(
          num_experts=int(hf.get("num_experts", hf.get("num_local_experts")) or 0),
          num_experts_per_tok=int(hf["num_experts_per_tok"]),
          moe_intermediate_size=int(hf["moe_intermediate_size"]),
          norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
          decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
          mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
      )
    if rope_type == "llama3":
      kw.update(
          rope_scaling_factor=float(scaling["factor"]),
          rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
          rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
          rope_original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
      )
    elif rope_type == "linear":
      kw.update(rope_linear_factor=float(scaling["factor"]))
    kw.update(overrides)
    return cls(**kw).validate()

  def hf_problems(self) -> list[str]:
    """Why a Hugging Face folder of this arch cannot hold this config (empty: it can)."""
    out = []
    if self.gemma and self.qk_norm != (self.arch == "gemma3"):
      out.append(
          f"qk_norm={self.qk_norm}: HF's {self.arch} has {'no ' * (self.arch == 'gemma2')}"
          "q/k norms"
      )
    if not self.gemma:
      out += [
          f"{f}={getattr(self, f)}: HF's {self.arch} has none"
          for f in (
              "query_pre_attn_scalar",
              "attn_logit_softcap",
              "final_logit_softcap",
              "sliding_window",
              "rope_local_theta",
          )
          if getattr(self, f)
      ]
      if self.rope_linear_factor != 1.0:
        out.append(f"rope_linear_factor={self.rope_linear_factor}: HF's {self.arch} has none")
    if self.arch == "gemma2" and (self.rope_local_theta or self.rope_linear_factor != 1.0):
      out.append("rope_local_theta / rope_linear_factor: HF's gemma2 has one RoPE")
    if self.gemma and self.rope_scaling_factor:
      out.append("rope_scaling_factor (Llama-3 scaling): HF's Gemma has none")
    return out

  def to_hf_config(self, torch_dtype: str = "float32") -> dict:
    bad = self.hf_problems()
    if bad:
      raise ValueError("this model has no Hugging Face config.json: " + "; ".join(bad))
    hf_arch, model_type = _HF_ARCH[self.arch]
    if self.num_experts:
      hf_arch, model_type = "Qwen3MoeForCausalLM", "qwen3_moe"
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
    if self.gemma:
      hf.pop("hidden_act")
      hf.update(
          hidden_activation="gelu_pytorch_tanh",
          query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar or self.head_dim),
          attn_logit_softcapping=self.attn_logit_softcap or None,
          final_logit_softcapping=self.final_logit_softcap or None,
          sliding_window=self.sliding_window or None,
          layer_types=[
              "sliding_attention" if local else "full_attention" for local in self.local_layers
          ],
          rope_scaling=None
          if self.rope_linear_factor == 1.0
          else {"rope_type": "linear", "factor": self.rope_linear_factor},
      )
      if self.arch == "gemma3":
        hf["rope_local_base_freq"] = self.rope_local_theta or self.rope_theta
        hf["sliding_window_pattern"] = self.sliding_window_pattern
    elif self.arch == "llama3":
      hf["mlp_bias"] = False
      hf["rope_scaling"] = None
      if self.rope_scaling_factor > 0:
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": self.rope_scaling_factor,
            "low_freq_factor": self.rope_low_freq_factor,
            "high_freq_factor": self.rope_high_freq_factor,
            "original_max_position_embeddings": self.rope_original_max_position,
        }
    else:
      hf["use_sliding_window"] = False
      hf["sliding_window"] = None
      hf["rope_scaling"] = None
    if self.num_experts:
      hf.update(
          num_experts=self.num_experts,
          num_experts_per_tok=self.num_experts_per_tok,
          moe_intermediate_size=self.moe_intermediate_size,
          norm_topk_prob=self.norm_topk_prob,
          decoder_sparse_step=self.decoder_sparse_step,
          mlp_only_layers=list(self.mlp_only_layers),
          output_router_logits=False,
      )
    return hf


def _int_if_whole(x: float):
  return int(x) if float(x).is_integer() else x


def _window_pattern(hf: dict, n_layers: int, window: int) -> int:
  """sliding_window_pattern from config.json's layer_types (or its pattern fields)."""
  types = hf.get("layer_types")
  if not window:
    if types and any(t != "full_attention" for t in types):
      raise ValueError(
          f"config.json: layer_types {types} name sliding layers but " "sliding_window is unset"
      )
    return 0
  if not types:
    n = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern"))
    if n is None and hf.get("model_type") == "gemma2":
      n = 2
    return int(n or 0)
  local = [t == "sliding_attention" for t in types]
  if len(local) != n_layers or not all(t in ("sliding_attention", "full_attention") for t in types):
    raise ValueError(
        f"config.json: layer_types must name {n_layers} layers, each "
        f"sliding_attention or full_attention (got {types})"
    )
  for n in range(n_layers + 2):
    probe = ModelConfig(num_layers=n_layers, sliding_window=window, sliding_window_pattern=n)
    if list(probe.local_layers) == local:
      return n
  raise ValueError(
      f"config.json: layer_types {types} is not a pattern of local layers with "
      "every N-th layer global (what the native decoder runs)"
  )
