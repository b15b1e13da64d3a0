"""GSM8K rewards for the `<reasoning>...</reasoning><answer>...</answer>` format.

Every function has the reward interface `fn(prompts, completions, **row_fields) ->
list[float]`; the answer key comes in `ground_truth` (a list aligned with completions).
The values follow the Tunix/Gemma GSM8K GRPO recipe, with numbers normalized ("1,234",
"$5", "72.0", "-3") where the recipe compared raw strings.
"""

from grpo_jax.rewards import parsing


def match_format_exactly(prompts, completions, **_) -> list[float]:
  """+3.0 when the completion is exactly `<reasoning>R</reasoning> ... <answer>A</answer>`
  (non-empty R and A, only whitespace outside), else 0.0."""
  del prompts
  return [3.0 if parsing.answer_in_format(c) is not None else 0.0 for c in completions]


def match_format_approximately(prompts, completions, **_) -> list[float]:
  """+0.5 for each of <reasoning>, </reasoning>, <answer>, </answer> that appears exactly once,
  -0.5 for each that does not (missing or repeated). Range [-2.0, 2.0]."""
  del prompts
  tags = (parsing.REASONING_START, parsing.REASONING_END, parsing.ANSWER_START, parsing.ANSWER_END)
  return [sum(0.5 if c.count(t) == 1 else -0.5 for t in tags) for c in completions]


def _check_one(guess: str | None, truth: str) -> float:
  if guess is None:
    return 0.0  # no answer in the format: nothing to check
  if guess == truth:
    return 3.0
  if guess.strip() == truth.strip():
    return 1.5
  g, t = parsing.parse_number(guess), parsing.parse_number(truth)
  if g is None or t is None:
    return -0.5  # the answer does not parse as a number
  if parsing.numbers_equal(g, t):
    return 1.5  # equal up to formatting ("1,234" vs "1234", "$5" vs "5", "72.0" vs "72")
  if t == 0:
    return -1.0
  ratio = g / t
  if 0.9 <= ratio <= 1.1:
    return 0.5
  if 0.8 <= ratio <= 1.2:
    return 0.25
  return -1.0


def check_answer(prompts, completions, ground_truth, **_) -> list[float]:
  """Scores the answer of a correctly formatted completion against the ground truth:
  +3.0 exact string; +1.5 equal after stripping whitespace or as numbers; else by the ratio
  answer / truth: within 10% +0.5, within 20% +0.25, otherwise -1.0; an answer that does not
  parse as a number -0.5; no formatted answer at all 0.0."""
  del prompts
  return [
      _check_one(parsing.answer_in_format(c), str(t)) for c, t in zip(completions, ground_truth)
  ]


def check_numbers(prompts, completions, ground_truth, **_) -> list[float]:
  """+1.5 when the first number inside <answer>...</answer> equals the ground truth as a
  number; 0.0 otherwise (also when there is no answer tag or no number in it)."""
  del prompts
  out = []
  for c, t in zip(completions, ground_truth):
    guess = parsing.first_number(parsing.answer_tag(c))
    out.append(1.5 if parsing.numbers_equal(guess, parsing.parse_number(str(t))) else 0.0)
  return out


def answer_match(prompts, completions, ground_truth, **_) -> list[float]:
  """1.0 when the (last) <answer> holds exactly the ground-truth number, up to formatting;
  else 0.0. The clean binary signal the CPU demo trains on."""
  del prompts
  return [1.0 if _is_correct(c, t) else 0.0 for c, t in zip(completions, ground_truth)]


def answer_format(prompts, completions, **_) -> list[float]:
  """1.0 when the completion is well formed (eval_flags' `formatted`: the full reasoning/answer
  format, or exactly one <answer>...</answer> and nothing else), else 0.0."""
  del prompts
  return [1.0 if eval_flags(c, "0")[2] else 0.0 for c in completions]


def _is_correct(completion: str, truth) -> bool:
  return parsing.numbers_equal(
      parsing.parse_number(parsing.answer_tag(completion)), parsing.parse_number(str(truth))
  )


def eval_flags(completion: str, ground_truth) -> tuple[bool, bool, bool]:
  """(correct, partial, formatted) for evaluation metrics.

  correct: the <answer> holds the ground-truth number (answer_match == 1).
  partial: the answer is within 10% of the ground truth (correct answers included).
  formatted: the completion has the full structured format (match_format_exactly > 0) or its
  <think>...</think><answer>...</answer> counterpart, or,
  for completions that use only an answer tag, exactly one well-formed <answer>...</answer>
  and nothing but whitespace outside it.
  """
  guess = parsing.parse_number(parsing.answer_tag(completion))
  truth = parsing.parse_number(str(ground_truth))
  correct = parsing.numbers_equal(guess, truth)
  partial = correct or (
      guess is not None and truth is not None and truth != 0 and 0.9 <= guess / truth <= 1.1
  )
  stripped = completion.strip()
  answer_only = (
      stripped.startswith(parsing.ANSWER_START)
      and stripped.endswith(parsing.ANSWER_END)
      and stripped.count(parsing.ANSWER_START) == 1
      and stripped.count(parsing.ANSWER_END) == 1
      and parsing.REASONING_START not in stripped
  )
  formatted = (
      parsing.answer_in_format(completion) is not None
      or answer_only
      or parsing.answer_in_think_format(completion) is not None
  )
  return correct, partial, formatted
