"""GRPO-MNIST (grpo_jax/examples/mnist.py): the update pushes toward the reward, data loading
and its errors, and the example learning MNIST end to end (when the shared data is there)."""

import functools
import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
import pytest

from grpo_jax.examples import mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_DIR = os.path.join(ROOT, "..", "shared", "data", "mnist")


def _run_example(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one real CPU device, as a user runs it
  return subprocess.run(
      [sys.executable, "-m", "grpo_jax.examples.mnist", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def test_update_raises_probability_of_rewarded_label():
  b, g = 8, 64
  images_bhw = np.random.default_rng(1).integers(0, 256, (b, 28, 28)).astype(np.uint8)
  labels_b = np.arange(b) % mnist.NUM_CLASSES
  graphdef, params = nnx.split(mnist.Policy(nnx.Rngs(params=0)))
  probs = jax.jit(
      lambda p: jax.nn.softmax(nnx.merge(graphdef, p)(images_bhw))[jnp.arange(b), labels_b]
  )
  before_b = probs(params)
  hp = mnist.Hparams(group_size=g, shift=0, updates_per_batch=2)
  tx = optax.adamw(1e-3)
  step = jax.jit(functools.partial(mnist.grpo_batch, graphdef=graphdef, tx=tx, hp=hp))
  params, _, metrics = step(params, tx.init(params), images_bhw, labels_b, jax.random.key(2))
  after_b = probs(params)
  # Near-uniform start: about 1 in 10 of the G samples is rewarded, every image has some.
  assert 0.05 < float(metrics["reward"]) < 0.2
  before_b, after_b = np.asarray(before_b), np.asarray(after_b)
  assert np.all(after_b > before_b) and np.mean(after_b / before_b) > 1.3, (before_b, after_b)


def test_shift_images_moves_whole_image():
  image_hw = jnp.zeros((28, 28), jnp.uint8).at[10:14, 12:15].set(255)
  images_bhw = jnp.broadcast_to(image_hw, (64, 28, 28))
  shifted_bhw = np.asarray(mnist.shift_images(jax.random.key(0), images_bhw, 2), np.int64)
  assert np.all(shifted_bhw.sum((1, 2)) == int(image_hw.sum()))  # nothing lost
  rows = {int(np.nonzero(im.any(1))[0][0]) for im in shifted_bhw}
  cols = {int(np.nonzero(im.any(0))[0][0]) for im in shifted_bhw}
  assert rows == set(range(8, 13)) and cols == set(range(10, 15))
  assert mnist.shift_images(jax.random.key(0), images_bhw, 0) is images_bhw


def _write_idx(path, array, magic, gz=True):
  header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
  raw = header + array.astype(np.uint8).tobytes()
  with open(path, "wb") as f:
    f.write(gzip.compress(raw) if gz else raw)


def _write_set(folder, name, n, gz=True, seed=0):
  images_nhw = np.random.default_rng(seed).integers(0, 256, (n, 28, 28))
  images_nhw[:, 0, 0] = np.arange(n)  # each image tells which one it is
  images_name, labels_name = mnist.SETS[name]
  _write_idx(folder / (images_name + (".gz" if gz else "")), images_nhw, 2051, gz)
  _write_idx(folder / (labels_name + (".gz" if gz else "")), np.arange(n) % 10, 2049, gz)


def test_load_mnist_split_and_sets(tmp_path):
  _write_set(tmp_path, "t10k", 50, gz=False)
  data = mnist.load_mnist(tmp_path)
  train_ids, held_ids = data.train_images_nhw[:, 0, 0], data.heldout_images_nhw[:, 0, 0]
  assert len(train_ids) == 40 and len(held_ids) == 10
  assert sorted(np.concatenate([train_ids, held_ids]).tolist()) == list(range(50))
  np.testing.assert_array_equal(data.train_labels_n, train_ids % 10)
  again = mnist.load_mnist(tmp_path)  # the split is fixed
  np.testing.assert_array_equal(again.heldout_images_nhw[:, 0, 0], held_ids)

  _write_set(tmp_path, "train", 30, seed=1)  # both sets: train on train, hold out t10k
  data = mnist.load_mnist(tmp_path)
  assert len(data.train_labels_n) == 30 and len(data.heldout_labels_n) == 50
  assert "train-images-idx3-ubyte.gz" in data.description


def test_load_mnist_errors_name_the_file_and_fix(tmp_path):
  with pytest.raises(mnist.DataError, match=r"no MNIST images in .*t10k-images-idx3-ubyte"):
    mnist.load_mnist(tmp_path)
  _write_set(tmp_path, "t10k", 20)
  os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
  with pytest.raises(mnist.DataError, match=r"t10k-labels-idx1-ubyte\(\.gz\) is missing\. Fix"):
    mnist.load_mnist(tmp_path)
  _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(20), 2051)  # images magic
  with pytest.raises(mnist.DataError, match=r"labels-idx1-ubyte.gz: not an idx labels file"):
    mnist.load_mnist(tmp_path)
  raw = gzip.compress(gzip.decompress((tmp_path / "t10k-images-idx3-ubyte.gz").read_bytes())[:-5])
  (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(raw)
  with pytest.raises(mnist.DataError, match=r"truncated or damaged\. Fix"):
    mnist.load_mnist(tmp_path)


def test_missing_data_is_one_line(tmp_path):
  r = _run_example(f"--data_dir={tmp_path}", f"--workdir={tmp_path / 'out'}")
  assert r.returncode == 2, r.stderr[-3000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: no MNIST images in"), r.stderr[-3000:]
  assert "Fix:" in lines[0]


def test_example_learns_mnist(tmp_path):
  if not os.path.exists(os.path.join(MNIST_DIR, "t10k-images-idx3-ubyte.gz")):
    pytest.skip(f"MNIST data not found at {os.path.abspath(MNIST_DIR)}")
  epochs = 6
  r = _run_example(
      f"--data_dir={MNIST_DIR}", f"--workdir={tmp_path}", "--seed=0", f"--epochs={epochs}"
  )
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["heldout_accuracy"] >= 0.90, summary["epochs"]
  assert summary["data"]["train"] == 8000 and summary["data"]["heldout"] == 2000
  assert [e["epoch"] for e in summary["epochs"]] == list(range(1, epochs + 1))
  assert summary["heldout_accuracy"] == summary["epochs"][-1]["heldout_accuracy"]
  assert summary["epochs"][-1]["mean_reward"] > summary["epochs"][0]["mean_reward"]
  assert 0 < summary["compile_sec"] < summary["wall_time_sec"]
  assert summary["hparams"]["epochs"] == epochs and summary["seed"] == 0
  assert f"epoch {epochs}/{epochs}" in r.stderr and "ETA" in r.stderr
