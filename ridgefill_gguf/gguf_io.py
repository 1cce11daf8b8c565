"""Reading GGUF files quickly and strictly: metadata, tensor infos, and raw tensor bytes through mmap.

gguf.GGUFReader builds a numpy view per array item (seconds on a 150k-token vocabulary) and reads
truncated files without complaint; this reader walks the header once and names what is wrong.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

VT = GGUFValueType
_SCALARS = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
            VT.FLOAT32: "f", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d", VT.BOOL: "?"}
DEFAULT_ALIGNMENT = 32

# raw form of one key: (value type, value, item type for arrays); strings stay bytes
RawField = tuple[VT, Any, "VT | None"]


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous dimension
    type: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne))


@dataclass
class GGUFFile:
    path: Path
    version: int
    fields: dict[str, RawField]
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int
    value_offsets: dict[str, int] = field(default_factory=dict)  # where each string value's bytes start

    def get(self, key: str, default: Any = None) -> Any:
        """A key's value with strings decoded (arrays as lists)."""
        if key not in self.fields:
            return default
        vt, value, sub = self.fields[key]
        if vt == VT.STRING:
            return value.decode("utf-8", errors="replace")
        if vt == VT.ARRAY and sub == VT.STRING:
            return [v.decode("utf-8", errors="replace") for v in value]
        return value

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes, memory-mapped."""
        info = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))


def tensor_nbytes(ne: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(ne))
    return n // block * size


def read_gguf(path: str | Path, *, skip_arrays: tuple[str, ...] = ()) -> GGUFFile:
    """Parse a GGUF's header. Arrays under keys starting with a prefix in skip_arrays are not decoded
    (their item count is kept as the value), which keeps a model's vocabulary from costing time."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot open: {e.strerror}") from e
    with f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFFormatError(f"{path}: not a GGUF file ({size} bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buf, size, skip_arrays)
    except (struct.error, IndexError, ValueError) as e:
        if isinstance(e, GGUFFormatError):
            raise
        raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from e
    finally:
        buf.close()


def _parse(path: Path, buf: mmap.mmap, size: int, skip_arrays: tuple[str, ...]) -> GGUFFile:
    if buf[:4] != b"GGUF":
        raise GGUFFormatError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    pos = 4

    def take(fmt: str) -> Any:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return v

    def string() -> bytes:
        nonlocal pos
        n = take("Q")
        if pos + n > size:
            raise GGUFFormatError(f"{path}: truncated GGUF header (a string runs past the end of the file)")
        pos += n
        return bytes(buf[pos - n:pos])

    def value(vt: VT) -> Any:
        return string() if vt == VT.STRING else take(_SCALARS[vt])

    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported")
    fields: dict[str, RawField] = {}
    value_offsets: dict[str, int] = {}
    for _ in range(n_kv):
        key = string().decode()
        vt = VT(take("I"))
        if vt == VT.ARRAY:
            sub, n = VT(take("I")), take("Q")
            if any(key.startswith(p) for p in skip_arrays) and sub != VT.STRING and sub != VT.ARRAY:
                pos += n * struct.calcsize(_SCALARS[sub])
                fields[key] = (vt, n, sub)
            elif any(key.startswith(p) for p in skip_arrays) and sub == VT.STRING:
                for _ in range(n):
                    length = take("Q")  # not `pos += take(...)`: take moves pos itself
                    pos += length
                fields[key] = (vt, n, sub)
            else:
                fields[key] = (vt, [value(sub) for _ in range(n)], sub)
        else:
            fields[key] = (vt, value(vt), None)
            if vt == VT.STRING:
                value_offsets[key] = pos - len(fields[key][1])
    infos = []
    for _ in range(n_tensors):
        name = string().decode()
        n_dims = take("I")
        ne = tuple(take("Q") for _ in range(n_dims))
        qtype = GGMLQuantizationType(take("I"))
        infos.append((name, ne, qtype, take("Q")))
    alignment = fields.get("general.alignment", (VT.UINT32, DEFAULT_ALIGNMENT, None))[1]
    data_offset = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, ne, qtype, rel in infos:
        nbytes = tensor_nbytes(ne, qtype)
        if data_offset + rel + nbytes > size:
            raise GGUFFormatError(f"{path}: truncated: tensor '{name}' ends at byte {data_offset + rel + nbytes}, "
                                  f"the file has {size}")
        tensors[name] = TensorInfo(name, ne, qtype, data_offset + rel, nbytes)
    return GGUFFile(path, version, fields, tensors, data_offset, size, value_offsets)


def tensor_f32(g: GGUFFile, name: str) -> np.ndarray:
    """A tensor as float32 in numpy order (the reverse of ggml's ne), dequantized where it must be."""
    info = g.tensors[name]
    raw = g.raw(name)
    if info.type == GGMLQuantizationType.F32:
        arr = raw.view(np.float32)
    elif info.type == GGMLQuantizationType.F16:
        arr = raw.view(np.float16).astype(np.float32)
    else:
        rows = int(np.prod(info.ne[1:])) if len(info.ne) > 1 else 1
        arr = dequantize(np.asarray(raw).reshape(rows, -1), info.type)
    return np.asarray(arr, dtype=np.float32).reshape(tuple(reversed(info.ne)))


def writer_like(src: str | Path, out: str | Path, arch: str | None = None):
    """(a gguf-py GGUFWriter on out holding src's key/values, src's GGUFReader): keys under src's architecture move
    to `arch` when given. Add tensors (copy_tensors for src's own), then write as usual."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    w = GGUFWriter(str(out), arch=arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        name = arch + f.name[len(old):] if f.name.startswith(old + ".") else f.name
        w.add_key_value(name, f.contents(), f.types[0],
                        sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    return w, r


def copy_tensors(r, w, keep=lambda name: True) -> None:
    """The tensors of reader r that keep(name) accepts, into writer w, bytes unchanged."""
    for t in r.tensors:
        if keep(t.name):
            data = np.asarray(t.data)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
