"""Minimal safetensors reading (memory-mapped, zero-copy) and streaming writing.

The format is an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the raw bytes. Reading through
np.memmap means a tensor's pages are read only when sliced, so loading a model one tensor (or
one shard) at a time never holds more than that in host memory. bfloat16 comes from ml_dtypes
(a JAX dependency), which the `safetensors` numpy API lacks. On cloud storage (gs://) each
tensor is one ranged read instead (grpo_jax/run/paths.py).
"""

import json
import struct

import ml_dtypes
import numpy as np

from grpo_jax.run import paths

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """Named tensors of one .safetensors file as read-only memmap views."""

  def __init__(self, path: str):
    self.path = path
    self.remote = paths.is_remote(path)
    with paths.path(path).open("rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header)")
      (n,) = struct.unpack("<Q", raw)
      size = f.seek(0, 2)
      if n > size - 8:
        raise ValueError(
            f"{path}: not a safetensors file (its header length {n} exceeds the "
            f"file's {size} bytes). Fix: point at .safetensors weights"
        )
      f.seek(8)
      try:
        header = json.loads(f.read(n))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    self.metadata = header.pop("__metadata__", {})
    self.header = header
    self._data_start = 8 + n
    for name, info in header.items():
      if 8 + n + info["data_offsets"][1] > size:
        raise ValueError(
            f"{path}: tensor {name} ends at byte {8 + n + info['data_offsets'][1]}"
            f" but the file has {size} bytes (truncated?). Fix: download or "
            "export the checkpoint again"
        )
    self._mm = None

  def keys(self):
    return self.header.keys()

  def get(self, name: str) -> np.ndarray:
    info = self.header[name]
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    if self.remote:
      with paths.path(self.path).open("rb") as f:
        f.seek(self._data_start + begin)
        buf = np.frombuffer(f.read(end - begin), np.uint8)
    else:
      if self._mm is None:
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
      buf = self._mm[self._data_start + begin : self._data_start + end]
    return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def write(path: str, tensors, metadata: dict | None = None):
  """Writes [(name, shape, dtype, producer)] streaming: producer() returns the array when its
  turn comes, so only one tensor is in host memory at a time."""
  tensors = list(tensors)
  header, offset = {}, 0
  for name, shape, dtype, _ in tensors:
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header[name] = {
        "dtype": _NAMES[dtype],
        "shape": list(shape),
        "data_offsets": [offset, offset + size],
    }
    offset += size
  if metadata:
    header["__metadata__"] = metadata
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # 8-byte alignment of the data section
  with paths.open_atomic(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype, producer in tensors:
      arr = np.ascontiguousarray(np.asarray(producer(), dtype=dtype))
      if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: produced shape {arr.shape}, header says {tuple(shape)}")
      f.write(arr.tobytes())
