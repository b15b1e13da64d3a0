"""XLA:GPU compiler options of the sampling programs, each read in the compiled HLO or XLA's thunk
sequence (tests/plan/test_compiled_programs.py; benchmarks/README.md "Slot engine").

    jax.jit(fn, compiler_options=merged(SCANNED_GPU_OPTIONS, STEP_GRAPH_OPTIONS))

`merged` joins the lists of passes each set disables (a plain dict update would keep only the
last set's list).
"""

# The scanned slot engine's layered programs: every GEMM reads its layer's weights where they
# lie in the stacks [L, ...] (a cuBLAS call at an address offset by the scan's loop index,
# computed on the host: XLA's dynamic-slice fusion), instead of an async copy of the layer's
# slice before a Triton GEMM (31.5 MB per layer, 0.88 GB per decode step for Qwen3-0.6B).
# Dynamic-slice fusion takes cuBLAS GEMMs only, hence no Triton GEMMs; and XLA's dot merger
# would join the q/k/v (gate/up) GEMMs into one over their weights concatenated per step, hence
# none.
SCANNED_GPU_OPTIONS = {
    "xla_gpu_enable_dynamic_slice_fusion": True,
    "xla_gpu_enable_triton_gemm": False,
    "xla_disable_hlo_passes": "dot-merger",
}

# Loops into CUDA graphs (rollout.step_graphs; opt-in: not yet run on a GPU). By default XLA's
# command buffers leave out `while` loops and `conditional`s: a decode loop launches a graph per
# step (per layer in a scanned step) and reads each loop's (and admission's) predicate on the
# host. With WHILE and CONDITIONAL commands and known-trip-count loops unrolled into the graph,
# the lockstep sampler's whole generate is one command buffer (no `while` left outside graphs;
# by default 2: the loop over 8-step blocks and the block's 8 steps).
# (XLA's default commands plus WHILE and CONDITIONAL; names that jax 0.11.2's XLA, the GPU
# machine's, knows too: not 0.12's COLLECTIVES_KERNEL; a decode on one GPU has none.)
LOOP_GRAPH_OPTIONS = {
    "xla_gpu_enable_command_buffer": (
        "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
    ),
    "xla_gpu_command_buffer_unroll_loops": True,
}

# The slot engine's decode steps, each one CUDA graph (its layers and admission included): the
# loop graphs, and no async wrapper of small dynamic-slice copies (the layers' norm scales, on
# other streams), which would keep the layer loop out of the graph.
STEP_GRAPH_OPTIONS = {
    **LOOP_GRAPH_OPTIONS,
    "xla_disable_hlo_passes": "dot-merger,dynamic-slice-copy-fusion-async-wrapper",
}


def merged(*option_sets: dict) -> dict:
  """The option sets in order, later values winning, except `xla_disable_hlo_passes`: the union
  of every set's passes (in first-seen order)."""
  out, passes = {}, []
  for options in option_sets:
    for key, value in options.items():
      if key == "xla_disable_hlo_passes":
        passes += [p for p in value.split(",") if p and p not in passes]
      else:
        out[key] = value
  if passes:
    out["xla_disable_hlo_passes"] = ",".join(passes)
  return out
