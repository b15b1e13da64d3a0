"""The HBM planner's parts (the command is `python -m grpo_jax.memory_plan`): the chips it
compiles for (tpu_targets.py), questions asked of optimized HLO (hlo_inspect.py), and its
printout (table.py)."""
