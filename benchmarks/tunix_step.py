r"""Tunix's side of benchmarks/grpo_step.py: Tunix's own GRPOLearner, one step per command.

Runs in an environment with `google-tunix==0.1.7` (it pins transformers, tokenizers,
safetensors and huggingface_hub below this repo's versions, so it lives in its own venv):

    python3.12 -m venv /work/tunixvenv
    /work/tunixvenv/bin/pip install jax==0.12.0.1 flax==0.12.12 optax==0.2.8 google-tunix==0.1.7

or, with no registry (the lent GPU machine: jax 0.11.2, flax from our .whl/), as a folder on
PYTHONPATH: `bash benchmarks/accelerator_wheels.sh` fills .whl_tunix/ with google-tunix 0.1.7
and the two packages its imports need that such a machine lacks (google-metrax 0.2.4 for
tunix.sft.metrics_logger, clu 0.0.12 for metrax); a third, perfetto, is stubbed below
(_stub_perfetto) rather than carried; install them with
`pip install --no-deps --target DIR .whl_tunix/*.whl` and pass grpo_step.py
`--tunix_path=DIR` (see its docstring). Tunix's other Requires-Dist (datasets,
tensorflow_datasets, kagglehub, grain, qwix, omegaconf, ...) are imported lazily or not on
the learner's path; none is needed for what this file imports (checked on jax 0.11.2 +
flax 0.12.10 with only that machine's packages importable). Its pin safetensors<0.8 is not
needed either: the 0.8.0 there imports and the learner reads no checkpoint.

grpo_step.py starts it as a subprocess and speaks a line protocol, so the two sides can take
turns step by step in one run (fair under a noisy machine):

  stdin, line 1   the workload as JSON (model shape, prompt batches, answers, the vocabulary,
                  G, lengths, beta, epsilon, learning rate, clip)
  stdout          {"ready": ..., "setup_sec": ...} once built, then one {"step": i, "sec": s,
                  "phases": {...}, "generated": n} per "step" line read (n: completion tokens
                  the rollout produced, EOS included); "stop" ends the run.

The model shape comes in the spec ("model": layers, vocab, widths, heads, rope_theta, tied,
and "dtype"/"param_dtype": compute and parameter dtypes, e.g. bfloat16 / float32).

The driver is ours; everything it times is Tunix's: `RLCluster` (vanilla rollout on the
actor's own weights, a full reference copy), `GRPOLearner.train` over an iterator that hands
out one batch per "step" command. A step is timed from the moment the learner takes its batch
to the moment it asks for the next one, after waiting for the actor's new weights, so it
covers everything Tunix does per step (rollout, rewards, reference log-probs, the update,
its metrics bookkeeping) and none of the wait for our command.
"""

import json
import os
import sys
import time

# The protocol owns the real stdout; anything the libraries print goes to stderr.
_PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)


def _stub_perfetto():
  """Stands in for the `perfetto` package when it does not import (not installed: .whl_tunix/
  leaves it out; or its generated protobuf code needs a newer protobuf runtime than the one
  there, 6.31.1 for perfetto 0.59.1). `import tunix` imports tunix.perf.export ->
  tunix.perf.perfetto, which imports TraceProtoBuilder, TrackDescriptor and TrackEvent at
  module import; they are used only to write a Perfetto trace when a
  PerfMetricsConfig asks for one, which this driver never sets (RLCluster's perf_config None:
  NoopTracer)."""
  import types  # pylint: disable=import-outside-toplevel

  try:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2  # noqa: F401
    from perfetto.trace_builder import proto_builder  # noqa: F401

    return
  except Exception:  # pylint: disable=broad-except
    pass

  class _Unused:

    def __init__(self, *_, **__):
      raise RuntimeError("perfetto is stubbed out in benchmarks/tunix_step.py")

  names = (
      "perfetto",
      "perfetto.trace_builder",
      "perfetto.trace_builder.proto_builder",
      "perfetto.protos",
      "perfetto.protos.perfetto",
      "perfetto.protos.perfetto.trace",
      "perfetto.protos.perfetto.trace.perfetto_trace_pb2",
  )
  for name in names:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so the submodule imports resolve through sys.modules
    sys.modules[name] = mod
  sys.modules["perfetto.trace_builder.proto_builder"].TraceProtoBuilder = _Unused
  pb2 = sys.modules["perfetto.protos.perfetto.trace.perfetto_trace_pb2"]
  pb2.TrackDescriptor = pb2.TrackEvent = _Unused
  for parent, child in zip(names, names[1:]):
    if child.startswith(parent + "."):
      setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
  setattr(sys.modules["perfetto"], "protos", sys.modules["perfetto.protos"])


_stub_perfetto()

_T0 = time.monotonic()


def _say(msg: str):
  """Progress on stderr (the protocol owns stdout): where a run stopped by a limit was."""
  print(f"[tunix {time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402


def say(**kw):
  _PROTO.write(json.dumps(kw) + "\n")


class CharTokenizer:
  """The vocabulary grpo_step.py sends (its char tokenizer's), with Tunix's tokenizer methods."""

  def __init__(self, itos, pad_id, eos_id):
    self.itos, self._pad, self._eos = list(itos), pad_id, eos_id
    self.stoi = {s: i for i, s in enumerate(self.itos)}

  def encode(self, text, **_):
    return [self.stoi[ch] for ch in text]

  def decode(self, ids, **_):
    return "".join(
        self.itos[i]
        for i in map(int, ids)
        if i not in (self._pad, self._eos) and 0 <= i < len(self.itos)
    )

  def bos_id(self):
    return 0  # falsy: Tunix's sampler then prepends no BOS, as grpo_jax's char prompts have none

  def eos_id(self):
    return self._eos

  def pad_id(self):
    return self._pad


class PhaseTimes:
  """Wall time of Tunix's own phase functions, each waited out (outputs blocked on), per step."""

  def __init__(self):
    self.current, self.generated = {}, 0

  def wrap(self, obj, attr, name, block=None, count=None):
    fn = getattr(obj, attr)

    def timed(*args, **kwargs):
      t0 = time.perf_counter()
      out = fn(*args, **kwargs)
      jax.block_until_ready(out if block is None else block())
      self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0
      if count is not None:
        self.generated += count(out)
      return out

    setattr(obj, attr, timed)

  def take(self):
    out, self.current, self.generated = (self.current, self.generated), {}, 0
    return out


class Commands:
  """The learner's train_ds: one batch per "step" line on stdin; times the previous step."""

  def __init__(self, batches, answers, cluster, phases):
    self.batches, self.answers, self.cluster, self.phases = batches, answers, cluster, phases
    self.i, self.t0 = 0, None

  def __iter__(self):
    return self

  def __next__(self):
    if self.t0 is not None:
      jax.block_until_ready(nnx.state(self.cluster.actor_trainer.model))
      sec = time.perf_counter() - self.t0
      phases, generated = self.phases.take()
      say(step=self.i - 1, sec=sec, phases=phases, generated=generated)
    line = sys.stdin.readline().strip()
    if line != "step":
      raise StopIteration
    k = self.i % len(self.batches)
    self.i += 1
    self.phases.take()
    self.t0 = time.perf_counter()
    return {"prompts": np.array(self.batches[k]), "answer": np.array(self.answers[k])}


def starts_with_sum(prompts, completions, answer, **_):
  return [1.0 if c.startswith(str(a)) else 0.0 for c, a in zip(completions, answer)]


def main():
  spec = json.loads(sys.stdin.readline())
  t_setup = time.perf_counter()
  m = spec["model"]
  cfg = qwen3.ModelConfig(
      num_layers=m["num_layers"],
      vocab_size=m["vocab_size"],
      embed_dim=m["hidden_size"],
      hidden_dim=m["intermediate_size"],
      num_heads=m["num_heads"],
      head_dim=m["head_dim"],
      num_kv_heads=m["num_kv_heads"],
      rope_theta=int(m["rope_theta"]),
      norm_eps=1e-6,
      use_tied_embedding=m["tie_embeddings"],
      dtype=jnp.dtype(m.get("dtype", "float32")),
      param_dtype=jnp.dtype(m.get("param_dtype", "float32")),
  )
  # Auto axes (jax.make_mesh's default is Explicit, which Tunix's layers do not expect).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  _say("Tunix side: building its Qwen3 (actor and reference)")
  actor = qwen3.Qwen3(cfg, rngs=nnx.Rngs(spec["seed"]))
  reference = qwen3.Qwen3(cfg, rngs=nnx.Rngs(spec["seed"]))  # a full copy, same weights
  p, c = spec["max_prompt_length"], spec["max_completion_length"]
  optimizer = optax.chain(
      optax.clip_by_global_norm(spec["max_grad_norm"]), optax.adamw(spec["learning_rate"])
  )
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={
          rl_cluster_lib.Role.ACTOR: mesh,
          rl_cluster_lib.Role.REFERENCE: mesh,
          rl_cluster_lib.Role.ROLLOUT: mesh,
      },
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optimizer,
          eval_every_n_steps=10**9,
          max_steps=10**9,
          pbar_description=None,
      ),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=c,
          max_prompt_length=p,
          kv_cache_size=p + c,
          temperature=spec["temperature"],
          top_p=1.0,
          top_k=None,
      ),
  )
  tokenizer = CharTokenizer(spec["itos"], spec["pad_id"], spec["eos_id"])
  _say("Tunix side: models built; RLCluster and GRPOLearner")
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=cluster_config
  )
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster,
      reward_fns=[starts_with_sum],
      algo_config=grpo_learner.GRPOConfig(
          num_generations=spec["num_generations"],
          num_iterations=1,
          beta=spec["beta"],
          epsilon=spec["clip_eps"],
      ),
  )
  # Phase times: the rollout's two jitted programs (Tunix compiles prefill and decode apart),
  # the learner's reward call, the reference log-probs and the actor update.
  phases = PhaseTimes()
  sampler = cluster.rollout._sampler  # pylint: disable=protected-access
  phases.wrap(sampler, "_compiled_prefill_fn", "prefill")
  phases.wrap(sampler, "_compiled_decode_fn", "decode")
  phases.wrap(cluster, "generate", "rollout", count=lambda out: sum(len(t) for t in out.tokens))
  phases.wrap(learner, "_compute_rewards", "rewards")
  phases.wrap(cluster, "get_ref_per_token_logps", "ref_logprobs")
  phases.wrap(
      cluster, "update_actor", "update", block=lambda: nnx.state(cluster.actor_trainer.model)
  )
  say(
      ready=True,
      setup_sec=time.perf_counter() - t_setup,
      device=jax.devices()[0].device_kind,
      tunix_params=sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param))),
  )
  learner.train(Commands(spec["batches"], spec["answers"], cluster, phases))
  say(done=True)


if __name__ == "__main__":
  main()
