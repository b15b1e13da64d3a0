"""The learned-judge reward (rewards/judge.py): scores == transformers' own forward on the
same judge text (classifier heads with 1 and 3 labels, yes-token probability normalized over
yes/no and over the vocabulary), padded batches across several jitted calls on an 8-device
mesh, prompt truncation that keeps the completion, a hand-set judge whose ranking and values
we predict, and one validation line per bad value."""

import functools
import os
import shutil

import jax
import ml_collections
import numpy as np
import pytest

from grpo_jax.parallel import sharding
from grpo_jax.rewards import judge as judge_lib
from tests.conftest import SHARED_DATA

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QWEN_TOK = os.path.join(SHARED_DATA, "qwen_tokenizer")
pytestmark = pytest.mark.skipif(
    not os.path.isdir(QWEN_TOK), reason=f"the Qwen tokenizer files are not at {QWEN_TOK}"
)

VOCAB = 151669  # the Qwen tokenizer's ids with Qwen3's added tokens (HFTokenizer's vocab_size)
TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nIs the answer right?"
PAIRS = [  # different lengths: left padding differs per row
    ("What is 2+2?", "4"),
    ("Name a colour.", "Blue, like the sky on a clear summer day."),
    ("Translate 'chat' from French.", "cat"),
    ("Sum 1..10?", "It is 55 because 10*11/2 = 55."),
    ("Capital of France?", "Paris"),
    ("Is {x} a field?", "No: {braces} stay literal in values."),
    ("2*3?", "6"),
    ("Write a haiku.", "old pond / a frog jumps in / water's sound"),
    ("x", "y"),
    ("Spell 'cat'.", "c-a-t"),
    ("Largest planet?", "Jupiter is the largest planet of the solar system."),
]


def _qwen3_config(**kw):
  return transformers.Qwen3Config(
      vocab_size=VOCAB,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=8,
      max_position_embeddings=512,
      rope_theta=10000.0,
      attn_implementation="eager",
      **kw,
  )


def _save(model, folder):
  model.save_pretrained(folder, safe_serialization=True)
  for name in os.listdir(QWEN_TOK):
    shutil.copy(os.path.join(QWEN_TOK, name), folder)
  return str(folder)


def _perturb(model, seed):
  torch.manual_seed(seed)
  with torch.no_grad():  # non-trivial norm scales, so a wrong norm mapping shows
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """Tiny random judges saved as HF folders with the Qwen tokenizer files beside them."""
  out = {}
  torch.manual_seed(0)
  out["cls1"] = _save(
      _perturb(
          transformers.Qwen3ForSequenceClassification(
              _qwen3_config(num_labels=1, tie_word_embeddings=False)
          ),
          1,
      ),
      tmp_path_factory.mktemp("cls1"),
  )
  out["cls3"] = _save(
      _perturb(
          transformers.Qwen3ForSequenceClassification(
              _qwen3_config(num_labels=3, tie_word_embeddings=True)
          ),
          2,
      ),
      tmp_path_factory.mktemp("cls3"),
  )
  lm = _perturb(transformers.Qwen3ForCausalLM(_qwen3_config(tie_word_embeddings=False)), 3)
  with torch.no_grad():  # opposite, large yes/no rows: p(yes) varies and is far above 1/V
    u = torch.nn.functional.normalize(torch.randn(32), dim=0)
    lm.lm_head.weight[9834] = 6.0 * u  # " yes"
    lm.lm_head.weight[902] = -6.0 * u  # " no"
  out["lm"] = _save(lm, tmp_path_factory.mktemp("lm"))
  return out


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh(2, 2, 2)  # batch rows over data * fsdp = 4, params over tensor


def _config(path, **kw):
  j = judge_lib.default_config()
  j.update(
      path=path,
      template=TEMPLATE,
      batch_size=8,
      max_length=48,
      dtype="float32",
      tokenizer_path=QWEN_TOK,
  )  # read once for all judges (each folder has a copy too)
  j.update(kw)
  return ml_collections.ConfigDict({"reward": {"judge": j}})


@functools.lru_cache(maxsize=1)
def _hf_tokenizer():
  return transformers.AutoTokenizer.from_pretrained(QWEN_TOK)


def _hf_logits(folder, texts, out):
  """transformers' own tokenizer and forward, one unpadded text at a time: the logits of
  the classification head, or the next-token logits after each text."""
  tok = _hf_tokenizer()
  cls = (
      transformers.AutoModelForSequenceClassification
      if out == "cls"
      else transformers.AutoModelForCausalLM
  )
  model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
  rows = []
  with torch.no_grad():
    for text in texts:
      ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
      logits = model(input_ids=ids).logits[0]
      rows.append((logits if out == "cls" else logits[-1]).double().numpy())
  return rows


def _texts(pairs):
  return [TEMPLATE.format(prompt=p, completion=c) for p, c in pairs]


@pytest.mark.parametrize("name,label_index", [("cls1", 0), ("cls3", 2)])
def test_classifier_matches_transformers(folders, mesh, name, label_index):
  own_tokenizer = {"tokenizer_path": ""} if name == "cls1" else {}  # the folder's copy
  judge = judge_lib.build_judge(
      _config(folders[name], mode="classifier", label_index=label_index, **own_tokenizer), mesh
  )
  prompts, completions = zip(*PAIRS)  # 11 rows: two jitted calls of 8, the second padded
  ours = judge(list(prompts), list(completions))
  logits = _hf_logits(folders[name], _texts(PAIRS), "cls")
  if name == "cls1":
    want = [1 / (1 + np.exp(-l[0])) for l in logits]
  else:
    want = [np.exp(l[label_index] - np.logaddexp.reduce(l)) for l in logits]
  assert ours.dtype == np.float32 and ours.shape == (len(PAIRS),)
  np.testing.assert_allclose(ours, want, atol=1e-5, rtol=0)
  assert np.ptp(ours) > 1e-3  # the rows really differ, so row order is checked too
  # Same shapes again: no recompilation, and no implicit transfer (the loop's guard).
  with jax.transfer_guard("disallow"):
    again = judge(list(prompts[:3]), list(completions[:3]))
  np.testing.assert_allclose(again, ours[:3], atol=1e-6)
  assert judge._scores._cache_size() == 1
  judge.close()


@pytest.fixture(scope="module")
def lm_judge(folders, mesh):
  judge = judge_lib.build_judge(_config(folders["lm"], mode="yes_prob"), mesh)
  yield judge
  judge.close()


def test_yes_prob_matches_transformers(folders, mesh, lm_judge):
  prompts, completions = zip(*PAIRS)
  vocab_judge = judge_lib.build_judge(_config(folders["lm"], normalize="vocab"), mesh)
  yes, no = 9834, 902
  last = np.stack(_hf_logits(folders["lm"], _texts(PAIRS), "lm"))  # [n, V]
  for judge, want in [
      (lm_judge, np.exp(last[:, yes] - np.logaddexp(last[:, yes], last[:, no]))),
      (vocab_judge, np.exp(last[:, yes] - np.logaddexp.reduce(last, axis=-1))),
  ]:
    ours = judge(list(prompts), list(completions))
    np.testing.assert_allclose(ours, want, atol=1e-7, rtol=1e-4)
    # Worth comparing: yes/no probabilities that vary, vocabulary probabilities far above 1/V.
    assert np.ptp(ours) > 1e-2 and max(want) > 100 / VOCAB
  vocab_judge.close()


def test_long_prompt_loses_its_start_and_the_completion_stays(folders, lm_judge):
  judge, tok = lm_judge, lm_judge.tokenizer
  prompt = " ".join(f"word{i}" for i in range(100))
  completion = "Paris is the capital."
  ids = judge.encode(prompt, completion)
  text = tok.decode(ids, skip_special=False)
  head, rest = text.split("\n", 1)
  kept = head[len("Question: ") :]
  assert 44 <= len(ids) <= 48 and head.startswith("Question: ")
  assert kept and prompt.endswith(kept) and len(kept) < len(prompt) / 2  # its end, cut
  assert rest == f"Answer: {completion}\nIs the answer right?"
  assert ids == tok.encode(TEMPLATE.format(prompt=kept, completion=completion))  # read whole
  # A completion longer than the room left: no prompt, the completion's beginning.
  long_completion = " ".join(f"step{i}" for i in range(80))
  text = tok.decode(judge.encode(prompt, long_completion), skip_special=False)
  assert text.startswith("Question: \nAnswer: step0 step1")
  assert text.endswith("\nIs the answer right?")
  cut = text[len("Question: \nAnswer: ") : -len("\nIs the answer right?")]
  assert long_completion.startswith(cut) and len(cut) < len(long_completion)
  # Scored as exactly those ids, next to a short row in the same padded batch.
  scores = judge([prompt, "Capital of France?"], [completion, "Paris"])
  model = transformers.AutoModelForCausalLM.from_pretrained(folders["lm"])
  with torch.no_grad():
    last = model(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()
  np.testing.assert_allclose(scores[0], 1 / (1 + np.exp(last[902] - last[9834])), atol=1e-6)


def _rmsnorm(x, eps=1e-6):
  return x / np.sqrt(np.mean(x * x) + eps)


@pytest.mark.parametrize("mode", ["classifier", "yes_prob"])
def test_hand_set_judge_prefers_the_right_completion(tmp_path, mesh, mode):
  """Attention and MLP outputs zeroed: the last hidden state is the final-normed embedding of
  the last token, so a head aligned with " correct" (against " wrong") must score a completion
  ending in " correct" high, one ending in " wrong" low, with values we compute here."""
  good, bad, yes, no = 4396, 4969, 9834, 902  # " correct", " wrong", " yes", " no"
  torch.manual_seed(5)
  if mode == "classifier":
    model = transformers.Qwen3ForSequenceClassification(
        _qwen3_config(num_labels=1, tie_word_embeddings=False)
    )
  else:
    model = transformers.Qwen3ForCausalLM(_qwen3_config(tie_word_embeddings=False))
  with torch.no_grad():
    for layer in model.model.layers:
      layer.self_attn.o_proj.weight.zero_()
      layer.mlp.down_proj.weight.zero_()
    emb = model.model.embed_tokens.weight.double().numpy()
    r_good, r_bad = _rmsnorm(emb[good]), _rmsnorm(emb[bad])
    direction = 4.0 * (r_good - r_bad) / 32
    if mode == "classifier":
      model.score.weight[0] = torch.tensor(direction)
    else:
      model.lm_head.weight[yes] = torch.tensor(direction)
      model.lm_head.weight[no] = torch.tensor(-direction)
  folder = _save(model.eval(), tmp_path / "judge")
  judge = judge_lib.build_judge(_config(folder, mode=mode, template="{prompt}\n{completion}"), mesh)
  completions = ["The sum is 4, which is correct", "The sum is 5, which is wrong"]
  scores = judge(["What is 2+2?"] * 2, completions)
  logit = lambda tok: (2 if mode == "yes_prob" else 1) * direction @ _rmsnorm(emb[tok])
  want = [1 / (1 + np.exp(-logit(good))), 1 / (1 + np.exp(-logit(bad)))]
  np.testing.assert_allclose(scores, want, atol=1e-5)
  assert scores[0] > 0.9 > 0.1 > scores[1]
  judge.close()


def _lines(path, data_parallel=None, **kw):
  return judge_lib.validate(_config(path, **kw), data_parallel=data_parallel)


def test_validation_names_each_bad_value(folders):
  assert _lines("") == [] and _lines("", mode="nonsense") == []  # off: nothing to check
  assert _lines(folders["lm"]) == [] and _lines(folders["lm"], tokenizer_path="") == []
  assert _lines(folders["cls1"], mode="classifier") == []
  assert _lines(folders["cls3"], mode="classifier", label_index=2) == []
  assert _lines(folders["lm"], mode="scorer") == [
      "reward.judge.mode='scorer': unknown judge mode. Fix: use one of classifier, yes_prob."
  ]
  bad = [  # (overrides, the field its one line names, words the line holds)
      (dict(normalize="softmax"), "normalize", "yes_no, vocab"),
      (dict(template="Answer: {prompt}"), "template", "0 {completion} fields"),
      (dict(template="{prompt} {answer} {completion}"), "template", "{answer}"),
      (dict(template="{completion} {completion}"), "template", "2 {completion}"),
      (dict(template="{completion"), "template", "expected '}'"),
      (dict(yes_token="yes please"), "yes_token", "2 tokens [9693, 4486]"),
      (dict(no_token=" yes"), "no_token", "same token as yes_token"),
      (dict(batch_size=0), "batch_size", "must be >= 1"),
      (dict(batch_size=6, data_parallel=4), "batch_size", "e.g. 8"),
      (dict(max_length=10), "max_length", "template's own text is 11 tokens"),
      (dict(dtype="fp8"), "dtype", "float32, bfloat16"),
      (dict(weight=float("nan")), "weight", "finite"),
      (dict(mode="classifier"), "path", "no score.weight"),
      (dict(tokenizer_path="/no/such/folder"), "tokenizer_path", "is not a folder"),
  ]
  for kw, field, words in bad:
    lines = _lines(folders["lm"], **kw)
    assert len(lines) == 1 and lines[0].startswith(f"reward.judge.{field}="), (kw, lines)
    assert words in lines[0] and ". Fix: " in lines[0], (kw, lines)
  for path, kw, field, words in [
      ("/no/such/judge", {}, "path", "is not a folder"),
      (folders["cls1"], {}, "path", "no lm_head.weight"),  # yes_prob on a classifier
      (folders["cls3"], dict(mode="classifier", label_index=3), "label_index", "3 labels"),
  ]:
    lines = _lines(path, **kw)
    assert len(lines) == 1 and lines[0].startswith(f"reward.judge.{field}="), lines
    assert words in lines[0], lines


def test_build_judge_off_and_refusals(folders, mesh):
  """Off is None; what would silently score wrong (jit clamps an out-of-range label index,
  a batch that does not split over the mesh) is refused in one line."""
  assert judge_lib.build_judge(_config(""), mesh) is None
  with pytest.raises(ValueError, match=r"reward.judge.batch_size=6: .* multiple of 4"):
    judge_lib.build_judge(_config(folders["lm"], batch_size=6), mesh)
  with pytest.raises(ValueError, match=r"label_index=3: out of range .* Fix: use 0..2"):
    judge_lib.build_judge(_config(folders["cls3"], mode="classifier", label_index=3), mesh)
  with pytest.raises(ValueError, match=r"yes_token='yes please': is 2 tokens"):
    judge_lib.build_judge(_config(folders["lm"], yes_token="yes please"), mesh)
  with pytest.raises(KeyError, match="lm_head.weight is missing"):  # no silent tied head
    judge_lib.build_judge(_config(folders["cls1"], mode="yes_prob"), mesh)
  assert set(judge_lib.default_config()) == {
      "path",
      "mode",
      "weight",
      "template",
      "yes_token",
      "no_token",
      "normalize",
      "label_index",
      "batch_size",
      "max_length",
      "tokenizer_path",
      "dtype",
  }
