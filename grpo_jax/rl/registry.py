"""Name registries: an algorithm variant is a named function plus a config value.

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(rewards_ng, *, eps, std_kind): ...

then `--config.loss.estimator=my_estimator`. The config validator lists `names()` in its
messages, so a new entry is usable and documented the moment it is registered.
"""

from typing import Callable


class Registry:
  """A dict of named functions with a clear error for unknown names."""

  def __init__(self, what: str):
    self.what = what
    self._fns: dict[str, Callable] = {}

  def register(self, *names: str):
    def deco(fn):
      for name in names:
        if name in self._fns:
          raise ValueError(f"{self.what} '{name}' is already registered")
        self._fns[name] = fn
      return fn

    return deco

  def get(self, name: str) -> Callable:
    try:
      return self._fns[name]
    except KeyError:
      raise ValueError(f"unknown {self.what} '{name}'; known: {', '.join(self.names())}") from None

  def names(self) -> tuple[str, ...]:
    return tuple(self._fns)

  def __contains__(self, name: str) -> bool:
    return name in self._fns


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
KL_ESTIMATORS = Registry("KL estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGG_MODES = Registry("loss aggregation mode")
OFFPOLICY_CORRECTIONS = Registry("off-policy correction")
