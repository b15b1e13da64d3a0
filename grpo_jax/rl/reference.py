"""The KL reference the loop asks for log-probs (GRPO step 5): one object for its every form.

    reference = Reference(config, policy, fns, mesh)
    reference.start(state["params"])            # a fresh GRPO run: the policy it starts from
    reference.restore(restored)                 # or: what the checkpoint holds (target())
    ref_logp = reference.logprobs(state["params"], input_ids, attention_mask)   # [N, C]
    ref_params = reference.weights(state["params"])   # for another layout's pass (packed rows)
    reference.after_update(step, state["params"])   # refresh_every_steps: a copy or an EMA
    saved = reference.saved()                   # {"ref": params} or {}: the checkpoint's part

Forms: none (beta = 0: `enabled` is False and nothing is built); a frozen copy of the policy
GRPO starts from, stored in the compute dtype (policy.as_reference; param_dtype for an EMA,
whose small mixes a 16-bit copy would round away), optionally kept in host memory between
uses (reference.offload_to_host); LoRA's base, run without the adapters (policy.reference:
no copy, nothing saved).
"""

from absl import logging
import jax

from grpo_jax.run import profiling
from grpo_jax.parallel import sharding
from grpo_jax.models import policy as policy_lib


class Reference:

  def __init__(self, config, policy, fns, mesh):
    self.config, self.policy, self.fns, self.mesh = config, policy, fns, mesh
    r = config.reference
    self.enabled = config.beta > 0
    self.own_copy = self.enabled and policy.reference is None  # a copy to keep and save
    self.offload = r.offload_to_host
    self.refresh_every = r.refresh_every_steps
    # The storage dtype: the compute dtype, except for an EMA refresh (refresh_mix < 1).
    self.dtype = (
        config.model.param_dtype
        if r.refresh_every_steps and r.refresh_mix < 1
        else config.model.dtype
    )
    self.params = None  # the copy (own_copy), possibly in pinned host memory

  def target(self) -> dict:
    """The checkpoint's reference entry as abstract arrays (what `restore` reads)."""
    if not self.own_copy:
      return {}
    abstract = sharding.abstract_with(self.policy.params, self.policy.param_shardings(self.mesh))
    return {"ref": policy_lib.as_reference(abstract, self.dtype)}

  def start(self, params):
    """A fresh GRPO run: the reference is the policy it starts from."""
    if self.own_copy:
      self._keep(policy_lib.as_reference(params, self.dtype))

  def restore(self, restored: dict):
    if self.own_copy:
      self._keep(restored["ref"])

  def saved(self) -> dict:
    return {"ref": self.params} if self.own_copy else {}

  def on_device(self):
    """The copy's arrays on the device (None without a copy): for compiling ahead."""
    return (
        _to_memory_kind(self.params, "device") if self.offload and self.own_copy else (self.params)
    )

  def weights(self, params):
    """The reference's params on the device; `params`: the policy's current ones (LoRA's
    reference is their base)."""
    return self.policy.reference(params) if self.policy.reference else self.on_device()

  def logprobs(self, params, input_ids, attention_mask):
    """Per-token log-probs [N, C] of the completions under the reference (`weights(params)`)."""
    return self.fns.logprobs(self.weights(params), input_ids, attention_mask)

  def after_update(self, step: int, params):
    """reference.refresh_every_steps: at every such step the copy becomes a copy (or an EMA)
    of the policy."""
    with profiling.phase("ref_refresh"):
      if self.own_copy and self.refresh_every and step % self.refresh_every == 0:
        self._keep(self.fns.refresh(self.on_device(), params))

  def _keep(self, params):
    self.params = _to_memory_kind(params, "pinned_host") if self.offload else params
    profiling.log_memory("the reference")


def _to_memory_kind(tree, kind):
  try:
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)
  except (ValueError, NotImplementedError) as e:  # backends without host memory spaces
    logging.log_first_n(logging.WARNING, "reference offload to %s unavailable here: %s", 1, kind, e)
    return tree
