"""What XLA builds for an MoE update: the loop's update (forward and backward, micro-batches
accumulated) of a tiny Qwen3-MoE-shaped policy (configs/tiny_moe.py: 2 layers, every layer 12
SwiGLU experts of width F = 96 over D = 128, top-2; bf16 compute) compiled through
memory_plan's path for one H100 and four H100s with the experts split 4 ways over the mesh's
expert axis (XLA:GPU's deviceless compile), and for a v5p-8 (libtpu) split 4 ways (and 2 ways
beside fsdp 2), read as optimized HLO (plan/hlo_inspect.py). Each target skips with one line when its compiler is not
importable (scripts/test_aot.sh installs both into .venv-aot).

  (a) the experts run as grouped GEMMs, 9 per layer (gate, up, down forward; each one's input
      and weight gradients): on the v5p the TPU compiler's ragged-dot kernels (moe.py's
      ragged_dot), on the H100 moe.py's Pallas Triton kernels (grouped_matmul.py: XLA:GPU
      (jax-cuda13-plugin 0.12.0.1) has no grouped GEMM for ragged-dot on CUDA; its
      RaggedDotRewriter makes dense dots of every expert over every row)
  (b) no dense all-expert compute: no dot batched over experts spanning all routed rows
  (c) under expert parallelism, its dispatch: the [ep, pairs, D] all-to-alls (sent and
      returned, forward and backward) of moe.expert_parallel
"""

import glob
import math
import os

import pytest

from configs import tiny_moe
from grpo_jax import memory_plan as mp
from grpo_jax.plan import hlo_inspect as hi
from tests.plan.test_compiled_programs import _target

E, K, D, F = 12, 2, 128, 96  # experts, experts per token, hidden, expert width
LAYERS = 2
MICRO = 64  # rows per micro-batch
S = 13  # tokens per row: prompt 6 + completion 7


def moe_config(fsdp: int, expert: int):
  c = tiny_moe.get_config()
  m = c.model
  m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size = E, K, F
  m.dtype = "bfloat16"  # f32 master weights, bf16 compute
  m.attention_impl = "xla"  # rows of 13 tokens: cuDNN's flash attention wants longer ones
  c.micro_batch_size = MICRO
  c.mesh.data, c.mesh.fsdp, c.mesh.expert = -1, fsdp, expert
  assert (m.hidden_size, m.num_layers) == (D, LAYERS)
  assert c.max_prompt_length + c.max_completion_length == S
  return c


class Update(dict):
  """platform, mesh shape, tokens per device per micro-batch, hlo: the update's text."""

  def __repr__(self):
    return f"Update({self['platform']}, {self['mesh']})"


@pytest.fixture(
    scope="module",
    params=[("h100", 1, 1), ("h100-4", 1, 4), ("v5p-8", 1, 4), ("v5p-8", 2, 2)],
    ids=["h100", "h100x4-ep4", "v5p-8-ep4", "v5p-8-fsdp2-ep2"],
)
def update(request, tmp_path_factory):
  """-> Update: the MoE update compiled for the target."""
  name, fsdp, expert = request.param
  target = _target(name)
  out = tmp_path_factory.mktemp(f"hlo_moe_{name}_{fsdp}_{expert}")
  _, mesh = mp.plan(
      moe_config(fsdp, expert),
      target,
      functions=("update",),
      log=lambda _: None,
      dump_hlo=str(out),
  )
  assert (mesh["fsdp"], mesh["expert"]) == (fsdp, expert), mesh
  (path,) = glob.glob(str(out / "update_*.hlo.txt"))
  devices = math.prod(mesh[a] for a in ("data", "fsdp", "expert"))
  return Update(
      platform=target.devices[0].platform,
      mesh=mesh,
      tokens=MICRO * S // devices,
      hlo=open(path).read(),
  )


def _show(ops) -> str:
  return "; ".join(f"{o.opcode} {o.type} ({o.computation})" for o in ops[:6]) + (
      f" ... ({len(ops)} in all)" if len(ops) > 6 else ""
  )


def test_experts_run_as_grouped_matmuls(update):
  grouped = hi.grouped_matmuls(update["hlo"])
  assert len(grouped) >= 9 * LAYERS, f"{len(grouped)} grouped GEMMs: {_show(grouped)}"


def test_no_dense_all_expert_compute(update):
  """No dot batched over experts that spans every routed pair of the device (its tokens * k,
  or under expert parallelism the ep * tokens * k rows its experts receive) at width F."""
  rows = update["mesh"]["expert"] * update["tokens"] * K
  assert E * max(D, F) < 2 * rows  # every weight below the bound (dense_expert_dots)
  dense = hi.dense_expert_dots(update["hlo"], rows, min(D, F))
  assert not dense, f"dense all-expert dots: {_show(dense)}"


def test_expert_parallel_dispatch_is_an_all_to_all(update):
  """The experts split over `expert`: each layer's pairs [ep, tokens * k, D] all-to-all to the
  experts' shards and back, forward and backward (4 per layer); one H100 has none."""
  ep = update["mesh"]["expert"]
  pairs = [
      o
      for o in hi.all_to_alls(update["hlo"])
      if hi.dims(o.type)[1] == (ep, update["tokens"] * K, D)
  ]
  if ep == 1:
    assert not hi.all_to_alls(update["hlo"])
    return
  assert len(pairs) >= 4 * LAYERS, f"{len(pairs)} [ep, pairs, D] all-to-alls: {_show(pairs)}"
