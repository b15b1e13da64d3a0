"""Held-out evaluation: the evaluator the loop calls (evaluate.py) and how each row is scored by
its data_source (tasks.py: math, summarization, code, exact match; pass@k)."""
