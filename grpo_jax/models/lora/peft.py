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
export as above. Adapters on the experts (an MoE layer's mlp/{gate,up,down}, A [E, in, r], B [E,
r, out]) export through PEFT's `target_parameters` onto transformers 5's fused 3-D expert
parameters, gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F]: PEFT's
`ParamWrapper` keeps lora_A [r E, in] expert-major ((E, r, in)) and lora_B [out, r E] rank-major
((out, r, E)), and adds scaling * B[e] @ A[e] to expert e (peft 0.21, checked against its own
merge). gate and up share one parameter, so their adapters go in as one of rank 2r: A = [A_gate^T;
A_up^T], B = [[B_gate^T, 0], [0, B_up^T]]; PEFT has one rank per file, so every adapter of such a
run exports at 2r, zero-padded (A = [A; 0], B = [B, 0]) with lora_alpha 2 alpha: scaling alpha / r,
the same deltas, exactly. Both on one layer's experts, PEFT nests them in parameter order: the
gate_up adapter is `mlp.experts.base_layer`, down's `mlp.experts`.
"""

import json

import jax
import numpy as np
from flax import nnx

from grpo_jax.run import paths
from grpo_jax.models.decoder import hf
from grpo_jax.models.lora import adapters as lora


def _rank(config) -> int:
  """The rank PEFT's file carries: 2r when some MoE layer's experts adapt gate or up (their
  fused gate_up_proj takes both adapters as one of rank 2r), else r."""
  mcfg = lora.model_config(config.model)
  fused = any(
      m == "mlp" and w in ("gate", "up") and mcfg.layer_is_moe(i)
      for i, m, w in lora.targets(mcfg.num_layers, config.lora.target_modules)
  )
  return int(config.lora.rank) * (2 if fused else 1)


def _expert_names(layer: int, adapted: set) -> dict:
  """{"gate_up" | "down": PEFT's module prefix} for one MoE layer's adapted expert parameters
  (`adapted` the native weights with adapters): nested in parameter order when both are."""
  stem = f"base_model.model.model.layers.{layer}.mlp.experts"
  both = bool(adapted & {"gate", "up"}) and "down" in adapted
  out = {}
  if adapted & {"gate", "up"}:
    out["gate_up"] = stem + (".base_layer" if both else "")
  if "down" in adapted:
    out["down"] = stem
  return out


def peft_tensors(params, config) -> dict:
  """{PEFT tensor name: host array} for every adapter in `params` (multi-host: collective),
  at `_rank(config)` (zero-padded where that is 2r)."""
  cfg, lc = config.model, config.lora
  mcfg = lora.model_config(cfg)
  rank = _rank(config)
  flat = dict(nnx.to_flat_state(params))

  def factors(i, m, w):
    prefix = ("layers",) if cfg.scan_layers else ("layers", i)
    a = hf._to_host(flat[(*prefix, m, f"{w}_lora_a")].get_value())
    b = hf._to_host(flat[(*prefix, m, f"{w}_lora_b")].get_value())
    return (a[i], b[i]) if cfg.scan_layers else (a, b)

  def padded(a_ri, b_or):  # PEFT's [r, in], [out, r] zero-padded to `rank`
    r = a_ri.shape[0]
    return np.pad(a_ri, ((0, rank - r), (0, 0))), np.pad(b_or, ((0, 0), (0, rank - r)))

  out, experts = {}, {}
  for i, m, w in lora.targets(cfg.num_layers, lc.target_modules):
    a, b = factors(i, m, w)
    if m == "mlp" and mcfg.layer_is_moe(i):
      experts.setdefault(i, {})[w] = (a, b)  # A [E, in, r], B [E, r, out]
      continue
    r = a.shape[-1]
    name = f"base_model.model.model.layers.{i}.{lora.HF_MODULES[(m, w)]}"
    a_ri, b_or = padded(a.reshape(-1, r).T, b.reshape(r, -1).T)
    out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_ri)
    out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_or)
  for i, ab in experts.items():
    names = _expert_names(i, set(ab))
    e, r = mcfg.num_experts, int(lc.rank)
    f, d = mcfg.moe_intermediate_size, mcfg.hidden_size
    if "gate_up" in names:  # [E, rank, D] and [E, 2F, rank]: gate's block, then up's
      a_eri = np.zeros((e, rank, d), np.float32)
      b_eor = np.zeros((e, 2 * f, rank), np.float32)
      for k, w in enumerate(("gate", "up")):
        if w in ab:
          a, b = ab[w]
          a_eri[:, k * r : (k + 1) * r] = a.swapaxes(1, 2)
          b_eor[:, k * f : (k + 1) * f, k * r : (k + 1) * r] = b.swapaxes(1, 2)
      _put_experts(out, names["gate_up"], a_eri, b_eor)
    if "down" in names:
      a, b = ab["down"]
      a_eri = np.zeros((e, rank, f), np.float32)
      b_eor = np.zeros((e, d, rank), np.float32)
      a_eri[:, :r], b_eor[:, :, :r] = a.swapaxes(1, 2), b.swapaxes(1, 2)
      _put_experts(out, names["down"], a_eri, b_eor)
  return out


def _put_experts(out: dict, name: str, a_eri: np.ndarray, b_eor: np.ndarray):
  """Per-expert factors (delta[e] = scaling * B[e] @ A[e]) in ParamWrapper's layout: lora_A
  [E r, in] expert-major, lora_B [out, r E] rank-major."""
  e, r, _ = a_eri.shape
  out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_eri.reshape(e * r, -1))
  out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_eor.transpose(1, 2, 0).reshape(-1, r * e))


def adapter_config(config, base_model_name_or_path: str = "") -> dict:
  """PEFT's LoraConfig as JSON: the exact module names that carry adapters, and the MoE
  layers' expert parameters (`target_parameters`)."""
  cfg, lc = config.model, config.lora
  mcfg = lora.model_config(cfg)
  modules, params = set(), set()
  for i, m, w in lora.targets(cfg.num_layers, lc.target_modules):
    if m == "mlp" and mcfg.layer_is_moe(i):
      param = "gate_up_proj" if w in ("gate", "up") else "down_proj"
      params.add(f"model.layers.{i}.mlp.experts.{param}")
    else:
      modules.add(f"model.layers.{i}.{lora.HF_MODULES[(m, w)]}")
  rank = _rank(config)
  out = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "r": rank,
      "lora_alpha": float(lc.alpha) * rank / int(lc.rank),  # scaling alpha / r, as trained
      # PEFT's ParamWrapper (expert parameters) refuses dropout; it is off at inference anyway
      "lora_dropout": 0.0 if params else float(lc.dropout),
      "target_modules": sorted(modules),
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "modules_to_save": None,
      "base_model_name_or_path": base_model_name_or_path,
      "inference_mode": True,
  }
  if params:
    out["target_parameters"] = sorted(params)
  return out


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
