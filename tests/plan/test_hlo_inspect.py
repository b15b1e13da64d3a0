"""hlo_inspect on hand-written HLO text (the compiled programs' tests read real modules:
tests/plan/test_compiled_programs.py, under scripts/test_aot.sh)."""

from grpo_jax.plan import hlo_inspect as hi

# A layer loop's body over stacked weights w [4, 64, 128] (16 KiB a layer, bf16): layer i's
# slice written by an async fusion (a copy), read in place by a cuBLAS call (XLA:GPU's
# dynamic-slice fusion), fused into a dot's operand, prefetched on chip (S(1)), and a small one.
MODULE = """HloModule layers

%copied (p0: bf16[4,64,128], p1: s32[]) -> bf16[64,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,64,128}
  ROOT %bitcast.1 = bf16[64,128]{1,0} bitcast(%dynamic-slice.1)
}

%addressed (p0: bf16[4,64,128], p1: s32[], p2: bf16[8,64]) -> bf16[8,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[8,64]{1,0} parameter(2)
  %c0 = s32[] constant(0)
  %dynamic-slice.2 = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,64,128}
  %bitcast.2 = bf16[64,128]{1,0} bitcast(%dynamic-slice.2)
  ROOT %custom-call.2 = bf16[8,128]{1,0} custom-call(%p2, %bitcast.2), custom_call_target="__cublas$lt$matmul"
}

%operand (p0: bf16[4,64,128], p1: s32[]) -> bf16[64,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %dynamic-slice.3 = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,64,128}
  ROOT %bitcast.3 = bf16[64,128]{1,0} bitcast(%dynamic-slice.3)
}

%matmul (p0: bf16[4,64,128], p1: s32[], p2: bf16[8,64]) -> bf16[8,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[8,64]{1,0} parameter(2)
  %fusion.3 = bf16[64,128]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%operand
  ROOT %dot.3 = bf16[8,128]{1,0} dot(%p2, %fusion.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%on_chip (p0: bf16[4,64,128], p1: s32[]) -> bf16[1,64,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %dynamic-slice.4 = bf16[1,64,128]{2,1,0:T(8,128)(2,1)S(1)} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,64,128}
}

%body (arg: (s32[], bf16[4,64,128], bf16[8,64], bf16[4,8])) -> (s32[], bf16[4,64,128], bf16[8,64], bf16[4,8]) {
  %arg = (s32[], bf16[4,64,128]{2,1,0}, bf16[8,64]{1,0}, bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %w = bf16[4,64,128]{2,1,0} get-tuple-element(%arg), index=1
  %x = bf16[8,64]{1,0} get-tuple-element(%arg), index=2
  %n = bf16[4,8]{1,0} get-tuple-element(%arg), index=3
  %fusion-start.1 = ((bf16[4,64,128]{2,1,0}, s32[]), bf16[64,128]{1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, calls=%copied
  %fusion-done.1 = bf16[64,128]{1,0} fusion-done(%fusion-start.1)
  %dynamic_slice_fusion.2 = bf16[8,128]{1,0} fusion(%w, %i, %x), kind=kCustom, calls=%addressed, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion","kernel_index":0}}}
  %fusion.4 = bf16[8,128]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%matmul
  %fusion.5 = bf16[1,64,128]{2,1,0:T(8,128)(2,1)S(1)} fusion(%w, %i), kind=kLoop, calls=%on_chip
  %c0 = s32[] constant(0)
  %dynamic-slice.6 = bf16[1,8]{1,0} dynamic-slice(%n, %i, %c0), dynamic_slice_sizes={1,8}
  ROOT %out = (s32[], bf16[4,64,128]{2,1,0}, bf16[8,64]{1,0}, bf16[4,8]{1,0}) tuple(%i, %w, %x, %n)
}

%cond (arg: (s32[], bf16[4,64,128], bf16[8,64], bf16[4,8])) -> pred[] {
  %arg = (s32[], bf16[4,64,128]{2,1,0}, bf16[8,64]{1,0}, bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %c4 = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %c4), direction=LT
}

ENTRY %main (a: (s32[], bf16[4,64,128], bf16[8,64], bf16[4,8])) -> (s32[], bf16[4,64,128], bf16[8,64], bf16[4,8]) {
  %a = (s32[], bf16[4,64,128]{2,1,0}, bf16[8,64]{1,0}, bf16[4,8]{1,0}) parameter(0)
  ROOT %while = (s32[], bf16[4,64,128]{2,1,0}, bf16[8,64]{1,0}, bf16[4,8]{1,0}) while(%a), condition=%cond, body=%body
}
"""


def test_slices_are_the_ones_written_to_memory():
  """A layer's weights copied out of the stack per iteration (the async fusion) count; the
  slice a cuBLAS call or a dot reads in place, the on-chip prefetch and a slice under
  min_bytes do not."""
  found = hi.slices(MODULE, 1024, within=hi.every_iteration(MODULE))
  assert [(o.name, n) for o, n in found] == [("dynamic-slice.1", 64 * 128 * 2)]
  assert [o.name for o, _ in hi.slices(MODULE, 16)] == ["dynamic-slice.1", "dynamic-slice.6"]
  assert not hi.slices(MODULE, 64 * 128 * 2 + 1)


# XLA:GPU's thunk sequence (its *thunk_sequence_after_thunk_passes.txt): a step loop driven
# from the host, whose body is one command buffer holding a conditional and a layer loop.
THUNKS = """000: kCommandBuffer [source       | next=002 (1)]
    001: kCopy         [source       | sink        ] kCopy
002: kWhile         [prev=000 (1) | sink        ]
condition:
    003: kCustomKernel [source       | sink        ] loop_and_fusion
  body:
    000: kCommandBuffer [source | sink]
        004: kConditional  [source       | next=006 (1)]
          false_branch:
            005: kWhile [source | sink]
condition:
                007: kCustomKernel [source | sink] compare
        006: kWhile          [prev=004 (1) | sink        ]
condition:
            008: kCustomKernel [source | sink] compare
    009: kConditional  [source | sink]
"""


def test_thunks_outside_graphs_follow_the_command_buffers_nesting():
  """The step loop and the conditional after the body's command buffer are outside any graph;
  the conditional, the admission's loop and the layer loop inside it are not."""
  assert [t.split(":")[0] for t in hi.thunks_outside_graphs(THUNKS, "kWhile")] == ["002"]
  assert [t.split(":")[0] for t in hi.thunks_outside_graphs(THUNKS, "kConditional")] == ["009"]
  assert not hi.thunks_outside_graphs(THUNKS, "kCopy")
