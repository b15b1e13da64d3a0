"""Run services the loop and the commands share: the session (session.py: checkpoints, writer,
preemption, teardown), Orbax checkpoints (checkpoint.py), per-step metrics (metrics.py), spans,
traces and memory lines (profiling.py), background compiles (compile_ahead.py), and the one path
layer for local or gs:// files (paths.py)."""
