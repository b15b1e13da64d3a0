"""A plug-in reward (verl's interface) that even a random-init model gets varied scores from:
the fraction of the completion's characters that are digits. Used by the loop tests so that
every GRPO step has non-zero advantages and actually moves the parameters."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  del data_source, ground_truth, extra_info
  if not solution_str:
    return 0.0
  return sum(ch.isdigit() for ch in solution_str) / len(solution_str)
