"""ROUGE-1/2/L F1 (Lin 2004) via Google's `rouge-score` package, and the summarization rewards."""

import functools


@functools.lru_cache(maxsize=1)
def _scorer():
  from rouge_score import rouge_scorer

  return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
  """F1 of ROUGE-1, ROUGE-2 and ROUGE-L (Porter stemming, rouge-score's tokenizer)."""
  s = _scorer().score(reference, prediction)
  return {k: float(v.fmeasure) for k, v in s.items()}


def rouge(prompts, completions, ground_truth, **_) -> list[float]:
  """Mean of ROUGE-1, ROUGE-2 and ROUGE-L F1 against the reference summary, in [0, 1]."""
  del prompts
  out = []
  for c, ref in zip(completions, ground_truth):
    s = rouge_scores(c, str(ref))
    out.append((s["rouge1"] + s["rouge2"] + s["rougeL"]) / 3.0)
  return out


def length_similarity(prompts, completions, ground_truth, **_) -> list[float]:
  """min / max of the completion's and the reference's word counts, in [0, 1] (1: same
  length): keeps a ROUGE-rewarded policy from padding or truncating its summaries."""
  del prompts
  out = []
  for c, ref in zip(completions, ground_truth):
    a, b = len(c.split()), len(str(ref).split())
    out.append(min(a, b) / max(a, b) if max(a, b) else 1.0)
  return out
