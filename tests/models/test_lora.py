"""LoRA / QLoRA (grpo_jax/models/lora/adapters.py): adapters on a frozen (optionally int8/int4) base.

B = 0 is the base exactly; the adapted forward == the plain decoder on merged weights ==
an independent NumPy merge; one update moves only the adapters (and the optimizer holds moments
only for them); the reference is the same base arrays run without adapters == a separately
built base; the loop keeps no reference copy and checkpoints no base, and resumes exactly; the
HF export (merged) and the PEFT export load in transformers / peft with our logits; the int8 base
stays within a stated tolerance of the float base.
"""

import importlib.util
import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from grpo_jax import configuration
from grpo_jax.parallel import sharding
from grpo_jax import train
from grpo_jax.models import build
from grpo_jax.models.lora import adapters as lora
from grpo_jax.models import policy as policy_lib
from grpo_jax.rl import step as step_lib
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lora_config(**overrides):
  kw = {"lora.rank": 4, "lora.alpha": 8.0}
  kw.update(overrides)
  return tiny_config(**kw)


def batch(seed=0, b=8, t=13, vocab=96):
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab, (b, t))
  mask = np.ones((b, t), np.int32)
  mask[1, :4] = 0  # left padding
  return jnp.asarray(ids), jnp.asarray(mask)


def logits(graphdef, params, ids, mask):
  return jax.jit(lambda p: nnx.merge(graphdef, p)(ids, mask))(params)


def one_device_mesh():
  return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True])
def test_adapted_forward_equals_merged_and_numpy_and_b_zero_is_the_base(scan):
  c = lora_config(**{"model.scan_layers": scan, "lora.init": "normal"})
  mesh = one_device_mesh()
  pol, plain = build.make_policy(c, mesh), policy_lib.native_policy(c, mesh)
  ids, mask = batch()
  ours = logits(pol.graphdef, pol.params, ids, mask)
  merged = jax.jit(lambda p: lora.merged(p, pol.graphdef))(pol.params)
  np.testing.assert_allclose(ours, logits(plain.graphdef, merged, ids, mask), atol=1e-5)
  base_logits = logits(plain.graphdef, plain.params, ids, mask)
  assert np.abs(ours - base_logits).max() > 1e-3
  # the merge itself against NumPy: W + (alpha / r) A.reshape(in, r) @ B.reshape(r, out)
  f, fm = dict(nnx.to_flat_state(pol.params)), dict(nnx.to_flat_state(merged))
  pre = ("layers",) if scan else ("layers", 1)
  for mod, w, n_in in (("attn", "q", 1), ("attn", "o", 2), ("mlp", "down", 1)):
    base = np.asarray(f[(*pre, mod, w)].get_value())
    a = np.asarray(f[(*pre, mod, f"{w}_lora_a")].get_value())
    b = np.asarray(f[(*pre, mod, f"{w}_lora_b")].get_value())
    if scan:
      base, a, b = base[1], a[1], b[1]
    want = base + 2.0 * (a.reshape(-1, 4) @ b.reshape(4, -1)).reshape(base.shape)
    got = np.asarray(fm[(*pre, mod, w)].get_value())
    np.testing.assert_allclose(got[1] if scan else got, want, atol=1e-6)
  # B = 0 (the default init): the adapted model is the base, bit for bit
  adapters, base_state = lora.split(pol.params)
  assert len(jax.tree.leaves(adapters)) == 2 * 7 * c.model.num_layers // (
      c.model.num_layers if scan else 1
  )
  assert all(
      isinstance(v, nnx.LoRAParam)
      for v in jax.tree.leaves(adapters, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )
  np.testing.assert_array_equal(
      logits(pol.graphdef, lora.zero_delta(pol.params), ids, mask), base_logits
  )


def test_update_moves_only_adapters_and_moments_cover_only_them():
  # (padded rows: this test hands fns.update the rows as assembled)
  c = lora_config(
      **{"lora.init": "normal", "mesh.fsdp": 2, "mesh.tensor": 2, "pack_sequences": False}
  )
  mesh = build.make_mesh(c)
  assert mesh.size == 8
  pol = build.make_policy(c, mesh)
  # adapters are sharded like the rows / columns of the weight they adapt; rank replicated
  f = dict(nnx.to_flat_state(pol.params))
  assert f[
      ("layers", 0, "attn", "q_lora_a")
  ].get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  assert f[
      ("layers", 0, "attn", "q_lora_b")
  ].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)
  fns = step_lib.build(c, pol, mesh)
  state = fns.init(pol.params)
  mu = [
      jax.tree_util.keystr(k)
      for k, _ in jax.tree_util.tree_leaves_with_path(state["opt_state"])
      if "lora" in jax.tree_util.keystr(k)
  ]
  n_opt = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim)
  n_adapters = sum(x.size for x in jax.tree.leaves(lora.split(pol.params)[0]))
  assert mu and n_opt == 2 * n_adapters  # Adam's two moments, for the adapters only
  before = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state["params"])}
  rows, C = c.batch_size * c.num_generations, c.max_completion_length
  ids, _ = batch(b=rows, t=c.max_prompt_length + C)
  rng = np.random.default_rng(1)
  upd = dict(
      input_ids=ids,
      attention_mask=jnp.ones_like(ids),
      completion_mask=jnp.ones((rows, C), jnp.int32),
      advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
  )
  state, metrics = fns.update(state, upd)
  assert float(metrics["grad_norm"]) > 0
  after = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state["params"])}
  changed = {jax.tree_util.keystr(k) for k in before if not np.array_equal(before[k], after[k])}
  assert changed and all("_lora_" in k for k in changed), sorted(changed)[:5]
  assert len(changed) == len(jax.tree.leaves(lora.split(pol.params)[0]))


def test_reference_is_the_base_arrays_and_equals_a_separate_base():
  c = lora_config(**{"lora.init": "normal"})
  mesh = one_device_mesh()
  pol, plain = build.make_policy(c, mesh), policy_lib.native_policy(c, mesh)
  ref = pol.reference(pol.params)
  full = dict(nnx.to_flat_state(pol.params))
  for path, var in nnx.to_flat_state(ref):  # the very arrays of the policy: no copy
    assert var.get_value() is full[path].get_value()
  ids, mask = batch()
  lp = jax.jit(pol.logprobs, static_argnums=3)
  want = jax.jit(plain.logprobs, static_argnums=3)(plain.params, ids, mask, 6)
  np.testing.assert_allclose(lp(ref, ids, mask, 6), want, atol=1e-6)
  assert np.abs(lp(pol.params, ids, mask, 6) - want).max() > 1e-3  # adapters on: different


def _checkpoint(workdir, step):
  d = os.path.join(workdir, "checkpoints", str(step))
  state = ocp.PyTreeCheckpointer().restore(os.path.join(d, "state"))
  meta = json.load(open(os.path.join(d, "meta", "metadata")))
  return state, meta


@pytest.mark.slow  # ~80 s: three runs of the loop
def test_loop_keeps_no_reference_checkpoints_adapters_and_resumes_exactly(tmp_path):
  """SFT warm start -> adapters folded, base written once; GRPO with beta > 0 (reference =
  base); 4 steps straight == 2 + resume + 2 (the base reloaded from WORKDIR/lora_base)."""
  kw = {"beta": 0.05, "sft_steps": 6, "sft.stop_at_accuracy": 0.0, "num_steps": 4}
  straight = str(tmp_path / "straight")
  train.run(lora_config(**kw), straight)
  split_dir = str(tmp_path / "split")
  with pytest.raises(SystemExit):
    train.run(lora_config(**kw, max_steps_per_run=2), split_dir)
  state, meta = _checkpoint(split_dir, 8)
  assert set(state) == {"train", "rng"}  # no "ref": the reference is the base itself
  leaves = jax.tree_util.tree_leaves_with_path(state["train"]["params"])
  assert leaves and all("_lora_" in jax.tree_util.keystr(k) for k, _ in leaves)
  assert meta["lora_base"] == os.path.join(split_dir, "lora_base")
  train.run(lora_config(**kw, max_steps_per_run=2), split_dir)
  a, b = grpo_rows(straight), grpo_rows(split_dir)
  assert [r["step"] for r in b] == [1, 2, 3, 4] and all(r["loss/grad_norm"] > 0 for r in a)
  assert any(r["loss/kl_divergence"] > 0 for r in a[1:])  # the adapters moved off the base
  for ra, rb in zip(a, b):
    for k in ("reward/total", "loss/policy_loss", "loss/kl_divergence", "loss/grad_norm"):
      assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
  sa, sb = _checkpoint(straight, 10)[0], _checkpoint(split_dir, 10)[0]
  for x, y in zip(jax.tree.leaves(sa["train"]), jax.tree.leaves(sb["train"])):
    np.testing.assert_array_equal(x, y)
  if _have("torch", "transformers", "peft"):  # infer --export_peft of the trained run: the
    _export_and_load(tmp_path, straight, kw)  # adapters + the SFT'd base they go with


def _export_and_load(tmp_path, workdir, kw):
  import subprocess
  import sys
  import torch
  import transformers
  import peft

  out, merged = tmp_path / "peft", tmp_path / "merged"
  args = [f"--config.{k}={v}" for k, v in kw.items()] + [
      "--config.lora.rank=4",
      "--config.lora.alpha=8.0",
  ]
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.infer",
          "--config=configs/tiny.py",
          f"--workdir={workdir}",
          f"--export_peft={out}",
          f"--export_hf={merged}",
          *args,
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.load(open(out / "adapter_config.json"))["base_model_name_or_path"] == str(
      out / "base"
  )
  model = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(out / "base"), out
  ).eval()
  want = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
  ids = torch.tensor(np.random.default_rng(0).integers(3, 60, (2, 9)))
  with torch.no_grad():
    assert float((model(ids).logits - want(ids).logits).abs().max()) <= 1e-4
    with model.disable_adapter():
      assert float((model(ids).logits - want(ids).logits).abs().max()) > 1e-4


def _have(*mods):
  return all(importlib.util.find_spec(m) for m in mods)


@pytest.mark.skipif(not _have("torch", "transformers", "peft"), reason="needs torch+peft")
def test_export_hf_merged_and_peft_adapters_load_with_our_logits(tmp_path):
  import torch
  import transformers
  import peft
  from grpo_jax.models.decoder import hf
  from grpo_jax.models.lora import peft as peft_export

  c = lora_config(
      **{
          "lora.init": "normal",
          "lora.target_modules": r"layers/\d+/(attn/(q|v|o)|mlp/down)|layers/1/mlp/(gate|up)",
      }
  )
  mesh = one_device_mesh()
  pol, plain = build.make_policy(c, mesh), policy_lib.native_policy(c, mesh)
  ids, mask = batch()
  ours = np.asarray(logits(pol.graphdef, pol.params, ids, mask))
  pos = np.maximum(np.cumsum(np.asarray(mask), -1) - 1, 0)

  def torch_logits(model):
    with torch.no_grad():
      return (
          model(
              torch.tensor(np.asarray(ids)),
              attention_mask=torch.tensor(np.asarray(mask)),
              position_ids=torch.tensor(pos),
          )
          .logits.float()
          .numpy()
      )

  keep = np.asarray(mask) > 0
  pol.save_hf(pol.params, str(tmp_path / "merged"))  # --export_hf
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  assert np.abs(torch_logits(merged) - ours)[keep].max() <= 1e-4
  hf.save_hf(nnx.merge(plain.graphdef, plain.params), str(tmp_path / "base"))
  peft_export.save_peft(pol.params, c, str(tmp_path / "adapter"))  # --export_peft
  cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
  assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and len(cfg["target_modules"]) == 10
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
  model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  assert np.abs(torch_logits(model) - ours)[keep].max() <= 1e-4
  with model.disable_adapter():  # and the adapters are what makes the difference
    assert np.abs(torch_logits(model) - ours)[keep].max() > 1e-3


@pytest.mark.parametrize(
    "qtype,tol", [("int8", 0.15), pytest.param("int4", 3.0, marks=pytest.mark.slow)]
)
def test_quantized_base_is_within_tolerance_of_the_float_base(qtype, tol):
  """Weight-only, per output channel (qwix absmax). Max |logit diff| over the tiny random model's
  logits (|logit| up to ~3-5): int8 <= 0.15 (measured 0.099); int4 (16 levels) <= 3.0."""
  c = lora_config(**{"lora.quantize_base": qtype, "mesh.tensor": 2})
  mesh = build.make_mesh(c)
  pol, plain = build.make_policy(c, mesh), policy_lib.native_policy(c, mesh)
  f = dict(nnx.to_flat_state(pol.params))
  assert f[("layers", 0, "mlp", "gate")].get_value().dtype == jnp.dtype(qtype)
  assert f[("layers", 0, "mlp", "gate_lora_a")].get_value().dtype == jnp.float32
  ids, mask = batch()
  got = logits(pol.graphdef, pol.params, ids, mask)
  want = logits(plain.graphdef, plain.params, ids, mask)
  diff = float(np.abs(got - want)[np.asarray(mask) > 0].max())
  assert 0 < diff <= tol, diff
  assert float(np.abs(want).max()) > 1.0


def test_validation_explains_bad_values():
  def errors(**kw):
    return " | ".join(configuration.validate(lora_config(**kw), num_devices=8))

  assert "lora.rank=200 > min(d_in, d_out) = min(128, 64) of attn/k" in errors(**{"lora.rank": 200})
  e = errors(**{"lora.target_modules": "attn/q"})
  assert "matches no weight" in e and "layers/0/attn/q" in e and "layers/0/mlp/down" in e
  assert "cannot be trained" in errors(**{"lora.quantize_base": "int8", "sft_steps": 5})
  assert "lora.dropout=0.1" in errors(**{"lora.dropout": 0.1})
  assert "refresh_every_steps" in errors(**{"beta": 0.1, "reference.refresh_every_steps": 2})
  assert "target every layer" in errors(
      **{"model.scan_layers": True, "lora.target_modules": r"layers/0/attn/q"}
  )
  assert errors() == ""


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f"cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_tiny_lora_and_the_qwen3_8b_one_flag_switch_validate():
  c = _load("tiny_lora")
  assert c.lora.rank == 8 and c.sft_steps > 0
  assert configuration.validate(c, num_devices=8) == []
  c = _load("qwen3_8b")
  assert c.lora.rank == 0
  c.lora.rank = 8  # (the recipe's data paths are the user's: only the lora block is checked)
  assert lora.problems(c) == []
  c.lora.quantize_base = "int8"
  assert lora.problems(c) == []
