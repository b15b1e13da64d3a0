r"""GRPO-MNIST: the classic one-step GRPO illustration, on the GRPO math the LM loop uses.

A categorical policy (MLP 784-128-128-10, Flax NNX) looks at an image (the "prompt") and
samples G labels (G one-token "completions"); the reward is 1 for the right label, else 0, and
the labels reach the gradient only through that reward. Advantages are group-relative
(`rl.group_advantages`, GRPO by default) and the loss is PPO-clip with its aggregation
(`rl.policy_loss`): the functions `train.py` calls. AdamW (optax). Training images are shifted
by up to +-`shift` pixels at random inside the jitted step; a whole epoch (shuffle, shifts,
sampling, rewards, advantages, updates) is one jitted `lax.scan` over batches.

    python -m grpo_jax.examples.mnist --data_dir=../shared/data/mnist --workdir=/tmp/mnist --seed=0

Expected with the defaults on the 10k set (8k train / 2k held out): 96.2-96.7% held-out
accuracy (greedy argmax; seeds 0, 1, 2) after 40 epochs, >= 95% from epoch 11-12 on, in 30-40 s
all told on 2 busy CPU cores (about 10 s of it compiling). The log has one line per epoch:
held-out accuracy, mean reward of the sampled labels, fraction of clipped rows, seconds, ETA.

Data: `--data_dir` (local or gs://) holds MNIST idx files, each raw or gzipped (`.gz`):
  train-images-idx3-ubyte, train-labels-idx1-ubyte   the 60k training set
  t10k-images-idx3-ubyte,  t10k-labels-idx1-ubyte    the 10k test set
Both sets: train on the 60k, hold out the 10k. One set: a fixed split of it (the same for every
seed) holds out 20% (for the 10k set: 8k train / 2k held out). Train labels without the train
images (as in ../shared/data/mnist) are ignored. The files: https://yann.lecun.com/exdb/mnist/
(mirror: https://ossci-datasets.s3.amazonaws.com/mnist/).

Writes WORKDIR/summary.json: heldout_accuracy (after the last epoch), wall_time_sec (all of it:
data, compile, training, evaluation), compile_sec, per-epoch held-out accuracy, mean reward and
seconds, the settings and the data used.
"""

import dataclasses
import functools
import gzip
import json
import sys
import time
import zlib

from absl import app
from absl import flags
from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax.run import paths
from grpo_jax import rl

NUM_CLASSES = 10
IMAGE_SIZE = 28
HELDOUT_FRACTION = 0.2  # of a single set, when only one is there
SPLIT_SEED = 0  # that split never depends on --seed
# set name -> (images file, labels file); each may also be there as NAME.gz.
SETS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_MAGIC = {"images": 2051, "labels": 2049}
_DOWNLOAD = "https://ossci-datasets.s3.amazonaws.com/mnist/"


@dataclasses.dataclass(frozen=True)
class Hparams:
  """Training settings; the flags below take their defaults from here."""

  epochs: int = 40
  batch_size: int = 256  # images (prompts) per update
  group_size: int = 32  # G labels sampled per image
  lr: float = 3e-3  # peak; cosine decay to 0 over the run
  weight_decay: float = 1e-4
  clip_eps: float = 0.2
  updates_per_batch: int = 2  # GRPO's mu: updates per sampled batch; the clip binds from the 2nd
  shift: int = 2  # random shift of training images, pixels in each direction
  estimator: str = "grpo"


_H = Hparams()


def _define_flags():
  """Flags exist only when this file runs as the program (importing it, e.g. in the test
  process beside grpo_jax.infer, must not define a second --workdir)."""
  global _DATA_DIR, _WORKDIR, _SEED, _EPOCHS, _BATCH, _GROUP, _LR, _WD, _CLIP, _UPDATES, _SHIFT
  global _ESTIMATOR
  _DATA_DIR = flags.DEFINE_string("data_dir", None, "Folder with the MNIST idx files (see above).")
  _WORKDIR = flags.DEFINE_string("workdir", None, "Writes summary.json here (local or gs://).")
  _SEED = flags.DEFINE_integer("seed", 0, "Initialisation, shuffling, shifts and sampling.")
  _EPOCHS = flags.DEFINE_integer(
      "epochs", _H.epochs, "Passes over the training images.", lower_bound=1
  )
  _BATCH = flags.DEFINE_integer(
      "batch_size", _H.batch_size, "Images per update (B).", lower_bound=1
  )
  _GROUP = flags.DEFINE_integer(
      "group_size",
      _H.group_size,
      "Labels sampled per image (G); a group of one has advantage 0.",
      lower_bound=2,
  )
  _LR = flags.DEFINE_float(
      "lr",
      _H.lr,
      "AdamW learning rate at the start; it decays to 0 " "along a cosine over the run.",
      lower_bound=0,
  )
  _WD = flags.DEFINE_float("weight_decay", _H.weight_decay, "AdamW weight decay.", lower_bound=0)
  _CLIP = flags.DEFINE_float(
      "clip_eps",
      _H.clip_eps,
      "PPO-clip range: ratios outside [1-eps, 1+eps] stop pulling; binds "
      "from the second update on a batch.",
      lower_bound=0,
  )
  _UPDATES = flags.DEFINE_integer(
      "updates_per_batch",
      _H.updates_per_batch,
      "Updates on each sampled batch (GRPO's mu).",
      lower_bound=1,
  )
  _SHIFT = flags.DEFINE_integer(
      "shift",
      _H.shift,
      "Training images move by up to +-shift pixels in x and y (0: " "not at all).",
      lower_bound=0,
      upper_bound=IMAGE_SIZE - 1,
  )
  _ESTIMATOR = flags.DEFINE_enum(
      "estimator",
      _H.estimator,
      list(rl.ADVANTAGE_ESTIMATORS.names()),
      "Advantage estimator (rl.ADVANTAGE_ESTIMATORS).",
  )


# ------------------------------------------------------------------------------------ data


class DataError(Exception):
  """A missing or malformed data file or setting; the message is one line with its fix."""


@dataclasses.dataclass(frozen=True)
class Data:
  train_images_nhw: np.ndarray  # uint8
  train_labels_n: np.ndarray  # uint8
  heldout_images_nhw: np.ndarray
  heldout_labels_n: np.ndarray
  description: str  # which files, which split


def read_idx(p, kind: str) -> np.ndarray:
  """An idx file (raw or .gz) of MNIST `kind` ("images" [N, 28, 28] or "labels" [N]), uint8."""
  raw = paths.read_bytes(p)
  if str(p).endswith(".gz"):
    try:
      raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
      raise DataError(
          f"{p}: not a readable gzip file ({e}). Fix: download it again from " f"{_DOWNLOAD}"
      ) from None
  ndim = 3 if kind == "images" else 1
  header = 4 + 4 * ndim
  magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
  if len(raw) < header or magic != _IDX_MAGIC[kind]:
    raise DataError(
        f"{p}: not an idx {kind} file (magic number {magic}, expected "
        f"{_IDX_MAGIC[kind]}). Fix: use the MNIST *-{kind}-idx{ndim}-ubyte file "
        f"from {_DOWNLOAD}"
    )
  dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
  if len(raw) - header != int(np.prod(dims)):
    raise DataError(
        f"{p}: {len(raw) - header} data bytes, its header says {dims} = "
        f"{int(np.prod(dims))}: truncated or damaged. Fix: download it again from "
        f"{_DOWNLOAD}"
    )
  if kind == "images" and dims[1:] != [IMAGE_SIZE, IMAGE_SIZE]:
    raise DataError(
        f"{p}: images are {dims[1]}x{dims[2]}, MNIST's are 28x28. Fix: use the " "MNIST files"
    )
  return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _find(root, name):
  for candidate in (name, name + ".gz"):
    if (root / candidate).exists():
      return root / candidate
  return None


def _read_set(root, name):
  images_name, labels_name = SETS[name]
  images_path, labels_path = _find(root, images_name), _find(root, labels_name)
  if images_path is None:
    return None
  if labels_path is None:
    raise DataError(
        f"{images_path} has no labels: {root / labels_name}(.gz) is missing. Fix: "
        f"put {labels_name}.gz (from {_DOWNLOAD}) next to it"
    )
  images_nhw, labels_n = read_idx(images_path, "images"), read_idx(labels_path, "labels")
  if len(images_nhw) != len(labels_n):
    raise DataError(
        f"{images_path} holds {len(images_nhw)} images but {labels_path} "
        f"{len(labels_n)} labels. Fix: use the matching pair of files"
    )
  if labels_n.max(initial=0) >= NUM_CLASSES:
    raise DataError(
        f"{labels_path}: label {labels_n.max()} is not a digit. Fix: use the " "MNIST labels file"
    )
  return images_nhw, labels_n, f"{images_path.name} + {labels_path.name}"


def load_mnist(data_dir) -> Data:
  """Train / held-out images and labels from `data_dir` (module docstring: which files, how)."""
  root = paths.path(data_dir)
  if not root.is_dir():
    raise DataError(
        f"--data_dir={data_dir} is not a folder. Fix: pass the folder holding the "
        "MNIST idx files, e.g. --data_dir=../shared/data/mnist"
    )
  found = {name: s for name in SETS if (s := _read_set(root, name)) is not None}
  if not found:
    raise DataError(
        f"no MNIST images in {root}: neither t10k-images-idx3-ubyte(.gz) nor "
        "train-images-idx3-ubyte(.gz) is there. Fix: put the images with their "
        f"labels files (from {_DOWNLOAD}) in it"
    )
  if len(found) == 2:
    (tx, ty, tdesc), (hx, hy, hdesc) = found["train"], found["t10k"]
    return Data(tx, ty, hx, hy, f"train on {tdesc} ({len(tx)}), hold out {hdesc} ({len(hx)})")
  ((images_nhw, labels_n, desc),) = found.values()
  order = np.random.default_rng(SPLIT_SEED).permutation(len(images_nhw))
  num_held = round(len(order) * HELDOUT_FRACTION)
  held, train = np.sort(order[:num_held]), np.sort(order[num_held:])
  return Data(
      images_nhw[train],
      labels_n[train],
      images_nhw[held],
      labels_n[held],
      f"{desc}: fixed split, train on {len(train)}, hold out {len(held)}",
  )


# ---------------------------------------------------------------------------------- policy


class Policy(nnx.Module):
  """Categorical policy over the 10 labels: MLP 784-128-128-10 with ReLU."""

  def __init__(self, rngs: nnx.Rngs, hidden: int = 128):
    self.fc1 = nnx.Linear(IMAGE_SIZE * IMAGE_SIZE, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

  def __call__(self, images_bhw: jax.Array) -> jax.Array:
    x_bd = images_bhw.reshape(images_bhw.shape[0], -1).astype(jnp.float32) / 255.0
    return self.out(jax.nn.relu(self.fc2(jax.nn.relu(self.fc1(x_bd)))))  # [B, V]


def shift_images(key, images_bhw: jax.Array, max_shift: int) -> jax.Array:
  """Each image moved by its own random (dy, dx) in [-max_shift, max_shift]^2, zero-filled."""
  if max_shift == 0:
    return images_bhw
  s = max_shift
  starts_b2 = jax.random.randint(key, (images_bhw.shape[0], 2), 0, 2 * s + 1)
  padded_bhw = jnp.pad(images_bhw, ((0, 0), (s, s), (s, s)))
  crop = lambda img, start: jax.lax.dynamic_slice(img, start, (IMAGE_SIZE, IMAGE_SIZE))
  return jax.vmap(crop)(padded_bhw, starts_b2)


def label_logprobs(logits_bv: jax.Array, labels_bg: jax.Array) -> jax.Array:
  """log pi(label | image) of the G labels of each image: [B, G]."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits_bv), labels_bg, axis=-1)


# ------------------------------------------------------------------------------------ GRPO


def grpo_loss(params, graphdef, images_bhw, sampled_bg, old_logp_bg, adv_bg, clip_eps):
  """`rl.policy_loss` (PPO-clip, no KL) on the B*G sampled labels as one-token completions."""
  logp_bg = label_logprobs(nnx.merge(graphdef, params)(images_bhw), sampled_bg)
  n = sampled_bg.size
  mask_n1 = jnp.ones((n, 1), bool)
  return rl.policy_loss(
      logp_bg.reshape(n, 1),
      old_logp_bg.reshape(n, 1),
      None,
      adv_bg.reshape(n),
      mask_n1,
      clip_eps=clip_eps,
      beta=0.0,
  )


def grpo_batch(params, opt_state, images_bhw, labels_b, key, *, graphdef, tx, hp: Hparams):
  """One GRPO step on a batch: shift, sample G labels per image, reward, advantages, update(s).

  -> (params, opt_state, metrics). The reward is the only place the labels are used.
  """
  shift_key, sample_key = jax.random.split(key)
  b, g = labels_b.shape[0], hp.group_size
  images_bhw = shift_images(shift_key, images_bhw, hp.shift)
  logits_bv = nnx.merge(graphdef, params)(images_bhw)
  sampled_bg = jax.random.categorical(sample_key, logits_bv[:, None, :], shape=(b, g))
  rewards_bg = (sampled_bg == labels_b[:, None]).astype(jnp.float32)
  adv_bg = rl.group_advantages(rewards_bg.reshape(-1), g, estimator=hp.estimator).reshape(b, g)
  old_logp_bg = label_logprobs(logits_bv, sampled_bg)  # the sampling policy's, a constant

  def update(carry, _):
    params, opt_state = carry
    (loss, m), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
        params, graphdef, images_bhw, sampled_bg, old_logp_bg, adv_bg, hp.clip_eps
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), (loss, m["clip_frac"])

  (params, opt_state), (loss_u, clip_u) = jax.lax.scan(
      update, (params, opt_state), length=hp.updates_per_batch
  )
  metrics = {"reward": rewards_bg.mean(), "loss": loss_u.mean(), "clip_frac": clip_u.mean()}
  return params, opt_state, metrics


def make_train_epoch(graphdef, tx, hp: Hparams, num_train: int):
  """One jitted epoch: a fresh shuffle, then a `lax.scan` of `grpo_batch` over full batches.

  (params, opt_state, images_nhw, labels_n, key) -> (params, opt_state, mean metrics).
  """
  num_batches = num_train // hp.batch_size
  step = functools.partial(grpo_batch, graphdef=graphdef, tx=tx, hp=hp)

  def train_epoch(params, opt_state, images_nhw, labels_n, key):
    order_key, step_key = jax.random.split(key)
    order_kb = jax.random.permutation(order_key, num_train)[: num_batches * hp.batch_size]
    order_kb = order_kb.reshape(num_batches, hp.batch_size)

    def body(carry, xs):
      idx_b, k = xs
      params, opt_state, metrics = step(*carry, images_nhw[idx_b], labels_n[idx_b], k)
      return (params, opt_state), metrics

    (params, opt_state), metrics_k = jax.lax.scan(
        body, (params, opt_state), (order_kb, jax.random.split(step_key, num_batches))
    )
    return params, opt_state, jax.tree.map(jnp.mean, metrics_k)

  return jax.jit(train_epoch, donate_argnums=(0, 1))


def make_accuracy(graphdef):
  """Greedy (argmax) accuracy of the policy: (params, images_nhw, labels_n) -> scalar."""

  def accuracy(params, images_nhw, labels_n):
    logits_nv = nnx.merge(graphdef, params)(images_nhw)
    return (logits_nv.argmax(-1) == labels_n).mean()

  return jax.jit(accuracy)


# ------------------------------------------------------------------------------------ loop


def run(data_dir, workdir, seed: int, hp: Hparams) -> dict:
  """Trains, logs one line per epoch, writes WORKDIR/summary.json (if given); -> the summary."""
  start = time.perf_counter()
  data = load_mnist(data_dir)
  num_train = len(data.train_labels_n)
  if hp.batch_size > num_train:
    raise DataError(
        f"--batch_size={hp.batch_size} is more than the {num_train} training "
        f"images. Fix: --batch_size={min(num_train, Hparams.batch_size)}"
    )
  logging.info("data: %s", data.description)

  init_key, train_key = jax.random.split(jax.random.key(seed))
  graphdef, params = nnx.split(Policy(nnx.Rngs(params=init_key)))
  total_updates = hp.epochs * (num_train // hp.batch_size) * hp.updates_per_batch
  tx = optax.adamw(optax.cosine_decay_schedule(hp.lr, total_updates), weight_decay=hp.weight_decay)
  opt_state = tx.init(params)
  train_x, train_y, held_x, held_y = jax.device_put(
      (data.train_images_nhw, data.train_labels_n, data.heldout_images_nhw, data.heldout_labels_n)
  )

  compile_start = time.perf_counter()
  train_epoch = (
      make_train_epoch(graphdef, tx, hp, num_train)
      .lower(params, opt_state, train_x, train_y, train_key)
      .compile()
  )
  accuracy = make_accuracy(graphdef).lower(params, held_x, held_y).compile()
  compile_sec = time.perf_counter() - compile_start

  epochs = []
  train_start = time.perf_counter()
  for epoch in range(1, hp.epochs + 1):
    epoch_start = time.perf_counter()
    params, opt_state, metrics = train_epoch(
        params, opt_state, train_x, train_y, jax.random.fold_in(train_key, epoch)
    )
    metrics, acc = jax.device_get((metrics, accuracy(params, held_x, held_y)))  # one read
    now = time.perf_counter()
    epochs.append(
        {
            "epoch": epoch,
            "heldout_accuracy": float(acc),
            "mean_reward": float(metrics["reward"]),
            "loss": float(metrics["loss"]),
            "clip_frac": float(metrics["clip_frac"]),
            "sec": now - epoch_start,
        }
    )
    eta = (now - train_start) / epoch * (hp.epochs - epoch)
    logging.info(
        "epoch %d/%d  held-out accuracy %.2f%%  mean reward %.3f  clip %.3f  %.2fs  " "ETA %.0fs",
        epoch,
        hp.epochs,
        100 * acc,
        metrics["reward"],
        metrics["clip_frac"],
        now - epoch_start,
        eta,
    )

  summary = {
      "heldout_accuracy": epochs[-1]["heldout_accuracy"],
      "wall_time_sec": time.perf_counter() - start,
      "compile_sec": compile_sec,
      "train_sec": time.perf_counter() - train_start,
      "epochs": epochs,
      "seed": seed,
      "hparams": dataclasses.asdict(hp),
      "data": {
          "dir": str(paths.path(data_dir)),
          "description": data.description,
          "train": num_train,
          "heldout": len(data.heldout_labels_n),
      },
      "device": str(jax.devices()[0]),
  }
  logging.info(
      "held-out accuracy %.2f%% after %d epochs, %.1fs in all (compile %.1fs)",
      100 * summary["heldout_accuracy"],
      hp.epochs,
      summary["wall_time_sec"],
      compile_sec,
  )
  if workdir:
    paths.makedirs(workdir)
    out = paths.path(workdir) / "summary.json"
    paths.write_atomic(out, json.dumps(summary, indent=2) + "\n")
    logging.info("wrote %s", out)
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  for flag in ("data_dir", "workdir"):
    value = flags.FLAGS[flag].value
    problem = value and paths.check_scheme(value)
    if problem:
      print(f"error: --{flag}={value}: {problem[0]}. Fix: {problem[1]}.", file=sys.stderr)
      sys.exit(2)
  hp = Hparams(
      epochs=_EPOCHS.value,
      batch_size=_BATCH.value,
      group_size=_GROUP.value,
      lr=_LR.value,
      weight_decay=_WD.value,
      clip_eps=_CLIP.value,
      updates_per_batch=_UPDATES.value,
      shift=_SHIFT.value,
      estimator=_ESTIMATOR.value,
  )
  try:
    run(_DATA_DIR.value, _WORKDIR.value, _SEED.value, hp)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  _define_flags()
  flags.mark_flag_as_required("data_dir")
  app.run(main)
