"""The jitted GRPO update: micro-batched gradient accumulation, AdamW, non-finite guard.

The step knows nothing about the model: it takes `logprob_fn(params, input_ids_bs,
attention_mask_bs) -> logp_bc`, the per-token log-probs of the C completion tokens at the end
of each [prompt; completion] row. The native decoder and the MaxText adapter each provide one,
so both policies train through this same code. With `config.pack_sequences` the rows are packed
(rl/packing.py: several sequences per row, segment ids) and the layout (`packing.PackedLayout`)
says how the log-probs are asked for and which tokens make a sequence; the loss is the same.

Exactness of accumulation: the loss of a batch split into micro-batches equals the loss of the
whole batch, not a mean of per-micro-batch losses. Each micro-batch's aggregated loss is
weighted by its share of the denominator of the batch-level aggregation (its token count for
`token-mean`, its row count otherwise; packed rows count the batch's N sequences in every
micro-batch, so their weight is 1), so gradients do not depend on the micro-batches (by rows
or by tokens: row_plan.MicroBatching) or on how rows are laid out over the mesh. The metrics
join exactly too (`METRIC_JOIN`).

`GrpoStep` (at the end) is the loop's steps 4-6 over these functions: advantages, the old and
reference log-probs, the updates, each in its named phase (run/profiling.py).
"""

import dataclasses
import functools
from typing import Callable

from absl import logging
import jax
import jax.numpy as jnp
import optax

from grpo_jax.parallel import sharding
from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rl import corrections
from grpo_jax.rl import losses
from grpo_jax.rl import packing
from grpo_jax.rl import row_plan
from grpo_jax.rl import replay
from grpo_jax.models.decoder.moe import routes_dtype
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import profiling


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """Plain values for `losses.policy_loss` (static under jit)."""

  beta: float
  clip_eps: float
  clip_eps_high: float | None = None
  clip_ratio_c: float | None = None
  kl_kind: str = "k3"
  kl_clamp: float | None = None
  loss_agg_mode: str = "seq-mean-token-mean"
  policy_loss: str = "ppo_clip"
  max_completion_length: int | None = None
  tis_cap: float = 0.0
  offpolicy_correction: str = "tis"
  correction_low: float = 0.5
  correction_high: float = 5.0

  @classmethod
  def from_config(cls, config) -> "LossSettings":
    l = config.loss
    # kl_in_reward: the KL is folded into the rewards (TrainFunctions.fold_kl), not the loss.
    return cls(
        beta=0.0 if config.kl_in_reward else float(config.beta),
        clip_eps=l.clip_eps,
        clip_eps_high=l.clip_eps_high,
        clip_ratio_c=l.clip_ratio_c,
        kl_kind=l.kl_kind,
        kl_clamp=l.kl_clamp,
        loss_agg_mode=l.loss_agg_mode,
        policy_loss=l.policy_loss,
        max_completion_length=config.max_completion_length,
        tis_cap=l.tis_cap,
        offpolicy_correction=l.offpolicy_correction,
        correction_low=l.correction_low,
        correction_high=l.correction_high,
    )


def make_optimizer(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_ratio: float,
    end_lr_ratio: float,
    b1: float,
    b2: float,
    weight_decay: float,
    max_grad_norm: float,
) -> optax.GradientTransformation:
  """AdamW on a linear-warmup + cosine schedule, after global-norm clipping (0 = no clip)."""
  total_steps = max(int(total_steps), 1)
  warmup = int(round(warmup_ratio * total_steps))
  if warmup:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup,
        decay_steps=total_steps,
        end_value=learning_rate * end_lr_ratio,
    )
  else:  # the same values, without optax's note on a zero-step warmup (it read as a mistake)
    end = learning_rate * end_lr_ratio
    schedule = optax.cosine_decay_schedule(
        init_value=learning_rate,
        decay_steps=total_steps,
        alpha=end / learning_rate if learning_rate else 0.0,
    )
  parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts)


def grpo_micro_loss(
    params,
    batch: dict,
    *,
    logprob_fn: Callable,
    settings: LossSettings,
    layout=packing.PADDED,
):
  """policy_loss on one micro-batch. `batch` holds (all [b, ...]):

  input_ids, attention_mask [b, P+C]; completion_mask [b, C]; advantages [b];
  old_logp [b, C] (optional: None means on-policy, ratio = 1 in value);
  ref_logp [b, C] (when beta > 0); sampler_logp [b, C] (when an off-policy correction is on:
  rl/corrections.py `active`; its weights multiply the policy-gradient token loss).
  Packed rows (`layout` a packing.PackedLayout): input_ids, segment_ids, positions and every
  per-token field [r, L], advantages per token [r, L] (rl/packing.py: pack).
  """
  logp_bc = layout.logprobs(logprob_fn, params, batch)
  old_bc = batch.get("old_logp")
  if old_bc is None:
    old_bc = jax.lax.stop_gradient(logp_bc)
  seqs = layout.seqs(batch)
  weights_bc, correction_metrics = corrections.correction_weights(
      settings.offpolicy_correction,
      old_bc,
      batch.get("sampler_logp"),
      batch["completion_mask"],
      cap=settings.tis_cap,
      low=settings.correction_low,
      high=settings.correction_high,
      seqs=seqs,
  )
  loss, metrics = losses.policy_loss(
      logp_bc,
      old_bc,
      batch.get("ref_logp"),
      batch["advantages"],
      batch["completion_mask"],
      clip_eps=settings.clip_eps,
      clip_eps_high=settings.clip_eps_high,
      beta=settings.beta,
      kl_kind=settings.kl_kind,
      loss_agg_mode=settings.loss_agg_mode,
      max_completion_length=settings.max_completion_length,
      policy_loss_kind=settings.policy_loss,
      clip_ratio_c=settings.clip_ratio_c,
      kl_clamp=settings.kl_clamp,
      tis_weights=weights_bc,
      seqs=seqs,
  )
  return loss, dict(metrics, **correction_metrics)


# How a micro-batch's metric joins the batch's, exactly: "loss" with the loss's own weight (what
# is aggregated like it), "max" the largest, "seqs" by its share of the sequences with tokens (a
# fraction of sequences), and any other (a token mean) by its share of the tokens.
METRIC_JOIN = {"pg_loss": "loss", "ratio_max": "max", "correction_masked_seq_frac": "seqs"}


def accumulate_gradients(
    loss_fn: Callable,
    params,
    batch: dict,
    num_micro: int,
    agg_mode: str,
    layout=packing.PADDED,
):
  """Sum of weighted micro-batch gradients == the gradient of the whole-batch loss.

  `loss_fn(params, micro_batch) -> (loss, metrics)`. Micro-batches are strided views
  (rows i, i + n, i + 2n, ... for micro-batch i) so every data-parallel shard contributes to
  each micro-batch and no cross-device reshuffle is needed. Packed rows (`layout`): micro-batch
  i's rows hold any of the batch's sequences (rl/packing.py), and the batch-level denominators
  count sequences, not rows. Metrics join as `METRIC_JOIN` says.
  """
  mask = batch["completion_mask"].astype(jnp.float32)
  total_tokens = mask.sum()
  total_seqs = layout.num_sequences(batch)
  seqs_with_tokens = (layout.seqs(batch).sums(mask) > 0).sum()

  def micro(i_batch):  # (packed rows' head_slots have their own row count)
    return jax.tree.map(
        lambda x: x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:])[:, i_batch], batch
    )

  def weighted(params, mb):
    loss, metrics = loss_fn(params, mb)
    mask_mb = mb["completion_mask"].astype(jnp.float32)
    seqs = layout.seqs(mb)
    w = losses.micro_batch_weight(agg_mode, mask_mb, total_tokens, total_seqs, seqs)
    shares = dict(
        loss=w,
        tokens=mask_mb.sum() / jnp.maximum(total_tokens, 1.0),
        seqs=(seqs.sums(mask_mb) > 0).sum() / jnp.maximum(seqs_with_tokens, 1),
    )
    return loss * w, (loss, metrics, shares)

  grad_fn = jax.value_and_grad(weighted, has_aux=True)

  def join(name, acc, m, shares):
    how = METRIC_JOIN.get(name, "tokens")
    return jnp.maximum(acc, m) if how == "max" else acc + shares[how] * m

  def body(carry, i):
    grads_acc, loss_acc, metrics_acc = carry
    (wloss, (_, metrics, shares)), grads = grad_fn(params, micro(i))
    grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
    metrics_acc = {k: join(k, metrics_acc[k], m, shares) for k, m in metrics.items()}
    return (grads_acc, loss_acc + wloss, metrics_acc), None

  if num_micro == 1:
    (loss, (_, metrics, _)), grads = grad_fn(params, batch)
    return loss, grads, metrics
  zeros = jax.tree.map(jnp.zeros_like, params)
  _, metrics_shape = jax.eval_shape(loss_fn, params, micro(0))
  metrics0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape)
  (grads, loss, metrics), _ = jax.lax.scan(
      body, (zeros, jnp.zeros((), jnp.float32), metrics0), jnp.arange(num_micro)
  )
  return loss, grads, metrics


def apply_update(optimizer: optax.GradientTransformation, state: dict, loss, grads, metrics: dict):
  """One optimizer update, skipped (params and moments unchanged) when loss/grads are not finite.

  state: {"params", "opt_state", "nonfinite_streak" (int32), "nonfinite_total" (int32)}.
  """
  # One reduction serves the check and the metric: a NaN or inf anywhere makes the sum of
  # squares non-finite (and so does a gradient past ~1e19 in f32: diverged anyway).
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, 0), grads)
  updates, new_opt = optimizer.update(safe_grads, state["opt_state"], state["params"])
  new_params = optax.apply_updates(state["params"], updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = dict(
      state,
      params=keep(new_params, state["params"]),
      opt_state=keep(new_opt, state["opt_state"]),
      nonfinite_streak=jnp.where(finite, 0, state["nonfinite_streak"] + 1),
      nonfinite_total=state["nonfinite_total"] + (~finite).astype(jnp.int32),
  )
  metrics = dict(
      metrics,
      loss=loss,
      grad_norm=jnp.where(finite, grad_norm, 0.0),
      skipped=(~finite).astype(jnp.float32),
      nonfinite_streak=new_state["nonfinite_streak"],
  )  # its own buffer: not donated
  return new_state, metrics


def make_grpo_update(
    logprob_fn: Callable,
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    micro: row_plan.MicroBatching | int,
    split: Callable | None = None,
    combine: Callable | None = None,
    layout=packing.PADDED,
):
  """(state, batch) -> (state, metrics): one optimizer update on a whole rollout batch.

  `micro`: the micro-batches (an int: that many, by rows); the layout counts them for a batch
  (packed rows carry their count: packing.MicroBatches).

  `split(params) -> (trained, frozen)` and `combine` (LoRA: adapters vs the base): gradients,
  optimizer moments and the update cover only the trained part; the frozen part passes through.
  `layout`: the rows' (packing.PADDED, or a packing.PackedLayout with `logprob_fn` taking packed
  rows)."""
  split = split or (lambda p: (p, None))
  combine = combine or (lambda trained, frozen: trained)
  if isinstance(micro, int):
    micro = row_plan.MicroBatching(count=micro)

  def update(state, batch):
    trained, frozen = split(state["params"])
    num_micro = layout.num_micro(batch, micro)
    # packed: the figures' views and the micro-batch count, not rows
    batch = {k: v for k, v in batch.items() if k not in ("sequences", "micro_batches")}

    def loss_fn(params, mb):
      return grpo_micro_loss(
          combine(params, frozen), mb, logprob_fn=logprob_fn, settings=settings, layout=layout
      )

    loss, grads, metrics = accumulate_gradients(
        loss_fn, trained, batch, num_micro, settings.loss_agg_mode, layout
    )
    new, metrics = apply_update(optimizer, dict(state, params=trained), loss, grads, metrics)
    return dict(new, params=combine(new["params"], frozen)), metrics

  return update


def init_state(params, optimizer: optax.GradientTransformation, split=None) -> dict:
  trained = params if split is None else split(params)[0]
  return dict(
      params=params,
      opt_state=optimizer.init(trained),
      nonfinite_streak=jnp.zeros((), jnp.int32),
      nonfinite_total=jnp.zeros((), jnp.int32),
  )


# ------------------------------------------------------------------ compiled for a run


@dataclasses.dataclass(frozen=True)
class TrainFunctions:
  """The jitted pieces of GRPO's steps 4-6 for one policy on one mesh (explicit shardings).

  init(params) -> state                 the update state (params, AdamW moments, counters)
  start(params) -> state                init that takes `params` (donated: the state's weights
                                        are those buffers, not a copy beside them; the loop's)
  update(state, batch) -> (state, metrics)   one optimizer update; `state` is donated
  logprobs(params, input_ids, attention_mask) -> [N, C]   completion log-probs, rows sharded
  assemble(prompt_ids, prompt_mask, rollout, rewards) -> batch   advantages and the
                                        [prompt; completion] rows the update trains on
  fold_kl(batch, rewards) -> (batch, rewards)   kl_in_reward: rewards - beta * sum_t KL_t
                                        (batch's old_logp vs ref_logp), advantages again
  refresh(ref, params) -> ref           reference refresh: mix * params + (1 - mix) * ref
  abstract_state                        `init`'s output as a restore target
  With config.pack_sequences (rl/packing.py), `update` trains on packed rows, and:
  pack(batch, row_of, offset_of, rows, head_rows, num_micro) -> packed batch   the device-side
                                        gather of a plan, per shard
  packed_logprobs(params, input_ids, segment_ids, positions, head_slots, micro_batches)
                                        -> [R, L]   (micro_batches: the batch's MicroBatches)
  packed_fold_kl(batch, rewards) -> (batch, rewards)     fold_kl on packed rows
  unpack(x_rl, slot_nc) -> [N, C]       a packed per-token array in the rollout's layout
  With rollout.routing_replay="rollout" (rl/replay.py), `update` replays the batch's routes, and:
  routed_logprobs(params, input_ids, attention_mask, routes, completion_mask) -> ([N, C],
                                        rollout/route_mismatch)   the replayed log-prob pass
  packed_routed_logprobs(params, input_ids, segment_ids, positions, head_slots, routes,
                         completion_mask, micro_batches) -> ([R, L], rollout/route_mismatch)
                                        the same on packed rows (pack_sequences)
  micro                                 the micro-batches (row_plan.MicroBatching: by rows or
                                        by tokens, over the data-parallel shards)
  """

  init: Callable
  update: Callable
  logprobs: Callable
  assemble: Callable
  fold_kl: Callable
  refresh: Callable
  abstract_state: dict
  start: Callable | None = None
  pack: Callable | None = None
  packed_logprobs: Callable | None = None
  packed_fold_kl: Callable | None = None
  unpack: Callable | None = None
  routed_logprobs: Callable | None = None
  packed_routed_logprobs: Callable | None = None
  micro: row_plan.MicroBatching = row_plan.MicroBatching()


def num_micro_batches(micro_batch_size: int, rows: int) -> int:
  """Gradient-accumulation passes over a step's rows: 0 or a size >= rows is one pass."""
  if micro_batch_size <= 0 or micro_batch_size >= rows:
    return 1
  if rows % micro_batch_size:
    raise ValueError(
        f"micro_batch_size={micro_batch_size} does not divide the step's {rows} " "rows"
    )
  return rows // micro_batch_size


def build(config, policy, mesh) -> TrainFunctions:
  """TrainFunctions from config (optimizer, loss settings, micro-batching, advantages)."""
  group, completion_len = config.num_generations, config.max_completion_length
  rows = group * config.batch_size
  optimizer = make_optimizer(
      learning_rate=config.optimizer.learning_rate,
      total_steps=config.num_steps * config.num_iterations,
      warmup_ratio=config.optimizer.warmup_ratio,
      end_lr_ratio=config.optimizer.end_lr_ratio,
      b1=config.optimizer.b1,
      b2=config.optimizer.b2,
      weight_decay=config.optimizer.weight_decay,
      max_grad_norm=config.optimizer.max_grad_norm,
  )
  temperature = float(config.rollout.temperature)
  replaying = config.rollout.routing_replay == "rollout"

  def logprobs(params, input_ids, attention_mask):
    return policy.logprobs(params, input_ids, attention_mask, completion_len, temperature)

  def routed_update_logprobs(params, input_ids, attention_mask, routes):
    return policy.routed_logprobs(
        params, input_ids, attention_mask, routes, completion_len, temperature
    )[0]

  def routed_logprobs(params, input_ids, attention_mask, routes, completion_mask):
    logp, own = policy.routed_logprobs(
        params, input_ids, attention_mask, routes, completion_len, temperature
    )
    return logp, replay.route_mismatch(own, routes, completion_mask)

  def advantages(rewards_n):
    adv_n = adv_lib.group_advantages(
        rewards_n,
        group,
        estimator=config.loss.estimator,
        eps=config.loss.adv_eps,
        std_kind=config.loss.std_kind,
    )
    if config.loss.advantage_clip > 0:
      adv_n = jnp.clip(adv_n, -config.loss.advantage_clip, config.loss.advantage_clip)
    return adv_n

  def assemble(prompt_ids_bp, prompt_mask_bp, rollout, rewards_n):
    adv_n = advantages(rewards_n)
    # The policy's own tokens are trained; tool responses are context (attention only).
    completion_mask_nc = rollout.action_mask
    if config.loss.dynamic_sampling:  # DAPO: groups with equal rewards leave the loss
      keep_n = adv_lib.dynamic_sampling_mask(rewards_n, group)
      completion_mask_nc = completion_mask_nc * keep_n[:, None].astype(completion_mask_nc.dtype)
    batch = dict(
        input_ids=jnp.concatenate([jnp.repeat(prompt_ids_bp, group, 0), rollout.tokens], 1),
        attention_mask=jnp.concatenate([jnp.repeat(prompt_mask_bp, group, 0), rollout.mask], 1),
        completion_mask=completion_mask_nc,
        advantages=adv_n,
        kl_mask=rollout.action_mask,  # the KL penalty's tokens (kl_in_reward)
    )
    if corrections.active(config.loss.offpolicy_correction, config.loss.tis_cap):
      batch["sampler_logp"] = rollout.logprobs
    if replaying:  # [N, P + C, L_moe, k], column for column with input_ids
      batch["routes"] = rollout.routes if rollout.routes is not None else no_routes(batch)
    return batch

  def no_routes(batch):
    """-1 everywhere (each forward its own top-k): a rollout without a routing record (an
    abstract Rollout.spec without routes)."""
    cfg = policy.model_config
    l_moe, k = sum(cfg.moe_layers), cfg.num_experts_per_tok
    n, s = batch["input_ids"].shape
    return jnp.full((n, s, l_moe, k), -1, routes_dtype(cfg.num_experts))

  def kl_penalized(rewards_n, old_nc, ref_nc, mask_nc):
    kl_nc = losses.token_kl(old_nc, ref_nc, config.loss.kl_kind, config.loss.kl_clamp)
    return rewards_n - config.beta * jnp.where(mask_nc > 0, kl_nc, 0.0).sum(-1)

  def fold_kl(batch, rewards_n):
    mask_nc = batch.get("kl_mask", batch["attention_mask"][:, -completion_len:])
    rewards_n = kl_penalized(rewards_n, batch["old_logp"], batch["ref_logp"], mask_nc)
    return dict(batch, advantages=advantages(rewards_n)), rewards_n

  shards = packing.batch_shards(mesh)
  micro = row_plan.MicroBatching(  # micro_batch_size and micro_batch_tokens: one of them is 0
      shards, num_micro_batches(config.micro_batch_size, rows), config.micro_batch_tokens
  )
  rows2 = sharding.batch_sharding(mesh, 2)

  # Packed rows: every gather stays within a data-parallel shard (rl/packing.py), the LM head's
  # too (head_slots within each shard's rows: models/logprobs.py _packed_head).
  def packed_logprobs(params, input_ids, segment_ids, positions, head_slots):
    """head_slots: the micro-batch's own (packing.pack), as the update hands them."""
    return policy.packed_logprobs(
        params, input_ids, segment_ids, positions, head_slots, temperature, shards=shards
    )

  def all_slots(head_slots, input_ids, micro_batches):
    r, s = input_ids.shape
    return packing.global_slots(
        head_slots, rows=r, num_micro=micro_batches.count, shards=shards, width=s
    )

  def packed_logprobs_all(params, input_ids, segment_ids, positions, head_slots, micro_batches):
    """One pass over all micro-batches' rows (the old-policy and reference passes)."""
    slots = all_slots(head_slots, input_ids, micro_batches)
    return packed_logprobs(params, input_ids, segment_ids, positions, slots)

  def packed_routed_update_logprobs(params, input_ids, segment_ids, positions, head_slots, routes):
    return policy.packed_routed_logprobs(
        params, input_ids, segment_ids, positions, head_slots, routes, temperature, shards=shards
    )[0]

  def packed_routed_logprobs_all(
      params, input_ids, segment_ids, positions, head_slots, routes, completion_mask, micro_batches
  ):
    """The replayed pass over all micro-batches' rows, and rollout/route_mismatch."""
    slots = all_slots(head_slots, input_ids, micro_batches)
    logp, own = policy.packed_routed_logprobs(
        params, input_ids, segment_ids, positions, slots, routes, temperature, shards=shards
    )
    return logp, replay.packed_route_mismatch(own, routes, completion_mask)

  def pack(batch, row_of_n, offset_of_n, packed_rows, head_rows, num_micro):
    return packing.pack(
        batch,
        row_of_n,
        offset_of_n,
        shards=shards,
        rows=packed_rows,
        num_micro=num_micro,
        head_rows=head_rows,
    )

  def unpack(x_rl, slot_nc):
    return packing.unpack(x_rl, slot_nc, shards)

  def packed_fold_kl(batch, rewards_n):
    # The sums per sequence over the rollout's [N, C] layout, as fold_kl's, so bit for bit.
    slot_nc = batch["sequences"]["slot"]
    old_nc, ref_nc = (unpack(batch[k], slot_nc) for k in ("old_logp", "ref_logp"))
    rewards_n = kl_penalized(rewards_n, old_nc, ref_nc, batch["sequences"]["kl_mask"])
    adv_n = advantages(rewards_n)
    adv_rl = packing.spread(adv_n, batch["segment_ids"], shards)
    sequences = dict(batch["sequences"], advantages=adv_n)
    return dict(batch, advantages=adv_rl, sequences=sequences), rewards_n

  mix = float(config.reference.refresh_mix)

  def refresh(ref, params):
    return jax.tree.map(
        lambda r, p: (mix * p.astype(jnp.float32) + (1 - mix) * r.astype(jnp.float32)).astype(
            r.dtype
        )
        if mix < 1
        else p.astype(r.dtype),
        ref,
        params,
    )

  def init(params):
    return init_state(params, optimizer, policy.split)

  param_shardings = policy.param_shardings(mesh)
  trained_shardings = policy.split(param_shardings)[0] if policy.split else param_shardings
  abstract = jax.eval_shape(init, policy.params)
  shardings = dict(
      params=param_shardings,
      opt_state=sharding.opt_state_shardings(
          optimizer, abstract["opt_state"], trained_shardings, mesh
      ),
      nonfinite_streak=sharding.replicated(mesh),
      nonfinite_total=sharding.replicated(mesh),
  )
  if packing.packs(config) and replaying:
    update_logprobs = packed_routed_update_logprobs
    layout = replay.RoutedPackedLayout(rows)
  elif packing.packs(config):
    update_logprobs = packed_logprobs
    layout = packing.PackedLayout(rows)
  elif replaying:
    update_logprobs, layout = routed_update_logprobs, replay.ROUTED
  else:
    update_logprobs, layout = logprobs, packing.PADDED
  update = make_grpo_update(
      update_logprobs,
      optimizer,
      LossSettings.from_config(config),
      micro,
      policy.split,
      policy.combine,
      layout,
  )
  return TrainFunctions(
      init=jax.jit(init, out_shardings=shardings),
      start=jax.jit(init, out_shardings=shardings, donate_argnums=0),
      # The model's forward runs in these two: traced in the mesh (activation constraints,
      # TPU splash attention's shard_map).
      update=jax.jit(
          sharding.traced_in(update, mesh),
          donate_argnums=0,
          out_shardings=(shardings, sharding.replicated(mesh)),
      ),
      logprobs=jax.jit(sharding.traced_in(logprobs, mesh), out_shardings=rows2),
      assemble=jax.jit(assemble, out_shardings=sharding.batch_sharding(mesh, 1)),
      fold_kl=jax.jit(fold_kl, out_shardings=sharding.batch_sharding(mesh, 1)),
      refresh=jax.jit(refresh, donate_argnums=0, out_shardings=param_shardings),
      abstract_state=sharding.abstract_with(abstract, shardings),
      pack=jax.jit(sharding.traced_in(pack, mesh), static_argnums=(3, 4, 5)),
      packed_logprobs=jax.jit(sharding.traced_in(packed_logprobs_all, mesh), out_shardings=rows2),
      packed_fold_kl=jax.jit(sharding.traced_in(packed_fold_kl, mesh)),
      unpack=jax.jit(sharding.traced_in(unpack, mesh), out_shardings=rows2),
      routed_logprobs=jax.jit(
          sharding.traced_in(routed_logprobs, mesh),
          out_shardings=(rows2, sharding.replicated(mesh)),
      )
      if replaying
      else None,
      packed_routed_logprobs=jax.jit(
          sharding.traced_in(packed_routed_logprobs_all, mesh),
          out_shardings=(rows2, sharding.replicated(mesh)),
      )
      if replaying and packing.packs(config)
      else None,
      micro=micro,
  )


# ------------------------------------------------------------------- the loop's steps 4-6


def old_logprobs_source(config, matches_trainer: bool) -> str:
  """Where the update's old-policy log-probs come from: "sampler" off-policy
  (rollout.max_staleness > 0: the behaviour policy's), unless an off-policy correction is on:
  then "trainer" off-policy too (decoupled PPO, as AReaL: the ratio is clipped against the
  weights before this update, the proximal policy, and the correction's weights compare those
  with the behaviour policy's log-probs, the staleness's gap); "trainer" (a log-prob pass) for
  the PPO ratio over several passes, for an off-policy correction (TIS and the others:
  rl/corrections.py), for kl_in_reward, and whenever the sampler is another program than the
  trainer (its log-probs are then only close); else "" (none: ratio 1)."""
  if config.rollout.max_staleness > 0:
    active = corrections.active(config.loss.offpolicy_correction, config.loss.tis_cap)
    return "trainer" if active else "sampler"
  if (
      config.num_iterations > 1
      or corrections.active(config.loss.offpolicy_correction, config.loss.tis_cap)
      or config.kl_in_reward
      or not matches_trainer
  ):
    return "trainer"
  return ""


class GrpoStep:
  """GRPO steps 4-6 over one scored batch (rollout/source.py's Scored), each in its phase
  (run/profiling.py):

    upd, kl_rewards_n = grpo.inputs(state, batch)   # 4-5: advantages, rows, log-probs
    state, metrics = grpo.update(state, upd)        # 6: num_iterations updates, dispatched
    grpo.wait(state)                                # after the host's work meanwhile
    device = grpo.figures(batch, upd, kl_rewards_n)  # the step's device scalars (replicated)
  """

  def __init__(self, config, fns: TrainFunctions, reference, mesh, *, matches_trainer: bool):
    """reference: rl/reference.py's Reference (disabled when beta = 0). matches_trainer: the
    sampler is the trainer's own program (no sampler/trainer gap to log)."""
    self.config, self.fns, self.reference, self.mesh = config, fns, reference, mesh
    self.matches_trainer = matches_trainer
    # The update's rows: as the rollout made them, or packed (rl/packing.py).
    packed = packing.packs(config)
    if config.pack_sequences and not packed:
      logging.info(
          "model.family=%r trains on padded rows (pack_sequences packs decoder-only policies)",
          config.model.family,
      )
    self.rows = packing.Packer(config, fns, mesh) if packed else packing.Padded(fns)
    # Routing replay (rl/replay.py): every log-prob pass replays the rollout's MoE routes.
    self.replay = config.rollout.routing_replay == "rollout"
    if self.replay and packed:
      self.rows = replay.RoutedPacker(config, fns, mesh)
    elif self.replay:
      self.rows = replay.Routed(fns)
    self.old_logp = old_logprobs_source(config, matches_trainer)
    self.stats_fn = jax.jit(
        functools.partial(
            metrics_lib.rollout_stats,
            group_size=config.num_generations,
            advantage_clip=config.loss.advantage_clip,
        ),
        out_shardings=sharding.replicated(mesh),
    )

  def inputs(self, state: dict, batch) -> tuple[dict, jax.Array | None]:
    """4. Advantages per group and the [prompt; completion] rows to train on; 5. the old and
    reference log-probs. -> (the update's batch, the rewards after the KL penalty [N] when
    kl_in_reward, else None)."""
    with profiling.phase("advantages"):
      upd = self.fns.assemble(
          batch.prompt["ids"], batch.prompt["mask"], batch.rollout, batch.rewards
      )
      if self.old_logp == "sampler":
        upd["old_logp"] = batch.behaviour_logp
      upd = self.rows.rows(upd)  # packed: the plan on the host, the gather on the device
    if self.replay:  # a replayed pass measures rollout/route_mismatch (figures)
      with profiling.phase("old_logprobs"):
        logp, upd["route_mismatch"] = self.rows.logprobs_and_mismatch(state["params"], upd)
      if self.old_logp == "trainer":
        upd["old_logp"] = logp
    elif self.old_logp == "trainer":
      with profiling.phase("old_logprobs"):
        upd["old_logp"] = self.rows.logprobs(state["params"], upd)
    if self.reference.enabled:
      with profiling.phase("ref_logprobs"):
        upd["ref_logp"] = self.rows.logprobs(self.reference.weights(state["params"]), upd)
    if not self.config.kl_in_reward:
      return upd, None
    with profiling.phase("kl_in_reward"):  # rewards - beta * sum_t KL_t, the advantages again
      return self.rows.fold_kl(upd, batch.rewards)

  def update(self, state: dict, upd: dict) -> tuple[dict, dict]:
    """6. num_iterations optimizer updates over the whole batch, dispatched (`state` donated).
    -> (the new state, the last update's metrics)."""
    upd = {k: v for k, v in upd.items() if k != "route_mismatch"}  # a figure, not a row
    with profiling.phase("update"):
      for _ in range(self.config.num_iterations):
        state, metrics = self.fns.update(state, upd)
    return state, metrics

  def wait(self, state: dict):
    """Returns once the update is done (a wait, not a read: its time is the update's)."""
    with profiling.phase("update"):
      jax.block_until_ready(state)

  def figures(self, batch, upd: dict, kl_rewards_n) -> dict:
    """The batch's scalars where its arrays live (metrics.rollout_stats; with the sampler/trainer
    log-prob gap when the sampler is another program, and the KL penalty when kl_in_reward)."""
    advantages_n, old_logp_nc = self.rows.per_sequence(upd)
    mismatch = (
        {}
        if self.matches_trainer
        else dict(sampler_logp_nc=batch.rollout.logprobs, trainer_logp_nc=old_logp_nc)
    )
    if kl_rewards_n is not None:
      mismatch["kl_rewards_n"] = kl_rewards_n
    out = self.stats_fn(batch.rewards, advantages_n, batch.rollout.action_mask, **mismatch)
    if "route_mismatch" in upd:
      out["rollout/route_mismatch"] = upd["route_mismatch"]
    return out
