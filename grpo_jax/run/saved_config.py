"""A run's saved config, WORKDIR/config.json (run/session.py writes it at start-up), read back:
the commands that act on a finished run (infer, report) take its settings from there, so no
training override is repeated, and `--config.a.b=v` on their command line still wins.

    config = saved_config.load("runs/demo/config.json")        # common.base() + the run's values
    argv = saved_config.with_config_arg(argv)                    # --config=WORKDIR/config.json
    config = saved_config.under_run(config, workdir, overridden) # the run's values win, but ours
"""

import json
import os

from absl import logging

FILE = "config.json"  # the run's config in its workdir (run/session.py writes it)


def load(path: str):
  """A run's config.json as a locked ConfigDict: configs/common.py's `base()` (every field, with
  its type) with the run's values on top (fields it has no place for are named by
  `under_run`'s warning)."""
  from configs import common
  from grpo_jax.run import paths

  config = common.base()
  try:
    overlay(config, json.loads(paths.read_text(path)))
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: not a readable run config ({e})") from None
  config.lock()
  return config


def overlay(config, saved: dict, keep=frozenset(), prefix: str = "") -> list[str]:
  """Sets the fields of `config` to a run's saved values (its config.json as a dict), except the
  fields named in `keep` (command-line overrides) and everything below them. -> the saved
  fields `config` has no place for (a run of other code), left out."""
  import ml_collections

  skipped = []
  for key, value in saved.items():
    name = prefix + key
    if name in keep:
      continue
    if key not in config:
      skipped.append(name)
    elif isinstance(config[key], ml_collections.ConfigDict) and isinstance(value, dict):
      skipped += overlay(config[key], value, keep, name + ".")
    else:
      try:
        config[key] = value
      except (TypeError, ValueError):  # a value to_json_best_effort could only write as text
        skipped.append(name)
  return skipped


def with_config_arg(argv: list[str]) -> list[str]:
  """`argv` with --config=WORKDIR/config.json when it names no --config and the workdir has one."""
  from grpo_jax.run import paths

  if any(a == "--config" or a.startswith("--config=") for a in argv[1:]):
    return argv
  workdir = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--workdir=")), None)
  if workdir is None and "--workdir" in argv[1:-1]:
    workdir = argv[argv.index("--workdir") + 1]
  if not workdir or not paths.exists(paths.path(workdir) / FILE):
    return argv
  return [argv[0], f"--config={os.fspath(paths.path(workdir) / FILE)}", *argv[1:]]


def under_run(config, workdir: str | None, overridden: dict | None = None):
  """The config to sample with: `config` (from --config, with the command-line overrides
  `overridden`: {field: value}) under the run's own values from WORKDIR/config.json, which win
  for every field not overridden. -> `config`, updated in place (as it is without a config.json).

  Overrides of model.* / lora.* fields that differ from the run's and that the checkpoint does
  not record (so it still loads, e.g. model.qk_norm: the policy then computes another function
  than the one trained) get one warning line; the recorded ones are infer's `check_shapes`'s."""
  from grpo_jax.run import paths
  from grpo_jax.run import session as session_lib

  overridden = overridden or {}
  path = paths.path(workdir) / FILE if workdir else None
  if path is None or not paths.exists(path):
    return config
  run = json.loads(paths.read_text(path))
  skipped = overlay(config, run, keep=frozenset(overridden))
  if skipped:
    logging.warning("%s: fields this code does not have, left out: %s", path, ", ".join(skipped))
  recorded = session_lib.resume_fields(config)
  differ = []
  for name, value in overridden.items():
    theirs = run
    for part in name.split("."):
      theirs = theirs.get(part) if isinstance(theirs, dict) else None
    if name.startswith(("model.", "lora.")) and name not in recorded and theirs is not None:
      if json.dumps(theirs) != json.dumps(value):
        differ.append(f"{name}={value!r} (the run's: {theirs!r})")
  if differ:
    logging.warning("sampling with other model settings than the run's: %s", ", ".join(differ))
  return config
