"""A plug-in reward that carries no signal for half the prompts: 0 for every completion of a
prompt whose answer is even (a zero-variance group), else the fraction of digits in the
completion (varies within a group). Used by the DAPO dynamic-sampling tests."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  del data_source, extra_info
  if int(ground_truth) % 2 == 0 or not solution_str:
    return 0.0
  return sum(ch.isdigit() for ch in solution_str) / len(solution_str)
