"""The optional supervised warm start before GRPO (`config.sft_steps`; cold start before RL).

train.run drives it: `SFTStage.start` (or a restore into `abstract_state()`), then `step` per
batch, with early stopping on held-out train rows (`validation_data`) at
`sft.stop_at_accuracy`. Its state (params, optimizer) is checkpointed under the "sft" key.
"""
import jax
import jax.numpy as jnp
import optax

from grpo_jax import data as data_lib
from grpo_jax import multihost
from grpo_jax import sharding


class SFTStage:
  """Supervised next-token training on demonstrations (cold start before RL).

  Loss: mean negative log-likelihood of the demonstration tokens (eos included), on the first
  `sft.num_demonstrations` train rows, AdamW at a constant `sft.learning_rate`.
  """

  def __init__(self, config, policy, mesh, param_shardings):
    self.config = config
    self.policy = policy
    self.mesh = mesh
    self.optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(config.sft.learning_rate, b1=config.optimizer.b1, b2=config.optimizer.b2,
                    weight_decay=0.0))
    L = config.max_completion_length
    lp = policy.logprobs

    def loss_fn(params, batch):
      logp = lp(params, batch["tokens"], batch["attention_mask"], L, 1.0)
      m = batch["loss_mask"].astype(jnp.float32)
      return -(logp * m).sum() / jnp.maximum(m.sum(), 1.0)

    def update(state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
      updates, opt = self.optimizer.update(grads, state["opt_state"], state["params"])
      return dict(params=optax.apply_updates(state["params"], updates), opt_state=opt), loss

    abstract_opt = jax.eval_shape(self.optimizer.init, policy.params)
    self.shardings = dict(params=param_shardings,
                          opt_state=sharding.opt_state_shardings(self.optimizer, abstract_opt,
                                                        param_shardings, mesh))
    self._update = jax.jit(update, donate_argnums=0,
                           out_shardings=(self.shardings, sharding.replicated(mesh)))
    self._init = jax.jit(lambda p: dict(params=p, opt_state=self.optimizer.init(p)),
                         out_shardings=self.shardings)
    self.state = None
    self.data_iter = None

  def _num_rows(self, n):
    """Demonstration rows: the first num_demonstrations (0: all but the validation rows)."""
    c = self.config.sft
    held_out = c.num_validation if c.stop_at_accuracy > 0 else 0
    return min(c.num_demonstrations, n) if c.num_demonstrations else n - held_out

  def validation_data(self, train_rows, tokenizer, prompt_kw):
    """Held-out train rows for early stopping (never the test split); None when disabled."""
    c = self.config.sft
    if c.stop_at_accuracy <= 0:
      return None
    rows = train_rows[len(train_rows) - c.num_validation:]
    if self._num_rows(len(train_rows)) > len(train_rows) - c.num_validation:
      raise ValueError(f"sft.num_demonstrations={c.num_demonstrations} overlaps the last "
                       f"sft.num_validation={c.num_validation} train rows held out for early "
                       "stopping: lower one of them")
    return data_lib.PromptData(rows, tokenizer, **prompt_kw)

  def iterator(self, train_data):
    n = self._num_rows(len(train_data))
    return data_lib.make_prompt_iterator(
        n, batch_size=self.config.sft.batch_size // jax.process_count(),
        seed=self.config.seed + 1)

  def start(self, params, train_data):
    self.state = self._init(params)
    self.data_iter = self.iterator(train_data)

  def abstract_state(self):
    abstract = jax.eval_shape(lambda p: dict(params=p, opt_state=self.optimizer.init(p)),
                              self.policy.params)
    return {"sft": sharding.abstract_with(abstract, self.shardings)}

  def step(self, train_data):
    idx = next(self.data_iter)
    b = data_lib.sft_batch(train_data, idx, self.config.max_completion_length)
    batch = {k: multihost.to_global(v, self.mesh) for k, v in b.items()}
    self.state, loss = self._update(self.state, batch)
    return loss
