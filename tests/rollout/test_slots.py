"""The slot engine (rollout/slots.py): the lockstep sampler's tokens and log-probs on-policy,
per-row randomness, budgets, and each token's log-prob under the weight version that drew it."""

import contextlib
import threading

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.parallel import sharding
from grpo_jax.rollout import GenerationConfig
from grpo_jax.rollout import Sampler
from grpo_jax.rollout.slots import SlotEngine
from tests.rollout.test_sampler import prompts
from tests.rollout.test_sampler import trainer_logprobs

CFG = PRESETS["tiny-qwen3"]
P, C, G = 7, 12, 3


@pytest.fixture(scope="module")
def model():
  return build_model(CFG, seed=0)


def engine(graphdef, slots, **kw):
  kw = dict(max_prompt_length=P, max_new_tokens=C, num_generations=G, eos_ids=(5, 9)) | kw
  return SlotEngine(graphdef, slots=slots, **kw)


@contextlib.contextmanager
def compiles():
  """The (thread name, program name) of every XLA compile while the context is open."""
  seen = []

  def on(event, secs, **k):
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append((threading.current_thread().name, k.get("fun_name", "")))

  jax.monitoring.register_event_duration_secs_listener(on)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(on)


@pytest.mark.parametrize("inside", [False, True], ids=["host_admits", "decode_admits"])
@pytest.mark.parametrize("slots,chunk", [(12, 64), (5, 3), (3, 1)])
def test_greedy_equals_the_lockstep_sampler(model, slots, chunk, inside):
  """Fewer, as many or more slots than rows, any chunk, admission between chunks or inside
  the decode: the lockstep sampler's greedy tokens, masks, lengths and stops; raw log-probs =
  the trainer's within 1e-5 (f32)."""
  ids, mask = prompts(CFG.vocab_size, b=4)
  graphdef, state = nnx.split(model)
  lock = Sampler(graphdef, max_prompt_length=P, max_new_tokens=C, num_generations=G, eos_ids=(5, 9))
  want = lock(state, ids, mask, jax.random.key(1), "greedy")
  e = engine(graphdef, slots, chunk=chunk, admit_in_decode=inside)
  got = e(state, ids, mask, jax.random.key(1), "greedy")
  for name in ("tokens", "mask", "lengths", "truncated"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  assert 0 < int(got.truncated.sum()) < got.truncated.size  # some rows stop, some run out
  m = np.asarray(got.mask) > 0
  train = np.asarray(trainer_logprobs(model, ids, mask, got, G))
  assert np.abs(train - np.asarray(got.raw_logprobs))[m].max() <= 1e-5
  np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, atol=1e-5)


@pytest.mark.parametrize("gen", ["standard", GenerationConfig(temperature=1.0)])
def test_sampled_logprobs_equal_the_trainers(model, gen):
  ids, mask = prompts(CFG.vocab_size, b=4, seed=3)
  graphdef, state = nnx.split(model)
  r = engine(graphdef, 5, chunk=4)(state, ids, mask, jax.random.key(2), gen)
  m = np.asarray(r.mask) > 0
  train = np.asarray(trainer_logprobs(model, ids, mask, r, G))
  assert np.abs(train - np.asarray(r.raw_logprobs))[m].max() <= 1e-5
  if isinstance(gen, GenerationConfig):  # T = 1, no truncation: sampled == raw
    assert np.abs(train - np.asarray(r.logprobs))[m].max() <= 1e-5
  assert np.all(np.asarray(r.logprobs)[~m] == 0) and np.all(np.asarray(r.tokens)[~m] == 0)


def test_a_rows_tokens_do_not_depend_on_its_slot_or_admission(model):
  """Row r draws from fold_in(fold_in(key, r), column): 3 slots and chunk 1 (rows queued,
  admitted late, into other slots) give the same samples as 12 slots and one long chunk."""
  ids, mask = prompts(CFG.vocab_size, b=4, seed=5)
  graphdef, state = nnx.split(model)
  a = engine(graphdef, 12)(state, ids, mask, jax.random.key(7), "liberal")
  b = engine(graphdef, 3, chunk=1)(state, ids, mask, jax.random.key(7), "liberal")
  c = engine(graphdef, 12)(state, ids, mask, jax.random.key(8), "liberal")
  d = engine(graphdef, 6, chunk=5, admit_in_decode=True)(
      state, ids, mask, jax.random.key(7), "liberal"
  )
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)  # other batches: last bits
  np.testing.assert_array_equal(a.tokens, d.tokens)
  np.testing.assert_allclose(a.logprobs, d.logprobs, atol=1e-5)
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_samples_follow_the_lockstep_samplers_distribution():
  """Same distributions as the lockstep sampler (whose draws depend on the row's place in the
  batch instead of its own key): the first two tokens of 600 rows of one prompt, two-sample
  chi-square on a 16-token vocabulary."""
  cfg = CFG.replace(vocab_size=16)
  model = build_model(cfg, seed=1)
  graphdef, state = nnx.split(model)
  ids, mask = jnp.asarray([[3, 4, 7]], jnp.int32), jnp.ones((1, 3), jnp.int32)
  gen = GenerationConfig(temperature=1.0)
  kw = dict(max_prompt_length=3, max_new_tokens=2, num_generations=600)
  lock = Sampler(graphdef, **kw)(state, ids, mask, jax.random.key(0), gen)
  slot = SlotEngine(graphdef, slots=600, **kw)(state, ids, mask, jax.random.key(1), gen)
  for col in (0, 1):
    table = np.stack(
        [np.bincount(np.asarray(r.tokens)[:, col], minlength=16) for r in (lock, slot)]
    )
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table)[1] > 1e-3, (col, table)


@pytest.mark.parametrize("inside", [False, True], ids=["host_admits", "decode_admits"])
def test_budgets_stop_each_row_at_its_own_length(model, inside):
  ids, mask = prompts(CFG.vocab_size, b=4)
  graphdef, state = nnx.split(model)
  caps = np.array([1, 2, 3, 12, 7, 5, 4, 9, 11, 6, 8, 10])
  e = engine(graphdef, 4, eos_ids=(), chunk=2, admit_in_decode=inside)
  r = e(state, ids, mask, jax.random.key(1), "standard", caps=caps)
  np.testing.assert_array_equal(r.lengths, caps)
  np.testing.assert_array_equal(np.asarray(r.mask).sum(-1), caps)
  assert np.all(np.asarray(r.truncated))  # no stop token: every row ran out of budget
  s = e.stats()  # 4 slots refilled: about sum(caps) / 4 steps, not 12 per 4 rows
  assert s["steps"] <= int(np.ceil((caps.sum() - caps.size) / 4)) + 12
  assert s["busy"] > 0.6


@pytest.mark.parametrize("inside", [False, True], ids=["host_admits", "decode_admits"])
def test_streaming_tokens_keep_the_log_probs_of_the_version_that_drew_them(model, inside):
  """Two steps in flight, new weights landing between decode chunks: rows straddle the two
  versions, and each token's recorded log-prob is the trainer's under the version recorded
  with it (1e-5, f32). Admission inside the decode: the device queue's groups, prefilled
  under the old weights when pushed, are prefilled again under the new ones."""
  graphdef, state = nnx.split(model)
  state2 = jax.tree.map(lambda x: x * 1.05 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  model2 = nnx.merge(graphdef, state2)
  e = engine(graphdef, 6, eos_ids=(), chunk=3, steps_in_flight=2, admit_in_decode=inside)
  e.reset(GenerationConfig(temperature=1.0), rows_per_step=12)
  e.set_weights(state, version=0)
  batches = [prompts(CFG.vocab_size, b=4, seed=s) for s in (1, 2)]
  for tag, (ids, mask) in enumerate(batches):
    e.enqueue(tag, ids, mask, jax.random.key(10 + tag))
  e.advance()
  e.advance()
  assert not inside or e._on_device  # groups prefilled under version 0, not admitted yet
  e.set_weights(state2, version=1)
  straddled = 0
  for tag, (ids, mask) in enumerate(batches):
    while not e.finished(tag):
      e.advance()
    r, versions = e.take(tag)
    m = np.asarray(r.mask) > 0
    v = np.asarray(versions)
    want = np.where(
        v == 0,
        np.asarray(trainer_logprobs(model, ids, mask, r, G)),
        np.asarray(trainer_logprobs(model2, ids, mask, r, G)),
    )
    assert np.abs(want - np.asarray(r.logprobs))[m].max() <= 1e-5
    straddled += int(np.sum((v[:, 0] == 0) & (v.max(-1) == 1)))
    assert np.all(v[~m] == 0)
  assert straddled > 0


def test_too_many_steps_in_flight_and_too_few_slots_are_refused(model):
  graphdef, state = nnx.split(model)
  with pytest.raises(ValueError, match="num_generations"):
    engine(graphdef, 2)
  e = engine(graphdef, 6)
  e.reset("greedy", rows_per_step=12)
  ids, mask = prompts(CFG.vocab_size, b=4)
  e.enqueue(0, ids, mask, jax.random.key(0))
  with pytest.raises(ValueError, match="steps_in_flight"):
    e.enqueue(1, ids, mask, jax.random.key(0))


def test_sliding_window_model_equals_the_lockstep_sampler():
  """Gemma 3's local layers (window 4 < the sequences) and soft-capping choices: the same
  greedy tokens as the lockstep sampler (whose local layers use ring caches)."""
  cfg = PRESETS["tiny-gemma3"].replace(sliding_window=4, dtype="float32")
  model = build_model(cfg, seed=2)
  graphdef, state = nnx.split(model)
  ids, mask = prompts(cfg.vocab_size, b=4)
  kw = dict(max_prompt_length=P, max_new_tokens=C, num_generations=G, eos_ids=(5,))
  want = Sampler(graphdef, **kw)(state, ids, mask, jax.random.key(1), "greedy")
  got = SlotEngine(graphdef, slots=5, chunk=2, **kw)(state, ids, mask, jax.random.key(1), "greedy")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, atol=1e-5)


@pytest.mark.parametrize("inside", [False, True], ids=["host_admits", "decode_admits"])
def test_mesh_results_equal_single_device(model, inside):
  """8 devices (data 2 x fsdp 2 x tensor 2): the slot caches' rows over (data, fsdp), the
  control arrays replicated: the single device's tokens and log-probs."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  ids, mask = prompts(CFG.vocab_size, b=4, seed=9)
  graphdef, state = nnx.split(model)
  one = engine(graphdef, 8, chunk=4)(state, ids, mask, jax.random.key(4), "standard")
  mesh = sharding.make_mesh(2, 2, 2)
  sharded = jax.device_put(state, sharding.state_shardings(state, mesh))
  got = engine(graphdef, 8, chunk=4, mesh=mesh, admit_in_decode=inside)(
      sharded,
      jax.device_put(ids, sharding.batch_sharding(mesh)),
      jax.device_put(mask, sharding.batch_sharding(mesh)),
      jax.random.key(4),
      "standard",
  )
  assert got.tokens.sharding.spec[0] == sharding.BATCH_AXES
  np.testing.assert_array_equal(got.tokens, one.tokens)
  np.testing.assert_allclose(got.logprobs, one.logprobs, atol=1e-5)


@pytest.mark.parametrize(
    "scan,kernel",
    [
        (False, "pallas"),
        (True, "pallas_tpu"),
        pytest.param(True, "pallas", marks=pytest.mark.slow),  # (suite time)
        pytest.param(False, "pallas_tpu", marks=pytest.mark.slow),
    ],
    ids=["per_layer-triton", "scanned-tpu", "scanned-triton", "per_layer-tpu"],
)
def test_ragged_kernel_with_per_row_lengths_equals_the_xla_attention(model, scan, kernel):
  """decode_attention="pallas" / "pallas_tpu" (the GPU's Triton kernel / the TPU's Mosaic one,
  in Pallas's interpreter here): each row's kernel reads its own written slots (scanned: of its
  layer in the stacked caches, in place); the same greedy tokens and log-probs as the XLA
  attention."""
  ids, mask = prompts(CFG.vocab_size, b=2, seed=4)
  graphdef, state = nnx.split(model)
  xla = engine(graphdef, 4, chunk=4, decode_attention="xla", scan_layers=scan)
  pallas = engine(graphdef, 4, chunk=4, decode_attention=kernel, scan_layers=scan)
  block = 128 if kernel == "pallas_tpu" else 64
  assert pallas.ragged and not xla.ragged and pallas.cache_len % block == 0
  assert pallas.ragged_tpu == (kernel == "pallas_tpu")
  want = xla(state, ids, mask, jax.random.key(3), "greedy")
  got = pallas(state, ids, mask, jax.random.key(3), "greedy")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, atol=1e-5)


@pytest.mark.usefixtures("no_compilation_cache")
@pytest.mark.parametrize("inside", [False, True], ids=["host_admits", "decode_admits"])
@pytest.mark.parametrize("on_mesh", [False, True])
def test_a_steps_programs_compile_at_once_before_the_first_admit(model, on_mesh, inside):
  """compile_threads: both admission widths (groups stay queued after the first admission;
  with admission in the decode the push instead), the decode and the take compile in the
  pool's threads before the first admit, each once (a shape or sharding unlike the call's
  would compile again, on the main thread), and the empty state's program there too, beside
  the first weight copy; with the tokens of an engine compiling one at a time."""
  if on_mesh and jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  ids, mask = prompts(CFG.vocab_size, b=8, seed=5)
  graphdef, state = nnx.split(model)
  kw = {}
  if on_mesh:
    kw["mesh"] = mesh = sharding.make_mesh(2, 2, 2)
    state = jax.device_put(state, sharding.state_shardings(state, mesh))
    ids, mask = (jax.device_put(x, sharding.batch_sharding(mesh)) for x in (ids, mask))
  with compiles() as seen:
    # 8 groups of G 3 in 12 slots: admissions of 4 groups (the whole engine), then of 1 (a refill)
    eng = engine(graphdef, 12, chunk=2, compile_threads=3, admit_in_decode=inside, **kw)
    got = eng(state, ids, mask, jax.random.key(6), "standard")
    for later in eng._later.values():  # (a LATER program not called: its compile may run on)
      later.result()
  # (a program's name: "_decode" is not "_decode_narrow")
  names = lambda part, where: [t for t, f in seen if f"({part})" in f and where(t)]  # noqa: E731
  main = lambda t: t == threading.main_thread().name  # noqa: E731
  # (admission in the decode: the push's prefill only, no admit program)
  assert len(names("_admit", lambda t: True)) == (0 if inside else 2), seen
  admit = ("_admit",) if not inside else ()
  narrow = ("_decode_narrow",) if eng.narrow else ()  # (on the mesh: 3 slots over 4 shards)
  push = ("_push",) if inside else ()  # (the device queue's)
  for part in (*admit, "_decode", "_take", *narrow, *push, "_init"):
    assert names(part, lambda t: t.startswith("ThreadPoolExecutor")), (part, seen)
    assert not names(part, main), f"{part} compiled again on the main thread: {seen}"
  assert len(names("_decode", lambda t: True)) == 1 and len(names("_take", lambda t: True)) == 1
  one = engine(graphdef, 12, chunk=2, compile_threads=1, admit_in_decode=inside, **kw)(
      state, ids, mask, jax.random.key(6), "standard"
  )
  np.testing.assert_array_equal(got.tokens, one.tokens)
  np.testing.assert_array_equal(got.logprobs, one.logprobs)


@pytest.mark.usefixtures("no_compilation_cache")
def test_the_refresh_compiles_behind_the_first_decode(model):
  """Streaming (two steps in flight): the refresh, which no step's first decode calls, is
  compiled in the pool's threads but not waited for before the first decode (it is still
  pending after it); when new weights land its call waits for that compile, and nothing
  compiles again on the main thread."""
  graphdef, state = nnx.split(model)
  with compiles() as seen:
    e = engine(graphdef, 6, chunk=3, steps_in_flight=2, compile_threads=2, admit_in_decode=True)
    e.reset(GenerationConfig(temperature=1.0), rows_per_step=12)
    e.set_weights(state, version=0)
    ids, mask = prompts(CFG.vocab_size, b=4, seed=1)
    e.enqueue(0, ids, mask, jax.random.key(10))
    e.advance()
    assert "refresh" in e._later  # its compile was not waited for by the first decode
    e.set_weights(jax.tree.map(lambda x: x, state), version=1)
    assert "refresh" not in e._later
    while not e.finished(0):
      e.advance()
  refresh = [t for t, f in seen if "(_refresh)" in f]
  assert len(refresh) == 1 and refresh[0].startswith("ThreadPoolExecutor"), seen


def test_admission_inside_the_decode_needs_fewer_calls_and_keeps_slots_busier(model):
  """A long-tailed batch (budgets 1..24) in 6 slots: admitting inside the decode runs the
  same rows in fewer decode calls than admitting between chunks (no call ends for a refill)
  with no fewer slots busy per step, and the same tokens."""
  ids, mask = prompts(CFG.vocab_size, b=8, seed=2)
  graphdef, state = nnx.split(model)
  caps = np.random.default_rng(0).integers(1, 25, 24)
  caps[::7] = 24
  out, stats = {}, {}
  for inside in (False, True):
    e = engine(graphdef, 6, eos_ids=(), chunk=64, max_new_tokens=24, admit_in_decode=inside)
    out[inside] = e(state, ids, mask, jax.random.key(3), "standard", caps=caps)
    stats[inside] = dict(e.stats(), calls=e._chunks)
  np.testing.assert_array_equal(out[True].tokens, out[False].tokens)
  np.testing.assert_array_equal(out[True].lengths, caps)
  assert stats[True]["calls"] < stats[False]["calls"], stats
  assert stats[True]["busy"] >= stats[False]["busy"] - 1e-9, stats


def test_a_steps_last_rows_decode_narrow_with_the_same_results(model):
  """Nothing queued and at most slots / 4 rows live: the narrow decode (those rows' caches
  gathered, decoded, written back) runs them, with the tokens and log-probs of the decode
  over every slot."""
  ids, mask = prompts(CFG.vocab_size, b=4, seed=6)
  graphdef, state = nnx.split(model)
  caps = np.array([2, 3, 12, 4, 2, 11, 3, 3, 12, 2, 4, 10])  # a long tail: 3 rows run on
  wide = engine(graphdef, 12, eos_ids=(), chunk=2)
  wide.narrow = 0
  narrow = engine(graphdef, 12, eos_ids=(), chunk=2)
  assert narrow.narrow == 3
  want = wide(state, ids, mask, jax.random.key(5), "standard", caps=caps)
  got = narrow(state, ids, mask, jax.random.key(5), "standard", caps=caps)
  assert any(k[0] == "decode_narrow" for k in narrow._programs)
  assert not any(k[0] == "decode_narrow" for k in wide._programs)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, caps)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
  assert narrow.stats() == wide.stats()


@pytest.mark.parametrize("inside", [False, True], ids=["host_admits", "decode_admits"])
def test_decode_phases_read_part_of_the_caches_with_the_same_results(model, inside):
  """decode_phases=4 (C 32: widths P + 8, 16, 24, 32): steps whose live rows are all short
  attend to the caches' first slots only, with the tokens, log-probs and stats of one phase
  over every slot; long-tailed budgets in fewer slots than rows, so rows are admitted while
  others are in a later phase (admission inside the decode: the scanned caches' phases)."""
  ids, mask = prompts(CFG.vocab_size, b=4, seed=8)
  graphdef, state = nnx.split(model)
  caps = np.array([3, 32, 9, 17, 2, 30, 5, 8, 25, 12, 1, 20])
  out, stats = {}, {}
  for phases in (1, 4):
    e = engine(
        graphdef,
        6,
        eos_ids=(),
        max_new_tokens=32,
        chunk=5,
        decode_phases=phases,
        admit_in_decode=inside,
        scan_layers=inside,
    )
    assert len(e.decode_widths) == phases and e.decode_widths[-1] == P + 32
    out[phases] = e(state, ids, mask, jax.random.key(4), "standard", caps=caps)
    stats[phases] = e.stats()
  np.testing.assert_array_equal(out[4].tokens, out[1].tokens)
  np.testing.assert_array_equal(out[4].lengths, caps)
  np.testing.assert_allclose(out[4].logprobs, out[1].logprobs, atol=1e-5)
  np.testing.assert_allclose(out[4].raw_logprobs, out[1].raw_logprobs, atol=1e-5)
  assert stats[4] == stats[1]


def test_scan_layers_auto_scans_with_an_accelerators_kernel_only(model):
  """rollout.slot_scan_layers None (the default) = "auto": the layer scan with the TPU kernel
  or on GPU with Triton's (whose scanned decodes copy nothing per step:
  tests/plan/test_compiled_programs.py), a program per layer otherwise (CPU, even with
  Triton's kernel interpreted)."""
  from configs import tiny
  from grpo_jax.rollout.slots import scan_layers_option

  cfg = tiny.get_config()
  assert cfg.rollout.slot_scan_layers is None and scan_layers_option(cfg) == "auto"
  cfg.rollout.slot_scan_layers = True
  assert scan_layers_option(cfg) is True
  graphdef, _ = nnx.split(model)
  assert not engine(graphdef, 4, scan_layers="auto").scan_layers  # (CPU: XLA's attention)
  assert not engine(graphdef, 4, scan_layers="auto", decode_attention="pallas").scan_layers
  tpu = engine(graphdef, 4, scan_layers="auto", decode_attention="pallas_tpu")
  assert tpu.scan_layers and tpu.slot_major
  # A model whose layers the kernel does not all read (sliding windows, soft-capping): XLA's
  # attention would copy their caches out of the stacks every step, so a program per layer.
  gemma = build_model(PRESETS["tiny-gemma3"].replace(sliding_window=4), seed=0)
  g_def, g_state = nnx.split(gemma)
  windows = engine(g_def, 4, scan_layers="auto", decode_attention="pallas_tpu")
  assert windows.scan_layers  # (the model is not known yet)
  windows.set_weights(g_state, version=0)
  assert not windows.scan_layers and windows.slot_major
  from grpo_jax.models.decoder.decode_attention import reads_every_layer

  for tpu in (False, True):
    assert reads_every_layer(CFG, tpu, interpret=True)
    assert not reads_every_layer(CFG.replace(attn_logit_softcap=50.0), tpu, interpret=True)
    assert not reads_every_layer(gemma.cfg, tpu, interpret=True)
  assert not reads_every_layer(CFG.replace(head_dim=24), False)  # (Triton: powers of two)
  assert not reads_every_layer(CFG.replace(head_dim=64), True)  # (TPU: 128 lanes)
  forced = engine(g_def, 4, scan_layers=True, decode_attention="pallas_tpu")
  forced.set_weights(g_state, version=0)
  assert forced.scan_layers  # (asked for)
