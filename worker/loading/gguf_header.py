"""A fast reader for a GGUF file's header: metadata and tensor directory, no tensor data.

`gguf.GGUFReader` builds a numpy view per metadata part, which takes seconds for a
150k-token vocabulary; the loader only needs the values and each tensor's type,
shape and offset, which plain `struct` reads in milliseconds. Layout (GGUF v2/v3):
magic, version, tensor count, key/value count, the key/values, the tensor infos,
then the data, aligned to `general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: `shape` in numpy (row-major) order, `type_id` GGML's type number."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # absolute, in the file


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # numeric arrays as numpy arrays, strings as str
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row, as `string` reads them: one tight loop, because a vocabulary
        and its merges are ~100k-300k of them and this loop is most of a header's parse."""
        buf, pos, out = self.buf, self.pos, []
        length = _U64.unpack_from
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += dtype.itemsize * count
                return out
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        if type_id not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {type_id}")
        return self.unpack(_SCALARS[type_id])


def read_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF at `path`; ValueError if it is not one."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return _parse(_Cursor(view))
        except (struct.error, ValueError, IndexError) as exc:
            raise ValueError(f"not a readable GGUF file: {exc}") from exc
        finally:
            view.release()


def _parse(cur: _Cursor) -> GGUFHeader:
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError("bad magic")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        type_id, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, tuple(reversed(dims)), type_id, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = [TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]
    return GGUFHeader(metadata, tensors)
