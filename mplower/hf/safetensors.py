"""Reading `*.safetensors` files without executing anything: the header parsed here, the data
memory-mapped.

The format (huggingface/safetensors, its README "Format"): an unsigned 64-bit little-endian
header length N, N bytes of UTF-8 JSON mapping each tensor name to `{"dtype", "shape",
"data_offsets": [begin, end]}` (offsets relative to the byte after the header; an optional
`__metadata__` of strings), then the data. Every entry is checked against the file before any
data is touched: a known dtype, a shape of non-negative integers, offsets inside the data whose
span is exactly the shape's bytes, no two tensors overlapping. A tensor is a view of one
read-only map of its file, so a checkpoint costs address space, not memory, until a tensor is
converted (bf16 to f32) or written. A sharded checkpoint's index (`model.safetensors.index.json`)
names its shards; a shard path that leaves the checkpoint folder is refused.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mplower.ir.diagnostics import DiagnosticError, Location

# The safetensors library refuses headers over 100 MB; so does this reader.
MAX_HEADER = 100_000_000
INDEX = "model.safetensors.index.json"

# Storage dtype of each safetensors dtype tag; BF16 is read as its bits and widened to f32.
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}


def _error(path: Path | str, message: str) -> DiagnosticError:
    return DiagnosticError.at(Location(str(path), 0, 0), message)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint: where it lies, not its data."""

    name: str
    dtype: str  # the safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in `file`
    nbytes: int


class SafetensorsFile:
    """The header of one file, checked; `array` maps a tensor's data on demand."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, TensorInfo] = {}
        self._map: np.ndarray | None = None  # the file's bytes, a view of _mmap
        self._mmap: mmap.mmap | None = None
        try:
            size = path.stat().st_size
            with open(path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise _error(path, f"not a safetensors file: {size} bytes, fewer than the "
                                       f"8-byte header length")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER or 8 + n > size:
                    raise _error(path, f"not a safetensors file: its header length {n} exceeds "
                                       f"the file ({size} bytes)" if n <= MAX_HEADER else
                                 f"not a safetensors file: header length {n} is over the "
                                 f"{MAX_HEADER}-byte limit")
                raw = fh.read(n)
        except OSError as e:
            raise _error(path, f"cannot read checkpoint file: {e.strerror or e}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _error(path, f"safetensors header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise _error(path, "safetensors header is not a JSON object")
        data_start, data_len = 8 + n, size - 8 - n
        spans = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            info = self._entry(name, entry, data_start, data_len)
            self.tensors[name] = info
            spans.append((info.start, info.start + info.nbytes, name))
        spans.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise _error(path, f"tensors '{a}' and '{b}' overlap in the data")

    def _entry(self, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
        where = f"tensor '{name}'"
        if not isinstance(entry, dict):
            raise _error(self.path, f"{where}: header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise _error(self.path, f"{where} has dtype {dtype!r}; mplower reads "
                                    f"{', '.join(DTYPES)}")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise _error(self.path, f"{where} has shape {shape!r}, not a list of non-negative "
                                    f"integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _error(self.path, f"{where} has data_offsets {offsets!r}, not [begin, end] "
                                    f"with 0 <= begin <= end")
        begin, end = offsets
        if end > data_len:
            raise _error(self.path, f"{where} ends at data byte {end}, past the end of the data "
                                    f"({data_len} bytes): the file is truncated")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != want:
            raise _error(self.path, f"{where} spans {end - begin} bytes but its shape {shape} "
                                    f"of {dtype} needs {want}")
        return TensorInfo(name, dtype, tuple(shape), self.path, data_start + begin, want)

    def array(self, info: TensorInfo) -> np.ndarray:
        """The tensor's data as stored (bf16 as uint16 bits), a read-only view of the file."""
        dt = DTYPES[info.dtype]
        if info.nbytes == 0:
            return np.zeros(info.shape, dt)
        if self._map is None:
            try:
                with open(self.path, "rb") as fh:
                    self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise _error(self.path, f"cannot map checkpoint file: {e}") from None
            self._map = np.frombuffer(self._mmap, np.uint8)
        raw = self._map[info.start:info.start + info.nbytes]
        return raw.view(dt).reshape(info.shape)

    def release(self) -> None:
        """Give back the pages of the file read so far: they count in the process's resident
        memory until then (a model streamed block by block would otherwise end up holding its
        whole checkpoint). The data stays mapped; a later read pages it in again."""
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)


def as_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A float tensor widened to f32 exactly (bf16 bits shifted into the high half)."""
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def inside(folder: Path, name: str, what: str, where: Path) -> Path:
    """`folder/name` when it is a regular file inside `folder` (after links), else an error at
    `where`."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise _error(where, f"{what} {name!r} is not a file name inside the checkpoint folder")
    path = (folder / name).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise _error(where, f"{what} {name!r} is outside the checkpoint folder {folder}; "
                            f"mplower reads only files inside it")
    if not path.is_file():
        raise _error(where, f"{what} {name!r} is missing from {folder}")
    return path


class Checkpoint:
    """Every tensor of a checkpoint folder: one `model.safetensors`, shards named by the index,
    or, with no index, every `*.safetensors` of the folder (no name in two files)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict[Path, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        if (folder / INDEX).exists():
            self._read_index(inside(folder, INDEX, "shard index", folder))
        else:
            paths = sorted(p for p in folder.glob("*.safetensors"))
            if not paths:
                raise _error(folder, "no *.safetensors file in the checkpoint folder")
            for p in paths:
                f = self._file(inside(folder, p.name, "weights file", folder))
                for name in f.tensors:
                    if name in self.where:
                        raise _error(p, f"tensor '{name}' is also in "
                                        f"{self.where[name].path.name}")
                    self.where[name] = f

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self.files:
            self.files[path] = SafetensorsFile(path)
        return self.files[path]

    def _read_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _error(index, f"cannot read the shard index: {e}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise _error(index, "the shard index has no 'weight_map' object")
        for name, shard in weight_map.items():
            f = self._file(inside(self.folder, shard, f"shard of tensor '{name}'", index))
            if name not in f.tensors:
                raise _error(index, f"tensor '{name}' is not in its shard {shard}")
            self.where[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def info(self, name: str) -> TensorInfo:
        f = self.where.get(name)
        if f is None:
            raise _error(self.folder, f"tensor '{name}' is missing from the checkpoint")
        return f.tensors[name]

    def release(self) -> None:
        """Give back the pages read so far of every file (SafetensorsFile.release)."""
        for f in self.files.values():
            f.release()

    def float32(self, name: str) -> np.ndarray:
        """The tensor as f32 (a view of the file when it is stored as f32)."""
        info = self.info(name)
        if info.dtype not in ("F32", "F16", "BF16", "F64"):
            raise _error(info.file, f"tensor '{name}' has dtype {info.dtype}, not a float")
        arr = self.where[name].array(info)
        return arr if info.dtype == "F32" else as_float32(arr, info.dtype)
