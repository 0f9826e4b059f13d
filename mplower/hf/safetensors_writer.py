"""Writing `*.safetensors` files, one tensor in memory at a time, without torch.

The format (huggingface/safetensors, its README "Format"): an unsigned 64-bit little-endian
header length N, N bytes of UTF-8 JSON mapping each tensor name to `{"dtype", "shape",
"data_offsets": [begin, end]}` (offsets from the byte after the header) and an optional
`__metadata__` of strings, then the data, little-endian and C-ordered. The header is padded
with spaces to a multiple of 8 bytes (as the safetensors library writes it), so every tensor
starts aligned. Tensors are given as (dtype tag, shape, a function that makes the array): the
header is written from the shapes, then each array is made, written and dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from mplower.hf.safetensors import DTYPES

# Tags beyond the reader's table: float8 weights of a compressed-tensors checkpoint.
WRITE_DTYPES = {**DTYPES, "F8_E4M3": np.dtype("u1")}


@dataclass(frozen=True)
class Pending:
    """A tensor to write: its tag and shape now, its values when `make` is called."""

    dtype: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * WRITE_DTYPES[self.dtype].itemsize


def write_safetensors(fh: BinaryIO, tensors: Mapping[str, Pending],
                      metadata: Mapping[str, str] | None = None) -> None:
    """The file of `tensors` (written in name order) to the binary stream `fh`."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    fh.write(len(head).to_bytes(8, "little"))
    fh.write(head)
    for name in names:
        t = tensors[name]
        arr = np.ascontiguousarray(t.make())
        want = WRITE_DTYPES[t.dtype]
        if arr.shape != t.shape or arr.dtype.itemsize != want.itemsize:
            raise ValueError(f"tensor {name}: made {arr.dtype}{list(arr.shape)}, declared "
                             f"{t.dtype}{list(t.shape)}")
        fh.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
