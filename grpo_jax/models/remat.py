"""Named rematerialization policies for the layer stack (`ModelConfig.remat_policy`).

  none          keep every activation (fastest, most memory), the LM head's logits included
                (models/logprobs.py: B x C x V floats per micro-batch, f32)
  full          keep only layer inputs; recompute the whole layer in the backward pass
  save_dots     keep matmul outputs without batch dims (jax's dots_with_no_batch_dims_saveable)
  save_qkv_out  keep the named q/k/v projections and attention/MLP outputs, recompute the rest
  offload_dots  like save_qkv_out + mlp_hidden, but the saved activations go to pinned host
                memory (`save_and_offload_only_these_names`): device memory of full remat at
                a fraction of its recompute. On CPU the offload is a no-op (no host placement
                in the compiled HLO) but numerics are the same; measure it on an accelerator.
Every policy but "none" also recomputes the LM head's logits chunk by chunk in the backward
pass (memory O(B x chunk x V) instead of O(B x C x V)). The layers tag activations with
`checkpoint_name` ("qkv_proj", "attn_out", "mlp_hidden", "mlp_out"; see layers.py) so these
policies can select them by name.
"""

import jax

_SAVED = ("qkv_proj", "attn_out", "mlp_out")


def _offload_dots():
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=[*_SAVED, "mlp_hidden"],
      offload_src="device",
      offload_dst="pinned_host",
  )


# name -> factory of the jax.checkpoint policy (None: no jax.checkpoint at all). Factories, not
# policies, so this module stays importable (by the config validator) without touching a
# backend; a new entry here is a new `model.remat_policy` value everywhere.
POLICIES = {
    "none": lambda: None,
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    "save_dots": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_out": lambda: jax.checkpoint_policies.save_only_these_names(*_SAVED),
    "offload_dots": _offload_dots,
}


def policy(name: str):
  """The jax.checkpoint policy for `name`, or None for "none" (no jax.checkpoint at all)."""
  if name not in POLICIES:
    raise ValueError(f"unknown remat policy '{name}'; known: {', '.join(POLICIES)}")
  return POLICIES[name]()
