r"""Rollout throughput: our jitted group sampler vs `transformers` generate and vLLM, same weights.

    python benchmarks/rollout.py            # tiny (2L d256) and small (8L d512), vocab 32k
    python benchmarks/rollout.py --quick    # tiny only, shorter; seconds (used by the tests)
    python benchmarks/rollout.py --no_vllm --no_transformers   # our sampler only

For each model: 16 prompts (random lengths, left-padded) x G=8 samples x 128 new tokens at
temperature 1 with no stop token, so both sides generate exactly the same number of tokens.
Prints generated tokens/s for each and the ratios ours / transformers and ours / vLLM (vLLM
engine of grpo_jax.rollout.vllm_engine: in-process, n=G per prompt, processed log-probs
returned, like the loop uses it), measured in one run on this machine, plus the prefill time of the group sampler for G=1 and G=8 (one prefill per
prompt, cache broadcast to the G samples) next to a naive G-fold prefill (B*G prompts).
Compile time is excluded (one warm-up call each); the best of --repeats timed calls is kept.
A second table puts the figures against a roofline: the generated tokens' matmul FLOPs at this
machine's measured matmul rate (on CPU both samplers are compute-bound on the LM head, so
roofline / transformers is the most any sampler could gain here).
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax.models.decoder import config as model_config  # noqa: E402
from grpo_jax.models.decoder import hf  # noqa: E402
from grpo_jax.models.decoder.transformer import build_model  # noqa: E402
from grpo_jax.rollout import Sampler  # noqa: E402
from grpo_jax.rollout.types import GenerationConfig  # noqa: E402

MODELS = {
    "tiny": dict(
        num_layers=2,
        hidden_size=256,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    ),
    "small": dict(
        num_layers=8,
        hidden_size=512,
        intermediate_size=1536,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    ),
}


def _prompts(b, p, vocab, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(p // 2, p + 1, b)
  ids = np.zeros((b, p), np.int32)
  mask = np.zeros((b, p), np.int32)
  for i, n in enumerate(lengths):
    ids[i, p - n :] = rng.integers(3, vocab, n)
    mask[i, p - n :] = 1
  return ids, mask


def _best(fn, repeats):
  fn()  # warm-up / compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def bench_ours(model, ids, mask, g, new_tokens, repeats):
  graphdef, state = nnx.split(model)
  sampler = Sampler(
      graphdef,
      max_prompt_length=ids.shape[1],
      max_new_tokens=new_tokens,
      num_generations=g,
      eos_ids=(),
  )
  ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)
  gen = GenerationConfig(1.0, 0, 1.0)
  key = jax.random.key(0)

  def run():
    out = sampler(state, ids_j, mask_j, key, gen)
    jax.block_until_ready(out.tokens)
    assert int(out.mask.sum()) == ids.shape[0] * g * new_tokens

  return _best(run, repeats)


def bench_transformers(path, ids, mask, g, new_tokens, repeats):
  import torch
  import transformers

  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
  model.eval()
  ids_t, mask_t = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

  def run():
    with torch.inference_mode():
      out = model.generate(
          input_ids=ids_t,
          attention_mask=mask_t,
          do_sample=True,
          temperature=1.0,
          top_k=0,
          top_p=1.0,
          max_new_tokens=new_tokens,
          min_new_tokens=new_tokens,
          num_return_sequences=g,
          pad_token_id=0,
          eos_token_id=None,
      )
    assert out.shape == (ids.shape[0] * g, ids.shape[1] + new_tokens)

  return _best(run, repeats)


def bench_vllm(path, ids, mask, g, new_tokens, repeats):
  import gc
  from grpo_jax.rollout import vllm_engine

  engine = vllm_engine.VLLMEngine(
      path,
      graphdef=None,
      num_generations=g,
      max_prompt_length=ids.shape[1],
      max_new_tokens=new_tokens,
      eos_ids=(),
      pad_id=0,
      tied=True,
      mesh=None,
  )
  gen = GenerationConfig(1.0, 0, 1.0)

  def run():
    _, m, _, _ = engine.generate_local(ids, mask, gen, seed=0)
    assert int(m.sum()) == ids.shape[0] * g * new_tokens

  try:
    return _best(run, repeats)
  finally:
    del engine
    gc.collect()


def matmul_gflops(rows, d, v, repeats):
  """This machine's float32 matmul rate (GFLOP/s) on the sampler's biggest per-step product,
  [rows, d] x [d, v] (the LM head): the roofline a compute-bound decoder cannot beat."""
  a = jnp.ones((rows, d), jnp.float32)
  w = jnp.ones((d, v), jnp.float32)
  f = jax.jit(lambda a, w: a @ w)
  sec = _best(lambda: jax.block_until_ready(f(a, w)), max(repeats, 5))
  return 2 * rows * d * v / sec / 1e9


def decode_flops_per_token(cfg, context):
  """Matmul FLOPs to generate one token: 2 * (non-embedding params + LM head) + attention."""
  d, f, h, g, k = (
      cfg.hidden_size,
      cfg.intermediate_size,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.head_dim,
  )
  per_layer = d * (h + 2 * g) * k + h * k * d + 3 * d * f
  attn = 2 * h * k * context  # q.k and p.v over the context
  return 2 * (cfg.num_layers * per_layer + d * cfg.vocab_size) + 2 * cfg.num_layers * attn


def bench_prefill(model, ids, mask, g, repeats):
  """Prefill (+ cache broadcast to G) + one sampled token: the sampler with 1 new token."""
  return bench_ours(model, ids, mask, g, 1, repeats)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny model only, 32 new tokens")
  ap.add_argument("--models", default="tiny,small")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--generations", type=int, default=8)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--no_transformers", action="store_true")
  ap.add_argument("--no_vllm", action="store_true")
  ap.add_argument("--json", default="", help="also write the results to this file")
  args = ap.parse_args()
  models = ["tiny"] if args.quick else args.models.split(",")
  new_tokens = 32 if args.quick else args.new_tokens
  repeats = 1 if args.quick else args.repeats
  b, g = args.batch, args.generations
  ids, mask = _prompts(b, args.prompt_len, args.vocab)
  print(
      f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  batch {b} prompts x "
      f"G={g}, {new_tokens} new tokens, prompt length <= {args.prompt_len}, vocab {args.vocab}"
  )
  results = []
  tokens = b * g * new_tokens

  def model_of(name):
    cfg = model_config.ModelConfig(
        arch="qwen3",
        vocab_size=args.vocab,
        rope_theta=1e6,
        tie_embeddings=True,
        max_position_embeddings=4096,
        **MODELS[name],
    )
    return cfg, build_model(cfg, seed=0)

  def timed_on_hf_folder(model, bench):
    with tempfile.TemporaryDirectory() as d:
      hf.save_hf(model, d)
      return bench(d, ids, mask, g, new_tokens, repeats)

  for name in models:
    cfg, model = model_of(name)
    r = dict(model=name, params_m=round(cfg.num_params / 1e6, 1))
    r["ours_sec"] = bench_ours(model, ids, mask, g, new_tokens, repeats)
    r["ours_tok_s"] = tokens / r["ours_sec"]
    if not args.no_transformers:
      r["hf_sec"] = timed_on_hf_folder(model, bench_transformers)
      r["hf_tok_s"] = tokens / r["hf_sec"]
      r["ratio"] = r["ours_tok_s"] / r["hf_tok_s"]
    # Roofline: the generated tokens' matmul FLOPs at this machine's matmul rate.
    gflops = matmul_gflops(b * g, cfg.hidden_size, cfg.vocab_size, repeats)
    flops = tokens * decode_flops_per_token(cfg, args.prompt_len + new_tokens // 2)
    r["matmul_gflops"] = gflops
    r["roofline_tok_s"] = tokens / (flops / (gflops * 1e9))
    r["ours_of_roofline"] = r["ours_tok_s"] / r["roofline_tok_s"]
    r["prefill_g1_ms"] = 1e3 * bench_prefill(model, ids, mask, 1, repeats)
    r["prefill_shared_ms"] = 1e3 * bench_prefill(model, ids, mask, g, repeats)
    r["naive_prefill_ms"] = 1e3 * bench_prefill(
        model, np.repeat(ids, g, 0), np.repeat(mask, g, 0), 1, repeats
    )
    results.append(r)
  # vLLM last: its CPU backend pins the process's threads, which would skew later timings.
  for r in results if not args.no_vllm else []:
    _, model = model_of(r["model"])
    r["vllm_sec"] = timed_on_hf_folder(model, bench_vllm)
    r["vllm_tok_s"] = tokens / r["vllm_sec"]
    r["ratio_vllm"] = r["ours_tok_s"] / r["vllm_tok_s"]

  print(
      f"\n{'model':<7}{'params':>8}{'ours tok/s':>12}{'transformers tok/s':>20}{'ratio':>8}"
      f"{'vLLM tok/s':>12}{'ratio':>8}"
      f"{'prefill G=1':>13}{f'G={g} shared':>13}{f'naive B*{g}':>12}"
  )
  for r in results:
    hf_col = f"{r['hf_tok_s']:>20.0f}{r['ratio']:>7.1f}x" if "ratio" in r else f"{'-':>20}{'-':>8}"
    vl_col = (
        f"{r['vllm_tok_s']:>12.0f}{r['ratio_vllm']:>7.2f}x"
        if "ratio_vllm" in r
        else f"{'-':>12}{'-':>8}"
    )
    print(
        f"{r['model']:<7}{r['params_m']:>7.1f}M{r['ours_tok_s']:>12.0f}{hf_col}{vl_col}"
        f"{r['prefill_g1_ms']:>11.1f}ms{r['prefill_shared_ms']:>11.1f}ms"
        f"{r['naive_prefill_ms']:>10.1f}ms"
    )
  print(
      f"\n{'model':<7}{'matmul GFLOP/s':>16}{'roofline tok/s':>16}{'ours/roofline':>15}"
      f"{'roofline/transformers':>23}"
  )
  for r in results:
    rh = f"{r['roofline_tok_s'] / r['hf_tok_s']:>22.1f}x" if "hf_tok_s" in r else f"{'-':>23}"
    print(
        f"{r['model']:<7}{r['matmul_gflops']:>16.1f}{r['roofline_tok_s']:>16.0f}"
        f"{r['ours_of_roofline']:>14.0%}{rh}"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(batch=b, generations=g, new_tokens=new_tokens, results=results), f, indent=2)
  return results


if __name__ == "__main__":
  main()
