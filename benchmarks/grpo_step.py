r"""One GRPO step, phase by phase: the loop's own jitted functions on named workloads, and Tunix.

    python benchmarks/grpo_step.py                      # tiny, small, tunix (+ Tunix side by side)
    python benchmarks/grpo_step.py --quick              # tiny only, 2 repeats; seconds (the test)
    python benchmarks/grpo_step.py --workloads=small --remat=none,full --micro_batch=0,8
    python benchmarks/grpo_step.py --workloads=tunix --tunix_python=/path/to/tunixvenv/bin/python
    python benchmarks/grpo_step.py --quick --trace=/tmp/trace   # Perfetto trace, phase names
    python benchmarks/grpo_step.py --workloads=tunix_gpu --tunix_python=python3 \
        --tunix_path=/tmp/tunixsite          # Tunix at Qwen3-0.6B's shape (a GPU; see below)

The step is train.py's steps 1-7 chained from the same pieces the loop builds (nothing copied):
`prompts.prompt_data` + `data.make_prompt_iterator` (prompts), `rollout.make_engine` (rollout,
with the host copy of the completions), `rewards.build_reward_computer` (rewards on the host),
`rl.step.build(config, policy, mesh)` -> assemble (advantages), logprobs (old: only when the
loop needs them; reference: beta > 0, a full copy) and update (one per num_iterations), then
the loop's device-side `metrics.rollout_stats` ("log"). Each phase is timed to its end
(`block_until_ready` on its output), so the phases add up to the step; a bare loop step
overlaps a little host work with device work that this waits out. Workloads:

  tiny   configs/tiny.py as it is: 0.4M-parameter Qwen3-style model, vocab 96, 32 prompts x
         G=8, prompt 6 + completion 7 tokens, beta 0, answer_match + answer_format rewards
  small  rollout.py's "small" model (8 layers, d512, 8/4 heads of 64, MLP 1536, vocab 32000,
         tied): 8 prompts x G=4, prompt 16 + completion 64 tokens, beta 0.04, micro-batches
         of 8 rows
  tunix  Tunix's workload: random-init Qwen3 (vocab 128, d256, 2 layers, 8 q / 4 kv heads of
         32, MLP 768, tied, rope_theta 1e6), 8 prompts "a+b=" x G=4, prompt 16 (left-padded)
         + 32 new tokens, temperature 1, beta 0.04 (full reference copy), epsilon 0.2, one
         update per step, AdamW lr 1e-5 with global-norm clip 1.0, reward 1 when the
         completion starts with the sum; one CPU device. Ours accumulates the one update
         over micro-batches of 8 rows (same gradients; cache-sized on CPU)
  tunix_gpu  the tunix workload at Qwen3-0.6B's shape (PRESETS["qwen3-0.6b"]: vocab 151936,
         d1024, 28 layers, 16 q / 8 kv heads of 128, MLP 3072, tied, qk-norm), random init,
         bf16 compute over float32 parameters on both sides, 8 prompts x G=4, prompt 128
         columns (left-padded, data.prompt_width "max", as Tunix pads) + 256 new tokens (no
         stop in effect: a random-init model draws the one EOS id of 151936 about once in
         150k tokens), one update over all 32 rows (Tunix's), same reward and optimizer.
         On CPU its code path runs in a minute with a small shape through --set, e.g.
         --set=model.vocab_size=2048,model.hidden_size=128,model.num_layers=2,\
model.intermediate_size=256,model.num_heads=4,model.num_kv_heads=2,model.head_dim=32,\
max_prompt_length=32,max_completion_length=16

The first step (compilation included) is reported apart from the steady state (the median
of the --repeats steps after it). "compile" is what JAX itself reports for the first step on
the main thread (jax.monitoring: tracing + lowering + XLA compilation, per phase in the JSON);
with config.compile_ahead (the default; --no_compile_ahead turns it off) the update, log-prob
and advantage programs (and the sampler's, if the worker gets to it before the rollout asks
for it) compile on a worker thread during the rollout instead, their seconds
in the JSON's compile_ahead_sec (overlapping the phases, so not part of "compile"); the JSON
also has first - steady. The rollout is one jitted program (prefill + while_loop decode), so its
prefill and decode cannot be timed apart inside the step: "prefill~" is the same sampler
built for 1 new token on the same prompts (rollout.py's method), "decode~" = rollout -
prefill~.

MFU of the update = model FLOPs of one update / update time / peak, where peak is a
2048^3 float32 matmul (1024^3 with --quick) timed in this process, best of repeats, before
and after the runs (the better of the two).
Model FLOPs of one update over N rows of S = P + C tokens (the update's forward runs the whole
row; only the C completion positions go through the LM head):

    6 * N_nonembed * N*S          matmul weights, forward + backward (2 + 4 FLOPs per weight)
  + 6 * D * V * N*C               the LM head (tied embedding: counted here, not in N_nonembed)
  + 12 * L * H * K * S * N*S      attention scores q.k and p.v, fwd + bwd, every query over all
                                  S keys (PaLM's convention: the causal mask is not halved)

with N_nonembed = L * (D*(H + 2*G_kv)*K + H*K*D + 3*D*F) (q, k, v, o, gate/up/down; norms and
the embedding gather are free). Recomputation under remat is not counted (MFU, not HFU).
A log-prob pass (old / reference: forward only) is a third of that: 2 FLOPs per weight per
token, 2 * D * V per completion token, 4 * L * H * K * S per token of attention; "lp MFU" is
the reference pass's (the old pass, when the workload has one, is the same program).

Sweeps (--remat, --micro_batch, --generations; comma lists, every combination) build one
step per combination and take their steady steps in turn, so the rows of a sweep are measured
under the same load. --trace writes one trace per workload (DIR/<workload>, the steady steps
only; with a sweep, its combinations' steps alternate in it), named as the loop names its
steps and phases (grpo_jax.run.profiling), for benchmarks/trace_analysis.py.

Tunix side by side (workload tunix): benchmarks/tunix_step.py runs Tunix's own GRPOLearner in
a subprocess (Tunix needs its own environment: see that file), fed the same prompts and
vocabulary; the two sides take turns step by step (ours, Tunix, ours, ...) so machine load
hits both alike. Speedup = Tunix steady step / ours (> 1: ours is faster), from the medians,
from the best steps, and paired (median over i of Tunix's step i / our step i); steps/s
ours/Tunix (the same ratio) and rollout tok/s ours/Tunix (Tunix: completion tokens its rollout
returned / the wall time of its RLCluster.generate). --tunix_path (or $TUNIX_PATH) goes in
front of the Tunix process's PYTHONPATH, so one python3 serves both sides: ours on .whl/,
Tunix on .whl_tunix/ (benchmarks/accelerator_wheels.sh fills both). Both run on the same
device; on a GPU each process takes at most XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 of its memory
unless that is set.

Memory of tunix_gpu: Tunix's side alone, at 2 of the 28 layers, passed 23 GB of resident
memory on this VM's CPU (killed in its first step, 2026-11-27): the vocabulary dominates
(32 rows x 384 x 151936 logits are 7.5 GB in float32). On a GPU each process gets 0.45 of it:
about 63 GB on an H200, 36 GB on an H100, so ask for nvidia-h200 (raise the fraction to 0.48
by exporting it if one side runs out).

On the lent GPU machine (jax 0.11.2 there; carry [".whl", ".whl_tunix"]), one command:

    P="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade";
    $P --target /tmp/site .whl/*.whl && $P --target /tmp/tunixsite .whl_tunix/*.whl &&
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit; set -o pipefail;
    python3 benchmarks/grpo_step.py --workloads=tunix_gpu --repeats=5 --tunix_python=python3
    --tunix_path=/tmp/tunixsite --json=$OUT/tunix_gpu.json 2>&1 | tee $OUT/log
"""

import argparse
import ast
import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import tiny as tiny_config  # noqa: E402
from grpo_jax.run import compile_ahead  # noqa: E402
from grpo_jax import data as data_lib  # noqa: E402
from grpo_jax.parallel import multihost  # noqa: E402
from grpo_jax.run import profiling  # noqa: E402
from grpo_jax.data import prompts as prompts_lib  # noqa: E402
from grpo_jax import rewards as rewards_lib  # noqa: E402
from grpo_jax import rollout as rollout_lib  # noqa: E402
from grpo_jax.rollout import source as source_lib  # noqa: E402
from grpo_jax.configuration import validate  # noqa: E402
from grpo_jax.models import build  # noqa: E402
from grpo_jax.rl import advantages as adv_lib  # noqa: E402
from grpo_jax.rl import step as step_lib  # noqa: E402
from grpo_jax.rl.reference import Reference  # noqa: E402

# The small/tunix reward: this file's compute_score, loaded as the loop loads a user plug-in.
_SUM_REWARD = {
    "reward.functions": (),
    "reward.weights": (),
    "reward.custom_file": os.path.abspath(__file__),
}
WORKLOADS = {  # dotted overrides of configs/tiny.py
    "tiny": {},
    "small": {
        "model.vocab_size": 32000,
        "model.hidden_size": 512,
        "model.num_layers": 8,
        "model.intermediate_size": 1536,
        "model.num_heads": 8,
        "model.num_kv_heads": 4,
        "model.head_dim": 64,
        "model.rope_theta": 1e6,
        "model.max_position_embeddings": 128,
        "batch_size": 8,
        "num_generations": 4,
        "max_prompt_length": 16,
        "max_completion_length": 64,
        "beta": 0.04,
        "micro_batch_size": 8,
        **_SUM_REWARD,
    },
    "tunix": {
        "model.vocab_size": 128,
        "model.hidden_size": 256,
        "model.num_layers": 2,
        "model.intermediate_size": 768,
        "model.num_heads": 8,
        "model.num_kv_heads": 4,
        "model.head_dim": 32,
        "model.rope_theta": 1e6,
        "model.max_position_embeddings": 64,
        "batch_size": 8,
        "num_generations": 4,
        "max_prompt_length": 16,
        "max_completion_length": 32,
        "rollout.temperature": 1.0,
        "beta": 0.04,
        "loss.clip_eps": 0.2,
        "num_iterations": 1,
        "optimizer.learning_rate": 1e-5,
        "optimizer.max_grad_norm": 1.0,
        "optimizer.warmup_ratio": 0.0,
        "optimizer.weight_decay": 1e-4,
        "optimizer.b2": 0.999,
        "micro_batch_size": 8,
        **_SUM_REWARD,
    },
}
# Tunix at Qwen3-0.6B's shape (grpo_jax.models PRESETS["qwen3-0.6b"], random init), bf16
# compute over float32 parameters on both sides, 8 prompts x G=4 at 128 prompt columns
# (left-padded: data.prompt_width "max", as Tunix pads to max_prompt_length) + 256 new tokens,
# the whole batch in one update (Tunix's), the tunix workload's reward and optimizer. With the
# vocabulary of 151936 and the char tokenizer's EOS one id among them, a random-init model
# draws EOS about once in 150k tokens: both sides generate the 256 tokens (no stop in effect).
WORKLOADS["tunix_gpu"] = {
    **WORKLOADS["tunix"],
    "model.vocab_size": 151936,
    "model.hidden_size": 1024,
    "model.num_layers": 28,
    "model.intermediate_size": 3072,
    "model.num_heads": 16,
    "model.num_kv_heads": 8,
    "model.head_dim": 128,
    "model.rope_theta": 1e6,
    "model.tie_embeddings": True,
    "model.dtype": "bfloat16",
    "model.param_dtype": "float32",
    "model.max_position_embeddings": 512,
    "max_prompt_length": 128,
    "max_completion_length": 256,
    "data.prompt_width": "max",
    "micro_batch_size": 0,
}
# The workloads that run Tunix beside ours (benchmarks/tunix_step.py).
TUNIX_PEERS = ("tunix", "tunix_gpu")
# LoRA on the small model (rank 8 on every projection): the sampler applying the adapters per
# layer like the trainer (the default) vs running the plain decoder on weights merged once per
# step (lora.merge_for_rollout). Update MFU counts the full model's 6N FLOPs per token.
_LORA = {"lora.rank": 8, "lora.alpha": 16.0, "sft_steps": 0}
WORKLOADS["small_lora"] = {**WORKLOADS["small"], **_LORA}
WORKLOADS["small_lora_merged"] = {**WORKLOADS["small"], **_LORA, "lora.merge_for_rollout": True}
WORKLOADS["tunix_lora"] = {**WORKLOADS["tunix"], **_LORA}
WORKLOADS["tunix_lora_merged"] = {**WORKLOADS["tunix"], **_LORA, "lora.merge_for_rollout": True}
PHASES = profiling.PHASES


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  """1 when the completion starts with the sum (Tunix's workload reward; verl's interface)."""
  del data_source, extra_info
  return 1.0 if solution_str.startswith(str(ground_truth)) else 0.0


def make_config(workload, remat=None, micro_batch=None, generations=None, extra=None):
  """configs/tiny.py with the workload's overrides, then `extra` (--set), then the sweep's
  values when given, validated as the entry point validates it."""
  config = tiny_config.get_config()
  overrides = {**WORKLOADS[workload], **(extra or {})}
  for key, value in (
      ("model.remat_policy", remat),
      ("micro_batch_size", micro_batch),
      ("num_generations", generations),
  ):
    if value is not None:
      overrides[key] = value
  for dotted, value in overrides.items():
    *path, leaf = dotted.split(".")
    node = config
    for p in path:
      node = node[p]
    node[leaf] = value
  config.mesh.data = 1  # one device, as Tunix's side runs
  # Padded rows, as Tunix's side runs (and as this benchmark's history was measured);
  # benchmarks/packed_update.py times packed rows against them.
  config.pack_sequences = False
  config.data.arithmetic.num_train = 1000  # plenty of batches; tokenizing 10k rows is setup time
  config.data.arithmetic.num_test = 8
  problems = validate(config, num_devices=1, num_processes=1)
  if problems:
    raise ValueError(f"workload {workload}: " + "; ".join(problems))
  return config


# jax.monitoring events of a first call: tracing, lowering to MLIR, XLA compilation.
_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "xla",
}
_compile_secs = {k: 0.0 for k in _COMPILE_EVENTS.values()}
_ahead_secs = [0.0]  # the same events on run/compile_ahead.py's worker thread


def _on_event(event, secs, **_):
  if event in _COMPILE_EVENTS:
    if threading.current_thread().name.startswith("compile_ahead"):
      _ahead_secs[0] += secs
    else:
      _compile_secs[_COMPILE_EVENTS[event]] += secs


def compile_seconds() -> float:
  """Seconds the main thread spent tracing, lowering and compiling so far."""
  return sum(_compile_secs.values())


class LoopStep:
  """train.py's GRPO steps 1-7 over the loop's own objects, with per-phase wall times."""

  def __init__(self, config):
    self.config = c = config
    self.mesh = build.make_mesh(c, devices=jax.devices()[:1])
    tokenizer = data_lib.build_tokenizer(c.tokenizer.kind, c.tokenizer.path)
    self.data, _ = prompts_lib.prompt_data(c, tokenizer)
    self.decode = source_lib.decoder(tokenizer)
    self.policy = build.make_policy(c, self.mesh)
    self.engine = rollout_lib.make_engine(c, self.policy, tokenizer, self.mesh)
    r = c.reward
    self.reward_fn = rewards_lib.build_reward_computer(
        r.functions, r.weights, custom_file=r.custom_file, custom_weight=r.custom_weight
    )
    self.fns = step_lib.build(c, self.policy, self.mesh)
    self.state = self.fns.init(self.policy.params)
    self.reference = Reference(c, self.policy, self.fns, self.mesh)  # beta 0: disabled
    self.reference.start(self.state["params"])
    self.iter = data_lib.make_prompt_iterator(len(self.data), batch_size=c.batch_size, seed=c.seed)
    self.rng = jax.random.wrap_key_data(
        multihost.replicated(jax.random.key_data(jax.random.key(c.seed)), self.mesh)
    )
    self.gen = rollout_lib.GenerationConfig(c.rollout.temperature, c.rollout.top_k, c.rollout.top_p)
    self.grpo = step_lib.GrpoStep(
        c, self.fns, self.reference, self.mesh, matches_trainer=self.engine.matches_trainer
    )
    self.stats_fn = self.grpo.stats_fn
    self.needs_old_logp = self.grpo.old_logp == "trainer"
    self.ahead = (
        compile_ahead.CompileAhead(
            c,
            self.grpo,
            engine=self.engine,
            generation=self.gen,
            key=source_lib.step_key(self.rng, 0, self.mesh),
        )
        if c.compile_ahead
        else None
    )
    self.generated, self.compile, self.widths = 0, {}, []

  def __call__(self, step: int) -> dict:
    """Runs one step; -> {phase: seconds} (+ "step"), and self.compile {phase: seconds spent
    tracing, lowering and compiling in it}."""
    c, G, times, self.compile = self.config, self.config.num_generations, {}, {}

    @contextlib.contextmanager
    def timed(name):
      c0 = compile_seconds()
      with profiling.phase(name) as span:  # the loop's own clock of a phase
        yield
      times[name] = span.sec
      self.compile[name] = compile_seconds() - c0

    t_step = time.perf_counter()
    with profiling.step_span(step):
      with timed("prompts"):
        batch = prompts_lib.prompt_batch(c, self.data, next(self.iter), self.mesh)
        prompt_ids = multihost.to_global(batch["prompt_ids"], self.mesh)
        self.widths.append(prompt_ids.shape[1])  # data.prompt_width: P of this step
        prompt_mask = multihost.to_global(batch["prompt_mask"], self.mesh)
        if self.ahead:  # as train.py: a new width's step programs compile in the background
          self.ahead.submit({"ids": prompt_ids, "mask": prompt_mask}, self.state)
      with timed("rollout"):
        if self.ahead:
          self.ahead.wait(prompt_ids.shape[1], only="sampler")
        rollout = self.engine.generate(
            self.state["params"], batch, source_lib.step_key(self.rng, step, self.mesh), self.gen
        )
        tokens_nc, mask_nc, _ = multihost.local_rows(
            (rollout.tokens, rollout.mask, rollout.truncated)
        )
      with timed("rewards"):
        scored = self.reward_fn(
            [p for p in batch["prompts"] for _ in range(G)],
            self.decode.rows(tokens_nc, mask_nc),
            [row for row in batch["rows"] for _ in range(G)],
        )
        host_rewards = scored.total + adv_lib.overlong_penalty(
            mask_nc.sum(-1), c.max_completion_length, c.loss.overlong_buffer, c.loss.overlong_factor
        )
        rewards_n = multihost.to_global(host_rewards.astype(np.float32), self.mesh)
      with timed("advantages"):
        if self.ahead:
          self.ahead.wait(prompt_ids.shape[1])
        upd = jax.block_until_ready(self.fns.assemble(prompt_ids, prompt_mask, rollout, rewards_n))
      if self.needs_old_logp:
        with timed("old_logprobs"):
          upd["old_logp"] = jax.block_until_ready(
              self.fns.logprobs(self.state["params"], upd["input_ids"], upd["attention_mask"])
          )
      if self.reference.enabled:
        with timed("ref_logprobs"):
          upd["ref_logp"] = jax.block_until_ready(
              self.reference.logprobs(self.state["params"], upd["input_ids"], upd["attention_mask"])
          )
      with timed("update"):
        for _ in range(c.num_iterations):
          self.state, upd_metrics = self.fns.update(self.state, upd)
        jax.block_until_ready(self.state)
      with timed("log"):
        jax.block_until_ready(
            (self.stats_fn(rewards_n, upd["advantages"], rollout.mask), upd_metrics)
        )
    times["step"] = time.perf_counter() - t_step
    self.compile["step"] = sum(self.compile.values())
    self.generated = int(mask_nc.sum())
    return times

  def prefill_seconds(self, repeats: int) -> float:
    """The rollout's sampler rebuilt for 1 new token (prefill + cache broadcast + 1 draw)."""
    c = self.config
    sampler = rollout_lib.Sampler(
        self.policy.sampler_graphdef,
        max_prompt_length=c.max_prompt_length,
        max_new_tokens=1,
        num_generations=c.num_generations,
        mesh=self.mesh,
    )
    batch = prompts_lib.prompt_batch(c, self.data, next(self.iter), self.mesh)
    ids = multihost.to_global(batch["prompt_ids"], self.mesh)
    mask = multihost.to_global(batch["prompt_mask"], self.mesh)
    params = self.state["params"]
    if not self.policy.sampler_is_trainer:  # e.g. LoRA merged for rollout: the sampler's weights
      params = jax.jit(self.policy.rollout_params)(params)
    run = lambda: jax.block_until_ready(sampler(params, ids, mask, self.rng, self.gen).tokens)
    run()
    return min(_timed(run) for _ in range(max(repeats, 3)))


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def matmul_peak_gflops(repeats: int, n: int = 2048) -> float:
  """float32 [n, n] x [n, n] rate in GFLOP/s, best of `repeats`: the peak MFU divides by
  (rollout.py's roofline method, on one big square product)."""
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, a))
  sec = min(_timed(lambda: jax.block_until_ready(f(a, a))) for _ in range(max(repeats, 5)))
  return 2 * n**3 / sec / 1e9


def update_flops(cfg, rows: int, prompt_len: int, completion_len: int) -> float:
  """Model FLOPs of one update over `rows` rows (formula in the module docstring); a forward
  log-prob pass over the same rows is a third of it."""
  d, f, h, g, k, l = (
      cfg.hidden_size,
      cfg.intermediate_size,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.head_dim,
      cfg.num_layers,
  )
  s = prompt_len + completion_len
  n_nonembed = l * (d * (h + 2 * g) * k + h * k * d + 3 * d * f)
  tokens = rows * s
  return (
      6 * n_nonembed * tokens
      + 6 * d * cfg.vocab_size * rows * completion_len
      + 12 * l * h * k * s * tokens
  )


class TunixSide:
  """benchmarks/tunix_step.py in a subprocess: one Tunix GRPO step per `step()`."""

  def __init__(self, python: str, config, batches, answers, itos, pad_id, eos_id, path: str = ""):
    m = config.model
    spec = dict(
        model={
            k: m[k]
            for k in (
                "num_layers",
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_heads",
                "head_dim",
                "num_kv_heads",
                "rope_theta",
                "tie_embeddings",
                "dtype",
                "param_dtype",
            )
        },
        seed=config.seed,
        max_prompt_length=config.max_prompt_length,
        max_completion_length=config.max_completion_length,
        max_grad_norm=config.optimizer.max_grad_norm,
        learning_rate=config.optimizer.learning_rate,
        temperature=config.rollout.temperature,
        num_generations=config.num_generations,
        beta=config.beta,
        clip_eps=config.loss.clip_eps,
        itos=itos,
        pad_id=pad_id,
        eos_id=eos_id,
        batches=batches,
        answers=answers,
    )
    # Tunix on the device ours uses (one device each; on a GPU both processes share it, see
    # XLA_PYTHON_CLIENT_MEM_FRACTION at the top); `path` goes in front of PYTHONPATH.
    env = dict(os.environ)
    if jax.default_backend() == "cpu":
      env["JAX_PLATFORMS"] = "cpu"
    if path:
      env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH", "")]))
    self.proc = subprocess.Popen(
        [python, os.path.join(ROOT, "benchmarks", "tunix_step.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        bufsize=1,
    )
    self.proc.stdin.write(json.dumps(spec) + "\n")
    self.proc.stdin.flush()
    self.ready = self._read()

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the Tunix side exited ({self.proc.wait()}); its stderr is above")
    return json.loads(line)

  def step(self) -> dict:
    """One Tunix GRPO step -> {"sec": wall, "phases": {name: sec}}."""
    self.proc.stdin.write("step\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self):
    self.proc.stdin.write("stop\n")
    self.proc.stdin.flush()
    self.proc.wait(timeout=120)


def tunix_python(flag: str) -> str | None:
  """The interpreter that has Tunix: --tunix_python, $TUNIX_PYTHON, or this one if it has it."""
  if flag or os.environ.get("TUNIX_PYTHON"):
    return flag or os.environ["TUNIX_PYTHON"]
  ok = subprocess.run([sys.executable, "-c", "import tunix"], capture_output=True).returncode
  return sys.executable if ok == 0 else None


def _median(xs):
  return float(np.median(xs))


def _settings(c):
  rows = c.batch_size * c.num_generations
  return c.model.remat_policy, min(c.micro_batch_size or rows, rows), c.num_generations


_T0 = time.monotonic()


def progress(msg: str):
  """A timestamped line on stderr as each side gets through its start (a run stopped by a
  time limit then says which side it was in)."""
  print(f"[{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def run_workload(workload, combos, args, tunix_py) -> list[dict]:
  """Every (remat, micro_batch, G) combo of one workload, their steady steps taken in turn
  (combo 1, combo 2, ..., Tunix, then again) so load on the machine hits all alike."""
  configs = [make_config(workload, *combo, extra=args.overrides) for combo in combos]
  for config in configs:
    config.compile_ahead = not args.no_compile_ahead
  loops, setup, first, first_compile = [], [], [], []
  for config in configs:
    t0 = time.perf_counter()
    progress(f"{workload}: ours, building {_settings(config)}")
    loops.append(LoopStep(config))
    setup.append(time.perf_counter() - t0)
    progress(f"{workload}: ours built in {setup[-1]:.1f} s; first step (compiles)")
    first.append(loops[-1](0))
    progress(f"{workload}: ours, first step {time.perf_counter() - t0 - setup[-1]:.1f} s")
    first_compile.append(dict(loops[-1].compile))
    # The worker's compiles for the first width (the step waited for them before step 4).
    first_compile[-1]["ahead"], _ahead_secs[0] = _ahead_secs[0], 0.0
  # Tunix beside the combo with the workload's own settings (Tunix's: G=4, one update on the
  # whole batch, no remat).
  own = _settings(make_config(workload, extra=args.overrides))
  mine = next((k for k, c in enumerate(configs) if _settings(c) == own), None)
  tunix = None
  if tunix_py and workload in TUNIX_PEERS and mine is not None:
    config, loop = configs[mine], loops[mine]
    batches, answers = [], []  # the prompts our side sees, in the same order
    same_iter = data_lib.make_prompt_iterator(
        len(loop.data), batch_size=config.batch_size, seed=config.seed
    )
    for idx in itertools.islice(same_iter, args.repeats + 1):
      rows = [loop.data.rows[i] for i in idx]
      batches.append([r["prompt"] for r in rows])
      answers.append([r["ground_truth"] for r in rows])
    tok = data_lib.build_tokenizer(config.tokenizer.kind, config.tokenizer.path)
    progress(f"{workload}: Tunix, starting its process ({tunix_py})")
    tunix = TunixSide(
        tunix_py, config, batches, answers, tok.itos, tok.pad_id, tok.eos_id, args.tunix_path
    )
    progress(f"{workload}: Tunix ready (setup {tunix.ready.get('setup_sec', float('nan')):.1f} s)")
    tunix_first = tunix.step()
    progress(f"{workload}: Tunix, first step {tunix_first.get('sec', float('nan')):.1f} s")
  steady, tunix_steady = [[] for _ in loops], []
  steady_compile = [0.0 for _ in loops]
  if args.trace:  # one trace per workload: with a sweep, its combos' steps alternate in it
    jax.profiler.start_trace(
        os.path.join(args.trace, workload),
        create_perfetto_trace=True,
        profiler_options=profiling.trace_options(),
    )
  for i in range(1, args.repeats + 1):  # turns: each combo of ours, then Tunix
    for k, loop in enumerate(loops):
      steady[k].append(loop(i))
      steady_compile[k] += loop.compile["step"]  # a recompiling step would show here
    if tunix:
      tunix_steady.append(tunix.step())
    progress(f"{workload}: steady step {i}/{args.repeats} done")
  if args.trace:
    jax.profiler.stop_trace()
  if tunix:
    tunix.close()
  results = []
  for k, (c, loop) in enumerate(zip(configs, loops)):
    # P: the prompt columns the steady steps ran with (data.prompt_width trims all-padding
    # columns), so FLOPs count the work done, not max_prompt_length.
    p_len = float(np.mean(loop.widths[1:] or loop.widths))
    rows, s = c.batch_size * c.num_generations, round(p_len) + c.max_completion_length
    phases = {name: _median([t[name] for t in steady[k]]) for name in steady[k][0]}
    prefill = loop.prefill_seconds(args.repeats)
    flops = update_flops(loop.policy.model_config, rows, p_len, c.max_completion_length)
    r = dict(
        workload=workload,
        remat=c.model.remat_policy,
        micro_batch=min(c.micro_batch_size or rows, rows),
        generations=c.num_generations,
        batch=c.batch_size,
        rows=rows,
        seq=s,
        params_m=sum(x.size for x in jax.tree.leaves(loop.policy.params)) / 1e6,
        setup_sec=setup[k],
        first_step_sec=first[k]["step"],
        steady_step_sec=phases["step"],
        best_step_sec=min(t["step"] for t in steady[k]),
        compile_sec=first_compile[k]["step"],
        compile_ahead_sec=first_compile[k]["ahead"],
        first_minus_steady_sec=first[k]["step"] - phases["step"],
        steady_compile_sec=steady_compile[k],
        phases=phases,
        phases_first=first[k],
        compile_phases=first_compile[k],
        prefill_est_sec=prefill,
        decode_est_sec=max(phases["rollout"] - prefill, 0.0),
        generated_tokens=loop.generated,
        rollout_tok_s=loop.generated / phases["rollout"],
        update_tok_s=rows * s / phases["update"],
        update_flops=flops,
        update_tflops_s=flops / phases["update"] / 1e12,
        logprob_flops=flops / 3,
    )
    shown = ("rollout", "rewards", "ref_logprobs", "update")  # the Tunix table's phases
    r["rest_sec"] = _median([t["step"] - sum(t.get(n, 0.0) for n in shown) for t in steady[k]])
    if tunix and k == mine:
      secs = [t["sec"] for t in tunix_steady]
      names = sorted({n for t in tunix_steady for n in t["phases"]})
      r["tunix"] = dict(
          setup_sec=tunix.ready["setup_sec"],
          first_step_sec=tunix_first["sec"],
          phases_first=tunix_first["phases"],
          phases={n: _median([t["phases"].get(n, 0.0) for t in tunix_steady]) for n in names},
          steady_step_sec=_median(secs),
          best_step_sec=min(secs),
          steps=secs,
          ours_steps=[t["step"] for t in steady[k]],
          rest_sec=_median(
              [t["sec"] - sum(t["phases"].get(n, 0.0) for n in shown) for t in tunix_steady]
          ),
          generated_tokens=tunix_steady[-1]["generated"],
          rollout_tok_s=_median([t["generated"] / t["phases"]["rollout"] for t in tunix_steady]),
      )
      r["tunix"]["steps_per_sec"] = 1.0 / r["tunix"]["steady_step_sec"]
      r["steps_per_sec"] = 1.0 / r["steady_step_sec"]
      # ours / Tunix: > 1 means ours is faster (steps/s is the speedup; rollout tok/s apart).
      r["tunix"]["rollout_tok_s_ratio"] = r["rollout_tok_s"] / r["tunix"]["rollout_tok_s"]
      r["tunix"]["speedup"] = r["tunix"]["steady_step_sec"] / r["steady_step_sec"]
      r["tunix"]["speedup_best"] = r["tunix"]["best_step_sec"] / r["best_step_sec"]
      # Each Tunix step over the step of ours just before it (same load), median.
      r["tunix"]["speedup_paired"] = _median(
          [t / o for t, o in zip(secs, r["tunix"]["ours_steps"])]
      )
    results.append(r)
  return results


def _overrides(s: str) -> dict:
  """--set's "a.b=1,c=x" -> {"a.b": 1, "c": "x"} (literals where they parse, else strings)."""
  out = {}
  for item in filter(None, s.split(",")):
    key, value = item.split("=", 1)
    try:
      out[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[key.strip()] = value.strip()
  return out


def _list(s, cast):
  return [None] if not s else [cast(x) for x in s.split(",")]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny only, 2 repeats, no Tunix")
  ap.add_argument("--workloads", default="tiny,small,tunix")
  ap.add_argument("--repeats", type=int, default=5, help="steady steps timed (after the first)")
  ap.add_argument("--remat", default="", help="comma list of remat policies (models/remat.py)")
  ap.add_argument("--micro_batch", default="", help="comma list of micro-batch sizes (0 = all)")
  ap.add_argument("--generations", default="", help="comma list of G")
  ap.add_argument("--no_tunix", action="store_true")
  ap.add_argument(
      "--no_compile_ahead",
      action="store_true",
      help="compile each program at its first call (config.compile_ahead=False)",
  )
  ap.add_argument("--tunix_python", default="", help="interpreter with google-tunix installed")
  ap.add_argument(
      "--tunix_path",
      default=os.environ.get("TUNIX_PATH", ""),
      help="put in front of the Tunix side's PYTHONPATH (a --target folder of .whl_tunix/)",
  )
  ap.add_argument(
      "--set",
      default="",
      help="dotted config overrides for every workload, comma list of key=value (a value is a "
      "Python literal or a string), e.g. model.num_layers=2,max_completion_length=16",
  )
  ap.add_argument("--trace", default="", help="write a Perfetto trace of the steady steps here")
  ap.add_argument("--json", default="", help="also write the results to this file")
  args = ap.parse_args(argv)
  args.overrides = _overrides(args.set)
  jax.monitoring.register_event_duration_secs_listener(_on_event)  # (not when loaded as a reward)
  workloads = ["tiny"] if args.quick else args.workloads.split(",")
  if args.quick:
    args.repeats = min(args.repeats, 2)
  tunix_py = (
      None
      if (args.quick or args.no_tunix or not set(TUNIX_PEERS) & set(workloads))
      else (tunix_python(args.tunix_python))
  )
  if tunix_py:
    # Both sides share one GPU: each process takes at most 45% of its memory (JAX's default
    # preallocation, 75% in the first, would leave the second too little). Read when the
    # backend starts, which is the matmul below.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
  n = 1024 if args.quick else 2048
  peak = matmul_peak_gflops(args.repeats, n)
  print(
      f"device: {jax.devices()[0].device_kind}, matmul peak {peak:.1f} GFLOP/s (f32 {n}^3); "
      f"steady = median of {args.repeats} steps after the first"
  )
  results = []
  combos = list(
      itertools.product(
          _list(args.remat, str), _list(args.micro_batch, int), _list(args.generations, int)
      )
  )
  for w in workloads:
    results += run_workload(w, combos, args, tunix_py)
  peak = max(peak, matmul_peak_gflops(args.repeats, n))  # the better of before/after the runs
  for r in results:
    r["update_mfu"] = r["update_flops"] / r["phases"]["update"] / (peak * 1e9)
    for name in ("old_logprobs", "ref_logprobs"):
      if r["phases"].get(name):
        r[name.replace("logprobs", "lp_mfu")] = (
            r["logprob_flops"] / r["phases"][name] / (peak * 1e9)
        )
  _print(results, peak)
  if set(TUNIX_PEERS) & set(workloads) and not any("tunix" in r for r in results):
    why = (
        "--no_tunix"
        if args.no_tunix or args.quick
        else "no interpreter with google-tunix: pass --tunix_python"
        if not tunix_py
        else "it runs beside the sweep value equal to the workload's own: remat none, micro-batch "
        "= all rows, G=4"
    )
    print(f"\nTunix: not run ({why})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
          dict(
              device=jax.devices()[0].device_kind,
              matmul_peak_gflops=peak,
              repeats=args.repeats,
              results=results,
          ),
          f,
          indent=2,
      )
  return results


def _print(results, peak):
  cols = [p for p in PHASES if any(p in r["phases"] for r in results)]
  short = {"advantages": "adv", "old_logprobs": "old_lp", "ref_logprobs": "ref_lp"}
  print(
      f"\n{'workload':<10}{'remat':<13}{'mb':>4}{'G':>3}{'params':>8}{'rows x S':>10}"
      f"{'first':>8}{'compile':>8}{'steady':>8}"
      + "".join(f"{short.get(p, p):>10}" for p in cols)
      + f"{'prefill~':>10}{'decode~':>10}{'gen tok/s':>10}{'upd tok/s':>10}{'upd MFU':>8}"
      f"{'lp MFU':>8}"
  )
  for r in results:
    ph = r["phases"]
    print(
        f"{r['workload']:<10}{r['remat']:<13}{r['micro_batch']:>4}{r['generations']:>3}"
        f"{r['params_m']:>7.2f}M{r['rows']:>5} x{r['seq']:>3}"
        f"{r['first_step_sec']:>7.2f}s{r['compile_sec']:>7.2f}s{r['steady_step_sec']:>7.3f}s"
        + "".join(f"{1e3 * ph[p]:>8.1f}ms" if p in ph else f"{'-':>10}" for p in cols)
        + f"{1e3 * r['prefill_est_sec']:>8.1f}ms{1e3 * r['decode_est_sec']:>8.1f}ms"
        f"{r['rollout_tok_s']:>10.0f}{r['update_tok_s']:>10.0f}{r['update_mfu']:>8.1%}"
        + (f"{r['ref_lp_mfu']:>8.1%}" if "ref_lp_mfu" in r else f"{'-':>8}")
    )
  tunix = [r for r in results if "tunix" in r]
  if not tunix:
    return
  print(
      f"\n{'Tunix workload, turn by turn':<26}{'first':>8}{'steady':>8}{'best':>8}"
      f"{'rollout':>9}{'prefill':>9}{'decode':>9}{'rewards':>9}{'ref_lp':>9}{'update':>9}"
      f"{'rest':>9}"
  )
  for r in tunix:
    t, ph, tph = r["tunix"], r["phases"], r["tunix"]["phases"]
    ours = dict(
        rollout=ph["rollout"],
        prefill=r["prefill_est_sec"],
        decode=r["decode_est_sec"],
        rewards=ph["rewards"],
        ref_logprobs=ph.get("ref_logprobs", 0.0),
        update=ph["update"],
    )
    theirs = {k: tph.get(k, 0.0) for k in ours}
    for name, row, d in (("grpo_jax (ours)", r, ours), ("Tunix 0.1.7 GRPOLearner", t, theirs)):
      print(
          f"{name:<26}{row['first_step_sec']:>7.2f}s{row['steady_step_sec']:>7.3f}s"
          f"{row['best_step_sec']:>7.3f}s"
          + "".join(
              f"{1e3 * d[k]:>7.1f}ms"
              for k in ("rollout", "prefill", "decode", "rewards", "ref_logprobs", "update")
          )
          + f"{1e3 * row['rest_sec']:>7.1f}ms"
      )
    print(
        f"{'speedup (Tunix / ours)':<26}{t['first_step_sec'] / r['first_step_sec']:>7.2f}x"
        f"{t['speedup']:>7.2f}x{t['speedup_best']:>7.2f}x"
        + "".join(
            f"{theirs[k] / ours[k]:>8.2f}x" if ours[k] > 0 else f"{'-':>9}"
            for k in ("rollout", "prefill", "decode", "rewards", "ref_logprobs", "update")
        )
    )
    print(f"paired speedup (median of Tunix step i / our step i): {t['speedup_paired']:.2f}x")
    print(
        f"steps/s: ours {r['steps_per_sec']:.3f}, Tunix {t['steps_per_sec']:.3f}, ours/Tunix "
        f"{t['speedup']:.2f}x; rollout tok/s: ours {r['rollout_tok_s']:.0f} "
        f"({r['generated_tokens']} tokens), Tunix {t['rollout_tok_s']:.0f} "
        f"({t['generated_tokens']} tokens; its generate() timed), ours/Tunix "
        f"{t['rollout_tok_s_ratio']:.2f}x"
    )
    print(
        "(ours: prefill/decode estimated, see the docstring; Tunix: its two jitted programs "
        "timed; rest = the step minus the phases shown, median over steps)"
    )


if __name__ == "__main__":
  main()
