"""The config system: shipped configs load and validate; typos and bad values give one line."""

import importlib.util
import os
import subprocess
import sys

import pytest

from grpo_jax import configuration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = (
    "tiny",
    "tiny_maxtext",
    "tiny_lora",
    "tiny_gemma3",
    "qwen3_0p6b",
    "qwen3_8b",
    "llama3_8b",
    "gemma3_1b",
    "tiny_your_data",
    "tiny_moe",
    "qwen3_30b_a3b",
    "tiny_tools",
    "qwen3_8b_tools",
)


def load(name):
  path = os.path.join(ROOT, "configs", f"{name}.py")
  if not os.path.exists(path):
    pytest.skip(f"configs/{name}.py not present")
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.lock()
  return config


def errors_of(config, **kw):
  kw.setdefault("num_devices", 8)
  kw.setdefault("num_processes", 1)
  return configuration.validate(config, **kw)


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_are_valid(name):
  config = load(name)
  if config.data.train_source != "arithmetic":
    # Real-data configs need user paths; point them at anything that exists.
    with config.unlocked():
      config.data.train_path = config.data.eval_path = __file__
      config.tokenizer.path = CHAT_TOKENIZER
  assert errors_of(config) == []


def test_qwen3_8b_validates_with_either_model_impl():
  pytest.importorskip("maxtext")
  c = load("qwen3_8b")
  with c.unlocked():
    c.data.train_path = c.data.eval_path = __file__
    c.tokenizer.path = ROOT
  for impl in ("native", "maxtext"):
    c.model.impl = impl
    assert errors_of(c) == [], impl
  c.model.maxtext.attention = "flashy"
  assert any("model.maxtext.attention='flashy'" in e for e in errors_of(c))
  llama = load("llama3_8b")  # Llama 3.1 8B: MaxText's llama2 block with Llama 3.1 RoPE
  with llama.unlocked():
    llama.data.train_path = llama.data.eval_path = __file__
    llama.tokenizer.path = ROOT
  llama.model.impl = "maxtext"
  assert [e for e in errors_of(llama) if e.startswith("model.")] == []
  llama.model.rope_scaling_factor = 4.0  # not MaxText's hard-coded Llama 3.1 scaling
  assert any(
      e.startswith("model.arch='llama3'")
      and "Llama RoPE scaling is Llama 3.1's" in e
      and "Fix: use --config.model.impl=native" in e
      for e in errors_of(llama)
  )
  gemma = load("tiny_gemma3")  # its 1-in-3 global layers are not MaxText's fixed 1 in 6
  gemma.model.impl = "maxtext"
  assert any(
      e.startswith("model.arch='gemma3'") and "sliding_window_pattern=6" in e
      for e in errors_of(gemma)
  )
  gemma.model.sliding_window_pattern = 6
  assert [e for e in errors_of(gemma) if e.startswith("model.")] == []


def test_qwen3_8b_has_the_recipe_values():
  c = load("qwen3_8b")
  assert (c.num_generations, c.beta, c.loss.clip_eps, c.num_iterations) == (2, 0.08, 0.2, 1)
  assert (c.optimizer.learning_rate, c.optimizer.warmup_ratio, c.optimizer.max_grad_norm) == (
      3e-6,
      0.1,
      0.1,
  )
  assert (c.rollout.temperature, c.rollout.top_k, c.max_completion_length) == (0.9, 50, 1024)
  assert (c.num_steps, c.save_interval_steps, c.checkpoint.max_to_keep) == (200, 500, 4)
  assert (c.model.param_dtype, c.model.dtype) == ("float32", "bfloat16")  # f32 master weights
  assert (c.model.num_layers, c.model.hidden_size, c.model.vocab_size) == (36, 4096, 151936)


def test_qwen3_30b_a3b_has_the_published_shape_and_the_recipe_values():
  c = load("qwen3_30b_a3b")
  m = c.model
  assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (
      48,
      2048,
      32,
      4,
      128,
  )
  assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.vocab_size) == (
      128,
      8,
      768,
      151936,
  )
  assert m.norm_topk_prob and m.rope_theta == 1e6 and tuple(m.mlp_only_layers) == ()
  assert (m.param_dtype, m.dtype, m.scan_layers) == ("float32", "bfloat16", True)
  assert (c.num_generations, c.beta, c.optimizer.learning_rate, c.max_completion_length) == (
      2,
      0.08,
      3e-6,
      1024,
  )
  # A mixed dense / MoE stack cannot be scanned: one line names the field and the fix.
  with c.unlocked():
    c.data.train_path = c.data.eval_path = __file__
    c.tokenizer.path = CHAT_TOKENIZER
  m.mlp_only_layers = (0,)
  assert any(
      e.startswith("model.scan_layers=True") and "scan_layers=False" in e for e in errors_of(c)
  )


BAD_VALUES = [
    # (field path, bad value, words the one line must contain)
    ("num_generations", 1, ["num_generations=1", "num_generations >= 2"]),
    ("loss.clip_eps", 1.5, ["loss.clip_eps=1.5", "(0, 1)"]),
    ("loss.clip_eps", 0.0, ["loss.clip_eps=0.0", "(0, 1)"]),
    ("batch_size", 3, ["batch_size=3", "data-parallel", "16"], {"num_devices": 16}),
    ("loss.loss_agg_mode", "token_mean", ["loss.loss_agg_mode='token_mean'", "token-mean"]),
    ("loss.kl_kind", "k4", ["loss.kl_kind='k4'", "k3"]),
    ("loss.estimator", "ppo", ["loss.estimator='ppo'", "grpo"]),
    ("max_completion_length", 100000, ["max_completion_length=100000", "context"]),
    ("rollout.top_p", 0.0, ["rollout.top_p=0.0", "(0, 1]"]),
    ("reward.functions", ("nope",), ["reward.functions=", "'nope'"]),
    ("optimizer.learning_rate", -1.0, ["optimizer.learning_rate=-1.0", "> 0"]),
    ("beta", -0.1, ["beta=-0.1", ">= 0"]),
    ("loss.clip_ratio_c", 0.5, ["loss.clip_ratio_c=0.5", "> 1"]),
    ("mesh.tensor", 3, ["mesh.data=", "8 available devices"]),
]


@pytest.mark.parametrize("case", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_gives_one_clear_line(case):
  field, value, words, kw = (*case, {})[:4]
  config = load("tiny")
  node = config
  parts = field.split(".")
  with config.unlocked():
    for p in parts[:-1]:
      node = node[p]
    if field == "reward.functions":
      config.reward.weights = (1.0,)
    setattr(node, parts[-1], value)
  errors = errors_of(config, **kw)
  assert len(errors) == 1, errors
  for w in words:
    assert w in errors[0], (w, errors[0])
  assert "Fix:" in errors[0]


@pytest.mark.parametrize(
    "name,fix",
    [
        ("xsum_t5", "Fix: --config.lora.rank=0 (full fine-tuning)"),
        (
            "tiny_maxtext",
            "Fix: --config.lora.rank=0 (full fine-tuning), or --config.model.impl=native",
        ),
    ],
)
def test_lora_on_a_policy_without_adapters_names_a_fix_that_applies(name, fix):
  """T5 is native already: its fix is no LoRA (model.impl=native would change nothing);
  a MaxText decoder can also switch to the native one."""
  config = load(name)
  with config.unlocked():
    config.lora.rank = 4
  lines = [e for e in errors_of(config) if e.startswith("lora.rank=4")]
  assert len(lines) == 1 and lines[0].endswith(fix), lines


def test_many_bad_values_are_reported_together():
  config = load("tiny")
  with config.unlocked():
    config.loss.clip_eps = 2.0
    config.loss.kl_kind = "kx"
    config.rollout.temperature = 0.0
  assert len(errors_of(config)) == 3


def _main(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )


def test_typo_in_override_names_the_field():
  r = _main("--config=configs/tiny.py", "--config.betta=1")
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  assert "--config.betta" in last and "beta" in last, r.stderr
  assert "Traceback" not in r.stderr


def test_a_comma_separated_list_sets_a_tuple_field():
  """`--config.reward.functions=a,b` is what a user types for a tuple of names; ml_collections
  reads it as the one name 'a,b' (a validation error naming 'a,b'): main splits it."""
  r = _main(
      "--config=configs/tiny.py",
      "--config.reward.functions=answer_match, answer_format",
      "--config.eval.generation_configs=greedy,standard",
      "--config.eval.pass_k=1,2",
      "--print_config",
  )
  assert r.returncode == 0, r.stderr
  printed = r.stdout.replace(" ", "")
  assert "functions:!!python/tuple\n-answer_match\n-answer_format\n" in printed
  assert "generation_configs:!!python/tuple\n-greedy\n-standard\n" in printed
  assert "pass_k:!!python/tuple\n-1\n-2\n" in printed
  c = load("tiny")
  c.eval.generation_configs, c.reward.weights = ("greedy",), (1.0, 0.1)
  assert configuration.split_comma_lists(c) == [] and c.eval.generation_configs == ("greedy",)
  c.eval.generation_configs = ("greedy,", "liberal")
  assert configuration.split_comma_lists(c) == ["eval.generation_configs"]
  assert c.eval.generation_configs == ("greedy", "liberal")


def test_bad_value_on_command_line_stops_before_training(tmp_path):
  r = _main(
      "--config=configs/tiny.py",
      "--config.loss.clip_eps=1.5",
      "--config.num_generations=1",
      f"--workdir={tmp_path}",
  )
  assert r.returncode == 2
  lines = [l for l in r.stderr.splitlines() if l.startswith("  ")]
  assert len(lines) == 2, r.stderr
  assert any("loss.clip_eps=1.5" in l for l in lines)
  assert any("num_generations=1" in l for l in lines)
  assert not os.listdir(tmp_path)


# ------------------------------------------------------- accepted names come from their owners


def _owner_names():
  """(config field, the names its owner module defines): what the validator must accept."""
  from grpo_jax.data import arithmetic
  from grpo_jax.data import pipeline
  from grpo_jax.data import sources
  from grpo_jax.data import templates
  from grpo_jax.data import tokenizers
  from grpo_jax.models import build
  from grpo_jax.models.decoder import config as model_config
  from grpo_jax.models.decoder import decode_attention
  from grpo_jax.models import remat
  from grpo_jax.rewards import computer
  from grpo_jax.rl import advantages
  from grpo_jax.rl import registry
  from grpo_jax.rollout import engine
  from grpo_jax.rollout import types

  impls = [
      i for i in build.IMPLS if i != "maxtext" or importlib.util.find_spec("maxtext") is not None
  ]
  return [
      ("model.impl", impls),
      ("model.param_dtype", model_config.DTYPES),
      ("model.dtype", model_config.DTYPES),
      ("model.remat_policy", remat.POLICIES),
      ("eval.generation_configs", [(name,) for name in types.GENERATION_CONFIGS]),
      ("data.train_source", sources.SOURCES),
      ("data.eval_source", sources.SOURCES),
      ("data.template", templates.TEMPLATES),
      ("data.system_prompt", templates.SYSTEM_PROMPTS),
      ("data.overlong_prompts", pipeline.OVERLONG_PROMPTS),
      ("data.arithmetic.demonstration", arithmetic.DEMONSTRATION_STYLES),
      ("tokenizer.kind", tokenizers.KINDS),
      ("reward.on_error", computer.ON_ERROR),
      ("loss.std_kind", advantages.STD_KINDS),
      ("loss.estimator", registry.ADVANTAGE_ESTIMATORS.names()),
      ("loss.policy_loss", registry.POLICY_LOSSES.names()),
      ("loss.kl_kind", registry.KL_ESTIMATORS.names()),
      ("loss.loss_agg_mode", registry.LOSS_AGG_MODES.names()),
      ("rollout.engine", engine.ENGINES),
      ("rollout.decode_attention", decode_attention.IMPLS),
      ("debug.transfer_guard", configuration.TRANSFER_GUARDS),
  ]


# A tokenizer folder with nothing but a chat template (data.template=tokenizer validates).
CHAT_TOKENIZER = os.path.join(ROOT, "tests", "data", "chat_tokenizer")


def test_template_tokenizer_needs_a_folder_with_a_chat_template():
  config = _tiny_with_paths()
  _set(config, "data.template", "tokenizer")
  (line,) = errors_of(config)
  assert line.startswith("data.template='tokenizer': the char tokenizer has no chat template")
  _set(config, "tokenizer.kind", "hf")
  _set(config, "tokenizer.path", ROOT)
  (line,) = errors_of(config)
  assert f"the tokenizer folder {ROOT} has no chat template" in line and "Fix:" in line


def _set(config, field, value):
  node = config
  parts = field.split(".")
  with config.unlocked():
    for p in parts[:-1]:
      node = node[p]
    setattr(node, parts[-1], value)


def _tiny_with_paths():
  """tiny.py with files and a tokenizer folder, so any source or tokenizer kind is usable."""
  config = load("tiny")
  with config.unlocked():
    config.data.train_path = config.data.eval_path = __file__
    config.tokenizer.path = CHAT_TOKENIZER
  return config


@pytest.mark.parametrize("field,names", _owner_names(), ids=[f for f, _ in _owner_names()])
def test_validator_accepts_exactly_the_owners_names(field, names):
  assert len(names) >= 2, (field, names)
  for name in names:
    config = _tiny_with_paths()
    _set(config, field, name)
    if (field, name) == ("data.template", "tokenizer"):
      _set(config, "tokenizer.kind", "hf")  # the char tokenizer has no chat template
    assert errors_of(config) == [], (field, name)
  config = _tiny_with_paths()
  bad = ("not-a-name",) if field == "eval.generation_configs" else "not-a-name"
  _set(config, field, bad)
  errors = errors_of(config)
  assert len(errors) == 1 and errors[0].startswith(f"{field}="), errors
  assert "Fix:" in errors[0]


def test_names_registered_at_runtime_are_accepted(monkeypatch):
  from grpo_jax.models import remat
  from grpo_jax.rollout import types

  config = load("tiny")
  _set(config, "model.remat_policy", "save_everything")
  _set(config, "eval.generation_configs", ("greedy", "lukewarm"))
  assert len(errors_of(config)) == 2
  monkeypatch.setitem(remat.POLICIES, "save_everything", lambda: None)
  monkeypatch.setitem(
      types.GENERATION_CONFIGS,
      "lukewarm",
      types.GenerationConfig(temperature=0.5, top_k=10, top_p=0.9),
  )
  assert errors_of(config) == []


@pytest.mark.parametrize("data,fsdp,tensor", [(3, 1, 1), (-1, 1, 3), (-1, -1, 1), (2, 2, 4)])
def test_bad_mesh_gives_one_mesh_line_with_the_fix(data, fsdp, tensor):
  config = load("tiny")
  with config.unlocked():
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
  errors = errors_of(config)
  assert len(errors) == 1, errors
  assert errors[0].startswith("mesh."), errors[0]
  assert "Fix: make data * fsdp * tensor equal the 8 available devices" in errors[0]


def test_micro_batch_at_least_the_step_rows_means_all_rows_at_once():
  """configs/tiny.py's micro-batch of 32 rows: a smaller batch needs no second flag; below the
  step's rows the size must divide them, in whole data-parallel shares."""
  from grpo_jax.rl import step as step_lib

  config = load("tiny")
  with config.unlocked():
    config.batch_size, config.num_generations = 2, 8  # 16 rows < micro_batch_size 32
  assert errors_of(config, num_devices=1) == []
  assert step_lib.num_micro_batches(32, 16) == 1 and step_lib.num_micro_batches(0, 16) == 1
  assert step_lib.num_micro_batches(8, 16) == 2
  with config.unlocked():
    config.batch_size, config.micro_batch_size = 8, 24  # 64 rows
  assert errors_of(config, num_devices=1) == [
      "micro_batch_size=24: must divide batch_size * num_generations = 64. Fix: use a divisor "
      "of 64 (or 0 for all rows at once)."
  ]
  with config.unlocked():
    config.micro_batch_size = 4
  assert errors_of(config)[0].startswith("micro_batch_size=4: not divisible by the data-parallel")


def test_micro_batch_tokens_is_one_row_per_device_or_more_and_alone():
  """micro_batch_tokens (rl/packing.py: MicroBatching): not beside micro_batch_size, and at
  least one row of P + C slots per data-parallel device; each a line with its fix."""
  config = load("tiny")  # P 6 + C 7 = 13 slots a row, micro_batch_size 32, 8 devices
  with config.unlocked():
    config.micro_batch_tokens = 8 * 13
  assert errors_of(config) == [
      "micro_batch_tokens=104: micro-batches are by tokens or by rows, and micro_batch_size=32 "
      "is set too. Fix: set one of them to 0."
  ]
  with config.unlocked():
    config.micro_batch_size, config.micro_batch_tokens = 0, 8 * 13 - 1
  assert errors_of(config) == [
      "micro_batch_tokens=103: gives each of the 8 data-parallel devices 12 token slots, less "
      "than one row of max_prompt_length + max_completion_length = 13. Fix: use at least 104 "
      "(or 0 for micro-batches by micro_batch_size)."
  ]
  with config.unlocked():
    config.micro_batch_tokens, config.pack_sequences = 8 * 13, True
  assert errors_of(config) == []


def test_disaggregated_placement_is_checked_against_the_trainer_half():
  """placement=disaggregated: an uneven split is one line with the fix; the mesh is checked
  against the trainer's half of the devices; vLLM is refused."""

  spec = importlib.util.spec_from_file_location(
      "cfg_tiny_p", os.path.join(ROOT, "configs", "tiny.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.rollout.placement = "disaggregated"
  assert configuration.validate(c, num_devices=8) == []
  c.rollout.num_devices = 3
  (e,) = configuration.validate(c, num_devices=8)
  assert e.startswith("rollout.num_devices=3") and "--config.rollout.num_devices=4" in e
  c.rollout.num_devices = 0.5
  c.mesh.data = 8
  (e,) = configuration.validate(c, num_devices=8)
  assert e.startswith("mesh.data=8") and "4 devices" in e
  c.mesh.data = -1
  c.rollout.engine = "vllm"
  assert any(e.startswith("rollout.placement=") for e in configuration.validate(c, num_devices=8))


def test_offpolicy_correction_names_and_the_fields_each_reads():
  """Every registered correction validates with the fields it reads; a bad name, a sequence
  weight with no cap and a band that leaves out ratio 1 are one line each, naming the field."""
  from grpo_jax.rl import registry

  config = load("tiny")
  for name in registry.OFFPOLICY_CORRECTIONS.names():
    _set(config, "loss.offpolicy_correction", name)
    _set(config, "loss.tis_cap", 5.0 if name == "sequence_is" else 0.0)
    assert errors_of(config) == [], name
  cases = [
      ({"loss.offpolicy_correction": "seq_is"}, "loss.offpolicy_correction='seq_is'", "icepop"),
      ({"loss.offpolicy_correction": "sequence_is"}, "loss.tis_cap=0.0", "tis_cap=5.0"),
      (
          {"loss.offpolicy_correction": "icepop", "loss.correction_low": 1.5},
          "loss.correction_low=1.5",
          "[0, 1]",
      ),
      (
          {"loss.offpolicy_correction": "geometric_mask", "loss.correction_high": 0.99},
          "loss.correction_high=0.99",
          "1.001",
      ),
  ]
  for overrides, start, words in cases:
    config = load("tiny")
    for field, value in overrides.items():
      _set(config, field, value)
    (line,) = errors_of(config)
    assert line.startswith(start) and words in line and "Fix:" in line, line
  # tis reads no band: one that would be refused for icepop is no error there.
  config = load("tiny")
  _set(config, "loss.correction_high", 0.5)
  assert errors_of(config) == []


def test_slot_engine_fields():
  """rollout.slots: the native decoder only, at least one group, whole data-parallel shares;
  each a line naming the field and the fix."""
  config = load("tiny")
  _set(config, "rollout.slots", 16)
  assert errors_of(config) == []
  cases = [
      ({"rollout.slots": 12}, "rollout.slots=12", "multiple of 8, e.g. 16"),
      ({"rollout.slots": 2}, "rollout.slots=2", "num_generations"),
      ({"rollout.slots": -1}, "rollout.slots=-1", ">= 0"),
      ({"rollout.slot_chunk": 0}, "rollout.slot_chunk=0", ">= 1"),
      ({"rollout.slot_admission": "gpu"}, "rollout.slot_admission='gpu'", "auto, decode, host"),
      ({"rollout.engine": "vllm"}, "rollout.slots=16", "native decoder"),
  ]
  for fields, field_line, why in cases:
    config = load("tiny")
    _set(config, "rollout.slots", 16)
    for k, v in fields.items():
      _set(config, k, v)
    errs = [e for e in errors_of(config) if e.startswith("rollout.slot")]
    assert len(errs) >= 1 and errs[0].startswith(field_line) and why in " ".join(errs), errs


def test_tool_fields(tmp_path):
  """rollout.tools: the shipped tool configs validate; each bad field is one line naming it and
  the fix; a tools file that does not import, or a tool without a docstring, names the file
  and the tool."""
  off = load("tiny_tools")  # (both shipped configs: test_shipped_configs_are_valid)
  _set(off, "rollout.tools.names", "")
  assert errors_of(off) == []
  cases = [
      ({"rollout.slots": 0}, "rollout.tools.names=", "slot engine"),
      ({"rollout.tools.format": "xml"}, "rollout.tools.format='xml'", "hermes"),
      ({"rollout.max_turns": 0}, "rollout.max_turns=0", ">= 1"),
      ({"rollout.max_tool_response_tokens": 500}, "rollout.max_tool_response_tokens=500", "[1,"),
      ({"rollout.tools.names": "calculator,abacus"}, "rollout.tools.names=", "abacus"),
      ({"rollout.slot_admission": "decode"}, "rollout.slot_admission='decode'", "paused"),
  ]
  for fields, start, words in cases:
    config = load("tiny_tools")
    for k, v in fields.items():
      _set(config, k, v)
    errs = [e for e in errors_of(config) if e.startswith(start)]
    assert errs and words in errs[0], (fields, errors_of(config))
  # vLLM runs tools too (re-submitted prefixes), slot engine or not.
  config = load("tiny_tools")
  _set(config, "rollout.engine", "vllm")
  _set(config, "rollout.slots", 0)
  assert not [e for e in errors_of(config) if e.startswith("rollout.tools")], errors_of(config)
  broken = tmp_path / "my_tools.py"
  broken.write_text("def lookup(key: str) -> str:\n  return key\n")  # no docstring
  config = load("tiny_tools")
  _set(config, "rollout.tools.file", str(broken))
  _set(config, "rollout.tools.names", "lookup")
  (line,) = [e for e in errors_of(config) if e.startswith("rollout.tools.names")]
  assert "my_tools.py" in line and "lookup" in line and "docstring" in line, line
  broken.write_text("import not_a_module\n")
  (line,) = [e for e in errors_of(config) if e.startswith("rollout.tools.names")]
  assert "my_tools.py" in line and "not_a_module" in line, line


def test_mesh_expert_must_divide_the_devices_and_the_experts():
  c = load("tiny_moe")  # 8 experts per layer
  c.mesh.expert = 4
  c.batch_size = 32
  assert errors_of(c) == []  # data fills the 8 / 4 devices left: rows over data * expert = 8
  c.mesh.expert = 3
  assert any(e.startswith("mesh.expert=3") and "8 devices" in e for e in errors_of(c))
  c.mesh.expert = 8
  c.model.num_experts = 4
  c.model.num_experts_per_tok = 2
  assert any(e.startswith("mesh.expert=8") and "4 experts" in e for e in errors_of(c))
  dense = load("tiny")
  dense.mesh.expert = 2
  assert any(e.startswith("mesh.expert=2") and "dense" in e for e in errors_of(dense))
