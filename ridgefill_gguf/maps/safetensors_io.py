"""Memory-mapped safetensors reading (and plain writing) that keeps bfloat16 as raw bits.

The `safetensors` package's numpy loader has no bfloat16 and its torch loader copies; maps are large
(1.2 GiB for a 27B model), so tensors are read lazily, one at a time, straight from the file.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# bfloat16 comes back as uint16 bit patterns; the caller converts
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I8": np.int8, "U8": np.uint8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64, "F64": np.float64}


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{self.path}: not a safetensors file (too short)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > 100 << 20:
                    raise SafetensorsError(f"{self.path}: not a safetensors file (header length {n})")
                header = json.loads(f.read(n))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            if isinstance(e, SafetensorsError):
                raise
            raise SafetensorsError(f"{self.path}: cannot read safetensors header: {e}") from e
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: not a safetensors file (the header is not a JSON object)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, Entry] = {}
        for name, spec in header.items():
            try:
                start, end = spec["data_offsets"]
                entry = Entry(name, str(spec["dtype"]), tuple(int(x) for x in spec["shape"]), 8 + n + int(start),
                              8 + n + int(end))
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsError(f"{self.path}: tensor '{name}' has a malformed header entry ({e!r})") from e
            if entry.end > size or entry.start > entry.end:
                raise SafetensorsError(f"{self.path}: tensor '{name}' runs past the end of the file (truncated)")
            itemsize = np.dtype(DTYPES[entry.dtype]).itemsize if entry.dtype in DTYPES else None
            count = int(np.prod(entry.shape)) if entry.shape else 1
            if itemsize is not None and count * itemsize != entry.end - entry.start:
                raise SafetensorsError(f"{self.path}: tensor '{name}' has {entry.end - entry.start} bytes for "
                                       f"shape {list(entry.shape)} {entry.dtype}")
            self.entries[name] = entry

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> np.ndarray:
        e = self.entries.get(name)
        if e is None:
            raise SafetensorsError(f"{self.path}: tensor '{name}' is missing")
        if e.dtype not in DTYPES:
            raise SafetensorsError(f"{self.path}: tensor '{name}' has unsupported dtype {e.dtype}")
        dtype = np.dtype(DTYPES[e.dtype])
        count = int(np.prod(e.shape)) if e.shape else 1
        if count * dtype.itemsize != e.end - e.start:
            raise SafetensorsError(f"{self.path}: tensor '{name}' has {e.end - e.start} bytes for shape "
                                   f"{list(e.shape)} {e.dtype}")
        if count == 0:
            return np.zeros(e.shape, dtype=dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=e.start, shape=e.shape)


_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "BF16"}


def save(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
         bf16: tuple[str, ...] = ()) -> None:
    """Write a safetensors file; tensors named in `bf16` are uint16 bit patterns stored as BF16."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dtype = "BF16" if name in bf16 else _NAMES[arr.dtype]
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            arr.tofile(f)
