"""Bad input, one clear line each: a table of what new users get wrong (config values, data
rows, tokenizer files, HF and MaxText checkpoints, reward plug-ins, the filesystem). Every case
fails where the bad thing is read, with ONE line that names the file / line / field and says
how to fix it; grpo_jax.main prints exactly that line (tests/run/test_resume.py shows the path)."""

import json
import os
import re
import shutil

from flax import nnx
import numpy as np
import pytest

from configs import tiny
from grpo_jax import configuration
from grpo_jax.run import session as session_lib
from grpo_jax.data import datasets
from grpo_jax.data import pipeline
from grpo_jax.data import tokenizers
from grpo_jax.models.decoder import hf
from grpo_jax.models.maxtext import adapter as maxtext_adapter
from grpo_jax.models import safetensors_io
from grpo_jax.models.decoder.presets import PRESETS
from grpo_jax.models.decoder.transformer import Transformer
from grpo_jax.rewards import computer


def _config(**fields):
  c = tiny.get_config()
  for key, value in fields.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    setattr(node, leaf, value)
  return c


def _validation(**fields):
  def run(tmp):
    del tmp
    errors = configuration.validate(_config(**fields))
    if errors:
      raise ValueError(errors[0])

  return run


def _write(tmp, name, data: bytes | str):
  p = os.path.join(tmp, name)
  os.makedirs(os.path.dirname(p), exist_ok=True)
  with open(p, "wb") as f:
    f.write(data.encode() if isinstance(data, str) else data)
  return p


def _gsm8k(lines):
  def run(tmp):
    datasets.read_gsm8k(_write(tmp, "train.jsonl", lines))

  return run


def _prompts(lines, name="rows.jsonl"):
  def run(tmp):
    datasets.read_prompt_file(_write(tmp, name, lines))

  return run


def _parquet(tmp, records):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  path = os.path.join(tmp, "t.parquet")
  pq.write_table(pa.Table.from_pylist(records), path)
  return path


def _table(make, source="parquet", columns=None):
  def run(tmp):
    if source == "hf_dataset":
      pytest.importorskip("datasets")
    from grpo_jax.data import tables

    tables.READERS[source](make(tmp), columns)

  return run


# A minimal byte-level BPE folder (the real Qwen2 files are in ../shared/data, not in CI's clone).
MINI_TOKENIZER = {
    "vocab.json": json.dumps({"h": 0, "i": 1, "hi": 2, "<|endoftext|>": 3}),
    "merges.txt": "#version: 0.2\nh i\n",
    "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>"}),
}


def _tokenizer(files):
  def run(tmp):
    d = os.path.join(tmp, "tok")
    os.makedirs(d)
    for name, src in files.items():
      _write(d, name, MINI_TOKENIZER[name] if src is None else src)
    tokenizers.build_tokenizer("hf", d)

  return run


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("hf"))
  hf.save_hf(Transformer(PRESETS["tiny-qwen3"], rngs=nnx.Rngs(0)), d)
  return d


def _hf(damage):
  def run(tmp, hf_dir):
    d = os.path.join(tmp, "ckpt")
    shutil.copytree(hf_dir, d)
    damage(d)
    hf.load_hf(d)

  run.needs_hf = True
  return run


def _truncate(d):
  fn = os.path.join(d, "model.safetensors")
  with open(fn, "r+b") as f:
    f.truncate(os.path.getsize(fn) - 1000)


def _not_safetensors(d):
  _write(d, "model.safetensors", b"PK\x03\x04 this is a zip file")


def _drop_tensor(d):
  fn = os.path.join(d, "model.safetensors")
  f = safetensors_io.SafetensorsFile(fn)
  keep = [n for n in f.keys() if "q_proj" not in n or "layers.0." not in n]
  items = [(n, f.get(n).shape, f.get(n).dtype, (lambda n=n: np.array(f.get(n)))) for n in keep]
  safetensors_io.write(fn + ".new", items)
  os.replace(fn + ".new", fn)


def _reshape_tensor(d):
  cfg = json.loads(open(os.path.join(d, "config.json")).read())
  cfg["intermediate_size"] += 8
  _write(d, "config.json", json.dumps(cfg))


def _reward(source, *, num_workers=0, on_error="raise"):
  def run(tmp):
    path = _write(tmp, "my_reward.py", source)
    rc = computer.build_reward_computer(
        (), (), custom_file=path, on_error=on_error, num_workers=num_workers, timeout_sec=5.0
    )
    try:
      rc(["1+1="], ["2"], [{"ground_truth": "2", "data_source": "x"}])
    finally:
      rc.close()

  return run


def _maxtext(make):
  def run(tmp):
    d = os.path.join(tmp, "mt")
    make(d)
    maxtext_adapter.load_maxtext_checkpoint(d, parts=None)

  return run


def _session_in(path_of):
  def run(tmp):
    workdir = path_of(tmp)
    session_lib.open_session(_config(), workdir, mesh=None).__enter__()

  return run


def _file_as_workdir(tmp):
  return os.path.join(_write(tmp, "a_file", "x"), "run")


GOOD_ROW = '{"question": "1+1?", "answer": "#### 2"}\n'
# (name, trigger, what the one line must contain (regex))
CASES = [
    # ---- config values (start-up validation)
    (
        "G=1 with dr_grpo",
        _validation(num_generations=1, **{"loss.estimator": "dr_grpo"}),
        r"num_generations=1: the 'dr_grpo' advantage .* Fix: set num_generations >= 2",
    ),
    ("clip_eps > 1", _validation(**{"loss.clip_eps": 1.5}), r"loss.clip_eps=1.5: .*Fix:"),
    ("mesh does not fit", _validation(**{"mesh.data": 3}), r"mesh.data=3: .*Fix:"),
    (
        "batch over devices",
        _validation(batch_size=7),
        r"batch_size=7: the prompts of a step do not divide over the data-parallel mesh size data \* fsdp = 8. Fix: use a multiple of 8",
    ),
    (
        "missing tokenizer",
        _validation(**{"tokenizer.kind": "hf", "tokenizer.path": "/no/tok"}),
        r"tokenizer.path='/no/tok': the tokenizer folder does not exist. Fix:",
    ),
    (
        "missing data file",
        _validation(**{"data.train_source": "gsm8k", "data.train_path": "/no/train.jsonl"}),
        r"data.train_path='/no/train.jsonl': the data file does not exist. Fix:",
    ),
    (
        "missing HF folder",
        _validation(**{"model.hf_path": "/no/model"}),
        r"model.hf_path='/no/model': .* does not exist. Fix:",
    ),
    (
        "missing reward file",
        _validation(**{"reward.custom_file": "/no/r.py"}),
        r"reward.custom_file='/no/r.py': the reward file does not exist. Fix:",
    ),
    (
        "negative lr",
        _validation(**{"optimizer.learning_rate": -1.0}),
        r"optimizer.learning_rate=-1.0: .*Fix:",
    ),
    # ---- data rows
    (
        "non-UTF-8 bytes",
        _gsm8k(GOOD_ROW.encode() + b'{"question": "caf\xe9"}\n'),
        r"train.jsonl:2: not UTF-8 .* Fix: re-encode",
    ),
    (
        "invalid JSON line",
        _gsm8k(GOOD_ROW + '{"question": "x", \n'),
        r"train.jsonl:2: invalid JSON",
    ),
    ("row not an object", _gsm8k(GOOD_ROW + "[1, 2]\n"), r"train.jsonl:2: expected a JSON object"),
    (
        "missing field",
        _gsm8k(GOOD_ROW + '{"question": "2+2?"}\n'),
        r"train.jsonl:2: missing field 'answer'",
    ),
    (
        "answer without ####",
        _gsm8k('{"question": "q", "answer": "4"}\n'),
        r"train.jsonl:1: field 'answer'",
    ),
    ("empty file", _gsm8k(""), r"train.jsonl: no rows"),
    (
        "field of the wrong type",
        _prompts('{"prompt": 3, "ground_truth": "1", ' '"data_source": "x"}\n'),
        r"rows.jsonl:1: field 'prompt' should be a string or a list of chat messages, got int",
    ),
    (
        ".json not a list",
        _prompts('{"prompt": "p"}', name="rows.json"),
        r"rows.json: expected a JSON list of objects, got dict",
    ),
    (
        "overlong-prompt policy typo",
        _validation(**{"data.overlong_prompts": "skip"}),
        r"data.overlong_prompts='skip': unknown overlong-prompt policy. Fix: use one of truncate, "
        r"drop",
    ),
    (
        "empty prompt",
        lambda tmp: pipeline.PromptData(
            [{"prompt": ""}],
            tokenizers.build_tokenizer("char"),
            template="plain",
            system_prompt="",
            max_prompt_length=8,
        ),
        r"row 0 renders to an empty prompt",
    ),
    # ---- parquet (verl) and datasets (TRL) tables
    (
        "parquet without the prompt column",
        _table(lambda tmp: _parquet(tmp, [{"question": "1+1?", "answer": "2"}])),
        r"t.parquet: no column 'prompt' for the prompt \(columns: \['answer', 'question'\]\)\. "
        r"Fix: --config.data.columns.prompt=<one of them>",
    ),
    (
        "parquet message without content",
        _table(
            lambda tmp: _parquet(
                tmp,
                [
                    {"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": "2"},
                    {"prompt": [{"role": "user", "content": None}], "ground_truth": "2"},
                ],
            )
        ),
        r"t.parquet: row 1: column 'prompt' message 0 should be \{'role': str, 'content': str\}",
    ),
    (
        "not a parquet file",
        _table(lambda tmp: _write(tmp, "t.parquet", "a,b\n1,2\n")),
        r"t.parquet: not a readable parquet file .* Fix: point data.\*_path at parquet files",
    ),
    (
        "null ground truth in a datasets folder",
        _table(
            lambda tmp: _parquet(
                tmp, [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": None}]
            ),
            source="hf_dataset",
            columns={"ground_truth": "answer"},
        ),
        r"t.parquet: row 1: column 'answer' is empty \(null\)\. Fix: fill it or drop the row",
    ),
    (
        "plain template meets a multi-turn prompt",
        lambda tmp: pipeline.PromptData(
            [
                {
                    "prompt": [
                        {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"},
                    ]
                }
            ],
            tokenizers.build_tokenizer("char"),
            template="plain",
            system_prompt="",
            max_prompt_length=8,
        ),
        r"prompt row 0 .*this prompt has the turns \['user', 'assistant', 'user'\]\. Fix: "
        r"data.template=chatml",
    ),
    (
        "reward function missing from the file",
        lambda tmp: computer.build_reward_computer(
            (),
            (),
            custom_file=_write(
                tmp,
                "r.py",
                "def good(prompts, completions, **kw):\n  " "return [0.0] * len(completions)\n",
            ),
            custom_function="god",
        ),
        r"r.py defines no function 'god' \(reward.custom_function\); it defines \['good'\]",
    ),
    (
        "data path glob in a missing folder",
        _validation(**{"data.train_source": "parquet", "data.train_path": "/no/dir/*.parquet"}),
        r"data.train_path='/no/dir/\*.parquet': the folder /no/dir of the pattern does not exist",
    ),
    # ---- tokenizer files
    (
        "tokenizer folder without vocab",
        _tokenizer({"tokenizer_config.json": None}),
        r"tok: no tokenizer.json and no vocab.json \+ merges.txt",
    ),
    (
        "broken added_tokens.json",
        _tokenizer(
            {
                "vocab.json": None,
                "merges.txt": None,
                "tokenizer_config.json": None,
                "added_tokens.json": "{'a': 1",
            }
        ),
        r"added_tokens.json: not valid JSON .* Fix: repair or delete",
    ),
    (
        "tokenizer folder missing",
        lambda tmp: tokenizers.build_tokenizer("hf", tmp + "/none"),
        r"tokenizer folder .*none' does not exist",
    ),
    # ---- HF checkpoints
    (
        "truncated safetensors",
        _hf(_truncate),
        r"model.safetensors: tensor .* but the file has \d+ bytes \(truncated\?\). Fix:",
    ),
    ("not safetensors", _hf(_not_safetensors), r"model.safetensors: (corrupt|not a) safetensors"),
    (
        "missing tensor",
        _hf(_drop_tensor),
        r"tensor model.layers.0.self_attn.q_proj.weight is missing from the checkpoint",
    ),
    (
        "wrong shape",
        _hf(_reshape_tensor),
        r"shape mismatch for tensor model.layers.0.mlp.\w+_proj.weight: checkpoint has",
    ),
    (
        "no config.json",
        _hf(lambda d: os.remove(os.path.join(d, "config.json"))),
        r"config.json: missing. Fix:",
    ),
    (
        "no weights",
        _hf(lambda d: os.remove(os.path.join(d, "model.safetensors"))),
        r"no model.safetensors or model.safetensors.index.json .* Fix:",
    ),
    # ---- MaxText checkpoints
    (
        "empty MaxText folder",
        _maxtext(os.makedirs),
        r"model.maxtext_checkpoint=.*mt: no Orbax checkpoint there.* Fix: point at",
    ),
    (
        "MaxText folder missing",
        _maxtext(lambda d: None),
        r"model.maxtext_checkpoint=.*mt: no such directory",
    ),
    # ---- reward plug-ins
    (
        "reward raises",
        _reward("def compute_score(*a, **k):\n  raise KeyError('gt')\n"),
        r"custom.*KeyError",
    ),
    (
        "reward returns NaN",
        _reward("def compute_score(*a, **k):\n  return float('nan')\n"),
        r"custom.*(NaN|nan|non-finite)",
    ),
    (
        "reward returns a string",
        _reward("def compute_score(*a, **k):\n  return 'good'\n"),
        r"custom.*(str|number)",
    ),
    (
        "reward returns None",
        _reward("def compute_score(*a, **k):\n  return None\n"),
        r"custom.*(None|number)",
    ),
    (
        "no compute_score",
        _reward("def score(*a):\n  return 1.0\n"),
        r"my_reward.py must define compute_score",
    ),
    (
        "plug-in syntax error",
        _reward("def compute_score(:\n"),
        r"my_reward.py: importing the reward file failed: SyntaxError",
    ),
    # ---- filesystem
    ("workdir under a file", _session_in(_file_as_workdir), r"a_file"),
]


@pytest.mark.parametrize("name,trigger,expect", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(name, trigger, expect, tmp_path, request):
  args = (
      (str(tmp_path), request.getfixturevalue("hf_dir"))
      if getattr(trigger, "needs_hf", False)
      else (str(tmp_path),)
  )
  with pytest.raises(Exception) as e:
    trigger(*args)
  msg = str(e.value).strip()
  if isinstance(e.value, KeyError):
    msg = msg.strip("'\"")
  assert re.search(expect, msg), f"{name}: {type(e.value).__name__}: {msg}"
  assert "\n" not in msg, f"{name}: more than one line: {msg}"


def test_the_table_is_broad():
  assert len(CASES) >= 30


@pytest.mark.parametrize("hf_path", ["", "/ckpt/Qwen3-0.6B"])
def test_infer_without_a_checkpoint_says_the_fix_that_fits_the_config(hf_path, tmp_path):
  """A --workdir with no checkpoint: with model.hf_path set, dropping --workdir samples from it;
  without one (the demo's config) that hint would be wrong, so the fix is to train there or to
  name a run's folder."""
  from grpo_jax import infer

  config = tiny.get_config()
  config.model.hf_path = hf_path
  with pytest.raises(FileNotFoundError) as e:
    infer.load_params(config, str(tmp_path), None, None)
  msg = str(e.value)
  assert "\n" not in msg and f"no checkpoint under {tmp_path}" in msg
  if hf_path:
    assert "drop --workdir to sample from model.hf_path" in msg
  else:
    assert "hf_path" not in msg
    assert f"--workdir={tmp_path}" in msg and "runs/tiny-" in msg
