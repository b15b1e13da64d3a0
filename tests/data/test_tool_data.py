"""Tool traces in data: the char_tools tokenizer, the arithmetic "tool" demonstration, and the
SFT loss mask that leaves tool responses out (grpo_jax/data/tool_traces.py)."""

import json
import os

import numpy as np
import pytest

from grpo_jax import data
from grpo_jax.data import arithmetic
from grpo_jax.data import tokenizers
from grpo_jax.data import tool_traces
from tests.conftest import SHARED_DATA

QWEN_TOK = os.path.join(SHARED_DATA, "qwen_tokenizer")

CALL = '{"name": "calculator", "arguments": {"expression": "123*45"}}'
TRACE = f"<tool_call>{CALL}</tool_call><tool_response>5535</tool_response>" "<answer>5535</answer>"


def test_tool_demonstration_is_the_plain_format_trace():
  assert arithmetic.demonstration("123*45", 5535, "tool") == TRACE
  assert CALL == json.dumps({"name": "calculator", "arguments": {"expression": "123*45"}})
  assert arithmetic.demonstration("123*45", 5535, "answer") == "<answer>5535</answer>"


def test_three_by_two_digit_multiplication_rows():
  rows = arithmetic.arithmetic_rows(
      200, split="train", seed=0, digits=3, digits2=2, ops="*", style="tool"
  )
  assert len(rows) == 200
  for r in rows:
    a, b = r["extra_info"]["expression"].split("*")
    assert int(a) < 1000 and int(b) < 100 and r["ground_truth"] == str(int(a) * int(b))
    assert r["demonstration"] == arithmetic.demonstration(f"{a}*{b}", int(a) * int(b), "tool")
  assert max(len(r["extra_info"]["expression"].split("*")[0]) for r in rows) == 3
  assert max(len(r["extra_info"]["expression"].split("*")[1]) for r in rows) == 2
  # The same problems with the no-tool baseline's demonstrations.
  plain = arithmetic.arithmetic_rows(
      200, split="train", seed=0, digits=3, digits2=2, ops="*", style="answer"
  )
  assert [r["prompt"] for r in plain] == [r["prompt"] for r in rows]
  assert all(r["demonstration"] == f"<answer>{r['ground_truth']}</answer>" for r in plain)


def test_digits2_zero_keeps_the_existing_rows():
  # digits2=0 draws exactly as before: the same as digits2 == digits.
  for kw in (dict(digits=2, ops="+"), dict(digits=3, ops="*-", num_ops=2, max_ops=4)):
    base = arithmetic.arithmetic_rows(64, split="train", seed=3, **kw)
    same = arithmetic.arithmetic_rows(64, split="train", seed=3, digits2=kw["digits"], **kw)
    assert base == same
  assert arithmetic.arithmetic_rows(3, split="test", seed=0)[0]["prompt"] == (
      arithmetic.arithmetic_rows(3, split="test", seed=0, digits2=0)[0]["prompt"]
  )


def test_char_tools_tokenizer_round_trips_the_trace_with_atomic_markers():
  char, tools = tokenizers.build_tokenizer("char"), tokenizers.build_tokenizer("char_tools")
  assert char.vocab_size == 96 and tools.vocab_size == 102
  assert char.itos == tokenizers.CharTokenizer().itos  # the char kind's ids are unchanged
  ids = tools.encode(TRACE)
  assert tools.decode(ids) == TRACE
  for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
    assert len(tools.encode(marker)) == 1
    assert ids.count(tools.encode(marker)[0]) == 1
  markers = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>")
  chars = TRACE.replace("</answer>", "")
  for m in markers:
    chars = chars.replace(m, "")
  assert len(ids) == len(chars) + 6  # one id per character, one per marker
  with pytest.raises(ValueError, match="not in the char tokenizer's alphabet"):
    char.encode(CALL)  # braces are char_tools' only


@pytest.mark.slow  # transformers' import
def test_char_tools_exports_a_folder_transformers_reads(tmp_path):
  transformers = pytest.importorskip("transformers")
  tok = tokenizers.build_tokenizer("char_tools")
  tokenizers.save_hf_folder(tok, str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  text = "123*45=" + TRACE
  assert theirs.encode(text, add_special_tokens=False) == tok.encode(text)
  assert tokenizers.HFTokenizer(str(tmp_path)).encode(text) == tok.encode(text)


def test_context_spans_plain_and_hermes():
  assert tool_traces.context_spans(TRACE) == [
      (TRACE.index("<tool_response>"), TRACE.index("<answer>"))
  ]
  two = "<tool_call>a</tool_call><tool_response>1</tool_response>x<tool_response>2</tool_response>"
  assert [two[s:e] for s, e in tool_traces.context_spans(two)] == [
      "<tool_response>1</tool_response>",
      "<tool_response>2</tool_response>",
  ]
  hermes = (
      "<think>go</think>\n<tool_call>\nC\n</tool_call><|im_end|>\n<|im_start|>user\n"
      "<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\nThe answer is 7."
  )
  (span,) = tool_traces.context_spans(hermes)
  assert hermes[: span[0]].endswith("</tool_call><|im_end|>")
  assert hermes[span[0] : span[1]].startswith("\n<|im_start|>user\n<tool_response>")
  assert hermes[span[0] : span[1]].endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
  assert hermes[span[1] :] == "The answer is 7."
  assert tool_traces.context_spans("<answer>5</answer>") == []


def test_sft_loss_weights_leave_out_exactly_the_tool_response():
  tok = tokenizers.build_tokenizer("char_tools")
  rows = arithmetic.arithmetic_rows(
      4, split="train", seed=0, digits=3, digits2=2, ops="*", style="tool"
  )
  rows[0] = dict(
      rows[0],
      prompt="123*45=",
      ground_truth="5535",
      extra_info={"expression": "123*45"},
      demonstration=TRACE,
  )
  prompts = data.PromptData(rows, tok, template="plain", system_prompt="", max_prompt_length=16)
  b = data.sft_batch(prompts, np.arange(4), 96)
  comp_bc = b["tokens"][:, 16:]
  w_bc = b["loss_mask"]
  attn_bc = b["attention_mask"][:, 16:]
  for i, r in enumerate(rows):
    n = int(attn_bc[i].sum())
    trained = tok.decode(comp_bc[i][w_bc[i] == 1], skip_special=False)
    answer = r["ground_truth"]
    call = json.dumps({"name": "calculator", "arguments": r["extra_info"]})
    assert trained == f"<tool_call>{call}</tool_call><answer>{answer}</answer><eos>"
    context = tok.decode(comp_bc[i][(w_bc[i] == 0) & (attn_bc[i] == 1)], skip_special=False)
    assert context == f"<tool_response>{answer}</tool_response>"
    assert tok.decode(comp_bc[i][:n], skip_special=False) == r["demonstration"] + "<eos>"
  # The SFT loss's weights (sft.py: sum(logp * m) / sum(m)): a token with log-prob -1 on each
  # response token and 0 elsewhere costs nothing.
  response_ids = {tok.stoi["<tool_response>"], tok.stoi["</tool_response>"]}
  in_response = np.zeros_like(w_bc, bool)
  for i in range(4):
    ids = comp_bc[i].tolist()
    s, e = ids.index(tok.stoi["<tool_response>"]), ids.index(tok.stoi["</tool_response>"])
    in_response[i, s : e + 1] = True
  assert response_ids <= set(comp_bc[in_response].tolist())
  logp_bc = -in_response.astype(np.float32)
  assert -(logp_bc * w_bc).sum() / w_bc.sum() == 0.0
  assert w_bc[in_response].sum() == 0 and w_bc[~in_response & (attn_bc == 1)].all()


def test_demonstrations_without_tools_keep_every_token_weighted():
  tok = tokenizers.build_tokenizer("char")
  rows = arithmetic.arithmetic_rows(4, split="train", seed=0, style="reasoning")
  prompts = data.PromptData(rows, tok, template="plain", system_prompt="", max_prompt_length=16)
  b = data.sft_batch(prompts, np.arange(4), 48)
  np.testing.assert_array_equal(b["loss_mask"], b["attention_mask"][:, 16:])


def test_hermes_pieces_tokenize_like_the_whole_text_with_qwen():
  if not os.path.exists(QWEN_TOK):
    pytest.skip(f"{QWEN_TOK} not present (../shared/data)")
  tok = tokenizers.HFTokenizer(QWEN_TOK)
  call = json.dumps({"name": "python", "arguments": {"code": "print(48 * 3 + 12)"}})
  text = (
      "<think>\nI compute it with the tool.\n</think>\n\n"
      f"<tool_call>\n{call}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\n156\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n<think>\nIt printed 156.\n</think>\n\n"
      f"<tool_call>\n{call}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\n156\n</tool_response>\n"
      "<tool_response>\n(second)\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\nThe answer is 156. #### 156"
  )
  ids, context = tool_traces.encode_with_context(tok, text)
  assert ids == tok.encode(text)
  assert len(tool_traces.context_spans(text)) == 2
  trained = tok.decode([i for i, c in zip(ids, context) if not c], skip_special=False)
  assert "tool_response" not in trained and "(second)" not in trained
  assert trained.count("<|im_end|>") == 2  # the assistant's own turn ends stay trained
  assert "<|im_start|>" not in trained
  context_text = tok.decode([i for i, c in zip(ids, context) if c], skip_special=False)
  assert context_text.count("<tool_response>") == 3
  assert context_text.count("<|im_start|>assistant\n") == 2
