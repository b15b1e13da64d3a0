"""KL estimators, PPO-clip / GSPO / TIS policy losses and aggregation vs NumPy references.

The references below are written independently (float64 NumPy, loops where clearer) from the
definitions in docs/design.md and the cited papers; they never call grpo_jax code.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import losses

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LR = 20.0  # the documented log-ratio clamp


# ------------------------------------------------------------------- NumPy references


def np_kl(logp, ref, kind):
  logp = logp.astype(np.float64)
  ref = ref.astype(np.float64)
  if kind == "k1":
    return logp - ref
  if kind == "k2":
    return 0.5 * (logp - ref) ** 2
  return np.exp(ref - logp) - (ref - logp) - 1.0


def np_aggregate(l, m, mode, max_len):
  l = np.where(m > 0, l, 0.0).astype(np.float64)
  m = m.astype(np.float64)
  rows = []
  for b in range(l.shape[0]):
    n = m[b].sum()
    if mode == "seq-mean-token-mean":
      rows.append(0.0 if n == 0 else (l[b] * m[b]).sum() / n)
    elif mode == "seq-mean-token-sum":
      rows.append((l[b] * m[b]).sum())
  if mode == "token-mean":
    return 0.0 if m.sum() == 0 else (l * m).sum() / m.sum()
  if mode == "seq-mean-token-sum-norm":
    return (l * m).sum() / (l.shape[0] * max_len)
  return float(np.mean(rows))


def np_policy_loss(
    logp,
    old,
    ref,
    adv,
    mask,
    eps_lo,
    eps_hi,
    beta,
    kl_kind,
    mode,
    max_len,
    kind="ppo_clip",
    clip_c=None,
    tis=None,
):
  logp = np.where(mask > 0, logp, 0.0).astype(np.float64)
  old = np.where(mask > 0, old, 0.0).astype(np.float64)
  B, T = logp.shape
  A = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (B, T)).astype(np.float64)
  loss = np.zeros((B, T))
  for b in range(B):
    n = mask[b].sum()
    seq_lr = 0.0 if n == 0 else sum(logp[b, t] - old[b, t] for t in range(T) if mask[b, t]) / n
    for t in range(T):
      if not mask[b, t]:
        continue
      lr = seq_lr if kind == "gspo" else logp[b, t] - old[b, t]
      r = np.exp(np.clip(lr, -MAX_LR, MAX_LR))
      a = A[b, t]
      val = -min(r * a, np.clip(r, 1 - eps_lo, 1 + eps_hi) * a)
      if clip_c is not None and a < 0:
        val = min(val, -a * clip_c)
      if tis is not None:
        val *= tis[b, t]
      if beta:
        val += beta * np_kl(np.array(logp[b, t]), np.array(ref[b, t]), kl_kind)
      loss[b, t] = val
  return np_aggregate(loss, mask, mode, max_len)


# ---------------------------------------------------------------------------- inputs


def make_batch(seed, B=4, T=7, scale=0.3, adv_per_token=False, empty_row=True):
  rng = np.random.default_rng(seed)
  logp = (-np.abs(rng.normal(size=(B, T))) - 0.1).astype(np.float32)
  old = (logp + scale * rng.normal(size=(B, T))).astype(np.float32)
  ref = (logp + scale * rng.normal(size=(B, T))).astype(np.float32)
  adv = rng.normal(size=(B, T) if adv_per_token else (B,)).astype(np.float32)
  lens = rng.integers(1, T + 1, size=B)
  mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
  if empty_row:
    mask[1] = 0
  # Garbage where masked: must never leak into anything.
  for x in (logp, old, ref):
    x[mask == 0] = np.nan
  return logp, old, ref, adv, mask


def close(got, want, rtol=1e-6, atol=1e-6):
  np.testing.assert_allclose(np.float64(got), want, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_token_kl_matches_numpy(kind):
  rng = np.random.default_rng(1)
  logp = rng.normal(size=(5, 9)).astype(np.float32) - 2
  ref = logp + rng.normal(size=(5, 9)).astype(np.float32)
  got = losses.token_kl(jnp.asarray(logp), jnp.asarray(ref), kind)
  want = np_kl(logp, ref, "k3" if kind == "low_var_kl" else kind)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_k3_is_nonnegative_and_tiny_for_close_policies():
  d = jnp.array([-1e-4, -1e-7, 0.0, 1e-7, 1e-4, 3.0, -3.0])
  k3 = np.asarray(losses.token_kl(jnp.zeros_like(d), d, "k3"))
  assert np.all(k3 >= 0)
  # exp(d) - d - 1 ~ d^2/2 for small d: computed without cancellation.
  dd = np.asarray(d[:5], np.float64)
  np.testing.assert_allclose(k3[:5], np.expm1(dd) - dd, rtol=1e-6, atol=0)
  # Around the switch to the series the value is continuous.
  e = jnp.array([0.0099999, 0.0100001, -0.0099999, -0.0100001])
  k = np.asarray(losses.token_kl(jnp.zeros_like(e), e, "k3"), np.float64)
  np.testing.assert_allclose(k, np.expm1(np.float64(e)) - np.float64(e), rtol=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_clamp_extreme_log_ratios(kind):
  logp = jnp.array([0.0, 0.0, -100.0, -5.0])
  ref = jnp.array([100.0, -100.0, 0.0, -5.5])
  got = np.asarray(losses.token_kl(logp, ref, kind, clamp=10.0))
  d = np.clip(np.asarray(ref - logp, np.float64), -MAX_LR, MAX_LR)
  want = np.clip(np_kl(-d, np.zeros_like(d), kind), -10, 10)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  g = jax.grad(lambda l: losses.token_kl(l, ref, kind, clamp=10.0).sum())(logp)
  assert np.all(np.isfinite(g))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_numpy(mode):
  rng = np.random.default_rng(2)
  l = rng.normal(size=(5, 6)).astype(np.float32)
  m = (rng.random((5, 6)) > 0.4).astype(np.float32)
  m[2] = 0
  l[m == 0] = np.inf  # garbage under the mask
  close(losses.aggregate(jnp.asarray(l), jnp.asarray(m), mode, 6), np_aggregate(l, m, mode, 6))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_all_masked_is_zero(mode):
  out = losses.aggregate(jnp.full((3, 4), jnp.nan), jnp.zeros((3, 4)), mode, 4)
  assert float(out) == 0.0


@pytest.mark.parametrize("num_micro", [1, 2, 3, 6])
@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES.names())
def test_weighted_micro_batches_sum_to_the_whole_batch(mode, num_micro):
  """What exact gradient accumulation relies on, for every registered mode: over strided
  micro-batches (rows i, i + n, ...), sum(micro_batch_weight * aggregate(micro)) equals the
  whole batch's aggregation."""
  assert mode in AGG_MODES, f"write a NumPy reference (np_aggregate) for the new mode {mode!r}"
  rng = np.random.default_rng(7)
  B, T, L = 12, 9, 11
  l = rng.uniform(0.5, 2.0, size=(B, T)).astype(np.float32)  # one sign: no cancellation
  lens = rng.integers(1, T + 1, size=B)
  lens[[1, 4, 7]] = 0  # with num_micro=6, micro-batch 1 (rows 1, 7) has no tokens at all
  mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
  l[mask == 0] = np.nan
  total_tokens = jnp.asarray(mask.sum())
  got = jnp.zeros((), jnp.float32)
  for i in range(num_micro):
    l_mb, m_mb = jnp.asarray(l[i::num_micro]), jnp.asarray(mask[i::num_micro])
    w = losses.micro_batch_weight(mode, m_mb, total_tokens, B)
    got = got + w * losses.aggregate(l_mb, m_mb, mode, L)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.float64(got), np_aggregate(l, mask, mode, L), rtol=1e-6)


def test_agg_mode_without_a_weight_fails_at_registration():
  reduce = lambda lm, m, max_len: lm.sum()
  with pytest.raises(TypeError, match="weight"):
    losses.register_agg_mode("token-sum")(reduce)
  with pytest.raises(TypeError, match="weight must be a function"):
    losses.register_agg_mode("token-sum", weight=None)(reduce)
  assert "token-sum" not in losses.LOSS_AGG_MODES


def test_dr_grpo_norm_requires_max_len():
  with pytest.raises(ValueError, match="max_completion_length"):
    losses.aggregate(jnp.ones((2, 3)), jnp.ones((2, 3)), "seq-mean-token-sum-norm")


GRID = list(
    itertools.product(
        [0, 1],  # seed
        AGG_MODES,
        [("k3", 0.04), ("k1", 0.1), ("k2", 0.5), ("k3", 0.0)],
        [(0.2, None), (0.2, 0.28)],  # clip_eps, clip_eps_high
        [False, True],
    )
)  # per-token advantages


@pytest.mark.parametrize("seed,mode,kl,clip,adv_tok", GRID)
def test_ppo_clip_loss_matches_numpy(seed, mode, kl, clip, adv_tok):
  kl_kind, beta = kl
  eps, eps_hi = clip
  logp, old, ref, adv, mask = make_batch(seed, adv_per_token=adv_tok, scale=0.4)
  ref_arg = None if beta == 0 else jnp.asarray(ref)
  loss, metrics = losses.policy_loss(
      jnp.asarray(logp),
      jnp.asarray(old),
      ref_arg,
      jnp.asarray(adv),
      jnp.asarray(mask),
      clip_eps=eps,
      clip_eps_high=eps_hi,
      beta=beta,
      kl_kind=kl_kind,
      loss_agg_mode=mode,
      max_completion_length=7,
  )
  want = np_policy_loss(logp, old, ref, adv, mask, eps, eps_hi or eps, beta, kl_kind, mode, 7)
  close(loss, want)
  assert all(np.isfinite(np.asarray(v)) for v in metrics.values())


def test_metrics_match_numpy():
  logp, old, ref, adv, mask = make_batch(3, B=6, T=9, scale=0.5)
  _, m = losses.policy_loss(
      jnp.asarray(logp),
      jnp.asarray(old),
      jnp.asarray(ref),
      jnp.asarray(adv),
      jnp.asarray(mask),
      clip_eps=0.2,
      clip_eps_high=0.3,
      beta=0.1,
      kl_kind="k3",
  )
  sel = mask > 0
  r = np.exp(logp[sel].astype(np.float64) - old[sel])
  A = np.broadcast_to(adv[:, None], mask.shape)[sel]
  high = (r > 1.3) & (A > 0)
  low = (r < 0.8) & (A < 0)
  close(m["clip_frac_high"], high.mean())
  close(m["clip_frac_low"], low.mean())
  close(m["clip_frac"], (high | low).mean())
  close(m["ppo_kl"], (old[sel] - logp[sel]).mean())
  close(m["ratio_mean"], r.mean(), rtol=1e-5)
  close(m["ratio_max"], r.max(), rtol=1e-5)
  close(m["kl"], np_kl(logp[sel], ref[sel], "k3").mean(), rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dual_clip_matches_numpy(seed):
  logp, old, ref, adv, mask = make_batch(seed, scale=2.0)  # big ratios -> dual clip binds
  loss, m = losses.policy_loss(
      jnp.asarray(logp),
      jnp.asarray(old),
      None,
      jnp.asarray(adv),
      jnp.asarray(mask),
      clip_eps=0.2,
      beta=0.0,
      clip_ratio_c=3.0,
      loss_agg_mode="token-mean",
  )
  close(
      loss,
      np_policy_loss(logp, old, ref, adv, mask, 0.2, 0.2, 0, "k3", "token-mean", 7, clip_c=3.0),
  )
  assert "dual_clip_frac" in m


@pytest.mark.parametrize("seed,mode", itertools.product([0, 1], AGG_MODES))
def test_gspo_matches_numpy(seed, mode):
  logp, old, ref, adv, mask = make_batch(seed, scale=0.01)
  loss, _ = losses.policy_loss(
      jnp.asarray(logp),
      jnp.asarray(old),
      jnp.asarray(ref),
      jnp.asarray(adv),
      jnp.asarray(mask),
      clip_eps=3e-4,
      clip_eps_high=4e-4,
      beta=0.02,
      loss_agg_mode=mode,
      max_completion_length=7,
      policy_loss_kind="gspo",
  )
  close(
      loss, np_policy_loss(logp, old, ref, adv, mask, 3e-4, 4e-4, 0.02, "k3", mode, 7, kind="gspo")
  )


def test_gspo_gradient_is_sequence_ratio_times_token_grad():
  # d/dlogp_t of -s*A / |y| (seq-mean-token-mean, unclipped) = -A * s / |y| for each token.
  rng = np.random.default_rng(5)
  logp = jnp.asarray(rng.normal(size=(2, 5)) * 0.01 - 1, jnp.float32)
  old = logp + jnp.asarray(rng.normal(size=(2, 5)) * 1e-5, jnp.float32)
  adv = jnp.array([1.0, -0.5])
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)
  g = jax.grad(
      lambda l: losses.policy_loss(
          l, old, None, adv, mask, clip_eps=0.2, beta=0.0, policy_loss_kind="gspo"
      )[0]
  )(logp)
  s = np.exp(
      [(np.asarray(logp - old)[b] * np.asarray(mask)[b]).sum() / mask[b].sum() for b in range(2)]
  )
  want = -np.asarray(adv)[:, None] * s[:, None] / np.asarray(mask).sum(1, keepdims=True) / 2
  np.testing.assert_allclose(g, want * np.asarray(mask), rtol=1e-5, atol=1e-8)


def test_tis_weights_and_loss():
  logp, old, ref, adv, mask = make_batch(4)
  sampler = (np.nan_to_num(old) + np.random.default_rng(0).normal(size=old.shape) * 0.5).astype(
      np.float32
  )
  w = np.asarray(losses.tis_weights(jnp.asarray(np.nan_to_num(old)), jnp.asarray(sampler), 2.0))
  want_w = np.minimum(np.exp(np.nan_to_num(old).astype(np.float64) - sampler), 2.0)
  np.testing.assert_allclose(w, want_w, rtol=1e-6)
  assert w.max() <= 2.0
  loss, _ = losses.policy_loss(
      jnp.asarray(logp),
      jnp.asarray(old),
      jnp.asarray(ref),
      jnp.asarray(adv),
      jnp.asarray(mask),
      clip_eps=0.2,
      beta=0.05,
      tis_weights=jnp.asarray(w),
      loss_agg_mode="token-mean",
  )
  close(
      loss, np_policy_loss(logp, old, ref, adv, mask, 0.2, 0.2, 0.05, "k3", "token-mean", 7, tis=w)
  )


def test_extreme_log_ratios_are_finite():
  logp = jnp.array([[0.0, -60.0, -1.0, -100.0]])
  old = jnp.array([[-60.0, 0.0, -1.0, 0.0]])
  ref = jnp.array([[-50.0, 50.0, -1.0, 0.0]])
  mask = jnp.ones((1, 4))
  for adv in (jnp.array([1.0]), jnp.array([-1.0])):
    f = lambda l: losses.policy_loss(
        l, old, ref, adv, mask, clip_eps=0.2, beta=0.1, kl_clamp=10.0, clip_ratio_c=3.0
    )[0]
    val, g = jax.value_and_grad(f)(logp)
    assert np.isfinite(val) and np.all(np.isfinite(g)), (val, g)
    want = np_policy_loss(
        np.asarray(logp),
        np.asarray(old),
        np.asarray(ref),
        np.asarray(adv),
        np.asarray(mask),
        0.2,
        0.2,
        0.0,
        "k3",
        "seq-mean-token-mean",
        None,
        clip_c=3.0,
    )
    d = np.clip(np.asarray(ref - logp, np.float64), -MAX_LR, MAX_LR)
    want += 0.1 * np.clip(np.exp(d) - d - 1, -10, 10).mean()
    close(val, want, rtol=1e-5)


def test_beta_zero_with_no_reference():
  logp, old, _, adv, mask = make_batch(6)
  loss, m = losses.policy_loss(
      jnp.asarray(logp),
      jnp.asarray(old),
      None,
      jnp.asarray(adv),
      jnp.asarray(mask),
      clip_eps=0.2,
      beta=0.0,
  )
  assert float(m["kl"]) == 0.0 and np.isfinite(float(loss))
  with pytest.raises(ValueError, match="ref_logp"):
    losses.policy_loss(
        jnp.asarray(logp),
        jnp.asarray(old),
        None,
        jnp.asarray(adv),
        jnp.asarray(mask),
        clip_eps=0.2,
        beta=0.1,
    )


# ------------------------------------------------------------------------- gradients


def _f64(fn):
  with jax.enable_x64(True):
    return fn()


@pytest.mark.parametrize("kl_kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradient_matches_finite_differences(kl_kind, mode):
  def run():
    rng = np.random.default_rng(7)
    B, T = 3, 5
    logp = jnp.asarray(-np.abs(rng.normal(size=(B, T))) - 0.1)
    # Keep every ratio away from the clip boundaries (|log r| in [0.05, 0.15] or > 0.4) so
    # central differences never straddle a kink.
    mag = rng.choice([0.1, 0.6], size=(B, T)) * rng.choice([-1, 1], size=(B, T))
    old = logp - jnp.asarray(mag)
    ref = logp + jnp.asarray(rng.normal(size=(B, T)) * 0.3)
    adv = jnp.asarray(rng.normal(size=B))
    mask = jnp.asarray((np.arange(T)[None] < np.array([5, 3, 1])[:, None]).astype(np.float64))
    f = lambda l: losses.policy_loss(
        l,
        old,
        ref,
        adv,
        mask,
        clip_eps=0.2,
        clip_eps_high=0.3,
        beta=0.2,
        kl_kind=kl_kind,
        loss_agg_mode=mode,
        max_completion_length=T,
    )[0]
    g = np.asarray(jax.grad(f)(logp))
    h = 1e-6
    fd = np.zeros((B, T))
    for b in range(B):
      for t in range(T):
        e = jnp.zeros((B, T)).at[b, t].set(h)
        fd[b, t] = (f(logp + e) - f(logp - e)) / (2 * h)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
    # Clipped tokens get no policy-gradient: with beta=0 their gradient is exactly 0.
    f0 = lambda l: losses.policy_loss(
        l,
        old,
        None,
        adv,
        mask,
        clip_eps=0.2,
        clip_eps_high=0.3,
        beta=0.0,
        loss_agg_mode=mode,
        max_completion_length=T,
    )[0]
    g0 = np.asarray(jax.grad(f0)(logp))
    r = np.exp(np.asarray(logp - old))
    A = np.broadcast_to(np.asarray(adv)[:, None], (B, T))
    clipped = ((r > 1.3) & (A > 0)) | ((r < 0.8) & (A < 0))
    m = np.asarray(mask) > 0
    assert (clipped & m).any() and (~clipped & m).any()
    assert np.all(g0[clipped] == 0)
    assert np.all(g0[~clipped & m] != 0)

  _f64(run)


def test_masked_positions_get_exactly_zero_gradient_even_with_nan():
  logp, old, ref, adv, mask = make_batch(8)
  g = jax.grad(
      lambda l: losses.policy_loss(
          l,
          jnp.asarray(old),
          jnp.asarray(ref),
          jnp.asarray(adv),
          jnp.asarray(mask),
          clip_eps=0.2,
          beta=0.1,
      )[0]
  )(jnp.asarray(logp))
  g = np.asarray(g)
  assert np.all(np.isfinite(g))
  assert np.all(g[mask == 0] == 0)
  assert np.any(g[mask > 0] != 0)


def test_jit_and_vmap():
  logp, old, ref, adv, mask = make_batch(9, empty_row=False)
  args = [jnp.asarray(np.nan_to_num(x)) for x in (logp, old, ref, adv, mask)]
  f = lambda *a: losses.policy_loss(*a, clip_eps=0.2, beta=0.04)[0]
  eager = f(*args)
  np.testing.assert_allclose(jax.jit(f)(*args), eager, rtol=1e-6)
  stacked = [jnp.stack([x, x]) for x in args]
  np.testing.assert_allclose(jax.vmap(f)(*stacked), jnp.stack([eager, eager]), rtol=1e-6)


def test_unknown_names():
  x = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="unknown KL estimator 'k9'; known: k1, k2, k3"):
    losses.token_kl(x, x, "k9")
  with pytest.raises(ValueError, match="unknown loss aggregation mode"):
    losses.aggregate(x, x, "mean")
  with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
    losses.policy_loss(x, x, None, jnp.zeros(1), x, clip_eps=0.2, beta=0.0, policy_loss_kind="ppo")
