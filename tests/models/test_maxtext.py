"""MaxText as the policy (models/maxtext/adapter.py): parity with the native decoder, the weight
mapping, GRPO steps, checkpoints, and MaxText's random-init loss. Skips without maxtext."""

import math
import os

import numpy as np
import pytest

from tests.conftest import skip_unless_maxtext  # noqa: E402

skip_unless_maxtext()  # absent, or installed with model code that does not import here

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import tiny  # noqa: E402
from grpo_jax.parallel import sharding  # noqa: E402
from grpo_jax import train  # noqa: E402
from grpo_jax.models.maxtext import adapter as mta  # noqa: E402
from grpo_jax.models import policy as policy_lib  # noqa: E402
from grpo_jax.rl import step as step_lib  # noqa: E402


def test_qwix_sparsity_modules_are_real_or_placeholders_that_say_why():
  """MaxText's model code imports on tpu-inference's qwix 0.1.2 (see maxtext_adapter's
  docstring): each weight-sparsity module is qwix's own where it exists, else a placeholder
  that fails on use with the cause; with a qwix that has them nothing is replaced."""
  import importlib.util
  import sys

  quantizations = mta.import_maxtext("maxtext.layers.quantizations")
  moe = mta.import_maxtext("maxtext.layers.moe")
  assert quantizations.sparsity is sys.modules["qwix._src.core.sparsity"]
  assert moe.sparsity_module is sys.modules["qwix.contrib.sparsity.sparsity_module"]
  for module, attr in (
      (quantizations.sparsity, "SparsityRule"),
      (moe.sparsity_module, "SparsityModule"),
  ):
    if getattr(module, "PLACEHOLDER", False):
      with pytest.raises(ImportError, match="weight sparsity with fp8 quantization"):
        getattr(module, attr)
    else:
      assert module.__spec__ is not None and importlib.util.find_spec(module.__name__)
      assert callable(getattr(module, attr))


def tiny_qwen3(**overrides):
  c = tiny.get_config()
  c.model.vocab_size = 101  # odd on purpose
  c.model.hidden_size = 64
  c.model.intermediate_size = 96
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 24  # != hidden / heads
  c.model.tie_embeddings = False
  c.model.rope_theta = 1e6
  c.model.max_position_embeddings = 64
  c.max_prompt_length = 12
  c.max_completion_length = 8
  c.model.maxtext.remat_policy = "full"
  for k, v in overrides.items():
    c.update_from_flattened_dict({k: v})
  return c


def left_padded(rng, vocab, lengths, total):
  ids = np.zeros((len(lengths), total), np.int32)
  mask = np.zeros((len(lengths), total), np.int32)
  for i, n in enumerate(lengths):
    ids[i, total - n :] = rng.integers(1, vocab, n)
    mask[i, total - n :] = 1
  return jnp.asarray(ids), jnp.asarray(mask)


def mesh_1():
  return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "scan,tied",
    [  # suite time: -m slow runs the unscanned/untied ones
        pytest.param(False, False, marks=pytest.mark.slow),
        pytest.param(True, False, marks=pytest.mark.slow),
        (True, True),
    ],
)
def test_same_weights_same_logits_as_native(scan, tied):
  config = tiny_qwen3(**{"model.scan_layers": scan, "model.tie_embeddings": tied})
  mesh = sharding.make_mesh(-1, 1, 1)
  mt = mta.maxtext_policy(config, mesh)
  native = policy_lib.native_policy(config, mesh)
  # Random-init MaxText policy starts from the native init of the same seed (exactly).
  got = nnx.to_pure_dict(jax.jit(mt.rollout_params)(mt.params))
  want = nnx.to_pure_dict(native.params)
  for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(k))

  ids, mask = left_padded(np.random.default_rng(0), 101, [20, 13, 7, 20, 3, 16, 20, 9], 20)
  parts = mta.build_parts(config, mesh)
  mt_logits = jax.jit(lambda p, i, m: mta.forward(parts.graphdef, p, parts.rest, i, m))(
      mt.params, ids, mask
  )
  nat = nnx.merge(native.graphdef, native.params)
  nat_logits = nat(ids, mask)
  if tied:
    # MaxText 0.2.5 rounds the tied embedding table to bfloat16 for the output projection
    # (layers/embeddings.py, attend_on_embedding), whatever `dtype` says. Same rounding here:
    head = nat.embed[...].astype(jnp.bfloat16).astype(jnp.float32).T
    nat_logits = jnp.einsum("btd,dv->btv", nat.hidden(ids, mask), head)
  m = np.asarray(mask, bool)
  diff = np.abs(np.asarray(mt_logits) - np.asarray(nat_logits))[m]
  assert diff.max() <= 1e-4, diff.max()
  assert np.abs(np.asarray(nat_logits)[m]).mean() > 1e-2  # not trivially zero
  lp_mt = mt.logprobs(mt.params, ids, mask, 6)
  lp_nat = native.logprobs(native.params, ids, mask, 6)
  tol = 2e-2 if tied else 1e-4  # tied: the bf16-rounded head above, not applied here
  # Log-probs of (or predicted from) padding are masked out of every loss.
  real = m[:, -6:] & m[:, -7:-1]
  np.testing.assert_allclose(np.asarray(lp_mt)[real], np.asarray(lp_nat)[real], atol=tol)


# Llama 3.1 (its RoPE scaling), Gemma 2 (pairs, attention soft-cap, query scale 12 != K) and
# Gemma 3 (blocks of 6 + a remainder, local/global RoPE bases, linear scaling), windows of 4
# over 20-token rows; the "off" overrides must change the native logits (the feature is live).
FAMILIES = {
    "llama3": (
        {
            "model.arch": "llama3",
            "model.qk_norm": False,
            "model.rope_theta": 5e5,
            "model.rope_scaling_factor": 8.0,
            "model.num_layers": 2,
        },
        {"model.rope_scaling_factor": 0.0},
    ),
    "gemma2": (
        {
            "model.arch": "gemma2",
            "model.qk_norm": False,
            "model.num_layers": 4,
            "model.sliding_window": 4,
            "model.sliding_window_pattern": 2,
            "model.query_pre_attn_scalar": 12.0,
            "model.attn_logit_softcap": 5.0,
        },
        {"model.attn_logit_softcap": 0.0, "model.sliding_window": 64},
    ),
    "gemma3": (
        {
            "model.arch": "gemma3",
            "model.num_layers": 8,
            "model.sliding_window": 4,
            "model.sliding_window_pattern": 6,
            "model.query_pre_attn_scalar": 24.0,
            "model.rope_local_theta": 1e4,
            "model.rope_linear_factor": 2.0,
        },
        {"model.rope_linear_factor": 1.0, "model.sliding_window": 64},
    ),
}


@pytest.mark.parametrize(
    "family,scan",
    [  # suite time: -m slow runs llama3 and gemma2
        pytest.param("llama3", True, marks=pytest.mark.slow),
        pytest.param("gemma2", False, marks=pytest.mark.slow),
        ("gemma3", True),
    ],
)
def test_families_same_weights_same_logits_as_native(family, scan):
  """MaxText's llama2 / gemma2 / gemma3 blocks on the mapped weights == the native decoder."""
  on, off = FAMILIES[family]
  config = tiny_qwen3(**on, **{"model.scan_layers": scan})
  mesh = mesh_1()
  mt = mta.maxtext_policy(config, mesh)
  native = policy_lib.native_policy(config, mesh)
  got = nnx.to_pure_dict(jax.jit(mt.rollout_params)(mt.params))
  for (k, a), b in zip(
      jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(nnx.to_pure_dict(native.params))
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7, err_msg=str(k))
  ids, mask = left_padded(np.random.default_rng(0), 101, [20, 13, 7, 20], 20)
  parts = mta.build_parts(config, mesh)
  mt_logits = jax.jit(lambda p, i, m: mta.forward(parts.graphdef, p, parts.rest, i, m))(
      mt.params, ids, mask
  )
  nat_logits = nnx.merge(native.graphdef, native.params)(ids, mask)
  m = np.asarray(mask, bool)
  diff = np.abs(np.asarray(mt_logits) - np.asarray(nat_logits))[m]
  assert diff.max() <= 1e-4, diff.max()
  other = policy_lib.native_policy(tiny_qwen3(**{**on, **off, "model.scan_layers": scan}), mesh)
  other_logits = nnx.merge(other.graphdef, native.params)(ids, mask)
  assert np.abs(np.asarray(other_logits) - np.asarray(nat_logits))[m].max() > 1e-2
  lp_mt = mt.logprobs(mt.params, ids, mask, 6)
  lp_nat = native.logprobs(native.params, ids, mask, 6)
  real = m[:, -6:] & m[:, -7:-1]
  np.testing.assert_allclose(np.asarray(lp_mt)[real], np.asarray(lp_nat)[real], atol=1e-4)


def test_padding_is_never_attended():
  """Changing the left-padding tokens must not change any real token's logits."""
  config = tiny_qwen3()
  mesh = mesh_1()
  mt = mta.maxtext_policy(config, mesh)
  parts = mta.build_parts(config, mesh)
  ids, mask = left_padded(np.random.default_rng(1), 101, [5, 12], 12)
  noisy = jnp.where(mask == 1, ids, 77)
  a = mta.forward(parts.graphdef, mt.params, parts.rest, ids, mask)
  b = mta.forward(parts.graphdef, mt.params, parts.rest, noisy, mask)
  m = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(a)[m], np.asarray(b)[m], atol=1e-6)


@pytest.mark.parametrize("native_scan", [False, True])
@pytest.mark.parametrize("mt_scan", [False, True])
def test_weight_mapping_round_trips_exactly(native_scan, mt_scan):
  config = tiny_qwen3(**{"model.scan_layers": native_scan})
  cfg = policy_lib.model_config_from(config)
  rng = np.random.default_rng(2)
  native = nnx.state(nnx.eval_shape(lambda: mta.Transformer(cfg, rngs=nnx.Rngs(0))))
  native = jax.tree.map(
      lambda x: rng.standard_normal(x.shape).astype(np.float32), nnx.to_pure_dict(native)
  )
  mt = mta.native_to_maxtext(native, cfg, scan_layers=mt_scan)
  if mt_scan:
    assert mt["decoder"]["layers"]["self_attention"]["query"]["kernel"].shape == (64, 2, 4, 24)
  else:
    assert mt["decoder"]["layers_1"]["mlp"]["wo"]["kernel"].shape == (96, 64)
  back = mta.maxtext_to_native(mt, cfg, scan_layers=mt_scan)
  assert jax.tree.structure(back) == jax.tree.structure(native)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(native)):
    np.testing.assert_array_equal(np.asarray(a), b)
  again = mta.native_to_maxtext(back, cfg, scan_layers=mt_scan)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(mt)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Every MaxText parameter of the real model is covered, with the model's shapes.
  mesh = mesh_1()
  parts = mta.build_parts(tiny_qwen3(**{"model.scan_layers": mt_scan}), mesh)
  want = nnx.to_pure_dict(parts.abstract_params)
  assert jax.tree.structure(want) == jax.tree.structure(mt)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(mt)):
    assert tuple(a.shape) == tuple(b.shape)
  names = mta.maxtext_hf_names(cfg, scan_layers=mt_scan)
  assert len(names) == len(jax.tree.leaves(mt))
  assert names["token_embedder/embedding"] == "model.embed_tokens.weight"


def test_two_grpo_updates_match_native():
  """Same weights, same rollout batch: the GRPO loss and the updated weights agree."""
  config = tiny_qwen3(beta=0.04)
  mesh = sharding.make_mesh(-1, 1, 1)
  G, B, L, P = 2, 4, 8, 12
  rng = np.random.default_rng(3)
  ids, mask = left_padded(rng, 101, rng.integers(3, P + 1, B * G), P)
  comp = jnp.asarray(rng.integers(1, 101, (B * G, L)), jnp.int32)
  cmask = jnp.asarray(np.arange(L)[None] < rng.integers(2, L + 1, (B * G, 1)), jnp.int32)
  ids = jnp.concatenate([ids, comp], 1)
  full_mask = jnp.concatenate([mask, cmask], 1)
  adv = jnp.asarray(rng.standard_normal(B * G), jnp.float32)
  settings = step_lib.LossSettings.from_config(config)
  opt = step_lib.make_optimizer(
      learning_rate=1e-2,
      total_steps=4,
      warmup_ratio=0.0,
      end_lr_ratio=1.0,
      b1=0.9,
      b2=0.99,
      weight_decay=0.0,
      max_grad_norm=1.0,
  )
  losses = {}
  finals = {}
  for impl in ("native", "maxtext"):
    pol = (
        mta.maxtext_policy(config, mesh)
        if impl == "maxtext"
        else policy_lib.native_policy(config, mesh)
    )
    lp = lambda p, i, m: pol.logprobs(p, i, m, L, 1.0)  # noqa: E731
    old = jax.jit(lp)(pol.params, ids, full_mask)
    batch = dict(
        input_ids=ids,
        attention_mask=full_mask,
        completion_mask=cmask,
        advantages=adv,
        old_logp=old,
        ref_logp=old - 0.01,
    )
    update = jax.jit(step_lib.make_grpo_update(lp, opt, settings, 2))
    state = step_lib.init_state(pol.params, opt)
    out = []
    for _ in range(2):
      state, metrics = update(state, batch)
      out.append(float(metrics["loss"]))
    losses[impl] = out
    finals[impl] = nnx.to_pure_dict(jax.jit(pol.rollout_params)(state["params"]))
  np.testing.assert_allclose(losses["maxtext"], losses["native"], atol=1e-4)
  assert losses["native"][0] != losses["native"][1]  # the first update changed the policy
  # Adam divides by sqrt(v): an entry whose gradient is ~0 moves by up to lr either way on a
  # 1e-7 gradient difference, so the weights are compared more loosely than the loss.
  for a, b in zip(jax.tree.leaves(finals["maxtext"]), jax.tree.leaves(finals["native"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-3)


def _init_loss(config, mesh):
  pol = mta.maxtext_policy(config, mesh)
  rng = np.random.default_rng(4)
  ids = jnp.asarray(rng.integers(0, config.model.vocab_size, (4, 20)), jnp.int32)
  mask = jnp.ones_like(ids)
  return -float(jnp.mean(pol.logprobs(pol.params, ids, mask, 19)))


@pytest.mark.slow  # suite time (-m slow runs it)
def test_maxtext_init_loss_is_explained_and_the_adapter_init_is_sane():
  """MaxText's own init (embedding N(0,1), tied unnormalized logits) gives a loss ~0.7 * D; the
  adapter's default (native fan-in init) gives ~log V."""
  mesh = mesh_1()
  base = {
      "model.tie_embeddings": True,
      "model.vocab_size": 256,
      "model.hidden_size": 64,
      "model.head_dim": 16,
  }
  sane = _init_loss(tiny_qwen3(**base), mesh)
  assert abs(sane - math.log(256)) < 0.5, sane
  wild = _init_loss(tiny_qwen3(**{**base, "model.maxtext.native_init": False}), mesh)
  assert 25 < wild < 70, wild  # ENVIRONMENT.md saw 44.6 with MaxText's own tiny config
  # The mechanism: with |e|^2 ~ D the "repeat the input token" logit dominates; a wider model
  # has a proportionally larger loss.
  wider = _init_loss(
      tiny_qwen3(**{**base, "model.maxtext.native_init": False, "model.hidden_size": 128}), mesh
  )
  assert wider > 1.5 * wild, (wild, wider)


def test_maxtext_checkpoint_loads_scanned_into_unscanned(tmp_path):
  """MaxText's Orbax layout (<step>/items with {"params": {"params": ...}}), either layer form."""
  import orbax.checkpoint as ocp

  mesh = mesh_1()
  src = mta.maxtext_policy(tiny_qwen3(**{"model.scan_layers": True}), mesh)
  tree = {"params": {"params": nnx.to_pure_dict(src.params)}}
  ocp.PyTreeCheckpointer().save(str(tmp_path / "7" / "items"), tree)
  for scan in (True, False):
    config = tiny_qwen3(
        **{"model.scan_layers": scan, "model.maxtext_checkpoint": str(tmp_path / "7")}
    )
    pol = mta.maxtext_policy(config, mesh)
    a = nnx.to_pure_dict(jax.jit(pol.rollout_params)(pol.params))
    b = nnx.to_pure_dict(jax.jit(src.rollout_params)(src.params))
    flat_b = {
        jax.tree_util.keystr(k).replace("'", ""): v
        for k, v in jax.tree_util.tree_leaves_with_path(b)
    }
    if not scan:  # compare layer 1 of the unscanned model with slice 1 of the scanned one
      q = flat_b["[layers][attn][q]"]
      np.testing.assert_array_equal(np.asarray(a["layers"][1]["attn"]["q"]), np.asarray(q)[1])
    else:
      for (k, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  bad = tiny_qwen3(**{"model.hidden_size": 32, "model.maxtext_checkpoint": str(tmp_path / "7")})
  with pytest.raises(ValueError, match="shape"):
    mta.maxtext_policy(bad, mesh)


@pytest.mark.slow  # suite time (-m slow runs it)
def test_loop_runs_with_tiny_maxtext_config(tmp_path):
  """configs/tiny_maxtext.py: the GRPO loop, checkpoint and resume with a MaxText policy."""
  from configs import tiny_maxtext

  config = tiny_maxtext.get_config()
  config.num_steps = 2
  config.sft_steps = 3
  config.eval.num_examples = 8
  config.save_interval_steps = 1
  summary = train.run(config, str(tmp_path / "run"))
  assert summary["final_step"] == 2 and summary["sft_steps"] == 3
  assert os.path.isdir(tmp_path / "run" / "checkpoints" / "5")  # numbered over SFT + GRPO
  config.num_steps = 3
  assert train.run(config, str(tmp_path / "run"))["final_step"] == 3


@pytest.mark.parametrize(
    "family",
    [  # suite time: -m slow runs Llama 3.1 and Gemma 3
        "qwen3",
        pytest.param("llama3", marks=pytest.mark.slow),
        pytest.param("gemma3", marks=pytest.mark.slow),
    ],
)
def test_two_loop_steps_with_the_maxtext_policy(tmp_path, family):
  """train.run with model.impl=maxtext (scanned, untied as qwen3-8b, with a reference): two GRPO
  steps that move the policy, the native sampler drawing from the mapped weights with log-probs
  the MaxText trainer reproduces (f32: within 1e-4), and a checkpoint. Llama 3.1 and Gemma 3
  (2 layers: MaxText's remainder block alone) as in FAMILIES."""
  from tests.test_train import grpo_rows
  from tests.test_train import tiny_config

  family_fields = {} if family == "qwen3" else {**FAMILIES[family][0], "model.num_layers": 2}
  if family == "gemma3":
    family_fields["model.query_pre_attn_scalar"] = 0.0  # head_dim's
  config = tiny_config(
      **{
          "model.impl": "maxtext",
          "model.scan_layers": True,
          "model.tie_embeddings": False,
          "model.maxtext.remat_policy": "full",
          "model.maxtext.attention": "dot_product",
          "num_steps": 2,
          "beta": 0.04,
          "save_interval_steps": 2,
          **family_fields,
      }
  )
  summary = train.run(config, str(tmp_path / "run"))
  assert summary["final_step"] == 2
  assert os.path.isdir(tmp_path / "run" / "checkpoints" / "2")
  rows = grpo_rows(tmp_path / "run")
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["rollout/logprob_abs_diff_mean"] <= 1e-4, r["rollout/logprob_abs_diff_mean"]
    assert np.isfinite(r["loss/policy_loss"])
  assert rows[1]["loss/kl_divergence"] > 0  # step 1's update moved the policy off the reference


def test_qwen3_8b_builds_abstractly_with_the_published_shapes():
  """configs/qwen3_8b.py with impl=maxtext: MaxText's model has exactly the native parameters."""
  from configs import qwen3_8b

  config = qwen3_8b.get_config()
  config.model.impl = "maxtext"
  mesh = sharding.make_mesh(1, -1, 1)
  pol = mta.maxtext_policy(config, mesh, abstract=True)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(pol.params))
  assert n == pol.model_config.num_params == 8_190_735_360
  q = pol.params["decoder"]["layers"]["self_attention"]["query"]["kernel"]
  assert q.shape == (4096, 36, 32, 128) and q.dtype == jnp.float32  # f32 master weights
  assert q.sharding.spec[0] is not None  # the embed axis is sharded (FSDP)
  native = jax.eval_shape(pol.rollout_params, pol.params)
  assert native["layers"]["attn"]["q"].shape == (36, 4096, 32, 128)


def test_hf_checkpoint_loads_into_the_maxtext_policy(tmp_path):
  """model.hf_path with impl=maxtext: the HF weights, mapped into MaxText's layout, give the
  same log-probs as the native decoder loaded from the same folder; save_hf round trips."""
  from grpo_jax.models.decoder import hf

  config = tiny_qwen3(**{"model.scan_layers": True})
  mesh = mesh_1()
  src = policy_lib.native_policy(tiny_qwen3(seed=7), mesh)
  hf.save_hf(nnx.merge(src.graphdef, src.params), str(tmp_path / "hf"))
  config.model.hf_path = str(tmp_path / "hf")
  mt = mta.maxtext_policy(config, mesh)
  native = policy_lib.native_policy(config, mesh)
  ids, mask = left_padded(np.random.default_rng(6), 101, [12, 9], 12)
  real = np.asarray(mask, bool)[:, -5:] & np.asarray(mask, bool)[:, -6:-1]
  a = np.asarray(mt.logprobs(mt.params, ids, mask, 5))[real]
  b = np.asarray(native.logprobs(native.params, ids, mask, 5))[real]
  np.testing.assert_allclose(a, b, atol=1e-4)
  mt.save_hf(mt.params, str(tmp_path / "back"))
  again = hf.load_hf(str(tmp_path / "back"))
  np.testing.assert_allclose(
      np.asarray(again(ids, mask))[np.asarray(mask, bool)],
      np.asarray(nnx.merge(native.graphdef, native.params)(ids, mask))[np.asarray(mask, bool)],
      atol=1e-5,
  )


@pytest.mark.slow  # ~1 min: a MaxText policy's update compiled padded and packed
def test_packed_rows_equal_padded_with_the_maxtext_policy():
  """pack_sequences with model.impl=maxtext: MaxText's attention reads the packed rows' segment
  ids and positions (as its pre-training packs); GrpoStep's metrics (loss, KL, grad norm, ...)
  equal the padded layout's (1e-5), 2 micro-batches; after one AdamW step the params differ by
  more than 1e-5 at under 0.1% of the coordinates (measured: 34 of 406k, where a near-zero
  gradient's f32 noise decides the sign of AdamW's first step, +-lr: rare tokens' embedding
  rows mostly)."""
  from tests.rl.test_packing import _step_both

  overrides = {"model.impl": "maxtext", "beta": 0.1, "micro_batch_size": 16}
  (params_a, metrics_a), (params_b, metrics_b) = _step_both(overrides)
  for k, v in metrics_a.items():
    assert float(metrics_b[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
  assert float(metrics_a["grad_norm"]) > 0
  la, lb = jax.tree.leaves(params_a), jax.tree.leaves(params_b)
  flat = lambda leaves: np.concatenate([np.asarray(x).ravel() for x in leaves])  # noqa: E731
  assert np.mean(np.abs(flat(lb) - flat(la)) > 1e-5) < 1e-3
