"""Compiling the slot engine's programs ahead (rollout/slots.py's SlotEngine is a SlotAhead):
before the first admission at a prompt width, the programs a step runs there are lowered on
the calls' own arguments and compiled by a thread pool at once (XLA compiles with the GIL
released; jit's caches then serve the calls), the ones no step's first decode calls (`LATER`)
behind it; and the programs on abstract inputs (`abstract_programs`: memory_plan.py and
benchmarks/slot_compile.py compile them without weights). Like SlotPrograms, it reads the
engine's static configuration and state, set by SlotEngine.
"""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.rollout.slot_programs import SlotPrograms

# Programs no step's first decode calls (the refresh: weights landing with rows in flight; the
# narrow decode: a step's last rows): `_compile_ahead` compiles them behind the ones it waits
# for, and their first call waits for that compile (`_program`).
LATER = ("refresh", "decode_narrow")


class SlotAhead(SlotPrograms):
  """The slot engine's compiles ahead of its calls and on abstract inputs (module docstring)."""

  def _compile_ahead(self, width: int, admissions, key):
    """The programs of a step at prompt `width` (`admissions`: the admission widths, in groups)
    not compiled yet, compiled at once (`compile_threads`) before their first call, on
    arguments shaped and placed as the calls' (a jit cache hit then); the LATER ones (refresh,
    the narrow decode) compile once the others, which alone are waited for here, are done:
    the first decode starts while they compile. Every admission asks; once a width's programs
    are compiled that is a set lookup."""
    statics = tuple(sorted(self._static().items()))
    keys = [("admit", a, width) for a in admissions]
    keys += [("decode", statics), ("take", self._rows_per_tag)]
    keys += [("refresh",)] if self.ring > 1 else []  # steps in flight: weights land, rows live
    keys += [("push",)] if self.admit_in_decode else []  # (its only admission)
    keys += [("decode_narrow", statics)] if self.narrow else []
    keys += [("extend", statics)] if self.turns is not None else []
    todo = [k for k in keys if k not in self._compiled]
    if not todo:
      return
    z = lambda *shape: self._replicated(np.zeros(shape, np.int32))  # noqa: E731
    st, w8, n = self._state, self._weights, self.num_slots

    def args(k):
      if k[0] == "admit":
        a = k[1]
        ids = (z(a, width), z(a, width))
        return (st, w8, *ids, *(z(a * self.g) for _ in range(4)), jnp.stack([key] * a))
      if k[0] in ("decode", "decode_narrow"):
        return (st, w8, self._version, z(), z(3), *self._scalars())
      if k[0] == "push":
        q, p = self.queue_len, self.max_prompt_length
        keys = jnp.stack([key] * q)
        return (st, w8, z(q, p), z(q, p), *(z(q, self.g) for _ in range(3)), keys, z())
      if k[0] == "take":
        return (st, z(self._rows_per_tag))
      if k[0] == "refresh":
        return (st, w8)
      go = self._replicated(np.zeros(n, bool))
      return (st, w8, z(n), z(n, self.max_append), z(n), go, self._version, *self._scalars())

    waits, later = [], []
    for k in sorted(todo, key=lambda k: k[0] in LATER):  # (stable: LATER ones last)
      self._compiled.add(k)  # each compile starts as soon as its program is lowered (the GIL)
      shape = k[1:] if k[0] == "admit" else ()
      lowered = self._program(k[0], *shape).lower(*args(k))
      if k[0] in LATER:
        later.append((k[0], lowered))
      else:
        waits.append(self._compile_pool().submit(lowered.compile))
    for done in waits:
      done.result()
    for name, lowered in later:  # (after the others: no thread of theirs taken)
      self._later[name] = self._compile_pool().submit(lowered.compile)

  def _compile_pool(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.compile_threads)
    return self._pool

  def _init_ahead(self):
    """The empty state's program compiled in the pool while the first weight copy compiles on
    the caller's thread (`set_weights`, before the first call: the two are independent); its
    first call waits for it (`_program`)."""
    if ("init",) in self._compiled or self._state is not None or self._rows_per_tag is None:
      return
    self._compiled.add(("init",))
    lowered = self._program("init").lower()
    self._later["init"] = self._compile_pool().submit(lowered.compile)

  def _program(self, name, *shape):
    """SlotPrograms._program; a LATER program's first call waits for its compile ahead (jit's
    cache then serves it: no second compile on this thread)."""
    later = self._later.pop(name, None) if self._later else None
    if later is not None:
      later.result()
    return super()._program(name, *shape)

  def abstract_programs(self, params, model_cfg, generation, *, rows_per_step: int):
    """The engine's programs on abstract inputs, for compiling ahead of time without weights
    (memory_plan.py, benchmarks/slot_compile.py): params, the policy's abstract params
    (ShapeDtypeStructs with shardings). -> {"copy": (program, args), "admit", "decode",
    "refresh", "take", "init", "decode_narrow" with a narrow decode, "push" with admission in
    the decode, and "extend" with max_append}, each program with .lower(*args); admit at the
    refill's and at the whole engine's width ("admit", "admit_all") and the full prompt
    width."""
    self.reset(generation, rows_per_step=rows_per_step)
    self._model_known(model_cfg)
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    sds = lambda shape, dt, s=rep: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731
    copy = self._program("copy")
    shardings = copy.lower(params).compile().output_shardings
    weights = jax.tree.map(
        lambda x, sh: sds(x.shape, x.dtype, sh), jax.eval_shape(self._copy, params), shardings
    )
    with jax.set_mesh(self.mesh):
      st = jax.eval_shape(self._init)
    st = jax.tree.map(lambda x, sh: sds(x.shape, x.dtype, sh), st, self._state_shardings())
    key = jax.eval_shape(lambda: jax.random.key(0))
    i32, f32, p = jnp.int32, jnp.float32, self.max_prompt_length
    scalars = (sds((), f32), sds((), f32))

    def admit(a):
      n = a * self.g
      args = (st, weights, sds((a, p), i32), sds((a, p), i32))
      args += tuple(sds((n,), i32) for _ in range(4))
      args += (sds((a, *key.shape), key.dtype),)
      return self._program("admit", a, p), args

    out = {}
    if self.max_append:  # multi-turn rows: the tool responses' append
      n, r = self.num_slots, self.max_append
      out["extend"] = (
          self._program("extend"),
          (st, weights, sds((n,), i32), sds((n, r), i32), sds((n,), i32), sds((n,), jnp.bool_))
          + (sds((), i32), *scalars),
      )
    decode_args = (st, weights, sds((), i32), sds((), i32), sds((3,), i32), *scalars)
    if self.narrow:  # a step's last rows
      out["decode_narrow"] = (self._program("decode_narrow"), decode_args)
    if self.admit_in_decode:  # the device queue
      q, g = self.queue_len, self.g
      push = (st, weights, sds((q, p), i32), sds((q, p), i32))
      push += tuple(sds((q, g), i32) for _ in range(3))
      push += (sds((q, *key.shape), key.dtype), sds((), i32))
      out["push"] = (self._program("push"), push)
    return out | dict(
        copy=(copy, (params,)),
        admit=admit(self.refill // self.g),
        admit_all=admit(self.num_slots // self.g),
        decode=(self._program("decode"), decode_args),
        refresh=(self._program("refresh"), (st, weights)),
        take=(self._program("take"), (st, sds((rows_per_step,), i32))),
        init=(self._program("init"), ()),
    )
