"""The slot engine's device programs (rollout/slots.py's SlotEngine runs them; the host-side
scheduler there decides what they run on). Each is jitted once per static shape and generation
config (`_program`), on the engine's mesh, over one state dict:

- init: the empty state (per-layer or stacked KV caches [slots, Hkv, S, K], each slot's row,
  position, budget, key, and the output rows [ring x rows per step, C]);
- admit: prefills A prompts once each (`Transformer.prefill_rows`), copies each prompt's
  keys/values into its G rows' slots; the first decode step draws each row's first token;
- decode: up to `chunk` steps for every slot at its own position (`Transformer.decode_rows`),
  each token written with its log-probs and weight version, a row stopped at a stop token or
  its budget; the chunk ends early once `refill` slots are free;
  with admission inside the decode (`admit_in_decode`), each step first copies the device
  queue's next groups' prefilled keys/values into free slots, G each, as many as fit;
  decode_narrow: the same over the live slots only (at most slots / 4), gathered once per call;
- push: groups onto the device queue, their prompts prefilled there in one batch;
- refresh: the live slots' keys/values again from their tokens (new weights), and the device
  queue's prefills;
- extend: tool responses appended into paused rows' live caches (`Transformer.extend_rows`);
- take / peek: a step's output rows as a `Rollout` (+ versions) / a stopped row's last turn;
- copy: the compute-dtype sampling copy of the weights, once per weight version.

`SlotPrograms` is SlotEngine's base: the programs read the engine's static configuration (slots,
lengths, stop ids, mesh, kernels; set in SlotEngine.__init__ and `reset`) and nothing else of
the host scheduler. See slots.py's docstring for the KV layout, randomness and multi-host rules.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models.decoder.cache import sampling_copy
from grpo_jax.models.decoder.cache import stacked_sampling_copy
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.decoder.transformer import compaction
from grpo_jax.parallel import sharding
from grpo_jax.rollout import gpu_options
from grpo_jax.rollout import sampling
from grpo_jax.rollout.types import GenerationConfig
from grpo_jax.rollout.types import Rollout

# The state's small arrays, replicated on a mesh (every process reads them and decides alike).
_CONTROL = (
    "length",
    "seq",
    "token",
    "col",
    "cap",
    "row",
    "live",
    "keys",
    "out_tokens",
    "out_logp",
    "out_raw",
    "out_version",
    "out_len",
    "out_stop",
    "out_tool",
    "steps",
    "live_steps",
    "extended",
    "out_done",
    "q_k",
    "q_v",
    "q_ids",
    "q_len",
    "q_rows",
    "q_index",
    "q_caps",
    "q_keys",
    "q_head",
    "q_tail",
)


# The state's per-slot arrays besides the caches (a narrow decode gathers them).
_PER_SLOT = ("length", "seq", "token", "col", "cap", "row", "live", "keys")

# The programs that run the layers (a prefill or a decode over them).
_LAYERED = ("admit", "decode", "decode_narrow", "refresh", "extend", "push")

# XLA:GPU options (rollout/gpu_options.py): SCANNED_GPU_OPTIONS for the scanned engine's layered
# programs, STEP_GRAPH_OPTIONS (rollout.step_graphs) for the programs that run decode steps.
SCANNED_GPU_OPTIONS = gpu_options.SCANNED_GPU_OPTIONS
STEP_GRAPH_OPTIONS = gpu_options.STEP_GRAPH_OPTIONS
# The programs a step graph takes: those that run decode steps.
_STEPPED = ("decode", "decode_narrow", "extend")


class SlotPrograms:
  """The device side of the slot engine (see the module docstring); SlotEngine's base class."""

  step_graphs = False  # each decode step one CUDA graph on GPU (SlotEngine(step_graphs=True))

  def _static(self):
    """The generation config's static knobs (one compile per combination)."""
    gen: GenerationConfig = self._gen
    return dict(
        top_k=int(gen.top_k) if not gen.is_greedy else 0,
        use_top_p=gen.top_p < 1.0,
        greedy=gen.is_greedy,
    )

  def _program(self, name, *shape):
    static = self._static() if name in ("decode", "decode_narrow", "extend") else {}
    key = (name, shape, tuple(sorted(static.items())))
    if key not in self._programs:
      fn = getattr(self, "_" + name)
      fn = functools.partial(fn, **static) if static else fn
      kw = {}
      stateful = ("admit", "decode", "decode_narrow", "refresh", "extend", "push")
      if name in stateful:
        kw["donate_argnums"] = (0,)
      if self.mesh is not None and name in ("init", *stateful):
        kw["out_shardings"] = self._state_shardings()
      if self.mesh is not None and name == "take":
        kw["out_shardings"] = (Rollout.shardings(self.mesh), sharding.batch_sharding(self.mesh, 2))
      options = self._gpu_options(name)
      if options:
        kw["compiler_options"] = options
      jitted = jax.jit(fn, **kw)
      self._programs[key] = jitted if self.mesh is None else _InMesh(jitted, self.mesh)
    return self._programs[key]

  def _gpu_options(self, name: str) -> dict | None:
    """The XLA:GPU compiler options of program `name` (None off GPU or none)."""
    if self.platform != "gpu":
      return None
    sets = []
    if self.scan_layers and name in _LAYERED:
      sets.append(SCANNED_GPU_OPTIONS)
    if self.step_graphs and name in _STEPPED:
      sets.append(STEP_GRAPH_OPTIONS)
    return gpu_options.merged(*sets) or None

  def _state_shardings(self):
    """The state's layout on the mesh: caches' slots over (data, fsdp); the rest replicated
    (every process reads the slots' status and makes the same decisions)."""
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    control = {k: rep for k in _CONTROL}
    if self.scan_layers:  # [L, slots, ...]: the slots over (data, fsdp)
      spec = sharding.batch_sharding(self.mesh, 4).spec
      cache = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(None, *spec))
      return dict(k=cache, v=cache, **control)
    cache = sharding.batch_sharding(self.mesh, 4)
    layers = self._model_cfg.num_layers
    control.update(q_k=(rep,) * layers, q_v=(rep,) * layers)  # (the queue's, per layer)
    return dict(k=(cache,) * layers, v=(cache,) * layers, **control)

  def _model(self, weights):
    model = nnx.merge(self._copy_graphdef, weights)
    model.kernels = Kernels.resolve(
        model.cfg, self.platform, ragged_decode=self.ragged, ragged_tpu=self.ragged_tpu
    )
    return model

  @property
  def slot_major(self) -> bool:
    """Whether the caches are [slots, S, Hkv, K] (with the TPU's kernel: XLA:TPU lays a cache
    written one slot per row out so, and the kernel reads it where it lies) rather than
    head-major [slots, Hkv, S, K] (the Triton kernel's and XLA's attention's)."""
    return self.ragged_tpu

  def _constrain_cache(self, kv):
    return _constrain_cache(kv, self.slot_major)

  def _prefill(self, model, ids, mask):
    """`Transformer.prefill_rows` -> (logits, ks, vs, length), the keys/values in the caches'
    layout (head-major as prefill_rows makes them, or slot-major)."""
    return model.prefill_rows(ids, mask, stacked=self.scan_layers, head_major=not self.slot_major)

  def _copy(self, state):
    model = nnx.merge(self.graphdef, state)
    model.kernels = Kernels.resolve(model.cfg, self.platform)
    copy = stacked_sampling_copy(model) if self.scan_layers else sampling_copy(model)
    graphdef, weights = nnx.split(copy)
    self._copy_graphdef = graphdef
    return weights

  def _init(self):
    model_cfg = self._model_cfg
    s, n, r = self.cache_len, self.num_slots, self.ring * self._rows_per_tag
    q, p, g = self.queue_len, self.max_prompt_length, self.g
    hkv, hd = model_cfg.num_kv_heads, model_cfg.head_dim
    # (slot-major with the TPU's kernel: [slots, S, Hkv, K], as XLA:TPU lays a cache out)
    shape = (n, s, hkv, hd) if self.slot_major else (n, hkv, s, hd)
    dt = jnp.dtype(model_cfg.dtype)
    staged = (q, p, hkv, hd) if self.slot_major else (q, hkv, p, hd)  # the queue's prefills
    layers = model_cfg.num_layers
    if self.scan_layers:
      zeros = lambda: jnp.zeros((layers, *shape), dt)  # noqa: E731
      zeros_q = lambda: jnp.zeros((layers, *staged), dt)  # noqa: E731
    else:
      zeros = lambda: tuple(jnp.zeros(shape, dt) for _ in range(layers))  # noqa: E731
      zeros_q = lambda: tuple(jnp.zeros(staged, dt) for _ in range(layers))  # noqa: E731
    return dict(
        k=zeros(),
        v=zeros(),
        length=jnp.zeros((n,), jnp.int32),
        seq=jnp.zeros((n, s), jnp.int32),
        token=jnp.zeros((n,), jnp.int32),
        col=jnp.zeros((n,), jnp.int32),
        cap=jnp.zeros((n,), jnp.int32),
        row=jnp.full((n,), r, jnp.int32),
        live=jnp.zeros((n,), bool),
        keys=jax.random.split(jax.random.key(0), n),
        out_tokens=jnp.full((r, self.c), self.pad_id, jnp.int32),
        out_logp=jnp.zeros((r, self.c), jnp.float32),
        out_raw=jnp.zeros((r, self.c), jnp.float32),
        out_version=jnp.zeros((r, self.c), jnp.int32),
        out_len=jnp.zeros((r,), jnp.int32),
        out_stop=jnp.zeros((r,), bool),
        out_tool=jnp.zeros((r, self.c), jnp.int32),
        steps=jnp.zeros((), jnp.int32),
        live_steps=jnp.zeros((), jnp.int32),
        extended=jnp.zeros((), jnp.int32),
        out_done=jnp.zeros((r,), bool),
        # The device queue (admission inside the decode): groups pushed, admitted in order.
        q_k=zeros_q(),
        q_v=zeros_q(),
        q_ids=jnp.zeros((q, p), jnp.int32),
        q_len=jnp.zeros((q,), jnp.int32),
        q_rows=jnp.zeros((q, g), jnp.int32),
        q_index=jnp.zeros((q, g), jnp.int32),
        q_caps=jnp.zeros((q, g), jnp.int32),
        q_keys=jax.random.split(jax.random.key(0), q),
        q_head=jnp.zeros((), jnp.int32),
        q_tail=jnp.zeros((), jnp.int32),
    )

  def _draw(self, temperature, top_p, *, top_k, use_top_p, greedy):
    return functools.partial(
        sampling.sample_token,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        use_top_p=use_top_p,
        greedy=greedy,
    )

  def _record(self, st, slots, active, token, logp, raw, version):
    """Writes each active entry's token (at its row's column) into the output rows and moves
    its slot on: column + 1, stopped at a stop token or its budget. `slots` [E]: the entries'
    slots (out-of-range entries are dropped), or None: every slot, in order (the decode's:
    no gather or scatter of the slots' arrays)."""
    r = self.ring * self._rows_per_tag
    if slots is None:
      take = lambda x: x  # noqa: E731
      put = lambda x, v: v  # noqa: E731
    else:
      take = lambda x: x.at[slots].get(mode="fill", fill_value=0)  # noqa: E731
      put = lambda x, v: x.at[slots].set(v, mode="drop")  # noqa: E731
    row = jnp.where(active, take(st["row"]), r)
    col = take(st["col"])
    stop_ids = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
    stop = active & jnp.isin(token, stop_ids)
    col2 = col + active
    live = active & ~stop & (col2 < take(st["cap"]))
    out = dict(
        st,
        out_tokens=st["out_tokens"].at[row, col].set(token, mode="drop"),
        out_logp=st["out_logp"].at[row, col].set(logp, mode="drop"),
        out_raw=st["out_raw"].at[row, col].set(raw, mode="drop"),
        out_version=st["out_version"].at[row, col].set(version, mode="drop"),
        out_len=st["out_len"].at[row].set(col2, mode="drop"),
        out_stop=st["out_stop"].at[row].set(stop, mode="drop"),
        col=put(st["col"], col2),
        live=put(st["live"], live),
        token=put(st["token"], jnp.where(active, token, take(st["token"]))),
    )
    if self.admit_in_decode:  # (the host reads which rows are done from here)
      out["out_done"] = st["out_done"].at[row].set(~live, mode="drop")
    return out

  def _admit(self, st, weights, ids, mask, slot_ids, row_ids, index, caps, keys):
    """Prefills the prompts into their rows' slots; draws nothing. Each row's last prompt
    token is its slot's next input (`token`, at position length - 1): the first decode step
    feeds it again (its keys/values written again, the same values) and draws the row's first
    token from its logits with key fold_in(row key, 0), as every later column t with
    fold_in(row key, t). So admit has no LM head and no sampling (a quarter of its compile for
    Qwen3-0.6B on an H100, 9.3 -> 7.1 s: benchmarks/slot_compile.py) and one program per
    (width, prompt width) serves every generation config; a row costs one decode step more.
    Padding entries come with the out-of-range slot and row: their writes are dropped."""
    model = self._model(weights)
    _, ks, vs, length = self._prefill(model, ids, mask)  # no logits
    compact = jnp.take_along_axis(ids, compaction(mask)[0], axis=1)
    return self._place(st, ks, vs, compact, length, slot_ids, row_ids, index, caps, keys)

  def _place(self, st, ks, vs, compact, length, slot_ids, row_ids, index, caps, keys):
    """A prefills' keys/values ([A, Hkv, W, K] per layer, or stacked [L, A, ...]), real
    tokens `compact` [A, W] first (`length` [A] of them), into their G rows' slots
    slot_ids [A * G]; each row's state and output row reset (see `_admit`)."""
    scan = self.scan_layers
    g, w = self.g, compact.shape[1]
    rep = lambda x: jnp.repeat(x, g, axis=0)  # noqa: E731
    put = lambda c, x: c.at[slot_ids].set(x.astype(c.dtype), mode="drop")  # noqa: E731

    slots = (slot_ids, slice(0, w)) if self.slot_major else (slot_ids, slice(None), slice(0, w))

    def kv(cache, new):
      if scan:  # stacked [L, slots, ...]: the prompts' rows repeated on axis 1
        new = jnp.repeat(new, g, axis=1).astype(cache.dtype)
        return cache.at[(slice(None), *slots)].set(new, mode="drop")
      return tuple(c.at[slots].set(rep(x).astype(c.dtype), mode="drop") for c, x in zip(cache, new))

    row_keys = jax.vmap(jax.random.fold_in)(rep(keys), index)
    last = jnp.maximum(length - 1, 0)
    last_token = jnp.take_along_axis(compact, last[:, None], axis=1)[:, 0]
    active = slot_ids < self.num_slots
    return dict(
        st,
        seq=st["seq"].at[slot_ids, :w].set(rep(compact), mode="drop"),
        k=self._constrain_cache(kv(st["k"], ks)),
        v=self._constrain_cache(kv(st["v"], vs)),
        length=put(st["length"], rep(last)),
        token=put(st["token"], rep(last_token)),
        col=put(st["col"], jnp.zeros_like(slot_ids)),
        cap=put(st["cap"], caps),
        row=put(st["row"], row_ids),
        live=put(st["live"], active),
        keys=st["keys"].at[slot_ids].set(row_keys, mode="drop"),
        out_len=st["out_len"].at[row_ids].set(0, mode="drop"),
        out_stop=st["out_stop"].at[row_ids].set(False, mode="drop"),
        out_done=st["out_done"].at[row_ids].set(False, mode="drop"),
        out_tool=st["out_tool"].at[row_ids].set(0, mode="drop"),
    )

  def _push(self, st, weights, ids, mask, rows, index, caps, keys, count):
    """Onto the device queue (admission inside the decode): the first `count` of the Q
    groups given (ids/mask [Q, P] left-padded, rows/index/caps [Q, G], keys [Q]), after the
    groups already queued, prefilled here, all Q prompts in one batch (the decode's
    admission then only copies their keys/values into slots); their rows' outputs are marked
    not done."""
    model = self._model(weights)
    _, ks, vs, length = self._prefill(model, ids, mask)
    compact = jnp.take_along_axis(ids, compaction(mask)[0], axis=1)
    q = self.queue_len
    j = jnp.arange(q)
    at = jnp.where(j < count, (st["q_tail"] + j) % q, q)
    put = lambda name, x: st[name].at[at].set(x, mode="drop")  # noqa: E731
    r = self.ring * self._rows_per_tag
    done_rows = jnp.where((j < count)[:, None], rows, r).reshape(-1)
    return dict(
        st,
        q_k=self._staged(st["q_k"], ks, at),
        q_v=self._staged(st["q_v"], vs, at),
        q_ids=put("q_ids", compact),
        q_len=put("q_len", length),
        q_rows=put("q_rows", rows),
        q_index=put("q_index", index),
        q_caps=put("q_caps", caps),
        q_keys=put("q_keys", keys),
        q_tail=st["q_tail"] + count,
        out_done=st["out_done"].at[done_rows].set(False, mode="drop"),
    )

  def _staged(self, old, new, at):
    """The device queue's keys/values with entries `at` [Q] (Q out of range: dropped) set."""
    if self.scan_layers:
      return old.at[:, at].set(new.astype(old.dtype), mode="drop")
    return tuple(o.at[at].set(x.astype(o.dtype), mode="drop") for o, x in zip(old, new))

  def _admit_queued(self, st):
    """The device queue's next group into G free slots (the lowest-numbered ones): its
    prefilled keys/values copied in."""
    e = st["q_head"] % self.queue_len
    free = jnp.nonzero(~st["live"], size=self.g, fill_value=self.num_slots)[0].astype(jnp.int32)
    if self.scan_layers:
      ks, vs = st["q_k"][:, e][:, None], st["q_v"][:, e][:, None]
    else:
      ks = tuple(x[e][None] for x in st["q_k"])
      vs = tuple(x[e][None] for x in st["q_v"])
    st = self._place(
        st,
        ks,
        vs,
        st["q_ids"][e][None],
        st["q_len"][e][None],
        free,
        st["q_rows"][e],
        st["q_index"][e],
        st["q_caps"][e],
        st["q_keys"][e][None],
    )
    return dict(st, q_head=st["q_head"] + 1)

  def _decode(self, st, weights, version, refill, watch, temperature, top_p, **static):
    """Up to `chunk` decode steps for every slot. The chunk ends early once `refill` slots
    are free (with admission inside the decode: once, too, the device queue is empty), or
    once watch = (lo, hi, need), need > 0, rows of [lo, hi) stopped in this call. With
    admission inside the decode (`admit_in_decode`), each step first admits the device
    queue's next groups, one per G free slots."""
    draw = self._draw(temperature, top_p, **static)
    return self._steps(st, weights, version, refill, watch, draw, self.admit_in_decode)

  def _decode_narrow(self, st, weights, version, refill, watch, temperature, top_p, **static):
    """`_decode` over `narrow` slots only: the live ones (the host calls it when at most
    `narrow` slots are live and nothing is queued: a step's last rows). Their caches and
    state are gathered once per call and written back after it; each step then costs a
    decode of `narrow` rows, not of every slot."""
    draw = self._draw(temperature, top_p, **static)
    n, m = self.num_slots, self.narrow
    idx = jnp.nonzero(st["live"], size=m, fill_value=n)[0]
    # (entries past the live slots read slot n - 1 and are not live; their writes are dropped)
    get = lambda x, axis=0: jnp.take(x, idx, axis=axis, mode="clip")  # noqa: E731
    if self.scan_layers:
      cache = lambda c: self._constrain_cache(get(c, 1))  # noqa: E731
    else:
      cache = lambda c: self._constrain_cache(tuple(get(x) for x in c))  # noqa: E731
    sub = dict(st, k=cache(st["k"]), v=cache(st["v"]))
    sub.update({name: get(st[name]) for name in _PER_SLOT})
    sub["live"] = sub["live"] & (idx < n)
    sub = self._steps(sub, weights, version, refill, watch, draw, False, (self.cache_len,))
    put = lambda x, new, axis=0: (  # noqa: E731
        x.at[idx].set(new, mode="drop") if axis == 0 else x.at[:, idx].set(new, mode="drop")
    )
    if self.scan_layers:
      back = lambda c, new: put(c, new, 1)  # noqa: E731
    else:
      back = lambda c, new: tuple(put(x, y) for x, y in zip(c, new))  # noqa: E731
    out = dict(sub, k=self._constrain_cache(back(st["k"], sub["k"])))
    out["v"] = self._constrain_cache(back(st["v"], sub["v"]))
    out.update({name: put(st[name], sub[name]) for name in _PER_SLOT})
    return out

  def _steps(self, st, weights, version, refill, watch, draw, inside, widths=None):
    """The decode loop over the state's slots (however many it holds; see `_decode`), in
    phases (`widths`, default the engine's `decode_widths`, ascending, the last the cache's
    width): while every live row's next slot is below a phase's width w, the steps attend to
    the caches' first w slots only (copied out of the caches once per phase, written back
    after it), as the lockstep sampler's decode phases do; a phase that cannot hold the live
    rows is skipped. The chunk, refill and watch count across phases."""
    model = self._model(weights)
    n = st["live"].shape[0]
    every = jnp.arange(n)
    lo, hi, need = watch[0], watch[1], watch[2]
    widths = self.decode_widths if widths is None else widths

    def fits(st, w):  # every live row's next slot is below w
      return jnp.max(jnp.where(st["live"], st["length"], 0)) < w

    def body(c):
      i, fin, st = c
      if inside:  # the device queue's groups into free slots, as many as fit

        def more(s):
          return (s["q_head"] < s["q_tail"]) & ((~s["live"]).sum() >= self.g)

        # (the loop behind a cond: most steps admit nothing and skip it for one predicate)
        admit = lambda s: jax.lax.while_loop(more, self._admit_queued, s)  # noqa: E731
        st = jax.lax.cond(more(st), admit, lambda s: s, st)
      live = st["live"]
      at = jnp.minimum(st["length"], _width(st["k"], self.scan_layers, self.slot_major) - 1)
      logits, ks, vs = model.decode_rows(st["token"], st["k"], st["v"], at)
      st = dict(
          st,
          k=self._constrain_cache(ks),
          v=self._constrain_cache(vs),
          seq=st["seq"].at[every, at].set(st["token"], unique_indices=True),
          length=st["length"] + live,
          steps=st["steps"] + 1,
          live_steps=st["live_steps"] + live.sum(),
      )
      token, lp, raw = draw(logits, jax.vmap(jax.random.fold_in)(st["keys"], st["col"]))
      st = self._record(st, None, live, token, lp, raw, version)
      if self.admit_in_decode:  # (the watch: rows the host waits for; see `_decode`)
        fin = fin + (live & ~st["live"] & (st["row"] >= lo) & (st["row"] < hi)).sum()
      return i + 1, fin, st

    def cond(c, w=None):
      i, fin, st = c
      live = st["live"].sum()
      queued = st["q_tail"] - st["q_head"] if inside else 0
      go = (i < self.chunk) & ((live > 0) | (queued > 0)) & ((need <= 0) | (fin < need))
      go = go & ((queued > 0) | (n - live < refill))
      return go if w is None else go & fits(st, w)

    def phase(c, w):
      i, fin, st = c
      cut = lambda x: _cut(x, w, self.scan_layers, self.slot_major)  # noqa: E731
      sub = dict(st, k=self._constrain_cache(cut(st["k"])), v=self._constrain_cache(cut(st["v"])))
      i, fin, sub = jax.lax.while_loop(functools.partial(cond, w=w), body, (i, fin, sub))
      back = lambda x, y: _paste(x, y, self.scan_layers, self.slot_major)  # noqa: E731
      k, v = back(st["k"], sub["k"]), back(st["v"], sub["v"])
      return i, fin, dict(sub, k=self._constrain_cache(k), v=self._constrain_cache(v))

    zero = jnp.zeros((), jnp.int32)
    c = (zero, zero, st)
    for w in widths[:-1]:
      c = jax.lax.cond(cond(c, w), functools.partial(phase, w=w), lambda c: c, c)
    return jax.lax.while_loop(cond, body, c)[2]

  def _refresh(self, st, weights):
    """Every slot's keys/values computed again from its tokens (new weights); with admission
    inside the decode, the device queue's prefills too."""
    model = self._model(weights)
    s_len = st["seq"].shape[1]
    mask = (jnp.arange(s_len)[None, :] < st["length"][:, None]).astype(jnp.int32)
    _, ks, vs, _ = self._prefill(model, st["seq"], mask)

    def fresh(cache, new):
      if self.scan_layers:
        return new.astype(cache.dtype)
      return tuple(x.astype(c.dtype) for c, x in zip(cache, new))

    st = dict(
        st, k=self._constrain_cache(fresh(st["k"], ks)), v=self._constrain_cache(fresh(st["v"], vs))
    )
    if self.admit_in_decode:
      p = st["q_ids"].shape[1]
      mask = (jnp.arange(p)[None, :] < st["q_len"][:, None]).astype(jnp.int32)
      _, ks, vs, _ = self._prefill(model, st["q_ids"], mask)
      st = dict(st, q_k=fresh(st["q_k"], ks), q_v=fresh(st["q_v"], vs))
    return st

  def _take(self, st, rows):
    length = st["out_len"][rows]
    mask = (jnp.arange(self.c)[None, :] < length[:, None]).astype(jnp.int32)
    on = mask != 0
    rollout = Rollout(
        tokens=jnp.where(on, st["out_tokens"][rows], self.pad_id),
        mask=mask,
        logprobs=jnp.where(on, st["out_logp"][rows], 0.0),
        raw_logprobs=jnp.where(on, st["out_raw"][rows], 0.0),
        lengths=length,
        truncated=~st["out_stop"][rows],
        tool_mask=jnp.where(on, st["out_tool"][rows], 0),
    )
    return rollout, jnp.where(on, st["out_version"][rows], 0)

  def _peek(self, st, rows):
    """Rows' tokens, lengths and whether they stopped at a stop token (multi-turn: the host
    reads a stopped row's last turn); out-of-range rows give zeros."""
    get = lambda x: x.at[rows].get(mode="fill", fill_value=0)  # noqa: E731
    return get(st["out_tokens"]), get(st["out_len"]), get(st["out_stop"])

  def _extend(
      self, st, weights, slot_ids, tokens, counts, go, version, temperature, top_p, **static
  ):
    """Tool responses into paused rows: entry i's first counts[i] `tokens` [E, R] are appended
    to slot slot_ids[i]'s row after its last token (which, drawn last, enters the cache with
    them: `Transformer.extend_rows` over the slots' live caches, only these tokens computed),
    written to its output with tool_mask 1, and the row draws its next token from there.
    go[i] False: the row ends instead, truncated (no room for the response)."""
    model = self._model(weights)
    n_slots, r_out = self.num_slots, self.ring * self._rows_per_tag
    take = lambda x: x.at[slot_ids].get(mode="fill", fill_value=0)  # noqa: E731
    put = lambda x, v: x.at[slot_ids].set(v, mode="drop")  # noqa: E731
    valid = slot_ids < n_slots
    go = go & valid
    row = jnp.where(valid, take(st["row"]), r_out)
    # Stopped for good: a stop token is no longer the row's end.
    st = dict(st, out_stop=st["out_stop"].at[jnp.where(valid & ~go, row, r_out)].set(False))
    # Every slot's row as the model sees it: the appended tokens at the rows' own positions.
    e, r = tokens.shape
    feed = jnp.zeros((n_slots, r + 1), jnp.int32)
    first = jnp.where(go, take(st["token"]), 0)
    n = jnp.where(go, counts + 1, 0)
    feed = feed.at[slot_ids].set(jnp.concatenate([first[:, None], tokens], 1), mode="drop")
    n_all = jnp.zeros((n_slots,), jnp.int32).at[slot_ids].set(n, mode="drop")
    at = jnp.minimum(st["length"], self.cache_len - 1)
    j = jnp.arange(r + 1)
    s_len = st["seq"].shape[1]
    seq_at = jnp.where(j[None] < n_all[:, None], at[:, None] + j[None], s_len)
    every = jnp.arange(n_slots)
    if self.reprefill_turns:  # the baseline: each row's whole history again
      seq = st["seq"].at[every[:, None], seq_at].set(feed, mode="drop")
      length = st["length"] + n_all
      mask = (jnp.arange(s_len)[None, :] < length[:, None]).astype(jnp.int32)
      logits, ks, vs, _ = self._prefill(model, seq, mask)
      if not self.scan_layers:
        ks, vs = (
            tuple(x.astype(c.dtype) for c, x in zip(old, new))
            for old, new in ((st["k"], ks), (st["v"], vs))
        )
      else:
        ks, vs = ks.astype(st["k"].dtype), vs.astype(st["v"].dtype)
      extended = jnp.where(n_all > 0, length, 0).sum()
    else:
      logits, ks, vs = model.extend_rows(feed, st["k"], st["v"], at, n_all)
      extended = n_all.sum()
    # Tool columns of the output rows: counts[i] of them after the stop token's column.
    col = take(st["col"])
    jr = jnp.arange(r)
    out_r = jnp.where(go[:, None] & (jr[None] < counts[:, None]), row[:, None], r_out)
    out_c = col[:, None] + jr[None]
    zero = jnp.zeros((e, r))
    st = dict(
        st,
        k=self._constrain_cache(ks),
        v=self._constrain_cache(vs),
        seq=st["seq"].at[every[:, None], seq_at].set(feed, mode="drop"),
        length=st["length"] + n_all,
        out_tokens=st["out_tokens"].at[out_r, out_c].set(tokens, mode="drop"),
        out_tool=st["out_tool"].at[out_r, out_c].set(1, mode="drop"),
        out_logp=st["out_logp"].at[out_r, out_c].set(zero, mode="drop"),
        out_raw=st["out_raw"].at[out_r, out_c].set(zero, mode="drop"),
        out_version=st["out_version"].at[out_r, out_c].set(0, mode="drop"),
        out_len=st["out_len"].at[jnp.where(go, row, r_out)].set(col + counts, mode="drop"),
        col=put(st["col"], jnp.where(go, col + counts, col)),
        extended=st["extended"] + extended,
    )
    draw = self._draw(temperature, top_p, **static)
    token, lp, raw = draw(logits, jax.vmap(jax.random.fold_in)(st["keys"], st["col"]))
    on = n_all > 0  # only the appended rows move on (the others keep their slot's state)
    return self._record(st, jnp.where(on, every, n_slots), on, token, lp, raw, version)


def _width(cache, scanned: bool, slot_major: bool = False) -> int:
  """The slots per row of a cache (per-layer tuple of [B, Hkv, S, K] or, slot-major,
  [B, S, Hkv, K]; or stacked [L, ...])."""
  return (cache.shape if scanned else cache[0].shape)[-3 if slot_major else -2]


def _cut(cache, w: int, scanned: bool, slot_major: bool = False):
  """The first `w` slots of every row of a cache (a copy)."""
  cut = (lambda c: c[..., :w, :, :]) if slot_major else (lambda c: c[..., :w, :])
  return cut(cache) if scanned else tuple(map(cut, cache))


def _paste(cache, part, scanned: bool, slot_major: bool = False):
  """`cache` with its first slots replaced by `part` (`_cut`'s shape; in place)."""
  axis = -3 if slot_major else -2
  if scanned:
    return jax.lax.dynamic_update_slice_in_dim(cache, part, 0, axis=axis)
  return tuple(jax.lax.dynamic_update_slice_in_dim(c, x, 0, axis=axis) for c, x in zip(cache, part))


def _constrain_cache(kv, slot_major: bool = False):
  """Per-layer caches (a tuple) or the stacked one [L, ...]: slots over the batch axes."""
  names = ("length", "kv_heads") if slot_major else ("kv_heads", "length")
  if not isinstance(kv, tuple):
    return sharding.constrain(kv, "layers", "batch", *names, "head_dim")
  return tuple(sharding.constrain(x, "batch", *names, "head_dim") for x in kv)


def _host(x) -> np.ndarray:
  """A host copy of a (replicated or host) array; on several processes each reads its own."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


class _InMesh:

  def __init__(self, fn, mesh):
    self.fn, self.mesh = fn, mesh

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.fn(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*args)
