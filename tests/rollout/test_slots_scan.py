"""The slot engine's scanned decode (SlotEngine(scan_layers=True): one `lax.scan` over stacked
layers and stacked caches [L, slots, Hkv, S, K]) == its per-layer decode: tokens and log-probs
(f32, 1e-5) on Qwen3 and on Gemma 3's sliding windows, from per-layer and from scanned policies,
streaming with new weights in flight; and its compiled decode updates the stacked cache in place
(no copy of it per step)."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.plan import hlo_inspect as hi
from grpo_jax.rollout import GenerationConfig
from grpo_jax.rollout.slots import SlotEngine
from tests.rollout.test_sampler import prompts

P, C, G = 7, 12, 3


def run(graphdef, state, scan, gen, *, slots=5, chunk=3, eos_ids=(5, 9), seed=0):
  ids, mask = prompts(PRESETS["tiny-qwen3"].vocab_size, b=4, seed=seed)
  e = SlotEngine(
      graphdef,
      slots=slots,
      max_prompt_length=P,
      max_new_tokens=C,
      num_generations=G,
      eos_ids=eos_ids,
      chunk=chunk,
      scan_layers=scan,
  )
  return e(state, ids, mask, jax.random.key(3), gen), e


def assert_same(got, want):
  for name in ("tokens", "mask", "lengths", "truncated"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  for name in ("logprobs", "raw_logprobs"):
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "preset,scanned_policy",
    [("tiny-qwen3", False), ("tiny-qwen3", True), ("tiny-gemma3", False)],
    ids=["qwen3", "qwen3-scanned-policy", "gemma3-windows"],
)
@pytest.mark.parametrize("gen", ["greedy", GenerationConfig(temperature=1.0)], ids=["greedy", "t1"])
def test_scanned_decode_equals_the_per_layer_decode(preset, scanned_policy, gen):
  """Gemma 3: window 4 < the sequences, local and global layers mixed (a traced per-layer
  flag in the scan)."""
  cfg = PRESETS[preset].replace(dtype="float32", param_dtype="float32")
  if preset == "tiny-gemma3":
    cfg = cfg.replace(sliding_window=4)
    assert any(cfg.local_layers) and not all(cfg.local_layers)
  model = build_model(cfg.replace(scan_layers=scanned_policy), seed=2)
  graphdef, state = nnx.split(model)
  want, per_layer = run(graphdef, state, False, gen)
  got, scanned = run(graphdef, state, True, gen)
  assert isinstance(scanned._state["k"], jax.Array) and scanned._state["k"].ndim == 5
  assert isinstance(per_layer._state["k"], tuple)
  assert 0 < int(np.asarray(want.lengths).min()) and int(np.asarray(want.mask).sum()) > 12
  assert_same(got, want)


def test_default_is_per_layer_and_none_follows_the_policy():
  model = build_model(PRESETS["tiny-qwen3"].replace(scan_layers=True), seed=0)
  graphdef, state = nnx.split(model)
  ids, mask = prompts(PRESETS["tiny-qwen3"].vocab_size, b=4)
  kw = dict(max_prompt_length=P, max_new_tokens=C, num_generations=G, chunk=64)
  assert SlotEngine(graphdef, slots=12, **kw).scan_layers is False
  e = SlotEngine(graphdef, slots=12, scan_layers=None, **kw)
  e(state, ids, mask, jax.random.key(0), "greedy")
  assert e.scan_layers is True


def test_streaming_with_new_weights_equals_the_per_layer_decode():
  """Two steps in flight and new weights between chunks (the refresh re-prefills the live
  rows into the stacked caches): the same tokens, log-probs and versions."""
  model = build_model(PRESETS["tiny-qwen3"], seed=1)
  graphdef, state = nnx.split(model)
  state2 = jax.tree.map(lambda x: x * 1.05 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  out = {}
  for scan in (False, True):
    e = SlotEngine(
        graphdef,
        slots=6,
        max_prompt_length=P,
        max_new_tokens=C,
        num_generations=G,
        chunk=3,
        steps_in_flight=2,
        scan_layers=scan,
    )
    e.reset(GenerationConfig(temperature=1.0), rows_per_step=12)
    e.set_weights(state, version=0)
    for tag in (0, 1):
      e.enqueue(
          tag, *prompts(PRESETS["tiny-qwen3"].vocab_size, b=4, seed=tag + 1), jax.random.key(tag)
      )
    e.advance()
    e.advance()
    e.set_weights(state2, version=1)
    out[scan] = []
    for tag in (0, 1):
      while not e.finished(tag):
        e.advance()
      out[scan].append(e.take(tag))
  for (got, gv), (want, wv) in zip(out[True], out[False]):
    assert_same(got, want)
    np.testing.assert_array_equal(gv, wv)
  assert any(np.asarray(v).max() == 1 and np.asarray(v)[:, 0].min() == 0 for _, v in out[True])


def decode_hlo(scan: bool, layers: int = 4) -> tuple[str, tuple]:
  """The optimized HLO of the engine's decode (CPU) for a `layers`-deep tiny Qwen3, and the
  stacked cache's shape."""
  cfg = PRESETS["tiny-qwen3"].replace(num_layers=layers)
  model = build_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  e = SlotEngine(graphdef, slots=8, max_prompt_length=16, max_new_tokens=48, scan_layers=scan)
  e.reset("standard", rows_per_step=8)
  e.set_weights(state, version=0)
  st = e._program("init")()
  args = (st, e._weights, e._version, jnp.int32(9), jnp.zeros(3, jnp.int32), *e._scalars())
  hlo = e._program("decode").lower(*args).compile().as_text()
  shape = (layers, 8, cfg.num_kv_heads, 16 + 48, cfg.head_dim)
  return hlo, shape


def test_scanned_decode_updates_the_stacked_cache_in_place():
  """Per decode step (the chunk's while loop, with the layer loop inside it): no copy of the
  stacked cache, nor of one layer's cache (the write is a scatter into the carried buffer)."""
  hlo, shape = decode_hlo(True)
  layer_bytes = int(np.prod(shape[1:])) * 4
  loops = hi.while_loops(hlo)
  assert len(loops) >= 2, "the chunk's loop and the layer scan's"
  within = frozenset().union(*(l.reach for l in loops))
  big = [(o, n) for o, n in hi.copies(hlo, within=within) if n >= layer_bytes]
  assert not big, [f"{o.type} {n} bytes ({o.computation})" for o, n in big]
  # The stacked cache is carried (a while-loop operand), not rebuilt per step.
  stacked = f"f32[{','.join(map(str, shape))}]"
  assert any(stacked in l.carry for l in loops), [l.carry[:200] for l in loops]


def test_scanned_mesh_results_equal_single_device():
  """8 devices: the stacked caches' slots (axis 1) over (data, fsdp)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  from grpo_jax.parallel import sharding

  model = build_model(PRESETS["tiny-qwen3"], seed=0)
  graphdef, state = nnx.split(model)
  ids, mask = prompts(PRESETS["tiny-qwen3"].vocab_size, b=4, seed=9)
  kw = dict(max_prompt_length=P, max_new_tokens=C, num_generations=G, chunk=4, scan_layers=True)
  one = SlotEngine(graphdef, slots=8, **kw)(state, ids, mask, jax.random.key(4), "standard")
  mesh = sharding.make_mesh(2, 2, 2)
  got = SlotEngine(graphdef, slots=8, mesh=mesh, **kw)(
      jax.device_put(state, sharding.state_shardings(state, mesh)),
      jax.device_put(ids, sharding.batch_sharding(mesh)),
      jax.device_put(mask, sharding.batch_sharding(mesh)),
      jax.random.key(4),
      "standard",
  )
  np.testing.assert_array_equal(got.tokens, one.tokens)
  np.testing.assert_allclose(got.logprobs, one.logprobs, atol=1e-5)
