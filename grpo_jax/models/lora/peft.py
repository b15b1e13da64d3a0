"""LoRA adapters out in PEFT's format: `adapter_model.safetensors` + `adapter_config.json`.

    peft_export.save_peft(params, config, "/tmp/adapter")   # or: infer --export_peft=DIR
    # then, with the base exported by --export_hf (or the model.hf_path it started from):
    #   PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "/tmp/adapter")

Layouts. PEFT's LoRA on an HF Linear (weight [out, in]) adds (lora_alpha / r) * B @ A with
lora_A.weight [r, in] and lora_B.weight [out, r]. Ours (models/lora/adapters.py) adds (alpha / r) *
A . B to the native weight with A [in..., r] and B [r, out...]; the native <-> HF weight
mapping (models/decoder/hf.py) flattens q/k/v's (heads, head_dim) and o's input (heads, head_dim) in
row-major order, so lora_A = A.reshape(in, r).T and lora_B = B.reshape(r, out).T.

MoE models (Qwen3-MoE): attention adapters, and the MLP adapters of a mixed model's dense layers,
export as above. Adapters on the experts (an MoE layer's mlp/{gate,up,down}, A [E, in, r]) are
refused in one line (`expert_refusal`): transformers 5 holds a layer's experts as fused 3-D
parameters (gate_up_proj [E, 2F, D], down_proj [E, D, F]) that PEFT reaches only through
`target_parameters` in its own layout, and transformers 4 as per-expert Linear modules
(mlp.experts.<e>.gate_proj); neither layout is built or tested here. Export such a run merged:
infer --export_hf (W + (alpha / r) A[e] . B[e] per expert, exact).
"""

import json

import jax
import numpy as np
from flax import nnx

from grpo_jax.run import paths
from grpo_jax.models.decoder import hf
from grpo_jax.models.lora import adapters as lora


def expert_refusal(config) -> str | None:
  """Why the adapters of `config` cannot be exported to PEFT (adapters on MoE experts), as one
  line with the fix; None when they can."""
  layers = lora.expert_targets(config)
  if not layers:
    return None
  return (
      f"lora.target_modules={config.lora.target_modules!r} adapts the experts of MoE layers "
      f"{layers[0]}..{layers[-1]}: exporting expert adapters to PEFT is not built (transformers "
      "5 fuses a layer's experts into 3-D parameters). Fix: --export_hf (the merged model), "
      r"or train attention-only adapters (--config.lora.target_modules='layers/\d+/attn/(q|k|v|o)')"
  )


def peft_tensors(params, config) -> dict:
  """{PEFT tensor name: host array} for every adapter in `params` (multi-host: collective).
  Adapters on MoE experts: a ValueError naming the fix (`expert_refusal`)."""
  cfg, lc = config.model, config.lora
  refusal = expert_refusal(config)
  if refusal:
    raise ValueError(refusal)
  flat = dict(nnx.to_flat_state(params))
  out = {}
  for i, m, w in lora.targets(cfg.num_layers, lc.target_modules):
    prefix = ("layers",) if cfg.scan_layers else ("layers", i)
    a = hf._to_host(flat[(*prefix, m, f"{w}_lora_a")].get_value())
    b = hf._to_host(flat[(*prefix, m, f"{w}_lora_b")].get_value())
    if cfg.scan_layers:
      a, b = a[i], b[i]
    r = a.shape[-1]
    name = f"base_model.model.model.layers.{i}.{lora.HF_MODULES[(m, w)]}"
    out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
    out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
  return out


def adapter_config(config, base_model_name_or_path: str = "") -> dict:
  """PEFT's LoraConfig as JSON: the exact module names that carry adapters."""
  cfg, lc = config.model, config.lora
  modules = sorted(
      {
          f"model.layers.{i}.{lora.HF_MODULES[(m, w)]}"
          for i, m, w in lora.targets(cfg.num_layers, lc.target_modules)
      }
  )
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "r": int(lc.rank),
      "lora_alpha": float(lc.alpha),
      "lora_dropout": float(lc.dropout),
      "target_modules": modules,
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "modules_to_save": None,
      "base_model_name_or_path": base_model_name_or_path,
      "inference_mode": True,
  }


def save_peft(params, config, path: str, *, base_model_name_or_path: str = ""):
  """Writes the adapters of `params` (base + adapters, or adapters only) to `path`. Every
  process calls it (the gathers are collective); process 0 writes. With a quantized base the
  adapters were trained against the dequantized weights: pair them with that base."""
  from safetensors.numpy import save

  tensors = peft_tensors(params, config)
  if jax.process_index() != 0:
    return
  folder = paths.path(path)
  folder.mkdir(parents=True, exist_ok=True)
  dtype = np.dtype(config.model.param_dtype) if config.model.param_dtype != "bfloat16" else None
  if dtype is not None:
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
  (folder / "adapter_model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
  paths.write_atomic(
      folder / "adapter_config.json",
      json.dumps(adapter_config(config, base_model_name_or_path), indent=2),
  )


def needs_own_base(config) -> bool:
  """True when the adapters' base is not `model.hf_path` as published: no hf_path (the seed's
  init), a full SFT warm start (folded into the base), or a quantized base (the adapters were
  trained against its dequantized weights)."""
  return not config.model.hf_path or config.sft_steps > 0 or config.lora.quantize_base != "none"


def save_base(policy, params, path: str):
  """The frozen base of `params` (adapters zeroed, dequantized) as an HF folder at `path`: what
  the PEFT adapters load onto when the base is not model.hf_path."""
  policy.save_hf(lora.zero_delta(params), path)  # save_hf merges: base + 0, dequantized
