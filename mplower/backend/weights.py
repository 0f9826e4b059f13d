"""Loading a module's weights and inputs safely.

Weights come from the `.npz` named by the module attribute `mp.weights`, resolved relative to
the IR file and refused if the path leaves the file's folder; `--weights` names another file
explicitly. Arrays are read with `allow_pickle=False`, so an npz can never run code. Every
problem (missing file, missing key, shape or dtype mismatch, NaN/inf in inputs) is a located
diagnostic.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from mplower.ir.diagnostics import UNKNOWN, Diagnostic, DiagnosticError, Location
from mplower.ir.graph import Module


def _error(loc: Location, message: str) -> DiagnosticError:
    return DiagnosticError(Diagnostic(loc, message))


def open_npz(path: Path, loc: Location, what: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz, read without pickle; a diagnostic for anything unreadable."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise _error(loc, f"{what} file '{path}' does not exist") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise _error(loc, f"cannot read {what} file '{path}': {e}") from None


def weights_path(module: Module, override: str | None) -> Path | None:
    """The weights file to use: `override`, else `mp.weights` inside the IR file's folder."""
    if override is not None:
        return Path(override)
    rel = module.attrs.get("mp.weights")
    if rel is None:
        return None
    if not isinstance(rel, str):
        raise _error(module.loc, "module attribute mp.weights must be a string path")
    base = Path(module.path).resolve().parent
    candidate = (base / rel).resolve()
    if not candidate.is_relative_to(base):
        raise _error(module.loc, f"mp.weights '{rel}' leaves the model's folder {base}; "
                                 f"pass --weights to use it deliberately")
    return candidate


class Weights:
    """Named constants of a module, loaded on first use."""

    def __init__(self, module: Module, override: str | None = None):
        self.path = weights_path(module, override)
        self.loc = module.loc
        self._arrays: dict[str, np.ndarray] | None = None

    def get(self, name: str, shape: tuple[int, ...], loc: Location) -> np.ndarray:
        if self.path is None:
            raise _error(loc, f"constant '{name}' needs weights, but the module has no "
                              f"mp.weights attribute and no --weights was given")
        if self._arrays is None:
            self._arrays = open_npz(self.path, self.loc, "weights")
        arr = self._arrays.get(name)
        if arr is None:
            raise _error(loc, f"weight '{name}' is missing from {self.path}")
        if tuple(arr.shape) != tuple(shape):
            raise _error(loc, f"weight '{name}' has shape {list(arr.shape)} in {self.path} but "
                              f"the IR declares {list(shape)}")
        if arr.dtype.kind not in "fiub":
            raise _error(loc, f"weight '{name}' has unsupported dtype {arr.dtype}")
        return arr


def load_inputs(path: str, names: list[str], shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    arrays = open_npz(Path(path), Location(path, 0, 0), "inputs")
    out = []
    for name, shape in zip(names, shapes):
        if name not in arrays:
            have = ", ".join(sorted(arrays)) or "none"
            raise _error(Location(path, 0, 0), f"input '{name}' is missing from {path} "
                                               f"(it has: {have})")
        arr = arrays[name]
        if tuple(arr.shape) != tuple(shape):
            raise _error(Location(path, 0, 0), f"input '{name}' has shape {list(arr.shape)} "
                                               f"but the function takes {list(shape)}")
        out.append(arr)
    return out


def check_finite(name: str, arr: np.ndarray, loc: Location = UNKNOWN) -> None:
    if arr.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        if bad:
            raise _error(loc, f"input '{name}' has {bad} NaN or infinite values")
