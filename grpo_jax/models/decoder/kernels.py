"""Which kernel each op of the decoder runs, decided once for the platform a program runs on.

    kernels = Kernels.resolve(cfg, "tpu")           # or Kernels.for_mesh(cfg, mesh)
    model = Transformer(cfg, rngs=nnx.Rngs(0), kernels=kernels)

The value lives on the model (`Transformer.kernels`, static: part of its graph) and every layer
reads it from there, so a trace never consults module globals or thread-local state. It is
resolved where the model is built: `build_model` / `load_hf` / the policies from their mesh's
platform (memory_plan builds its abstract policies on the target chip's devices, so a TPU plan
traced on a CPU host gets TPU kernels), and again by the sampler, for its own mesh and its
decode attention (rollout.Sampler: `ragged_decode`). The MoE experts' grouped GEMM is chosen
where they are traced, from the same platform (moe.grouped_matmul_for: a Triton kernel on GPU).
"""

import dataclasses

import jax

from grpo_jax.models.decoder.config import ModelConfig


def platform_name(platform: str) -> str:
  """ "cpu", "gpu" or "tpu" for a JAX platform or backend name ("cuda" and "rocm" are "gpu")."""
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The decoder's kernel choices for one platform.

  Attributes:
    platform: "cpu", "gpu" or "tpu": the backend the traced program runs on.
    fused_attention: the training forward and the prefill move each row's real tokens first
      (transformer.compaction) and run one causal kernel (`attention.causal_attention`: cuDNN
      flash attention on GPU, Pallas splash attention on TPU, XLA's form on CPU), and packed
      rows run one kernel that reads their segment ids (`attention.segment_attention`: Pallas's
      Triton flash attention on GPU, splash on TPU, the masked form on CPU); else the masked
      einsum attention.
    fuse_gate_up: gate and up as one [D, 2F] GEMM, forward and backward (`layers.swiglu`).
      An XLA:CPU tuning: one wide GEMM beats two narrow ones there; on TPU/GPU the weights are
      sharded over F (the mlp axis), a concatenation would reshard them, and their compilers
      fuse the two GEMMs anyway.
    ragged_decode: the decode step's attention is `decode_attention.ragged` (one kernel over the
      written cache slots only; the sampler's choice, rollout.decode_attention) where the
      layer's shapes allow it; else the XLA attention over every slot.
    ragged_tpu: with ragged_decode, the slot engine's decode runs `decode_attention.ragged_tpu`
      (the TPU's Mosaic kernel; off TPU in Pallas's interpreter) instead of the Triton one.
  """

  platform: str
  fused_attention: bool
  fuse_gate_up: bool
  ragged_decode: bool = False
  ragged_tpu: bool = False

  @property
  def interpret(self) -> bool:
    """Whether Pallas kernels run in Pallas's interpreter (off GPU: the CPU tests)."""
    return self.platform != "gpu"

  @classmethod
  def resolve(
      cls,
      cfg: ModelConfig,
      platform: str | None = None,
      *,
      ragged_decode: bool = False,
      ragged_tpu: bool = False,
  ) -> "Kernels":
    """The kernels for `cfg` on `platform` (default: jax.default_backend()).

    cfg.attention_impl "auto" fuses the attention where the platform has a kernel for the
    shape: cuDNN flash attention on GPU (bf16/f16, head_dim a multiple of 8 up to 256, no
    soft-capped scores), Pallas splash attention on TPU (head_dim a multiple of 128: lanes);
    "fused" always, "xla" never."""
    platform = platform_name(platform or jax.default_backend())
    if cfg.attention_impl == "auto":
      if platform == "tpu":
        fused = cfg.head_dim % 128 == 0
      else:
        fused = (
            platform == "gpu"
            and cfg.dtype in ("bfloat16", "float16")
            and cfg.head_dim <= 256
            and cfg.head_dim % 8 == 0
            and not cfg.attn_logit_softcap
        )
    else:
      fused = cfg.attention_impl == "fused"
    return cls(
        platform=platform,
        fused_attention=fused,
        fuse_gate_up=platform == "cpu",
        ragged_decode=ragged_decode,
        ragged_tpu=ragged_decode and ragged_tpu,
    )

  @classmethod
  def for_mesh(cls, cfg: ModelConfig, mesh=None) -> "Kernels":
    """The kernels for `cfg` on the platform of `mesh`'s devices (None: the default backend)."""
    return cls.resolve(cfg, None if mesh is None else mesh.devices.flat[0].platform)
