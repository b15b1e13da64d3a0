"""The jitted group sampler: one prefill per prompt, a shared KV cache, a while_loop decode.

    sampler = Sampler(graphdef, max_prompt_length=P, max_new_tokens=C, num_generations=G,
                      eos_ids=(eos,), pad_id=pad, mesh=mesh)
    rollout = sampler(params_state, prompt_ids, prompt_mask, rng, "standard")

1. Prefill: the B left-padded prompts run once ([B, P]), so prefill cost does not grow with
   G. Their keys/values stay one copy per prompt (`share_prompt`): each decode step reads a
   prompt's keys once for its G samples, not G times.
2. Decode: `lax.while_loop`s over the [B*G, Hkv, S, K] caches of the new tokens; each step
   samples one token per row (sampling.py), records it and its log-probs, and stops when every
   row has emitted a stop token (or after C steps). Rows that stopped keep emitting `pad_id`.
   On GPU (`decode_attention` auto) one kernel per layer attends over the prompt and the
   slots written so far (models/decoder/decode_attention.py), in one loop over C slots. The XLA
   attention (CPU, TPU) reads every cache slot each step, so there the C steps run in
   `decode_phases` loops over a cache that grows between them (S = C/phases, 2C/phases, ...,
   C slots): a step reads about the slots written so far, not all C. Each phase is its own
   compiled loop (compile time grows with the phases; 1 = one loop over C slots; see
   `phase_ends`).
3. Routing replay (`record_routes`, an MoE policy with rollout.routing_replay="rollout"): the
   prefill's and each decode step's MoE routes (the experts every MoE layer chose for the
   tokens fed) are kept as `Rollout.routes` [B*G, P+C, L_moe, k] (types.py has the layout),
   for the trainer's forward to replay (rl/replay.py).
4. Everything is one jit per (shapes, static sampling path); new parameters, prompts, rng,
   temperature and top_p reuse the compiled program. Batch rows shard over (data, fsdp).

Randomness: step t of a call uses fold_in(rng, t); each draw covers the whole [B*G] batch, so
a row's sample depends on the rng and its position in the batch (same inputs + rng -> same
tokens, on one device or a mesh).
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import decode_attention as decode_attention_lib
from grpo_jax.models.decoder.cache import grow_cache
from grpo_jax.models.decoder.cache import ring_sizes
from grpo_jax.models.decoder.cache import sampling_copy
from grpo_jax.models.decoder.cache import share_prompt
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.decoder.moe import routes_dtype
from grpo_jax.rollout import gpu_options
from grpo_jax.rollout import sampling
from grpo_jax.rollout.types import GenerationConfig
from grpo_jax.rollout.types import Rollout
from grpo_jax.rollout.types import generation_config


class Sampler:
  """Compile-once rollout generation for a model graph (see the module docstring)."""

  def __init__(
      self,
      graphdef,
      *,
      max_prompt_length: int,
      max_new_tokens: int,
      num_generations: int = 1,
      eos_ids=(),
      pad_id: int = 0,
      mesh=None,
      decode_phases: int = 0,
      decode_block: int = 0,
      decode_attention: str | None = None,
      record_routes: bool = False,
      step_graphs: bool = False,
  ):
    """record_routes: keep the MoE routes of every token fed (Rollout.routes; an MoE model).
    step_graphs (GPU; rollout.step_graphs): the decode loops inside one CUDA graph
    (gpu_options.LOOP_GRAPH_OPTIONS), not a graph per step and a host read of each loop's
    predicate; unmeasured on a GPU so far, hence opt-in."""
    self.graphdef = graphdef
    self.record_routes = record_routes
    self.step_graphs = bool(step_graphs)
    self.max_prompt_length = max_prompt_length
    self.max_new_tokens = max_new_tokens
    self.num_generations = num_generations
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.pad_id = int(pad_id)
    self.mesh = mesh
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    self.platform = platform
    # Decode steps per check of the loop's stop condition (see `block_size`); the loops then
    # run over `columns` >= max_new_tokens slots so each phase is a whole number of blocks.
    self.block = block_size(decode_block, platform)
    # The decode attention: one kernel over the written cache slots only (GPU by default), or
    # the XLA form over all of them; the kernel needs no phases (auto: 1).
    self.ragged = decode_attention_lib.choose(decode_attention, platform)
    ends = phase_ends(max_new_tokens, decode_phases or (1 if self.ragged else 0), platform)
    self.phase_ends = tuple(sorted({1 + self.block * -(-(e - 1) // self.block) for e in ends}))
    self.columns = self.phase_ends[-1]
    self._compiled = {}
    self._device_scalars = {}

  def _fn(self, top_k: int, use_top_p: bool, greedy: bool):
    key = (top_k, use_top_p, greedy)
    if key not in self._compiled:
      fn = functools.partial(self._generate, top_k=top_k, use_top_p=use_top_p, greedy=greedy)
      kw = {}
      if self.mesh is not None:
        kw["out_shardings"] = Rollout.shardings(self.mesh, routes=self.record_routes)
      if self.step_graphs and self.platform == "gpu":
        kw["compiler_options"] = dict(gpu_options.LOOP_GRAPH_OPTIONS)
      self._compiled[key] = jax.jit(fn, **kw)
    return self._compiled[key]

  def __call__(self, state, prompt_ids, prompt_mask, rng, generation="greedy") -> Rollout:
    fn, args = self._call(state, prompt_ids, prompt_mask, rng, generation)
    if self.mesh is not None:
      with jax.set_mesh(self.mesh):
        return fn(*args)
    return fn(*args)

  def program(self, state, prompt_ids, prompt_mask, rng, generation="greedy"):
    """The jitted program a call with these arguments (arrays or ShapeDtypeStructs) runs, for
    compiling it ahead: -> (an object with .lower(*args), args). Its compile lands in jit's
    caches, so the call that follows finds it compiled."""
    fn, args = self._call(state, prompt_ids, prompt_mask, rng, generation)
    return _InMesh(fn, self.mesh), args

  def _call(self, state, prompt_ids, prompt_mask, rng, generation):
    gen: GenerationConfig = generation_config(generation)
    b, p = prompt_ids.shape
    if p > self.max_prompt_length:  # narrower batches (data.prompt_width) compile once each
      raise ValueError(
          f"prompt_ids has {p} columns; this sampler was built for at most "
          f"max_prompt_length={self.max_prompt_length} (left-truncate prompts)"
      )
    if self.mesh is not None:
      dp = sharding.data_parallel_size(self.mesh)
      if b % dp:
        raise ValueError(
            f"{b} prompts do not split over the data-parallel mesh size {dp}: "
            f"pad the batch to a multiple of {dp}"
        )
    fn = self._fn(int(gen.top_k) if not gen.is_greedy else 0, gen.top_p < 1.0, gen.is_greedy)
    temperature, top_p = self._scalars(gen)
    return fn, (state, prompt_ids, prompt_mask, rng, temperature, top_p)

  def _scalars(self, gen: GenerationConfig):
    """Temperature and top_p as device scalars, put there once per config (explicitly: the
    training loop runs its steady state under jax.transfer_guard("disallow"))."""
    key = (float(gen.temperature), float(gen.top_p))
    if key not in self._device_scalars:
      self._device_scalars[key] = tuple(
          jax.device_put(np.float32(v))
          if self.mesh is None
          else multihost.replicated(np.float32(v), self.mesh)
          for v in key
      )
    return self._device_scalars[key]

  def _slots(self, end: int) -> int:
    """Cache slots for a phase ending at column `end`: its decodes write slots 0..end-2 (the
    last column's token is drawn, never decoded); the ragged kernel reads whole blocks."""
    block = decode_attention_lib.BLOCK
    return -(-(end - 1) // block) * block if self.ragged else end

  def _generate(
      self, state, prompt_ids, prompt_mask, rng, temperature, top_p, *, top_k, use_top_p, greedy
  ) -> Rollout:
    model = nnx.merge(self.graphdef, state)
    # The kernels of this sampler's platform and decode attention, for every trace of it.
    model.kernels = Kernels.resolve(model.cfg, self.platform, ragged_decode=self.ragged)
    # The weights the loops read: compute dtype, per layer, made once here (sampling_copy).
    model = sampling_copy(model)
    g, c_len, cols = self.num_generations, self.max_new_tokens, self.columns
    b, p = prompt_ids.shape
    n = b * g
    prompt_ids = sharding.constrain(prompt_ids, "batch", "length")
    cache = _constrain_cache(model.init_cache(b, p))
    logits, cache, prompt_routes = model.prefill_routed(prompt_ids, prompt_mask, cache)  # [B, V]
    if self.record_routes and prompt_routes is None:
      raise ValueError("record_routes: the model has no MoE layers (model.num_experts = 0)")
    routes_dt = routes_dtype(model.cfg.num_experts)
    rings = ring_sizes(model.cfg)  # local layers: window-sized completion caches
    cache = _constrain_cache(
        share_prompt(
            cache,
            g,
            self._slots(self.phase_ends[0]),
            decode_attention_lib.BLOCK if self.ragged else 1,
            rings,
        )
    )
    if g > 1:
      logits = jnp.repeat(logits, g, axis=0)
    stop_ids = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
    draw = functools.partial(
        sampling.sample_token,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        use_top_p=use_top_p,
        greedy=greedy,
    )

    def col(arr, v, t):
      return jax.lax.dynamic_update_slice(arr, v[:, None].astype(arr.dtype), (0, t))

    def record(c, t, logits, done):
      """Draws token t for the rows still live and writes it (and its log-probs) out."""
      token, lp, raw = draw(logits, jax.random.fold_in(rng, t))
      live = ~done & (t < c_len)  # columns past max_new_tokens (a block's rest) stay empty
      token = jnp.where(live, token, self.pad_id)
      return dict(
          c,
          t=t + 1,
          token=token,
          done=done | (live & jnp.isin(token, stop_ids)),
          tokens=col(c["tokens"], token, t),
          mask=col(c["mask"], live, t),
          logprobs=col(c["logprobs"], jnp.where(live, lp, 0.0), t),
          raw_logprobs=col(c["raw_logprobs"], jnp.where(live, raw, 0.0), t),
      )

    # Token 0 comes from the prefill's logits; each loop iteration decodes the previous token
    # and draws the next, so no decode runs after the last token (no per-step lax.cond, and
    # the [N, V] logits never sit in the loop carry).
    def cond(c, end):
      return (c["t"] < end) & ~jnp.all(c["done"])

    def step(c):
      logits, cache, routes = model.decode_routed(c["token"], c["cache"])
      c = dict(c, cache=_constrain_cache(cache))
      if self.record_routes:  # the token decoded is column t - 1's
        new = routes[:, None].astype(routes_dt)
        c["routes"] = jax.lax.dynamic_update_slice(c["routes"], new, (0, c["t"] - 1, 0, 0))
      return record(c, c["t"], logits, c["done"])

    def body(c):  # `block` steps: a loop of known trip count, no stop check between them
      if self.block == 1:
        return step(c)
      return jax.lax.fori_loop(0, self.block, lambda _, c: step(c), c)

    init = dict(
        t=jnp.zeros((), jnp.int32),
        token=jnp.zeros((n,), jnp.int32),
        cache=cache,
        done=jnp.zeros((n,), bool),
        tokens=jnp.full((n, cols), self.pad_id, jnp.int32),
        mask=jnp.zeros((n, cols), jnp.int32),
        logprobs=jnp.zeros((n, cols), jnp.float32),
        raw_logprobs=jnp.zeros((n, cols), jnp.float32),
    )
    if self.record_routes:
      l_moe, k = prompt_routes.shape[2:]
      init["routes"] = jnp.full((n, cols, l_moe, k), -1, routes_dt)
    final = record(init, init["t"], logits, init["done"])
    for i, end in enumerate(self.phase_ends):
      if i:
        final = dict(
            final, cache=_constrain_cache(grow_cache(final["cache"], self._slots(end), rings))
        )
      final = jax.lax.while_loop(functools.partial(cond, end=end), body, final)
    out = {k: final[k][:, :c_len] for k in ("tokens", "mask", "logprobs", "raw_logprobs")}
    routes = None
    if self.record_routes:  # [N, P + C, L_moe, k]: the prompt's (one prefill per group), then
      prompt = jnp.repeat(prompt_routes.astype(routes_dt), g, axis=0)
      routes = jnp.concatenate([prompt, final["routes"][:, :c_len]], axis=1)
    return Rollout(
        **out,
        lengths=out["mask"].sum(-1),
        truncated=~final["done"],
        tool_mask=jnp.zeros_like(out["mask"]),
        routes=routes,
    )


class _InMesh:
  """fn.lower(*args) inside the mesh context the sampler's calls run in."""

  def __init__(self, fn, mesh):
    self.fn, self.mesh = fn, mesh

  def lower(self, *args):
    if self.mesh is None:
      return self.fn.lower(*args)
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*args)


def _constrain_kv(x):
  names = ("batch", "kv_heads", "length", "head_dim")
  return sharding.constrain(x, *(("layers",) if x.ndim == 5 else ()), *names)


def _constrain_cache(cache: dict) -> dict:
  out = dict(
      cache,
      valid=sharding.constrain(cache["valid"], "batch", "length"),
      pos=sharding.constrain(cache["pos"], "batch"),
  )
  for name in ("k", "v", "prefix_k", "prefix_v"):
    if name in cache:
      out[name] = jax.tree.map(_constrain_kv, cache[name])
  if "prefix_valid" in cache:
    out["prefix_valid"] = sharding.constrain(cache["prefix_valid"], "batch", "length")
  return out


def config_options(config) -> dict:
  """The Sampler's decode knobs from config.rollout (the loop's engine, memory_plan)."""
  r = config.rollout
  return dict(
      decode_phases=r.decode_phases,
      decode_block=r.decode_block,
      decode_attention=r.decode_attention,
      step_graphs=r.step_graphs,
  )


def phase_ends(
    max_new_tokens: int, decode_phases: int = 0, platform: str = "cpu"
) -> tuple[int, ...]:
  """The completion lengths at which the decode loops end (the last is max_new_tokens).

  decode_phases 0 = auto (for the XLA decode attention; the Sampler asks for 1 with the ragged
  kernel, GPU's default, which reads the written slots only): on CPU one phase per 32 new
  tokens, at most 4 (compile time grows with them); on GPU one per 128, at most 4 (the XLA
  decode step reads each layer's cache at the HBM rate: 4 phases read 5/8 of it on average;
  measured: benchmarks/README.md, section "Accelerator: the recipe's step on one GPU", item 6
  "Decode phases on GPU"); on TPU 1, since growing the cache holds the old and
  the new buffer at once (at the last growth 1.75x the cache with 4 phases), which a TPU
  memory plan may not afford. Phases never get shorter than 8 tokens."""
  c = max_new_tokens
  if decode_phases < 0:
    raise ValueError(f"decode_phases={decode_phases}: use 0 (auto) or a count >= 1")
  if platform == "cpu":
    auto = max(1, min(4, -(-c // 32)))
  elif platform in ("gpu", "cuda", "rocm"):
    auto = max(1, min(4, c // 128))
  else:
    auto = 1
  n = int(decode_phases) or auto
  n = max(1, min(n, c // 8))
  return tuple(sorted({-(-c * (i + 1) // n) for i in range(n)}))


def block_size(decode_block: int = 0, platform: str = "cpu") -> int:
  """Decode steps run between two checks of the loop's stop condition ("every row stopped").

  On GPU, XLA reads a while loop's condition back to the host every iteration (the loop's trip
  count is data-dependent), and the device idles while the host waits and launches the next
  step's kernels; a block of steps in an inner loop of known trip count runs without that wait
  (at most block - 1 steps decoded after the last row stopped). 0 = auto: 8 on GPU, else 1
  (TPU and CPU run the loop on their own)."""
  if decode_block < 0:
    raise ValueError(f"decode_block={decode_block}: use 0 (auto) or a count >= 1")
  return int(decode_block) or (8 if platform in ("gpu", "cuda", "rocm") else 1)


_SAMPLERS: dict = {}


def sample(
    model,
    prompt_ids,
    prompt_mask,
    *,
    num_generations: int,
    max_new_tokens: int,
    rng,
    generation="greedy",
    eos_ids=(),
    pad_id: int = 0,
    mesh=None,
) -> Rollout:
  """Samples `num_generations` completions per prompt (a stable entry point: docs/design.md).

  prompt_ids / prompt_mask: int32 [B, P], left-padded. Returns a Rollout with rows grouped by
  prompt (prompt i -> rows i*G .. i*G+G-1). Compiled samplers are cached per model graph and
  shapes, so repeated calls with new weights or prompts do not recompile.
  """
  graphdef, state = nnx.split(model)
  key = (
      graphdef,
      prompt_ids.shape[1],
      max_new_tokens,
      num_generations,
      tuple(eos_ids),
      pad_id,
      mesh,
  )
  if key not in _SAMPLERS:
    _SAMPLERS[key] = Sampler(
        graphdef,
        max_prompt_length=prompt_ids.shape[1],
        max_new_tokens=max_new_tokens,
        num_generations=num_generations,
        eos_ids=eos_ids,
        pad_id=pad_id,
        mesh=mesh,
    )
  return _SAMPLERS[key](
      state,
      jnp.asarray(prompt_ids, jnp.int32),
      jnp.asarray(prompt_mask, jnp.int32),
      rng,
      generation,
  )
