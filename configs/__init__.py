"""Experiment configs: `common.py` defines every field; one file per experiment overrides.

Installed with the package (setup.py), so `--config=configs/x.py` files can `from configs
import common` from any working directory.
"""
