"""The run's mesh and policy from config: the one place that knows `config.model.impl` and
`config.model.family`.

    mesh = build.make_mesh(config)               # every stage and engine uses this mesh
    policy = build.make_policy(config, mesh)     # models.policy.Policy, whatever the impl

`IMPLS` names the implementations and `FAMILIES` the architectures (the config validator lists
them): "decoder" (decoder-only, either impl) or "t5" (encoder-decoder, native only). The MaxText policy needs
MaxText's many-axis mesh (our data/fsdp/tensor axes plus its own, of size 1, over the same
devices in the same order), so `make_mesh` builds that mesh up front for impl=maxtext: the
loop, the sampler and the policy then share one mesh object and PartitionSpecs over
(data, fsdp, tensor) mean the same thing on it.
"""

import jax

from grpo_jax.parallel import sharding
from grpo_jax.models import policy as policy_lib

IMPLS = ("native", "maxtext")
FAMILIES = ("decoder", "t5")


def make_mesh(config, devices=None):
  """The mesh of the run (config.mesh sizes; -1 fills), shaped for the model implementation.

  config.mesh.dcn_data > 1 makes it multi-slice: the sizes are per slice and the data axis is
  dcn_data times longer, one block per slice (sharding.make_mesh)."""
  if devices is None and config.rollout.engine == "vllm":
    # rollout.vllm.num_devices > 0: vLLM-TPU's own chips (each host's last N) stay off the mesh.
    devices, _ = sharding.split_off_local(config.rollout.vllm.num_devices)
  base = sharding.make_mesh(
      config.mesh.data,
      config.mesh.fsdp,
      config.mesh.tensor,
      devices=devices,
      dcn_data=config.mesh.dcn_data,
      expert=config.mesh.expert,
  )
  if config.model.impl == "maxtext":
    from grpo_jax.models.maxtext import adapter as maxtext_adapter  # optional dependency

    return maxtext_adapter.make_mesh(config, base)
  return base


def make_meshes(config):
  """(trainer mesh, sampler mesh). rollout.placement=colocated: one mesh, twice. disaggregated:
  the last rollout.num_devices of the global devices (a count, a fraction of all, 0 = half)
  form the sampler's mesh (config.mesh sizes, -1 filling), the others the trainer's (so
  process 0 always holds trainer devices). The two must be equal in size (parallel/transfer.py)."""
  if config.rollout.placement != "disaggregated":
    mesh = make_mesh(config)
    return mesh, mesh
  devices = jax.devices()
  n = sampler_devices(config.rollout.num_devices, len(devices))
  sampler = sharding.make_mesh(
      config.mesh.data,
      config.mesh.fsdp,
      config.mesh.tensor,
      devices=devices[len(devices) - n :],
      expert=config.mesh.expert,
  )
  return make_mesh(config, devices[: len(devices) - n]), sampler


def sampler_count(num_devices: float, total: int) -> int:
  """rollout.num_devices -> a count: as is when >= 1, a fraction of `total` when in (0, 1),
  half when 0."""
  return (
      total // 2
      if not num_devices
      else (int(num_devices) if num_devices >= 1 else int(round(num_devices * total)))
  )


def sampler_devices(num_devices: float, total: int) -> int:
  """sampler_count, or ValueError (one line, with the fix) unless it leaves the trainer as
  many."""
  n = sampler_count(num_devices, total)
  if total < 2:
    raise ValueError(
        "rollout.placement=disaggregated needs at least 2 devices (one sampler, "
        "one trainer). Fix: --config.rollout.placement=colocated"
    )
  if n != total - n:
    raise ValueError(
        f"rollout.placement=disaggregated: rollout.num_devices={num_devices} gives the sampler "
        f"{n} of {total} devices; the weight transfer (grpo_jax/parallel/transfer.py) pairs each sampler "
        f"device with a trainer device, so the split must be even. Fix: "
        f"--config.rollout.num_devices={total // 2} (or 0 = half)"
    )
  return n


def make_policy(config, mesh, *, abstract: bool = False) -> policy_lib.Policy:
  """The trained policy on `mesh` (from make_mesh). `abstract=True`: shapes and shardings only,
  a target to restore a checkpoint into."""
  if config.model.family not in FAMILIES:
    raise ValueError(f"model.family={config.model.family!r}: use one of {', '.join(FAMILIES)}")
  if config.model.family == "t5":
    if config.model.impl != "native":
      raise ValueError(
          f"model.family='t5' runs on the native T5 only (model.impl="
          f"{config.model.impl!r}). Fix: --config.model.impl=native"
      )
    return policy_lib.t5_policy(config, mesh, abstract=abstract)
  if config.model.impl == "maxtext":
    from grpo_jax.models.maxtext import adapter as maxtext_adapter  # optional dependency

    return maxtext_adapter.maxtext_policy(config, mesh, abstract=abstract)
  if config.model.impl != "native":
    raise ValueError(f"model.impl={config.model.impl!r}: use one of {', '.join(IMPLS)}")
  if config.lora.rank:  # adapters (and a quantized base) on the native decoder: lora_policy.py
    from grpo_jax.models.lora import policy as lora_policy

    return lora_policy.lora_policy(config, mesh, abstract=abstract)
  return policy_lib.native_policy(config, mesh, abstract=abstract)
