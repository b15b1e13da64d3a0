"""Advantage estimators and DAPO helpers vs NumPy references written here, independently."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rl import registry


def np_grpo(r, g, eps, ddof):
  r = r.reshape(-1, g).astype(np.float64)
  out = np.zeros_like(r)
  for i, row in enumerate(r):
    std = row.std(ddof=ddof) if len(row) > ddof else 0.0
    out[i] = 0.0 if std == 0 else (row - row.mean()) / (std + eps)
  return out.reshape(-1)


def np_dr_grpo(r, g):
  r = r.reshape(-1, g).astype(np.float64)
  return (r - r.mean(1, keepdims=True)).reshape(-1)


def np_rloo(r, g):
  r = r.reshape(-1, g).astype(np.float64)
  out = np.zeros_like(r)
  if g > 1:
    for i, row in enumerate(r):
      for j in range(g):
        out[i, j] = row[j] - np.delete(row, j).mean()
  return out.reshape(-1)


def cases():
  rng = np.random.default_rng(0)
  yield "random", rng.normal(size=32).astype(np.float32), 8
  yield "binary", rng.integers(0, 2, size=48).astype(np.float32), 4
  yield "all_equal", np.full(16, 3.0, np.float32), 4
  yield "G1", rng.normal(size=5).astype(np.float32), 1
  yield "G2", np.array([1.0, 0.0, 5.0, 5.0, -2.0, 7.0], np.float32), 2
  yield "large", (rng.normal(size=24) * 1e4).astype(np.float32), 6
  yield "one_diff", np.array([0, 0, 0, 1, 2, 2, 2, 2], np.float32), 4


CASES = list(cases())


@pytest.mark.parametrize("name,r,g", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("std_kind,ddof", [("population", 0), ("sample", 1)])
def test_grpo_matches_numpy(name, r, g, std_kind, ddof):
  got = adv_lib.group_advantages(jnp.asarray(r), g, estimator="grpo", std_kind=std_kind, eps=1e-4)
  want = np_grpo(r, g, 1e-4, ddof)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,r,g", CASES, ids=[c[0] for c in CASES])
def test_dr_grpo_and_rloo_match_numpy(name, r, g):
  got = adv_lib.group_advantages(jnp.asarray(r), g, estimator="dr_grpo")
  scale = max(1.0, np.abs(r).max())
  np.testing.assert_allclose(got, np_dr_grpo(r, g), rtol=1e-6, atol=1e-6 * scale)
  got = adv_lib.group_advantages(jnp.asarray(r), g, estimator="rloo")
  np.testing.assert_allclose(got, np_rloo(r, g), rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("std_kind", ["population", "sample"])
def test_degenerate_groups_give_finite_zeros(estimator, std_kind):
  # 0.1 and 1.1 are not exact in binary: their group mean is off by ~1e-9.
  for r, g in [
      (jnp.full((12,), 7.0), 4),
      (jnp.arange(5.0), 1),
      (jnp.zeros(6), 6),
      (jnp.full((8,), 0.1), 8),
      (jnp.full((6,), 1.1), 3),
      (jnp.array([0.1] * 7 + [1 / 3] * 7), 7),
  ]:
    a = adv_lib.group_advantages(r, g, estimator=estimator, std_kind=std_kind, eps=0.0)
    assert np.all(np.asarray(a) == 0.0), (estimator, g, a)


def test_grpo_advantage_sign_and_scale():
  # Within a group, higher reward -> higher advantage; population-std GRPO has unit std.
  r = jnp.array([0.0, 1.0, 2.0, 3.0])
  a = np.asarray(adv_lib.group_advantages(r, 4, eps=0.0))
  assert np.all(np.diff(a) > 0)
  np.testing.assert_allclose(a.std(), 1.0, rtol=1e-6)
  np.testing.assert_allclose(a.mean(), 0.0, atol=1e-7)


def test_jit_and_vmap():
  r = jax.random.normal(jax.random.key(0), (3, 16))
  f = jax.jit(lambda x: adv_lib.group_advantages(x, 4, estimator="grpo"))
  batched = jax.vmap(f)(r)
  for i in range(3):
    np.testing.assert_allclose(batched[i], np_grpo(np.asarray(r[i]), 4, 1e-6, 0), atol=1e-6)


def test_bad_shapes_and_unknown_names():
  with pytest.raises(ValueError, match="G=3"):
    adv_lib.group_advantages(jnp.zeros(8), 3)
  with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: grpo"):
    adv_lib.group_advantages(jnp.zeros(8), 4, estimator="ppo")
  assert set(registry.ADVANTAGE_ESTIMATORS.names()) >= {"grpo", "dr_grpo", "rloo"}


def test_advantage_metrics():
  r = jnp.array([1.0, 1.0, 0.0, 2.0, 5.0, 5.0])
  a = adv_lib.group_advantages(r, 2)
  m = adv_lib.advantage_metrics(r, a, 2)
  np.testing.assert_allclose(m["reward/zero_std_group_fraction"], 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["reward/std_within_group"], np.mean([0.0, 1.0, 0.0]), rtol=1e-6)
  np.testing.assert_allclose(m["advantages/max"], np.asarray(a).max())


def test_dynamic_sampling_mask():
  r = np.array([1, 1, 1, 0, 1, 0, 2, 2, 2, 3, 3, 3], np.float32)
  got = np.asarray(adv_lib.dynamic_sampling_mask(jnp.asarray(r), 3))
  want = np.repeat([r[i : i + 3].std() > 0 for i in range(0, 12, 3)], 3)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("max_len,buf,factor", [(100, 20, 1.0), (64, 16, 0.5), (10, 0, 1.0)])
def test_overlong_penalty(max_len, buf, factor):
  lengths = np.arange(0, max_len + 1)
  got = np.asarray(adv_lib.overlong_penalty(jnp.asarray(lengths), max_len, buf, factor))
  want = np.zeros(len(lengths))
  if buf:
    for i, n in enumerate(lengths):
      if n > max_len - buf:
        want[i] = -(n - (max_len - buf)) / buf * factor
  np.testing.assert_allclose(got, want, atol=1e-6)
  if buf:
    assert got[-1] == pytest.approx(-factor)
