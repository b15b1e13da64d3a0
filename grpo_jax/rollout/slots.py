"""The slot engine: generation that does not wait for the longest row.

    engine = SlotEngine(graphdef, slots=16, max_prompt_length=P, max_new_tokens=C,
                        num_generations=G, eos_ids=(eos,), pad_id=pad)
    rollout = engine(params_state, prompt_ids, prompt_mask, rng, "standard")   # on-policy
    # streaming: several steps' prompts in flight, new weights between decode chunks
    engine.set_weights(params_state, version=3)
    engine.enqueue(step, prompt_ids, prompt_mask, key)
    while not engine.finished(step): engine.advance()
    rollout, versions = engine.take(step)

The lockstep sampler (sampler.py) decodes all B x G rows together until the longest has
stopped: on a long-tailed batch most of its decode steps run for rows that are done. Here a
fixed number of decode *slots* each hold one row at its own position; a row that stops frees its
slot, and the next queued group takes it: admitted inside the decode program (the default,
`admit_in_decode`) or by the host between decode chunks (with tool turns).

Admission inside the decode: the host pushes queued groups onto a device queue (up to
slots / G of them, their prompts prefilled there in one batch under the current weights, and
again by `refresh` when new ones land); each decode step first copies the queue's next groups'
keys/values into free slots, G each, as many as fit. No decode call ends to refill slots, and no
slot waits for the host: on CPU, streaming draws 2.8-3.6x the lockstep sampler's tokens per
second instead of 2.3-2.6x (benchmarks/README.md "Slot engine"). A call ends when the rows the
host waits for are done (`watch`: a step's rows, or a count of rows for partial rollouts), when
the device queue ran dry with groups still on the host, or after `chunk` steps. A step's last
rows (at most slots / 4 live, nothing queued) run in the narrow decode: their caches gathered
once per call, each step a decode of slots / 4 rows, written back after.

Device programs (rollout/slot_programs.py, compiled ahead by rollout/slot_ahead.py; static
shapes; one compile per (slots, admission width, prompt width); two admission widths, a
refill's and the whole engine's; with admission inside the decode also push (the device
queue's prefill, at the full prompt width) and the decode admits; decode_narrow: the decode
over slots / 4 of them):
- admit: prefills A prompts once each (`Transformer.prefill_rows`: real tokens first, so slot j
  of a row holds position j), copies each prompt's keys/values into its G rows' slots, and
  leaves each row's last prompt token as its next input (no LM head, no sampling: the first
  decode step feeds it again and draws the row's first token);
- decode: `chunk` steps for every slot at its own position (`Transformer.decode_rows`), each
  drawing one token per live row, writing it, its log-probs and the weight version that drew it
  into the output rows, and stopping a row at a stop token or its budget (`caps`, default C);
- refresh: the live slots' keys/values computed again from their tokens (new weights; it and
  decode_narrow are `LATER`, rollout/slot_ahead.py: compiled behind the first decode, not
  waited for before it);
- take: a step's output rows as a `Rollout` (+ versions [N, C]).
The decode reads the compute-dtype, per-layer copy of the weights (cache.sampling_copy) made
once per weight version by `set_weights`; with `scan_layers=True` the same weights kept stacked
(cache.stacked_sampling_copy) and caches stacked [L, slots, Hkv, S, K], which every program runs
as one `lax.scan` over the layers (the decode carries the caches and scatters each layer's
token into them in place: no cache copy per step). What a step copies, read in the compiled
HLO (benchmarks/slot_compile.py --dump_hlo, Qwen3-0.6B recipe shapes, 64 slots;
tests/plan/test_compiled_programs.py): on GPU and TPU nothing of the layers' weights or
caches: the ragged kernel reads its layer's slots of the stacked caches in place
(decode_attention.ragged with `layer`; on TPU `ragged_tpu`), and each matmul its layer's
weights where they lie in the stacks (TPU: the slice fused into the matmul; GPU: cuBLAS at an
address offset from the loop index, XLA's dynamic-slice fusion, slot_programs.
SCANNED_GPU_OPTIONS; before, 0.88 GB of async weight copies a step). XLA's attention (CPU)
reads each layer's cache sliced out of the stack, a copy of the whole layer cache (2 x 168 MB
per layer, 9.4 GB a step at those shapes): on CPU the scanned decode steps 1.47x slower, and
the scan only halves a 28-layer decode's compile. So scan_layers "auto" (the config's default)
scans on GPU and TPU and runs a program per layer on CPU; for an H100 (deviceless) the scanned
programs compile in about half the per-layer ones' time (benchmarks/README.md "Slot engine";
no accelerator runtime measured).

KV layout (benchmarks/README.md "Slot engine"): per-slot contiguous caches [slots, Hkv, P + C, K]
per layer (P + C rounded up to the ragged kernel's block on GPU). A prompt is prefilled once
per group; its keys are copied into each of its G slots (P x G slots, not P: the price of
per-row refill, and what multi-turn rows need, whose contexts diverge after the prompt). The
XLA attention reads a phase's first P + e slots of every row's cache while every live row is
short enough (`decode_phases`, as the lockstep sampler's; copied out once per phase), else
every slot (masked past each row's position); on GPU and TPU (decode_attention "auto") one
kernel per layer reads each row's written slots only (decode_attention.ragged, Triton's, with
per-row lengths; on TPU ragged_tpu, Mosaic's, P + C rounded up to its 128-slot blocks, the
caches then kept slot-major [slots, S, Hkv, K], as XLA:TPU lays out a cache written one slot
per row: no relayout per step, per call or per admission; benchmarks/README.md "Slot engine").
Sliding-window layers keep full caches here (no rings) and the XLA attention.

Randomness: row r of a step with key `rng` draws its token at completion column t from
fold_in(fold_in(rng, r), t): a row's tokens depend on its own key only, never on which slot it
got or when it was admitted (the lockstep sampler's draws depend on the row's place in the
batch instead: same distributions, different draws; tests/rollout/test_slots.py).

Multi-host: every process holds all prompts (the scheduler's decisions read replicated arrays
only), so every process makes the same decisions and dispatches the same programs; a process
without devices in the engine's mesh (disaggregated placement) schedules nothing.
tests/parallel/test_multihost.py: 2 processes == 1, colocated and disaggregated streaming.
"""

import collections
import dataclasses
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models.decoder import decode_attention as decode_attention_lib
from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding
from grpo_jax.rollout.sampler import phase_ends
from grpo_jax.rollout.slot_ahead import SlotAhead
from grpo_jax.rollout.slot_programs import _host
from grpo_jax.rollout.types import generation_config

# Live slots at or below 1/NARROW_DIV of them, nothing queued: the narrow decode runs them.
NARROW_DIV = 4
# A decode chunk ends early, groups queued, once this share of the slots is free (whole groups).
REFILL_DIV = 8


def scan_layers_option(config) -> bool | str:
  """config.rollout.slot_scan_layers -> SlotEngine's scan_layers (None: "auto")."""
  value = config.rollout.slot_scan_layers
  return "auto" if value is None else bool(value)


def admits_in_decode(admission: str, with_turns: bool) -> bool:
  """rollout.slot_admission -> SlotEngine's admit_in_decode: "decode", or "auto" without tool
  turns (a row paused on a tool call keeps its slot, which only the host knows)."""
  return admission == "decode" or (admission == "auto" and not with_turns)


@dataclasses.dataclass
class _Group:
  """A queued prompt: its host ids/mask [W], the step key, its G output rows and budgets."""

  tag: int
  ids: np.ndarray
  mask: np.ndarray
  key: jax.Array
  rows: np.ndarray  # [G] output row ids
  index: np.ndarray  # [G] the rows' index within their step (their rng fold)
  caps: np.ndarray  # [G] completion budgets


class SlotEngine(SlotAhead):
  """Generation in decode slots with per-row positions and refill (see the module docstring)."""

  def __init__(
      self,
      graphdef,
      *,
      slots: int,
      max_prompt_length: int,
      max_new_tokens: int,
      num_generations: int = 1,
      eos_ids=(),
      pad_id: int = 0,
      mesh=None,
      chunk: int = 64,
      steps_in_flight: int = 1,
      decode_attention: str | None = None,
      scan_layers: bool | str | None = False,
      turns=None,
      max_append: int = 0,
      reprefill_turns: bool = False,
      compile_threads: int = 0,
      admit_in_decode: bool = False,
      decode_phases: int = 0,
      step_graphs: bool = False,
  ):
    """scan_layers: the decode (and prefills) as one `lax.scan` over stacked layers and caches
    [L, slots, Hkv, S, K] (compile time flat in depth) instead of a program per layer; None: as
    the policy's model.scan_layers; "auto" (the config's default): scanned where a ragged
    kernel reads the stacked caches (GPU, TPU; their scanned decodes copy nothing per step in
    the compiled HLO, and compile in about half the time), per layer on CPU (XLA's attention:
    the scan copies each layer's cache out of the stack every step, 1.47x the step time) and
    for a model whose layers the kernel does not all read (sliding windows, soft-capping:
    decode_attention.reads_every_layer; known at `set_weights`). Default False.

    turns: multi-turn rows (rollout/turns.py's ToolTurns, or any object with its methods): a
    row that stops is offered to `turns.stopped`; if it takes the row (a tool call is running),
    the row keeps its slot, paused, until `turns.ready` hands back the tokens to append (at
    most `max_append`), which are fed into the row's live cache (only they are prefilled) with
    tool_mask 1; the row then goes on drawing. reprefill_turns: instead, every slot's whole
    history is prefilled again after each append, as engines without a live cache do (the
    baseline of benchmarks/tool_turns.py).

    compile_threads: before the first admission at a prompt width, the programs a step runs
    there (the admission's width and a refill's when one is coming, the decode, the take; the
    refresh with steps in flight, the extend with turns) are lowered on the call's own shapes
    and shardings and compiled by this many threads at once (XLA compiles with the GIL
    released; jit's caches then serve the calls), so the first step waits for the slowest
    program, not their sum, and not for the programs its first decode does not call (LATER:
    the refresh, the narrow decode), which compile behind it; 0: one per core this process
    may run on, 1: one after the other.

    admit_in_decode: groups wait in a queue on the device (up to slots / G of them, pushed
    by the host before each decode call) and the decode admits the next one, at the full
    prompt width, as soon as G slots are free, inside its loop: no host round trip per
    admission and no slot idle until the next call (a call ends once its watched rows are
    done, or the device queue runs dry while the host holds more); each step admits as many
    queued groups as there are free slots for. No admit program then: the push's prefill is
    the only one. Not with turns (a paused row's slot is the host's to keep).

    step_graphs (GPU): each decode step one CUDA graph, its layers and admission included
    (slot_programs.STEP_GRAPH_OPTIONS; else a graph per layer and a host read of the
    admission's predicate per step). Opt-in until measured on a GPU.

    decode_phases: the decode attends to the caches' first P + e slots while every live row's
    next slot is below that, for the phase ends e of the lockstep sampler's
    `rollout.decode_phases` (sampler.phase_ends: 0 = auto, on CPU one per 32 new tokens, at
    most 4; on TPU 1); 1 with a ragged kernel (it reads each row's written slots only). A
    decode call that starts with its rows short reads a part of the caches, as the lockstep
    sampler's phases do (on a uniform batch on CPU 0.91-0.96x the lockstep sampler ->
    0.99-1.06x: benchmarks/README.md "Slot engine")."""
    g = num_generations
    if slots < g:
      raise ValueError(f"rollout.slots={slots}: needs at least num_generations={g} slots")
    if mesh is not None and slots % sharding.data_parallel_size(mesh):
      dp = sharding.data_parallel_size(mesh)
      raise ValueError(
          f"rollout.slots={slots} does not divide over the sampler's data-parallel mesh size "
          f"{dp}: use a multiple of {dp}, e.g. {-(-slots // dp) * dp}"
      )
    self.graphdef = graphdef
    self.num_slots, self.g = int(slots), int(g)
    self.max_prompt_length, self.c = int(max_prompt_length), int(max_new_tokens)
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.pad_id = int(pad_id)
    self.mesh = mesh
    self.chunk = max(1, int(chunk))
    # Free slots that end a decode chunk when groups are queued: whole groups, about 1/8 of the
    # slots, so admissions come in batches (one prefill each) yet slots idle little.
    self.refill = self.g * max(1, self.num_slots // (REFILL_DIV * self.g))
    self.ring = max(1, int(steps_in_flight))
    self.platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    # A process without devices in the mesh (placement=disaggregated: the trainer's processes
    # for the sampler's engine, and the other way round) schedules nothing: the programs it
    # calls run nowhere on it, and it cannot read the slots' status.
    me = jax.process_index()
    self.local = mesh is None or any(d.process_index == me for d in mesh.devices.flat)
    # The decode attention: on GPU and TPU by default one kernel over each row's written slots
    # only (decode_attention.ragged / ragged_tpu, per-row lengths); else (CPU) the XLA
    # attention over every slot (a phase's).
    self.ragged, self.ragged_tpu = decode_attention_lib.choose_slots(
        decode_attention, self.platform
    )
    # "auto": scanned where a kernel reads a stacked layer's caches in place (GPU, TPU), unless
    # the model has layers it does not read (`_model_known`: XLA's attention would copy their
    # caches out of the stacks every step).
    self._scan_auto = scan_layers == "auto"
    scanned = self.ragged_tpu or (self.ragged and self.platform == "gpu")
    self.scan_layers = scanned if self._scan_auto else scan_layers
    s = self.max_prompt_length + self.c
    block = decode_attention_lib.TPU_BLOCK if self.ragged_tpu else decode_attention_lib.BLOCK
    self.cache_len = -(-s // block) * block if self.ragged else s  # the kernel reads blocks
    ends = phase_ends(self.c, 1 if self.ragged else int(decode_phases), self.platform)
    self.decode_widths = tuple(self.max_prompt_length + e for e in ends[:-1]) + (self.cache_len,)
    self.step_graphs = bool(step_graphs)
    self._programs = {}
    self._copy_graphdef = None
    self._model_cfg = None
    self._weights = None
    self._version = None
    self._state = None
    self._rows_per_tag = None
    self._queue = collections.deque()
    self._tags = {}  # tag -> its first output row (a step of rows_per_step rows)
    self._slot_row = np.full(self.num_slots, -1, np.int64)  # host view: the row in each slot
    self._open_rows = collections.Counter()  # tag -> rows not finished
    # Whole groups (tag, index in the step): rows not finished, untaken ones per tag, and the
    # decode chunk each finished one ended in (partial rollouts take groups as they finish).
    self._open_group = collections.Counter()
    self._untaken = {}  # tag -> set of its groups not taken
    self._done = {}  # (tag, group) -> the chunk count when its last row stopped
    self._chunks = 0
    self._gen = None
    # Multi-turn rows (turns): slots paused on a tool call; where each slot's turn began.
    self.turns = turns
    self.max_append = int(max_append)
    self.reprefill_turns = bool(reprefill_turns)
    if turns is not None and self.max_append < 1:
      raise ValueError("a slot engine with turns needs max_append >= 1 (tool response tokens)")
    self._paused = set()
    self._turn_col = np.zeros(self.num_slots, np.int64)
    self._live = np.zeros(self.num_slots, bool)  # host view after the last program
    self.compile_threads = int(compile_threads) or len(os.sched_getaffinity(0))
    self._compiled = set()  # the programs compiled ahead (`_compile_ahead`'s keys)
    self._pool = None  # their compile threads
    self._later = {}  # name -> the compile of a LATER program not waited for yet
    if admit_in_decode and turns is not None:
      raise ValueError("admit_in_decode does not take turns (paused rows keep their slots)")
    self.admit_in_decode = bool(admit_in_decode)
    # The device queue's groups (their prompts' keys/values, prefilled at push): 1 unused.
    self.queue_len = max(1, self.num_slots // self.g) if self.admit_in_decode else 1
    # A step's last rows (at most `narrow` live, nothing queued) decode in a narrow program, on
    # CPU: its decode step costs about its rows' FLOPs (a quarter of the slots: 1.3x on-policy
    # tok/s, benchmarks/README.md "Slot engine"). Not on accelerators, where a step of a few
    # rows reads the same weights as a step of many (the ragged kernel reads only written
    # slots), so a program more to compile would buy little.
    narrow = self.num_slots // NARROW_DIV
    dp = 1 if mesh is None else sharding.data_parallel_size(mesh)
    cpu = self.platform == "cpu"
    self.narrow = narrow if cpu and narrow >= 1 and narrow % dp == 0 and turns is None else 0
    self._on_device = collections.deque()  # groups pushed to the device queue, not admitted
    self._admitted = set()  # (admit_in_decode) rows in slots, as of the last call

  def _model_known(self, model_cfg):
    """The policy's ModelConfig, once (before any program is built): scan_layers None takes
    the model's; "auto" runs a program per layer for a model whose layers the decode kernel
    does not all read (soft-capping, sliding windows: decode_attention.reads_every_layer)."""
    self._model_cfg = model_cfg
    if self.scan_layers is None:
      self.scan_layers = bool(model_cfg.scan_layers)
    if self._scan_auto and self.scan_layers:
      interpret = self.platform not in ("gpu", "tpu")
      every = decode_attention_lib.reads_every_layer(model_cfg, self.ragged_tpu, interpret)
      self.scan_layers = every

  # ------------------------------------------------------------------------- on-policy

  def __call__(self, state, prompt_ids, prompt_mask, rng, generation="greedy", caps=None):
    """All rows of one prompt batch (global arrays [B, W]) from the weights `state`: the
    on-policy rollout, in the layout the lockstep sampler returns. caps: optional per-row
    completion budgets [B*G] (<= max_new_tokens)."""
    self.reset(generation, rows_per_step=prompt_ids.shape[0] * self.g)
    self.set_weights(state, version=0)
    self.enqueue(0, prompt_ids, prompt_mask, rng, caps=caps)
    while not self.finished(0):
      self.advance()
    return self.take(0)[0]

  # ------------------------------------------------------------------------- streaming

  def reset(self, generation, *, rows_per_step: int):
    """Empties the engine for a generation config and a step size (rows per step)."""
    self._gen = generation_config(generation)
    self._rows_per_tag = int(rows_per_step)
    self._queue.clear()
    self._on_device.clear()
    self._device_head = 0
    self._admitted.clear()
    self._tags.clear()
    self._open_rows.clear()
    self._open_group.clear()
    self._untaken.clear()
    self._done.clear()
    self._chunks = 0
    self._slot_row[:] = -1
    self._state = None
    self._paused.clear()
    self._live[:] = False
    if self.turns is not None:
      self.turns.reset()

  def set_weights(self, state, version: int):
    """New weights for every decode from now on; the compute-dtype copy is made once here. Rows
    in flight continue under them: their keys/values are computed again from their tokens so
    far (one prefill of the live slots), so each later token's log-prob is exactly the new
    version's given the row's context (no keys of the old weights stay in a cache)."""
    if self._model_cfg is None:
      self._model_known(nnx.merge(self.graphdef, state).cfg)
    self._init_ahead()  # (compiles beside the copy's compile)
    self._weights = self._program("copy")(state)
    self._version = self._replicated(np.int32(version))
    held = np.any(self._slot_row >= 0) or self._on_device  # (queued: prefilled at push)
    if self.local and self._state is not None and held:
      self._state = self._program("refresh")(self._state, self._weights)

  def enqueue(self, tag: int, prompt_ids, prompt_mask, key, caps=None):
    """Queues the B prompts (arrays [B, W], left-padded; global or host) of step `tag`, G rows
    each, drawn with `key` (row r: fold_in(key, r))."""
    self._untaken[tag] = set(range(self._rows_per_tag // self.g))
    if not self.local:
      self._tags[tag] = tag % self.ring * self._rows_per_tag
      self._open_rows[tag] = 0
      return
    ids, mask = self._whole(prompt_ids), self._whole(prompt_mask)
    b = ids.shape[0]
    n = b * self.g
    if n != self._rows_per_tag:
      raise ValueError(f"{b} prompts x {self.g} = {n} rows; this engine takes {self._rows_per_tag}")
    if ids.shape[1] > self.max_prompt_length:
      raise ValueError(f"prompts of {ids.shape[1]} columns > max_prompt_length")
    live_tags = {t for t in self._tags}
    slot = tag % self.ring
    if any(t % self.ring == slot for t in live_tags):
      raise ValueError(f"step {tag}: more than {self.ring} steps in flight (steps_in_flight)")
    caps = np.full(n, self.c, np.int64) if caps is None else np.minimum(self._whole(caps), self.c)
    base = slot * n
    self._tags[tag] = base
    self._open_rows[tag] = n
    for i in range(b):
      rows = np.arange(i * self.g, (i + 1) * self.g)
      self._open_group[tag, i] = self.g
      self._queue.append(_Group(tag, ids[i], mask[i], key, base + rows, rows, caps[rows]))

  def advance(self, *, tag: int | None = None, rows: int | None = None):
    """Admits queued groups into free slots, then runs one decode chunk. With
    admit_in_decode the chunk runs until step `tag`'s rows are done (default: the oldest step
    with open rows), or with `rows` until that many more rows of any step stopped, or until
    the device queue ran dry with groups still on the host (or `chunk` steps)."""
    if not self.local:
      return
    if self._state is None:
      self._state = self._program("init")()
    if self.admit_in_decode:
      return self._advance_inside(tag, rows)
    self._admit_ready()
    if self._paused:  # tool responses that came back: appended, their rows live again
      self._extend_ready()
    # The chunk ends early once enough slots are free to admit queued groups (multi-turn: once
    # that many more rows stopped, beyond those paused on tool calls: new calls to start).
    if self._queue or self._paused:
      refill = min(self.refill + len(self._paused), self.num_slots + 1)
    else:
      refill = self.num_slots + 1
    self._state = self._program(self._decode_name())(
        self._state,
        self._weights,
        self._version,
        self._replicated(np.int32(refill)),
        self._replicated(np.zeros(3, np.int32)),
        *self._scalars(),
    )
    self._live = np.array(_host(self._state["live"]))
    self._chunks += 1
    stopped = np.nonzero((self._slot_row >= 0) & ~self._live)[0]
    stopped = [s for s in stopped if s not in self._paused]
    if self.turns is not None and stopped:
      stopped = self._offer_turns(stopped)
    for s in stopped:
      self._free(s)

  def _advance_inside(self, tag, rows):
    """advance() with admission inside the decode (see __init__'s admit_in_decode)."""
    self._push_ready()
    n_rows = self.ring * self._rows_per_tag
    if rows is not None:
      watch = (0, n_rows, max(1, int(rows)))
    else:
      if tag is None or not self._open_rows[tag]:
        open_tags = [t for t in self._tags if self._open_rows[t] > 0]
        tag = min(open_tags) if open_tags else None
      lo = self._tags[tag] if tag is not None else 0
      watch = (lo, lo + self._rows_per_tag, self._open_rows[tag] if tag is not None else 0)
    refill = self.refill if self._queue else self.num_slots + 1
    self._state = self._program(self._decode_name())(
        self._state,
        self._weights,
        self._version,
        self._replicated(np.int32(refill)),
        self._replicated(np.asarray(watch, np.int32)),
        *self._scalars(),
    )
    self._chunks += 1
    live, row, head, done = (_host(self._state[k]) for k in ("live", "row", "q_head", "out_done"))
    self._live = np.array(live)
    for _ in range(int(head) - self._device_head):
      self._admitted.update(int(r) for r in self._on_device.popleft().rows)
      self._device_head += 1
    for r in sorted(r for r in self._admitted if done[r]):
      self._admitted.discard(r)
      self._finish(r)
    self._slot_row = np.where(self._live, row, -1).astype(np.int64)

  def _decode_name(self) -> str:
    """The decode over every slot, or the narrow one when few are live and none queued."""
    live = int(np.sum(self._slot_row >= 0))
    queued = self._queue or self._on_device or self._paused
    return "decode_narrow" if not queued and 0 < live <= self.narrow else "decode"

  def _push_ready(self):
    """Host-queued groups onto the device queue, as many as it has room for, once it is at
    most half full (each push prefills the queue's width of prompts, valid or not)."""
    if len(self._on_device) * 2 > self.queue_len:
      return
    room = self.queue_len - len(self._on_device)
    groups = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
    if not groups:
      return
    q, p, g = self.queue_len, self.max_prompt_length, self.g
    self._compile_ahead(p, (), groups[0].key)
    ids = np.full((q, p), self.pad_id, np.int32)
    mask = np.zeros((q, p), np.int32)
    rows, index = np.zeros((q, g), np.int32), np.zeros((q, g), np.int32)
    caps = np.ones((q, g), np.int32)
    for j, grp in enumerate(groups):
      width = grp.ids.shape[0]
      ids[j, p - width :], mask[j, p - width :] = grp.ids, grp.mask
      rows[j], index[j], caps[j] = grp.rows, grp.index, grp.caps
    keys = jnp.stack([grp.key for grp in groups] + [groups[0].key] * (q - len(groups)))
    args = [self._replicated(x) for x in (ids, mask, rows, index, caps)]
    count = self._replicated(np.int32(len(groups)))
    self._state = self._program("push")(self._state, self._weights, *args, keys, count)
    self._on_device.extend(groups)

  def _free(self, s):
    self._finish(self._slot_row[s])
    self._slot_row[s] = -1

  def _finish(self, row):
    """Row `row` stopped for good: its step's and group's counts."""
    tag = self._tag_of(row)
    self._open_rows[tag] -= 1
    group = (tag, int(row - self._tags[tag]) // self.g)
    self._open_group[group] -= 1
    if not self._open_group[group]:
      del self._open_group[group]
      self._done[group] = self._chunks
    if self.turns is not None:
      self.turns.finish(int(row))

  def _offer_turns(self, slots) -> list:
    """Stopped rows -> the ones that are done; the others (a tool call running) stay paused."""
    rows = np.full(self.num_slots, self.ring * self._rows_per_tag, np.int32)
    rows[: len(slots)] = self._slot_row[slots]
    tokens, length, stop = (
        _host(x) for x in self._program("peek")(self._state, self._replicated(rows))
    )
    done = []
    for i, s in enumerate(slots):
      row = int(self._slot_row[s])
      turn = tokens[i, self._turn_col[s] : length[i]]
      if stop[i] and self.turns.stopped(row, turn):
        self._paused.add(s)
      else:
        done.append(s)
    return done

  def _extend_ready(self):
    """Appends the tool responses that are back to their paused rows (blocking for one when no
    slot is live: nothing else to run meanwhile)."""
    block = not self._live.any()
    ready = self._agree(self.turns.ready(block=block))
    if not ready:
      return
    by_row = {int(self._slot_row[s]): s for s in self._paused}
    n_slots, r = self.num_slots, self.max_append
    col, cap = _host(self._state["col"]), _host(self._state["cap"])
    slot_ids = np.full(n_slots, n_slots, np.int32)
    tokens = np.full((n_slots, r), self.pad_id, np.int32)
    counts = np.zeros(n_slots, np.int32)
    go = np.zeros(n_slots, bool)
    ready = {row: ids for row, ids in ready.items() if row in by_row}
    for i, (row, ids) in enumerate(sorted(ready.items())):
      s = by_row[row]
      ids = np.asarray(ids, np.int32)[:r]
      # The response and at least one more drawn token must fit the row's budget; else the
      # row ends here, truncated (the call was not answered).
      slot_ids[i], counts[i], go[i] = s, len(ids), col[s] + len(ids) < cap[s]
      tokens[i, : len(ids)] = ids
      self._paused.discard(s)
    args = [self._replicated(x) for x in (slot_ids, tokens, counts, go)]
    self._state = self._program("extend")(
        self._state, self._weights, *args, self._version, *self._scalars()
    )
    self._live = np.array(_host(self._state["live"]))
    col = _host(self._state["col"])
    for i in range(len(ready)):
      s = int(slot_ids[i])
      if go[i]:
        self._turn_col[s] = col[s] - 1  # the new turn starts at its first drawn token
      if not self._live[s]:  # stopped at once (its first token) or ended: offered next chunk
        if not go[i]:
          self._free(s)

  def finished(self, tag: int) -> bool:
    queued = (*self._queue, *self._on_device)
    return self._open_rows[tag] == 0 and not any(g.tag == tag for g in queued)

  def take(self, tag: int):
    """A finished step's rows -> (Rollout, versions int32 [N, C]: the weight version that drew
    each token, 0 where masked); its output rows are free for a later step."""
    return self.take_groups([(tag, i) for i in range(self._rows_per_tag // self.g)])

  def finished_groups(self) -> list[tuple[int, int]]:
    """The groups (tag, index in its step) whose G rows have all stopped, not yet taken, in
    the order they finished: by decode chunk, then oldest enqueued first (tag, index). The
    same on every process that schedules (the slots' status is replicated); [] on one that
    does not."""
    return sorted(self._done, key=lambda grp: (self._done[grp], grp))

  def untaken(self) -> dict[int, set]:
    """tag -> the indices of its groups not taken yet (finished or not), every tag in flight."""
    return {tag: set(groups) for tag, groups in self._untaken.items()}

  def take_groups(self, groups) -> tuple:
    """Finished groups [(tag, index)] -> their rows, G per group in that order, as (Rollout,
    versions int32 [len*G, C]); a step's output rows are free for a later step once all its
    groups are taken."""
    rows = []
    for tag, i in groups:
      rows.append(self._tags[tag] + i * self.g + np.arange(self.g))
      self._done.pop((tag, i), None)
      self._untaken[tag].remove(i)
    for tag in {tag for tag, _ in groups}:
      if not self._untaken[tag]:
        del self._untaken[tag], self._tags[tag], self._open_rows[tag]
    if self._state is None:  # (a process that schedules nothing)
      self._state = self._program("init")()
    rows = self._replicated(np.concatenate(rows).astype(np.int32))
    return self._program("take")(self._state, rows)

  def running(self) -> bool:
    """Whether a decode chunk can make progress: groups queued or rows in slots."""
    queued = self._queue or self._on_device
    return bool(queued) or bool(np.any(self._slot_row >= 0))

  def stats(self) -> dict:
    """Decode steps run since `reset` and the slots' busy fraction over them (live slots /
    slots, per step)."""
    if not self.local:
      return {}  # (the slots' status lives on other processes)
    if self._state is None:
      return dict(steps=0, live_steps=0, busy=0.0)
    steps, live = (int(_host(self._state[k])) for k in ("steps", "live_steps"))
    return dict(steps=steps, live_steps=live, busy=live / max(1, steps * self.num_slots))

  def pending(self) -> int:
    """Groups queued, not yet admitted."""
    return len(self._queue) + len(self._on_device)

  def _agree(self, ready: dict) -> dict:
    """The tool responses every process appends now: the engine's first process's (it runs
    the tools; which calls are back is a matter of timing), sent to the others, so every
    process dispatches the same programs. One process: as they are."""
    if self.mesh is None or not multihost.spans_processes(self.mesh):
      return ready
    n, r = self.num_slots, self.max_append
    table = np.full((n, r + 2), -1, np.int32)  # row, count, tokens
    for i, (row, ids) in enumerate(sorted(ready.items())):
      ids = list(ids)[:r]
      table[i, 0], table[i, 1], table[i, 2 : 2 + len(ids)] = row, len(ids), ids
    table = multihost.from_first_process(table, self.mesh)
    return {int(t[0]): t[2 : 2 + t[1]].tolist() for t in table if t[0] >= 0}

  # ------------------------------------------------------------------------- host side

  def _tag_of(self, row: int) -> int:
    base = row // self._rows_per_tag * self._rows_per_tag
    return next(t for t, b in self._tags.items() if b == base)

  def _admit_ready(self):
    free = list(np.nonzero(self._slot_row < 0)[0])
    groups = []
    while self._queue and len(free) >= self.g * (len(groups) + 1):
      groups.append(self._queue.popleft())
    if not groups:
      return
    # Two admission widths, so two compiles per prompt width (an admit program costs about a
    # decode program's compile; benchmarks/slot_compile.py): a refill's and a whole engine's.
    small = self.refill // self.g
    a = small if len(groups) <= small else self.num_slots // self.g
    w = max(grp.ids.shape[0] for grp in groups)
    # compiled ahead: this admission's width, and a refill's when one is coming (groups still
    # queued, or later steps' in flight)
    widths = {a} | ({small} if self._queue or self.ring > 1 else set())
    self._compile_ahead(w, widths, groups[0].key)
    ids = np.full((a, w), self.pad_id, np.int32)
    mask = np.zeros((a, w), np.int32)
    n = a * self.g
    slot_ids = np.full(n, self.num_slots, np.int32)  # out of range: dropped
    row_ids = np.full(n, self.ring * self._rows_per_tag, np.int32)
    index = np.zeros(n, np.int32)
    caps = np.ones(n, np.int32)
    keys = []
    for j, grp in enumerate(groups):
      width = grp.ids.shape[0]
      ids[j, w - width :], mask[j, w - width :] = grp.ids, grp.mask
      sl = slice(j * self.g, (j + 1) * self.g)
      slot_ids[sl] = free[sl]
      row_ids[sl], index[sl], caps[sl] = grp.rows, grp.index, grp.caps
      self._slot_row[free[sl]] = grp.rows
      self._turn_col[free[sl]] = 0
      self._live[free[sl]] = True
      keys.append(grp.key)
    keys += [groups[0].key] * (a - len(groups))
    args = [self._replicated(x) for x in (ids, mask, slot_ids, row_ids, index, caps)]
    self._state = self._program("admit", a, w)(self._state, self._weights, *args, jnp.stack(keys))

  def _scalars(self):
    return (
        self._replicated(np.float32(self._gen.temperature)),
        self._replicated(np.float32(self._gen.top_p)),
    )

  def _whole(self, x) -> np.ndarray:
    """Every row of a (global, possibly row-sharded over processes) array, on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      everywhere = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      x = jax.jit(lambda a: a, out_shardings=everywhere)(x)
    return _host(x)

  def _replicated(self, x):
    return jnp.asarray(x) if self.mesh is None else multihost.replicated(np.asarray(x), self.mesh)
