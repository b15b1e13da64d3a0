"""Answer extraction and number normalization shared by the rewards and the evaluation."""

import re
import unicodedata

REASONING_START, REASONING_END = "<reasoning>", "</reasoning>"
ANSWER_START, ANSWER_END = "<answer>", "</answer>"
THINK_START, THINK_END = "<think>", "</think>"

# The full structured format: <reasoning>...</reasoning> ... <answer>X</answer>, nothing else
# around it but whitespace (checked with fullmatch, so text before or after fails).
FORMAT_RE = re.compile(r"\s*<reasoning>.+?</reasoning>.*?<answer>(.+?)</answer>\s*", re.DOTALL)
THINK_FORMAT_RE = re.compile(r"\s*<think>.+?</think>.*?<answer>(.+?)</answer>\s*", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number: optional sign, digits with optional thousands commas, optional decimals.
NUMBER_RE = re.compile(r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+−]?\.\d+")


def answer_in_format(completion: str) -> str | None:
  """The text inside <answer> when the whole completion has the structured format, else None."""
  m = FORMAT_RE.fullmatch(completion)
  return m.group(1) if m else None


def answer_in_think_format(completion: str) -> str | None:
  """Like `answer_in_format` for the <think>...</think> ... <answer>...</answer> family."""
  m = THINK_FORMAT_RE.fullmatch(completion)
  return m.group(1) if m else None


def answer_tag(completion: str) -> str | None:
  """The text inside the last <answer>...</answer> pair, wherever it is; None if absent."""
  found = ANSWER_RE.findall(completion)
  return found[-1] if found else None


def parse_number(text: str | None) -> float | None:
  """A number from text that is just a number, up to currency, units and formatting.

  "1,234" -> 1234, "$5" -> 5, "72.0" -> 72, "-3" -> -3, " 42 dollars" -> 42, "½" -> None.
  Text holding two or more different numbers is ambiguous and gives None.
  """
  if text is None:
    return None
  text = unicodedata.normalize("NFKC", text).replace("−", "-")
  found = NUMBER_RE.findall(text)
  if not found:
    return None
  values = {_to_float(f) for f in found}
  if len(values) != 1:
    return None
  return values.pop()


def first_number(text: str | None) -> float | None:
  """The first number appearing in text (commas as thousands separators), or None."""
  if text is None:
    return None
  m = NUMBER_RE.search(unicodedata.normalize("NFKC", text).replace("−", "-"))
  return _to_float(m.group(0)) if m else None


def _to_float(s: str) -> float:
  return float(s.replace(",", "").replace("−", "-"))


def gsm8k_ground_truth(answer: str) -> str:
  """The final answer after GSM8K's '#### ' marker, normalized ("1,000" -> "1000")."""
  if "####" not in answer:
    raise ValueError("a GSM8K answer ends with a '#### N' line; none found")
  raw = answer.split("####")[-1].strip()
  return canonical_number(raw)


def canonical_number(text: str) -> str:
  """'1,000' -> '1000', '72.0' -> '72', '3.50' -> '3.5'; non-numbers come back stripped."""
  value = parse_number(text)
  if value is None:
    return text.strip()
  if value == int(value):
    return str(int(value))
  return repr(value)


def numbers_equal(a: float | None, b: float | None, rel_tol: float = 1e-9) -> bool:
  if a is None or b is None:
    return False
  return abs(a - b) <= rel_tol * max(1.0, abs(a), abs(b))
