"""Weights files for passes: find a module's `.npz`, read it safely, write a new one atomically.

The `.npz` named by the module attribute `mp.weights` resolves relative to the IR file and is
refused if the path leaves that file's folder; `--weights` (PassContext.weights_path) names
another file explicitly. Arrays are read with `allow_pickle=False`, so an npz can never run
code. A pass that changes weights writes all of them to `<stem>.npz` beside `-o` in one atomic
rename (mplower.io.atomic) and points `mp.weights` at it. Every problem is a located diagnostic.

An archive is read one member at a time (`NpzArchive`): a model pays only for the arrays it
names, and each member's npy header is checked (against the IR's type by the caller, against the
size the zip records here) before any of its data is inflated.
"""

from __future__ import annotations

import lzma
import math
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Self

import numpy as np

from mplower.dialect.plan import SHAPES_ONLY, WEIGHTS
from mplower.io.atomic import atomic_output, module_relative, staged_path
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import Module

ALIGN = 64
ZIPALIGN_EXTRA = 0xD935  # the extra-field id Android's zipalign pads with
MAP_AT_LEAST = 1 << 16  # smaller arrays are read: a map costs a page of address space anyway


def _error(loc: Location, message: str) -> DiagnosticError:
    return DiagnosticError(Diagnostic(loc, message))


def weights_file(module: Module, override: str | None) -> Path | None:
    """The weights file to use: `override`, else `mp.weights` inside the IR file's folder."""
    if override is not None:
        return Path(override)
    rel = module.attrs.get(WEIGHTS)
    if rel is None:
        return None
    if not isinstance(rel, str):
        raise _error(module.attr_loc(WEIGHTS), "module attribute mp.weights must be a string path")
    return module_relative(module, WEIGHTS, rel, "pass --weights to use it deliberately")


# What zipfile and numpy raise for a damaged, encrypted or oddly compressed member.
_READ_ERRORS = (OSError, ValueError, EOFError, RuntimeError, NotImplementedError,
                zipfile.BadZipFile, zlib.error, lzma.LZMAError)


class NpzArchive:
    """An .npz archive whose arrays are read one at a time, each only when asked for.

    `header` reads a member's npy header and nothing more, so a caller compares shape and dtype
    with the IR before paying for the data. `read` refuses a member whose header promises more
    or less data than the zip entry holds; since zipfile never inflates an entry past the size
    its directory records, a member allocates at most what its (already checked) header
    promises, however well its data compresses. Loads never unpickle.
    """

    def __init__(self, path: Path, loc: Location, what: str = "weights"):
        self.path, self.what = path, what
        fh = _open_regular_file(path, loc, what)
        self._fh = fh
        try:
            self._zip = zipfile.ZipFile(fh)
        except zipfile.BadZipFile:
            fh.close()
            raise _error(loc, f"{what} file '{path}' is not an .npz archive of named "
                              f"arrays") from None
        except _READ_ERRORS as e:
            fh.close()
            raise _error(loc, f"cannot read {what} file '{path}': {e}") from None
        # numpy's keys: a member's name without its .npy suffix
        self._members = {m.removesuffix(".npy"): m for m in self._zip.namelist()}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._zip.close()

    @property
    def names(self) -> list[str]:
        """The archive's keys, in file order."""
        return list(self._members)

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def header(self, name: str, loc: Location) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of array `name` (a key of `names`) from its npy header alone."""
        with self._open(name, loc) as fh:
            shape, dtype, _ = self._header(fh, name, loc)
        return shape, dtype

    def read(self, name: str, loc: Location) -> np.ndarray:
        """Array `name` (a key of `names`)."""
        member = self._members[name]
        with self._open(name, loc) as fh:
            shape, dtype, offset = self._header(fh, name, loc)
            promised = math.prod(shape) * dtype.itemsize
            held = self._zip.getinfo(member).file_size - offset
            if held != promised:
                raise _error(loc, f"{self.what} file '{self.path}': array '{name}' is damaged: "
                                  f"its header promises {promised} bytes of data "
                                  f"({'x'.join(map(str, shape)) or 'scalar'} {dtype}) but the "
                                  f"archive holds {held}")
            mapped = self._mapped(member, shape, dtype, offset)
            if mapped is not None:
                return mapped
            try:
                fh.seek(0)
                return np.lib.format.read_array(fh, allow_pickle=False)
            except MemoryError:
                raise _error(loc, f"not enough memory to load array '{name}' ({promised} "
                                  f"bytes) from {self.what} file '{self.path}'") from None
            except _READ_ERRORS as e:
                raise _error(loc, f"cannot read array '{name}' of {self.what} file "
                                  f"'{self.path}': {e}") from None

    def _mapped(self, member: str, shape: tuple[int, ...], dtype: np.dtype,
                offset: int) -> np.ndarray | None:
        """The array of an uncompressed member as a read-only map of the file, when its data
        is aligned for its dtype (save_npz aligns every member): a weight then costs memory
        only for the pages an op reads. None where it must be read instead (compressed, small,
        Fortran order, unaligned)."""
        info = self._zip.getinfo(member)
        nbytes = math.prod(shape) * dtype.itemsize
        if info.compress_type != zipfile.ZIP_STORED or nbytes < MAP_AT_LEAST or not shape:
            return None
        try:
            local = os.pread(self._fh.fileno(), 30, info.header_offset)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + 30 + name_len + extra_len + offset
            with self._zip.open(member) as fh:
                fh.seek(0)
                fmt = np.lib.format
                version = fmt.read_magic(fh)
                read_header = fmt.read_array_header_1_0 if version == (1, 0) \
                    else fmt.read_array_header_2_0
                _, fortran, _ = read_header(fh)
            if fortran or start % dtype.alignment:
                return None
            return np.memmap(self._fh, dtype=dtype, mode="r", offset=start, shape=shape)
        except _READ_ERRORS:
            return None

    def _open(self, name: str, loc: Location):
        try:
            return self._zip.open(self._members[name])
        except _READ_ERRORS as e:
            raise _error(loc, f"cannot read array '{name}' of {self.what} file "
                              f"'{self.path}': {e}") from None

    def _header(self, fh, name: str, loc: Location) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape, dtype, offset of the data) of the open member `fh`."""
        fmt = np.lib.format
        try:
            if fh.read(len(fmt.MAGIC_PREFIX)) != fmt.MAGIC_PREFIX:
                raise _error(loc, f"{self.what} file '{self.path}': member '{name}' is not a "
                                  f"numpy array (.npy)")
            fh.seek(0)
            version = fmt.read_magic(fh)
            # Versions 2.0 and 3.0 share the header layout (3.0 allows UTF-8 field names).
            read_header = fmt.read_array_header_1_0 if version == (1, 0) \
                else fmt.read_array_header_2_0
            shape, _, dtype = read_header(fh)
            offset = fh.tell()
        except _READ_ERRORS as e:
            raise _error(loc, f"cannot read array '{name}' of {self.what} file "
                              f"'{self.path}': {e}") from None
        if dtype.hasobject:
            raise _error(loc, f"cannot read {self.what} file '{self.path}': array '{name}' "
                              f"holds Python objects, which only unpickling could load "
                              f"(mplower loads with allow_pickle=False)")
        return tuple(shape), dtype, offset


def _open_regular_file(path: Path, loc: Location, what: str):
    """`path` opened for reading, refused at once unless it is a regular file: a FIFO or a
    device would block the read or never end. A file this run has staged but not yet committed
    (the weights an earlier pass wrote beside `-o`) reads as its staged content."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting
        fd = os.open(staged_path(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise _error(loc, f"{what} file '{path}' does not exist") from None
    except OSError as e:
        raise _error(loc, f"cannot read {what} file '{path}': {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _error(loc, f"{what} file '{path}' is not a regular file")
    return os.fdopen(fd, "rb")


def read_npz(path: Path, loc: Location, what: str = "weights") -> dict[str, np.ndarray]:
    """All arrays of an .npz, in file order, read without pickle."""
    with NpzArchive(path, loc, what) as archive:
        return {name: archive.read(name, loc) for name in archive.names}


ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def save_npz(fh: IO[bytes], arrays: dict[str, np.ndarray]) -> None:
    """np.savez, but any key works: `np.savez(fh, **arrays)` takes a key `file` or
    `allow_pickle` for its own parameter, and ONNX initializer and output names can be
    anything. Uncompressed, every array written without pickle."""
    with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, a in arrays.items():
            with zf.open(_aligned(zf, f"{key}.npy"), "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(a), allow_pickle=False)


def _aligned(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    """The member `name`, its local header padded (an extra field, as Android's zipalign pads
    APKs) so that its data starts on a 64-byte boundary of the file; numpy's npy header is
    itself padded to 64 bytes, so the array's data is aligned and NpzArchive maps it.
    Dated 1980-01-01 (zip's epoch), not now: the same arrays give the same bytes, so a
    lowering's weights can be checked by digest and rebuilt identically."""
    info = zipfile.ZipInfo(name, ZIP_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    # local header: 30 fixed bytes, the name, the zip64 extra field (20 bytes, forced), ours
    start = zf.start_dir + 30 + len(name.encode("utf-8")) + 20 + 4
    pad = -start % ALIGN
    info.extra = struct.pack("<HH", ZIPALIGN_EXTRA, pad) + bytes(pad)
    return info


def write_npz(path: Path, arrays: dict[str, np.ndarray], loc: Location) -> None:
    """Write `arrays` to `path` atomically: readers see the old file or the whole new one."""
    try:
        with atomic_output(path, "wb") as fh:
            save_npz(fh, arrays)
    except OSError as e:
        raise _error(loc, f"cannot write weights file '{path}': {e.strerror or e}") from None


def beside(output_path: str) -> Path:
    """`<stem>.npz` in the folder of the `-o` file."""
    return Path(output_path).with_suffix(".npz")


class WeightStore:
    """A module's named constants, each read on first use, after its npy header has been
    checked against the declared shape. The archive stays open while the store lives, so that
    each constant costs one member's read, not another pass over the zip's directory.

    `override` is the user's weights file, or a mapping of arrays that stands for it (a caller
    that holds the weights already: one block of a checkpoint streamed by mplower.hf.blocks,
    each array made when it is read)."""

    def __init__(self, module: Module, override: str | Mapping[str, np.ndarray] | None = None):
        self.module = module
        self._source = override if isinstance(override, Mapping) else None
        self.path = None if self._source is not None else weights_file(module, override)
        # Where a problem with the file is reported: the attribute that named it, if one did.
        self._file_loc = module.loc if override is not None else module.attr_loc(WEIGHTS)
        self._archive: NpzArchive | None = None
        self._arrays: dict[str, np.ndarray] = {}

    def _open(self, loc: Location) -> NpzArchive:
        if self.path is None:
            raise _error(loc, "this constant needs weights, but the module has no mp.weights "
                              "attribute and no --weights was given")
        if self._archive is None:
            self._archive = NpzArchive(self.path, self._file_loc)
        return self._archive

    def all(self, loc: Location) -> dict[str, np.ndarray]:
        """Every array of the file (what a pass that rewrites some of them copies over)."""
        if self._source is not None:
            return {name: self._source[name] for name in self._source}
        archive = self._open(loc)
        return {name: self._read(archive, name, loc) for name in archive.names}

    def get(self, name: str, shape: tuple[int, ...], loc: Location) -> np.ndarray:
        if self._source is not None:
            return self._from_source(name, shape, loc)
        if self.module.attrs.get(SHAPES_ONLY) and self.path is None:
            # Imported without weights (mplower import --shapes-only): zeros, in no memory, so
            # that passes which only need shapes (quantize's types and layout) still run.
            return np.broadcast_to(np.float32(0), shape)
        archive = self._open(loc)
        if name not in archive:
            raise _error(loc, f"weight '{name}' is missing from {self.path}")
        have, dtype = archive.header(name, loc)
        if have != tuple(shape):
            raise _error(loc, f"weight '{name}' has shape {list(have)} in {self.path} but "
                              f"the IR declares {list(shape)}")
        if dtype.kind not in "fiub":
            raise _error(loc, f"weight '{name}' has dtype {dtype}, which holds no numbers")
        return self._read(archive, name, loc)

    def _from_source(self, name: str, shape: tuple[int, ...], loc: Location) -> np.ndarray:
        if name not in self._source:
            raise _error(loc, f"weight '{name}' is missing from the weights given")
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = np.asarray(self._source[name])
        if arr.shape != tuple(shape):
            raise _error(loc, f"weight '{name}' has shape {list(arr.shape)} but the IR "
                              f"declares {list(shape)}")
        return arr

    def _read(self, archive: NpzArchive, name: str, loc: Location) -> np.ndarray:
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = archive.read(name, loc)
        return arr
