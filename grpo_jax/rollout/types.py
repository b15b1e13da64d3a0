"""What every rollout engine (the native sampler, vLLM) takes and returns."""

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """Sampling controls. `top_k=0` and `top_p=1.0` mean no truncation.

  `temperature` <= 1e-4 with `top_k=1` is greedy (the "greedy" config below); engines treat
  `top_k == 1` as argmax so no division by a tiny temperature happens.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @property
  def is_greedy(self) -> bool:
    return self.top_k == 1


# The three named configs of the GSM8K GRPO recipe, used for evaluation.
GENERATION_CONFIGS = {
    "greedy": GenerationConfig(temperature=1e-4, top_k=1, top_p=1.0),
    "standard": GenerationConfig(temperature=0.7, top_k=50, top_p=0.95),
    "liberal": GenerationConfig(temperature=0.85, top_k=2000, top_p=1.0),
}


def generation_config(generation: "str | GenerationConfig") -> GenerationConfig:
  if isinstance(generation, GenerationConfig):
    return generation
  try:
    return GENERATION_CONFIGS[generation]
  except KeyError:
    raise ValueError(
        f"unknown generation config {generation!r}; known: "
        f"{', '.join(GENERATION_CONFIGS)} (or pass a GenerationConfig)"
    ) from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rollout:
  """Completions of B prompts x G samples, group-major (prompt i -> rows i*G .. i*G+G-1).

  tokens      int32 [B*G, C]  sampled tokens (and, in multi-turn rows, the tool responses
                              appended between turns); after the stop token, pad_id.
  mask        int32 [B*G, C]  1 up to and including the stop token, else 0: the tokens the
                              row holds (the trainer's attention mask).
  logprobs    f32   [B*G, C]  log-prob of each sampled token under the distribution it was
                              sampled from (temperature, top-k, top-p applied); 0 where masked
                              and on tool tokens.
  raw_logprobs f32  [B*G, C]  log-prob under the raw policy (temperature 1, no truncation).
  lengths     int32 [B*G]     completion lengths (= mask.sum(-1)).
  truncated   bool  [B*G]     True when the row hit C tokens without a stop token.
  tool_mask   int32 [B*G, C]  1 on tokens a tool wrote (context, not actions: no loss, no KL,
                              not counted in lengths' statistics), else 0; zeros without tools.
  routes      int8/16 [B*G, P+C, L_moe, k] or None: routing replay's record (an MoE policy
                              on the lockstep sampler with rollout.routing_replay="rollout";
                              dtype: models/decoder/moe.py `routes_dtype`): column c holds the
                              experts each MoE layer chose for the token at index c of the
                              row's [prompt (left-padded to P); completion] when the sampler
                              fed it to the model (prompt columns: the prefill's; completion
                              token j: the decode step after it was drawn; -1 where it was
                              never fed: the last token). The trainer's forward over the same
                              row replays them column for column (rl/replay.py). None
                              otherwise. An in-flight rollout travels with its routes
                              through a checkpoint (rollout/source.py: the meta names their
                              shape, which `spec` cannot know).

  `action_mask` (mask without the tool tokens) is what is trained.
  """

  tokens: jax.Array
  mask: jax.Array
  logprobs: jax.Array
  raw_logprobs: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  tool_mask: jax.Array
  routes: jax.Array | None = None

  @property
  def action_mask(self) -> jax.Array:
    """The tokens the policy drew: mask without the tool tokens."""
    # array ops only: no Python scalar to put on a device (the loop's transfer guard)
    return self.mask - self.mask * self.tool_mask

  @classmethod
  def shardings(cls, mesh, *, routes: bool = False) -> "Rollout":
    """Every field's sharding on `mesh`: rows over (data, fsdp) (the engines' out_shardings);
    `routes`: the routing-replay record's too (else None)."""
    rows, vec = (sharding.batch_sharding(mesh, k) for k in (2, 1))
    return cls(
        tokens=rows,
        mask=rows,
        logprobs=rows,
        raw_logprobs=rows,
        lengths=vec,
        truncated=vec,
        tool_mask=rows,
        routes=sharding.batch_sharding(mesh, 4) if routes else None,
    )

  @classmethod
  def spec(cls, rows: int, completion_len: int, mesh) -> "Rollout":
    """What every engine returns for `rows` completions on `mesh`, as ShapeDtypeStructs: the
    dtypes above, rows sharded over (data, fsdp) (run/compile_ahead.py lowers on it)."""

    def sds(dtype, *shape):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))

    return cls(
        tokens=sds(jnp.int32, rows, completion_len),
        mask=sds(jnp.int32, rows, completion_len),
        logprobs=sds(jnp.float32, rows, completion_len),
        raw_logprobs=sds(jnp.float32, rows, completion_len),
        lengths=sds(jnp.int32, rows),
        truncated=sds(jnp.bool_, rows),
        tool_mask=sds(jnp.int32, rows, completion_len),
    )
