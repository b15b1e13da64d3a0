"""Rollout routing replay (R3, Ma et al. 2025, arXiv 2510.11370) in the trainer's forwards.

    config.rollout.routing_replay = "rollout"     # an MoE native decoder, the lockstep sampler
    batch["routes"] = rollout.routes              # rl/step.py assemble: [N, S, L_moe, k]
    logp_nc, own_nslk = policy.routed_logprobs(params, ids, mask, batch["routes"], C, temp)
    route_mismatch(own_nslk, batch["routes"], completion_mask_nc)  # rollout/route_mismatch
    # pack_sequences: rl/packing.py gathers routes with their tokens -> [R, S, L_moe, k]
    logp_rs, own_rslk = policy.packed_routed_logprobs(params, ids, seg, pos, slots, routes_rslk,
                                                      temp, shards=D)  # D: data-parallel shards
    packed_route_mismatch(own_rslk, routes_rslk, completion_mask_rs)  # the same figure

An MoE policy's sampler and trainer route some tokens to different experts (their numerics
differ: batch shapes, kernels, bf16), so the trainer's log-probs are those of another policy than
the one that sampled. R3 records the sampler's routes (rollout/sampler.py: every MoE layer's k
experts for each token it fed, `Rollout.routes`, layout in rollout/types.py) and makes every
trainer forward over the rollout (the old-policy log-probs, the reference's, the update) use
them instead of its own top-k. The gates stay the current router's softmax probabilities at the
replayed experts (renormalized over the k with norm_topk_prob: models/decoder/moe.py
`replay_route`), so the router keeps its gradient; only the discrete choice is the sampler's.

Every column of the [prompt; completion] row is replayed, the prompt's too: a position's output
depends on the keys/values of the positions before it, which depend on their routes, so only
the whole row replayed reproduces the sampler's forward. The last completion token (never fed to
the sampler) keeps its own top-k; its output predicts no trained token. Packed rows
(pack_sequences, rl/packing.py) carry each real token's routes to its slot (-1 on padding
slots), so the packed forward replays the same experts for the same tokens as the padded one.

rollout/route_mismatch: the fraction of recorded (token, MoE layer, k-slot) routes that the
trainer's own top-k (computed in the same replayed forward, so at each layer on the inputs the
sampler's routes lead to) does not contain, over the positions whose outputs predict the
update's completion tokens (completion_mask). Compared as sets: the k experts' order does not
change the layer's output. Measured by a log-prob pass of the trainer's weights before the
update (rl/step.py GrpoStep.inputs), logged when routing replay is on.
"""

import jax
import jax.numpy as jnp

from grpo_jax.models.decoder.moe import routes_dtype
from grpo_jax.parallel import sharding
from grpo_jax.rl import packing

MODES = ("none", "rollout")


def route_mismatch(own_bslk, routes_bslk, completion_mask_bc) -> jax.Array:
  """Fraction (f32 scalar) of recorded routes the trainer's own top-k lacks, over the positions
  S-C-1 .. S-2 (each predicts completion token j = position - (S-C-1)) where the completion
  mask is set and a route was recorded (>= 0). own, routes [B, S, L_moe, k]; mask [B, C]."""
  s, c = routes_bslk.shape[1], completion_mask_bc.shape[1]
  return _missed_fraction(
      own_bslk[:, s - c - 1 : s - 1], routes_bslk[:, s - c - 1 : s - 1], completion_mask_bc > 0
  )


def packed_route_mismatch(own_rslk, routes_rslk, completion_mask_rs) -> jax.Array:
  """`route_mismatch` of packed rows (rl/packing.py): the positions counted are those whose
  next slot holds a trained completion token (completion_mask [R, S], per slot), the same
  (token, layer, k-slot) routes as the padded layout's. own, routes [R, S, L_moe, k]."""
  predicts = jnp.pad(completion_mask_rs[:, 1:] > 0, ((0, 0), (0, 1)))  # a sequence's last: none
  return _missed_fraction(own_rslk, routes_rslk, predicts)


def _missed_fraction(own_tlk, routes_tlk, counted_t) -> jax.Array:
  """Over the positions `counted_t` [...] whose routes [..., L, k] were recorded (>= 0): the
  fraction of recorded experts missing from own [..., L, k] (compared as sets)."""
  recorded = routes_tlk.astype(jnp.int32)
  found = (recorded[..., :, None] == own_tlk[..., None, :]).any(-1)  # [..., L, k]
  counted = counted_t[..., None, None] & (recorded >= 0)
  missed = (counted & ~found).sum().astype(jnp.float32)
  return missed / jnp.maximum(counted.sum(), 1).astype(jnp.float32)


def routes_spec(model_cfg, rows: int, width: int, mesh) -> jax.ShapeDtypeStruct:
  """What a sampler records for `rows` rows of `width` = P + C columns (Rollout.routes), as a
  ShapeDtypeStruct on `mesh`: run/compile_ahead.py lowers the step programs on it."""
  shape = (rows, width, sum(model_cfg.moe_layers), model_cfg.num_experts_per_tok)
  return jax.ShapeDtypeStruct(
      shape, routes_dtype(model_cfg.num_experts), sharding=sharding.batch_sharding(mesh, 4)
  )


class RoutedLayout(packing.PaddedLayout):
  """Padded rows with their recorded routes: `logprob_fn(params, input_ids, attention_mask,
  routes) -> [b, C]` (the update's, rl/step.py)."""

  def logprobs(self, logprob_fn, params, batch: dict) -> jax.Array:
    return logprob_fn(params, batch["input_ids"], batch["attention_mask"], batch["routes"])


ROUTED = RoutedLayout()


class RoutedPackedLayout(packing.PackedLayout):
  """Packed rows with their recorded routes (rl/packing.py: pack): `logprob_fn(params,
  input_ids, segment_ids, positions, head_slots, routes) -> [r, L]` (the update's)."""

  def logprobs(self, logprob_fn, params, batch: dict) -> jax.Array:
    return logprob_fn(
        params,
        batch["input_ids"],
        batch["segment_ids"],
        batch["positions"],
        batch["head_slots"],
        batch["routes"],
    )


class Routed(packing.Padded):
  """GrpoStep's rows with routing replay: the log-prob passes (old, reference) replay the
  batch's routes. fns: rl/step.py's TrainFunctions (its `routed_logprobs`)."""

  def logprobs(self, params, upd: dict) -> jax.Array:
    return self.logprobs_and_mismatch(params, upd)[0]

  def logprobs_and_mismatch(self, params, upd: dict):
    """-> (log-probs [N, C], rollout/route_mismatch: a replicated f32 scalar)."""
    return self.fns.routed_logprobs(
        params, upd["input_ids"], upd["attention_mask"], upd["routes"], upd["completion_mask"]
    )


class RoutedPacker(packing.Packer):
  """Packed rows with routing replay (pack_sequences): the routes ride the gather
  (packing.pack), the log-prob passes replay them. fns: TrainFunctions' `packed_routed_logprobs`."""

  def logprobs(self, params, upd: dict) -> jax.Array:
    return self.logprobs_and_mismatch(params, upd)[0]

  def logprobs_and_mismatch(self, params, upd: dict):
    """-> (log-probs [R, S], rollout/route_mismatch: a replicated f32 scalar)."""
    return self.fns.packed_routed_logprobs(
        params,
        upd["input_ids"],
        upd["segment_ids"],
        upd["positions"],
        upd["head_slots"],
        upd["routes"],
        upd["completion_mask"],
        upd["micro_batches"],
    )
