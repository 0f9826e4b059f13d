"""Weights files for passes: find a module's `.npz`, read it safely, write a new one atomically.

The `.npz` named by the module attribute `mp.weights` resolves relative to the IR file and is
refused if the path leaves that file's folder; `--weights` (PassContext.weights_path) names
another file explicitly. Arrays are read with `allow_pickle=False`, so an npz can never run
code. A pass that changes weights writes all of them to `<stem>.npz` beside `-o` in one atomic
rename (mplower.fileio) and points `mp.weights` at it. Every problem is a located diagnostic.
(mplower.backend.weights holds the executor's copy of the same rules; it should use this.)
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from mplower.fileio import atomic_output, module_relative
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import Module


def _error(loc: Location, message: str) -> DiagnosticError:
    return DiagnosticError(Diagnostic(loc, message))


def weights_file(module: Module, override: str | None) -> Path | None:
    """The weights file to use: `override`, else `mp.weights` inside the IR file's folder."""
    if override is not None:
        return Path(override)
    rel = module.attrs.get("mp.weights")
    if rel is None:
        return None
    if not isinstance(rel, str):
        raise _error(module.loc, "module attribute mp.weights must be a string path")
    return module_relative(module, "mp.weights", rel, "pass --weights to use it deliberately")


def read_npz(path: Path, loc: Location, what: str = "weights") -> dict[str, np.ndarray]:
    """All arrays of an .npz, in file order, read without pickle."""
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise _error(loc, f"{what} file '{path}' is not an .npz archive of named arrays")
        with data:
            return {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise _error(loc, f"{what} file '{path}' does not exist") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise _error(loc, f"cannot read {what} file '{path}': {e}") from None


def write_npz(path: Path, arrays: dict[str, np.ndarray], loc: Location) -> None:
    """Write `arrays` to `path` atomically: readers see the old file or the whole new one."""
    try:
        with atomic_output(path, "wb") as fh:
            np.savez(fh, **arrays)
    except OSError as e:
        raise _error(loc, f"cannot write weights file '{path}': {e.strerror or e}") from None


def beside(output_path: str) -> Path:
    """`<stem>.npz` in the folder of the `-o` file."""
    return Path(output_path).with_suffix(".npz")


class WeightStore:
    """A module's named constants, read on first use and checked against their declared shape."""

    def __init__(self, module: Module, override: str | None = None):
        self.module = module
        self.path = weights_file(module, override)
        self._arrays: dict[str, np.ndarray] | None = None

    def all(self, loc: Location) -> dict[str, np.ndarray]:
        """Every array of the file (what a pass that rewrites some of them copies over)."""
        if self.path is None:
            raise _error(loc, "this constant needs weights, but the module has no mp.weights "
                              "attribute and no --weights was given")
        if self._arrays is None:
            self._arrays = read_npz(self.path, self.module.loc)
        return self._arrays

    def get(self, name: str, shape: tuple[int, ...], loc: Location) -> np.ndarray:
        arrays = self.all(loc)
        arr = arrays.get(name)
        if arr is None:
            raise _error(loc, f"weight '{name}' is missing from {self.path}")
        if tuple(arr.shape) != tuple(shape):
            raise _error(loc, f"weight '{name}' has shape {list(arr.shape)} in {self.path} but "
                              f"the IR declares {list(shape)}")
        if arr.dtype.kind not in "fiub":
            raise _error(loc, f"weight '{name}' has dtype {arr.dtype}, which holds no numbers")
        return arr
