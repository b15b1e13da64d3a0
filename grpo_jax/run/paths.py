"""One path layer for all I/O on user paths: local folders and cloud storage alike.

Workdirs, checkpoints, TensorBoard events, metrics.jsonl, summary.json, data files,
tokenizers, HF checkpoints and reward plug-in files all go through `etils.epath` (what Orbax
itself uses), so `--workdir=gs://bucket/run` is one bucket folder that every host of a pod
writes and resumes from, not a local `./gs:/bucket/run` per host.

    p = paths.path("gs://bucket/run") / "summary.json"      # epath.Path (local: absolute)
    paths.write_atomic(p, text)                             # tmp + rename locally; one upload
    with paths.append_log(p) as log: log.write(line)        # metrics.jsonl, also on gs://

`gs://` needs gcsfs (`pip install -e '.[gcs]'`); `check_scheme` says so up front, in one line.
Cloud objects cannot be appended to or renamed atomically: appending rewrites the object
from a host-side copy, and a single upload is already all-or-nothing.
"""

import contextlib
import io
import os
import sys
import tempfile

from etils import epath

REMOTE_SCHEMES = ("gs://", "s3://", "az://")
_FSSPEC_PACKAGES = {"gs://": "gcsfs", "s3://": "s3fs", "az://": "adlfs"}


def is_remote(p) -> bool:
  return os.fspath(p).startswith(REMOTE_SCHEMES)


def path(p) -> epath.Path:
  """`p` as an epath.Path; local paths made absolute (they are logged and handed to Orbax)."""
  p = os.fspath(p)
  return epath.Path(p if is_remote(p) else os.path.abspath(os.path.expanduser(p)))


def check_scheme(p) -> tuple[str, str] | None:
  """None when `p` can be opened here; else (why not, the fix)."""
  p = os.fspath(p)
  for scheme, package in _FSSPEC_PACKAGES.items():
    if p.startswith(scheme):
      try:
        __import__(package)
      except ImportError:
        fix = "pip install -e '.[gcs]'" if scheme == "gs://" else f"pip install {package}"
        return f"{scheme} paths need the {package} package", fix
  return None


def exists(p) -> bool:
  return path(p).exists()


def isdir(p) -> bool:
  return path(p).is_dir()


def listdir(p) -> list[str]:
  return sorted(c.name for c in path(p).iterdir())


def read_text(p) -> str:
  return path(p).read_text(encoding="utf-8")


def read_bytes(p) -> bytes:
  return path(p).read_bytes()


def makedirs(p):
  path(p).mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def open_atomic(p, mode: str = "w"):
  """A file that appears at `p` whole or not at all: locally a temp file renamed over `p`;
  on cloud storage one upload (objects become visible only when complete)."""
  dst = path(p)
  if is_remote(dst):
    with dst.open(mode) as f:
      yield f
    return
  dst.parent.mkdir(parents=True, exist_ok=True)
  tmp = os.fspath(dst) + ".tmp"
  with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
    yield f
  os.replace(tmp, dst)


def write_atomic(p, data: str | bytes):
  with open_atomic(p, "wb" if isinstance(data, bytes) else "w") as f:
    f.write(data)


class AppendLog:
  """A text file to append lines to (metrics.jsonl). Local: a plain appending file. Cloud: the
  whole object is rewritten from a host-side copy on every `flush` (objects cannot be
  appended to); what was there before (an earlier run of the same workdir) is kept."""

  def __init__(self, p, *, keep_lines: int | None = None):
    """`keep_lines`: first drop all but the first lines of an existing file."""
    self.path = path(p)
    self.remote = is_remote(self.path)
    old = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
    lines = old.splitlines(keepends=True)
    if keep_lines is not None and keep_lines < len(lines):
      lines = lines[:keep_lines]
      if not self.remote:
        write_atomic(self.path, "".join(lines))
    self.lines = len(lines)
    if self.remote:
      self._buf = io.StringIO("".join(lines))
      self._buf.seek(0, io.SEEK_END)
      self._dirty = self.lines != len(old.splitlines())
    else:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      self._f = open(self.path, "a", encoding="utf-8")

  def write(self, text: str):
    if self.remote:
      self._buf.write(text)
      self._dirty = True
    else:
      self._f.write(text)

  def flush(self):
    if self.remote:
      if self._dirty:
        self.path.write_text(self._buf.getvalue(), encoding="utf-8")
        self._dirty = False
    else:
      self._f.flush()

  def close(self):
    self.flush()
    if not self.remote:
      self._f.close()


def local_copy(p, suffix: str = "") -> str:
  """A local file path with `p`'s contents: `p` itself when local, else a downloaded temp copy
  (for readers that need a real file, e.g. importing a reward plug-in)."""
  if not is_remote(p):
    return os.fspath(path(p))
  fd, tmp = tempfile.mkstemp(suffix=suffix or os.path.splitext(os.fspath(p))[1])
  with os.fdopen(fd, "wb") as f:
    f.write(path(p).read_bytes())
  return tmp


class _EventsWriter:
  """tensorboardX record writer onto any epath (cloud) path: buffers and rewrites on flush."""

  def __init__(self, p):
    self.path = epath.Path(p)
    self.buffer = io.BytesIO()
    self.closed = False

  def write(self, data: bytes):
    self.buffer.write(data)

  def flush(self):
    self.path.write_bytes(self.buffer.getvalue())

  def close(self):
    if not self.closed:
      self.flush()
      self.closed = True


class _EventsWriterFactory:

  def open(self, p):
    return _EventsWriter(p)

  def directory_check(self, p):
    del p  # cloud folders need no creating


def register_tensorboard_schemes():
  """TensorBoard event files on gs:// (etc.) through this layer rather than tensorboardX's own
  GCS writer (which needs google-cloud-storage)."""
  from tensorboardX import record_writer

  for scheme in REMOTE_SCHEMES:
    record_writer.register_writer_factory(scheme[:-3], _EventsWriterFactory())


# The checkout (or install) this package runs from: `--config=configs/tiny.py` also names its
# file from any other folder.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_file_args(argv: list[str]) -> list[str]:
  """`argv` with `--config=FILE[:ARG]` made absolute where FILE is not found from the current
  folder but is under the package's root (configs/ ships with the package), so the README's
  commands work from any folder. A FILE found in neither: one line on stderr and exit 2 (without
  this, ml_collections only fails at the first read of the config, or prints an error object)."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith("--config="):
      value = arg[len("--config=") :]
    elif arg == "--config" and i + 1 < len(out):
      value = out[i + 1]
    else:
      continue
    file, sep, rest = value.partition(":")
    if not file or "://" in value or os.path.exists(file):
      continue
    candidate = os.path.join(PACKAGE_ROOT, file)
    if not os.path.isfile(candidate):
      where = dict.fromkeys(os.path.realpath(p) for p in (os.getcwd(), PACKAGE_ROOT))  # once
      sys.stderr.write(
          f"error: --config={value}: no such file in {' or in '.join(where)}. Fix: "
          f"give the config file's path (the shipped ones: {os.path.join(PACKAGE_ROOT, 'configs')})\n"
      )
      sys.exit(2)
    value = candidate + sep + rest
    if arg == "--config":
      out[i + 1] = value
    else:
      out[i] = "--config=" + value
  return out
