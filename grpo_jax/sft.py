"""The optional supervised warm start before GRPO (`config.sft_steps`; a cold start for RL).

    params = sft.run(config, session, policy, mesh, train_data, evaluator)

`run` owns the stage: the evaluation before it (summary.json's `eval_initial`), its loop, its
early stop on held-out train rows (`sft.stop_at_accuracy`), its checkpoints (state under the
"sft" key), preemption, and its restore when the run was interrupted during SFT. It returns
the parameters GRPO starts from; when the run is past SFT (`session.meta["phase"] == "grpo"`)
it does nothing and returns `policy.params` (abstract when GRPO is about to be restored).
"""

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import data as data_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding


def run(config, session, policy, mesh, train_data, evaluator):
  """Trains `policy` on demonstrations until sft_steps (or early stop); -> params."""
  meta = session.meta
  if meta["phase"] != "sft":
    return policy.params
  if meta["eval_initial"] is None:
    meta["eval_initial"] = evaluator(
        policy.params,
        0,
        jax.random.fold_in(session.rng, multihost.replicated(np.uint32(1 << 20), mesh)),
    )
  stage = SFTStage(config, policy, mesh)
  if session.resume_phase == "sft":
    data_iter = stage.iterator(train_data)
    stage.state = session.restore(stage.abstract_state(), data_iter)["sft"]
    stage.data_iter = data_iter
  else:
    stage.start(policy.params, train_data)
  val_data = stage.validation_data(train_data)
  c = config.sft
  progress = metrics_lib.Progress(config.sft_steps, meta["sft_step"], "sft")
  while meta["sft_step"] < config.sft_steps:
    step = meta["sft_step"] = meta["sft_step"] + 1
    loss = stage.step(train_data)
    if step % config.log_interval_steps == 0 or step == config.sft_steps:
      scalars = {"sft/loss": float(multihost.read(loss, mesh))}  # (every process)
      session.writer.write_scalars(step, scalars)
      progress.log(step, scalars, ("sft/loss",))
    if val_data is not None and step % c.eval_interval_steps == 0:
      acc = evaluator.accuracy(stage.state["params"], val_data, session.rng)
      session.writer.write_scalars(step, {"sft/validation_accuracy": acc})
      if acc >= c.stop_at_accuracy:
        logging.info(
            "SFT: validation accuracy %.3f >= sft.stop_at_accuracy=%.3f after %d "
            "steps; starting GRPO",
            acc,
            c.stop_at_accuracy,
            step,
        )
        break
    if step % config.save_interval_steps == 0 and step < config.sft_steps:
      session.save(step, {"sft": stage.state}, stage.data_iter)
    if session.stop_requested():
      session.stop(step, {"sft": stage.state}, stage.data_iter)
  meta["phase"] = "grpo"
  return stage.state["params"]


class SFTStage:
  """Supervised next-token training on demonstrations: its state, data and jitted step.

  Loss: mean negative log-likelihood of the demonstration tokens (eos included; not the tool
  responses a multi-turn demonstration holds: data/pipeline.py sft_batch), on the first
  `sft.num_demonstrations` train rows, AdamW at a constant `sft.learning_rate`.
  """

  def __init__(self, config, policy, mesh):
    self.config = config
    self.policy = policy
    self.mesh = mesh
    self.optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            config.sft.learning_rate,
            b1=config.optimizer.b1,
            b2=config.optimizer.b2,
            weight_decay=0.0,
        ),
    )
    completion_len = config.max_completion_length
    lp = policy.logprobs

    def loss_fn(params, batch):
      logp_bc = lp(params, batch["tokens"], batch["attention_mask"], completion_len, 1.0)
      m_bc = batch["loss_mask"].astype(jnp.float32)
      return -(logp_bc * m_bc).sum() / jnp.maximum(m_bc.sum(), 1.0)

    def update(state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
      updates, opt = self.optimizer.update(grads, state["opt_state"], state["params"])
      return dict(params=optax.apply_updates(state["params"], updates), opt_state=opt), loss

    param_shardings = policy.param_shardings(mesh)
    abstract_opt = jax.eval_shape(self.optimizer.init, policy.params)
    self.shardings = dict(
        params=param_shardings,
        opt_state=sharding.opt_state_shardings(self.optimizer, abstract_opt, param_shardings, mesh),
    )
    self._update = jax.jit(
        update, donate_argnums=0, out_shardings=(self.shardings, sharding.replicated(mesh))
    )
    self._init = jax.jit(
        lambda p: dict(params=p, opt_state=self.optimizer.init(p)), out_shardings=self.shardings
    )
    self.state = None
    self.data_iter = None

  def _num_rows(self, n):
    """Demonstration rows: the first num_demonstrations (0: all but the validation rows)."""
    c = self.config.sft
    held_out = c.num_validation if c.stop_at_accuracy > 0 else 0
    return min(c.num_demonstrations, n) if c.num_demonstrations else n - held_out

  def validation_data(self, train_data):
    """Held-out train rows for early stopping (never the test split); None when disabled."""
    c = self.config.sft
    if c.stop_at_accuracy <= 0:
      return None
    n = len(train_data)
    if self._num_rows(n) > n - c.num_validation:
      raise ValueError(
          f"sft.num_demonstrations={c.num_demonstrations} overlaps the last "
          f"sft.num_validation={c.num_validation} train rows held out for early "
          "stopping: lower one of them"
      )
    return train_data.select(range(n - c.num_validation, n))

  def iterator(self, train_data):
    n = self._num_rows(len(train_data))
    b, c = self.config.sft.batch_size, self.config.sft
    if n < 1:
      raise ValueError(
          f"SFT has no demonstration rows: {len(train_data)} train rows, "
          f"sft.num_demonstrations={c.num_demonstrations}, and the last sft.num_validation="
          f"{c.num_validation} held out for early stopping. Fix: lower sft.num_validation (or "
          "set sft.stop_at_accuracy=0), or give more train rows"
      )
    return data_lib.make_prompt_iterator(
        n, batch_size=b, seed=self.config.seed + 1, rows=multihost.process_rows(self.mesh, b)
    )

  def start(self, params, train_data):
    self.state = self._init(params)
    self.data_iter = self.iterator(train_data)

  def abstract_state(self):
    abstract = jax.eval_shape(
        lambda p: dict(params=p, opt_state=self.optimizer.init(p)), self.policy.params
    )
    return {"sft": sharding.abstract_with(abstract, self.shardings)}

  def step(self, train_data):
    idx = next(self.data_iter)
    b = data_lib.sft_batch(train_data, idx, self.config.max_completion_length)
    batch = {k: multihost.to_global(v, self.mesh, self.config.sft.batch_size) for k, v in b.items()}
    self.state, loss = self._update(self.state, batch)
    return loss
