"""One rollout-engine interface for the loop, whichever engine samples.

    engine = make_engine(config, policy, tokenizer, mesh)        # config.rollout.engine
    rollout = engine.generate(params, batch, rng, generation)    # -> Rollout (global arrays)
    engine.matches_trainer    # True: its log-probs are the trainer's (same program, same weights)
    engine.stats()            # optional figures, e.g. {"perf/weight_sync_sec": 0.02}
    engine.stream()           # native slot engine only: streaming.Stream (several steps in
                              # flight, weights landing between decode chunks), else None
    engine.close()

`params` are the policy's trainable params (the engine maps them to its own layout with
`policy.rollout_params`); `batch` is this process's rows of a prompt batch as
`data.PromptData.batch` returns them (host arrays `prompt_ids`/`prompt_mask` [b, P]). Every
engine returns the same `Rollout`: global arrays whose rows (group-major, G per prompt) are
sharded over the mesh's (data, fsdp) axes, so the update consumes either engine's output the
same way. Engines: "native" (the jitted sampler of rollout/sampler.py, or for an
encoder-decoder policy, one with `policy.decoder_start_id`, rollout/seq2seq_sampler.py) and
"vllm" (rollout/vllm_engine.py, optional dependency; decoder-only policies; on a TPU with
vllm-tpu installed, its subclass in rollout/tpu_inference_sync.py, which writes the weights into
tpu-inference's JAX model on device).
"""

import jax

from grpo_jax.parallel import multihost
from grpo_jax.rollout.sampler import Sampler
from grpo_jax.rollout.sampler import config_options
from grpo_jax.rollout.seq2seq_sampler import Seq2SeqSampler
from grpo_jax.rollout import streaming
from grpo_jax.rollout.slots import SlotEngine
from grpo_jax.rollout.slots import admits_in_decode
from grpo_jax.rollout.slots import scan_layers_option
from grpo_jax.rollout.tools import formats as tool_formats
from grpo_jax.rollout.tools import loader as tools_loader
from grpo_jax.rollout.turns import ToolTurns
from grpo_jax.rollout.types import Rollout

ENGINES = ("native", "vllm")


class NativeEngine:
  """The jitted group sampler on the policy's rollout weights (no copy for a native policy)."""

  def __init__(
      self,
      policy,
      mesh,
      *,
      num_generations: int,
      max_prompt_length: int,
      max_new_tokens: int,
      eos_ids,
      pad_id: int,
      decode_phases: int = 0,
      decode_block: int = 0,
      decode_attention: str | None = None,
      slots: int = 0,
      slot_chunk: int = 64,
      slot_scan_layers: bool | str = False,
      slot_compile_threads: int = 0,
      slot_admission: str = "auto",
      step_graphs: bool = False,
      steps_in_flight: int = 1,
      turns=None,
      max_append: int = 0,
      record_routes: bool = False,
  ):
    """slots > 0: the slot engine (rollout/slots.py) with that many decode slots, room for
    `steps_in_flight` steps' rows at once (streaming: streaming.steps_in_flight), else the
    lockstep group sampler. record_routes: the lockstep sampler keeps the MoE routes of its
    rollouts (Rollout.routes, routing replay: rl/replay.py). step_graphs (GPU): either engine's
    decode loops (steps) as CUDA graphs (rollout/gpu_options.py). slot_admission: "decode" admits
    queued groups inside the slot engine's decode, "host" between its chunks, "auto" decode
    unless `turns` (configs/common.py)."""
    self.mesh = mesh
    kw = dict(
        max_prompt_length=max_prompt_length,
        max_new_tokens=max_new_tokens,
        num_generations=num_generations,
        eos_ids=eos_ids,
        pad_id=pad_id,
        mesh=mesh,
    )
    if slots and policy.decoder_start_id is None:
      self.sampler = SlotEngine(
          policy.sampler_graphdef,
          slots=slots,
          chunk=slot_chunk,
          scan_layers=slot_scan_layers,
          compile_threads=slot_compile_threads,
          admit_in_decode=slot_admission == "decode"
          or (slot_admission == "auto" and turns is None),
          decode_phases=decode_phases,
          decode_attention=decode_attention,
          step_graphs=step_graphs,
          steps_in_flight=steps_in_flight,
          turns=turns,
          max_append=max_append,
          **kw,
      )
    elif policy.decoder_start_id is None:
      self.sampler = Sampler(
          policy.sampler_graphdef,
          decode_phases=decode_phases,
          decode_block=decode_block,
          decode_attention=decode_attention,
          record_routes=record_routes,
          step_graphs=step_graphs,
          **kw,
      )
    else:  # encoder-decoder: prompts are the encoder's input
      self.sampler = Seq2SeqSampler(
          policy.sampler_graphdef, decoder_start_id=policy.decoder_start_id, **kw
      )
    self.matches_trainer = policy.sampler_is_trainer
    # A native policy samples from the trained arrays themselves; MaxText maps them on device.
    self._to_rollout = None if policy.sampler_is_trainer else jax.jit(policy.rollout_params)
    self._rollout_spec = None  # the mapped weights' shapes and shardings, once seen

  def generate(self, params, batch: dict, rng, generation) -> Rollout:
    state = self._rollout_weights(params)
    rows = batch.get("global_rows")  # (a process without devices here has no rows)
    return self.sampler(
        state,
        multihost.to_global(batch["prompt_ids"], self.mesh, rows),
        multihost.to_global(batch["prompt_mask"], self.mesh, rows),
        rng,
        generation,
    )

  def program(self, params, prompt: dict, rng, generation):
    """The sampler program `generate(params, ...)` runs for global prompt arrays shaped like
    prompt["ids"] / ["mask"], for compiling it ahead (run/compile_ahead.py): -> (an object with
    .lower(*args), args), or None while the rollout weights' shardings are unknown (a policy
    whose sampler weights are mapped from the trained ones, before its first generate)."""
    if isinstance(self.sampler, SlotEngine):
      return None  # several programs, compiled at their first call
    if self._to_rollout is None:
      state = params
    elif self._rollout_spec is not None:
      state = self._rollout_spec
    else:
      return None
    return self.sampler.program(state, prompt["ids"], prompt["mask"], rng, generation)

  def stream(self):
    """The slot engine's streaming interface (rollout/streaming.py's Stream, which maps the
    trained params to the sampler's as `generate` does), or None for the lockstep samplers."""
    if not isinstance(self.sampler, SlotEngine):
      return None
    return streaming.Stream(self.sampler, self._rollout_weights)

  def stats(self) -> dict[str, float]:
    """Tool turns' figures since the last call (tool_call/...), when the rows call tools."""
    turns = getattr(self.sampler, "turns", None)
    return {} if turns is None else turns.stats()

  def _rollout_weights(self, params):
    """The sampler's weights for the policy's params (a native policy's: the params)."""
    state = params if self._to_rollout is None else self._to_rollout(params)
    if self._to_rollout is not None and self._rollout_spec is None:  # for program()
      self._rollout_spec = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
      )
    return state

  def close(self):
    turns = getattr(self.sampler, "turns", None)
    if turns is not None:
      turns.close()


def tool_turns(config, tokenizer, mesh, *, each_process: bool = False):
  """rollout.tools as the engine's `turns` (rollout/turns.py), or None without tools. ->
  (turns, the extra stop ids: the format's turn end when it is one token of its own).
  each_process: every process runs its own rows' tools (the vLLM engine, whose processes
  sample their own prompts); else the engine's first process runs them for all (the slot
  engine, whose rows are global)."""
  r = config.rollout
  toolset = tools_loader.load_tools(r.tools.file, r.tools.names)
  if toolset is None:
    return None, ()
  fmt = tool_formats.get(r.tools.format)
  end = tokenizer.encode(fmt.turn_end)
  if len(end) != 1:
    raise ValueError(
        f"rollout.tools.format={fmt.name!r}: its turn end {fmt.turn_end!r} is {len(end)} tokens "
        "in this tokenizer; a row stops at one token. Fix: a tokenizer with it as a special "
        "token (tokenizer.kind='char_tools' for the char demo; Qwen's has <|im_end|>)"
    )
  first = min(d.process_index for d in mesh.devices.flat) if mesh is not None else 0
  turns = ToolTurns(
      toolset,
      fmt,
      tokenizer,
      max_turns=r.max_turns,
      max_response_tokens=r.max_tool_response_tokens,
      timeout_sec=r.tools.timeout_sec,
      workers=r.tools.workers,
      runs_tools=each_process or jax.process_index() == first,
  )
  return turns, tuple(end)


def make_engine(
    config,
    policy,
    tokenizer,
    mesh,
    *,
    num_generations: int | None = None,
    max_new_tokens: int | None = None,
    kind: str | None = None,
    record_routes: bool = False,
):
  """The engine named by `kind` (default config.rollout.engine) for `policy` on `mesh`.

  num_generations / max_new_tokens default to the training rollout's (config.num_generations,
  config.max_completion_length); evaluation asks for 1 and config.eval.max_new_tokens.
  record_routes: the native lockstep sampler records the MoE routes (the training rollout's
  with rollout.routing_replay="rollout").
  """
  kind = kind or config.rollout.engine
  g = config.num_generations if num_generations is None else num_generations
  c = config.max_completion_length if max_new_tokens is None else max_new_tokens
  if kind == "vllm":
    if policy.decoder_start_id is not None:
      raise ValueError(
          "rollout.engine='vllm' serves decoder-only policies; this one is an "
          "encoder-decoder (model.family). Fix: --config.rollout.engine=native"
      )
    from grpo_jax.rollout import tpu_inference_mapping
    from grpo_jax.rollout import tpu_inference_sync

    if tpu_inference_mapping.available():  # vLLM-TPU: on-device sync into its JAX model
      cls = tpu_inference_sync.engine_class()
    else:
      from grpo_jax.rollout import vllm_engine  # optional dependency

      cls = vllm_engine.VLLMEngine
    turns, turn_end = tool_turns(config, tokenizer, mesh, each_process=True)
    return cls.from_config(
        config,
        policy,
        tokenizer,
        mesh,
        num_generations=g,
        max_new_tokens=c,
        turns=turns,
        turn_end=turn_end,
    )
  if kind != "native":
    raise ValueError(f"rollout.engine={kind!r}: use one of {', '.join(ENGINES)}")
  turns, turn_end = tool_turns(config, tokenizer, mesh)
  slots = config.rollout.slots
  if turns is not None and not slots:  # (evaluation of a vLLM run: tools need the slot engine)
    slots = config.batch_size * g
  return NativeEngine(
      policy,
      mesh,
      num_generations=g,
      max_prompt_length=config.max_prompt_length,
      max_new_tokens=c,
      eos_ids=tuple(dict.fromkeys((*tokenizer.stop_ids, *turn_end))),
      pad_id=tokenizer.pad_id,
      **config_options(config),
      slots=slots,
      slot_chunk=config.rollout.slot_chunk,
      slot_scan_layers=scan_layers_option(config),
      slot_compile_threads=config.rollout.slot_compile_threads,
      slot_admission=config.rollout.slot_admission,
      steps_in_flight=streaming.steps_in_flight(config),
      turns=turns,
      max_append=config.rollout.max_tool_response_tokens if turns is not None else 0,
      record_routes=record_routes,
  )
