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
from mplower.ir.types import TensorType
from mplower.numerics.formats import FORMATS


def _error(loc: Location, message: str) -> DiagnosticError:
    return DiagnosticError(Diagnostic(loc, message))


def open_npz(path: Path, loc: Location, what: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz, read without pickle; a diagnostic for anything unreadable."""
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):  # a bare .npy array
            raise _error(loc, f"{what} file '{path}' is not an .npz archive of named arrays")
        with data:
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

    def get(self, name: str, t: TensorType, loc: Location) -> np.ndarray:
        """The array named `name`, checked against the constant's declared type `t`."""
        if self.path is None:
            raise _error(loc, f"constant '{name}' needs weights, but the module has no "
                              f"mp.weights attribute and no --weights was given")
        if self._arrays is None:
            self._arrays = open_npz(self.path, self.loc, "weights")
        arr = self._arrays.get(name)
        if arr is None:
            raise _error(loc, f"weight '{name}' is missing from {self.path}")
        if tuple(arr.shape) != t.shape:
            raise _error(loc, f"weight '{name}' has shape {list(arr.shape)} in {self.path} but "
                              f"the IR declares {list(t.shape)}")
        check_values(f"weight '{name}'", arr, t.elem, loc)
        return arr


def check_values(what: str, arr: np.ndarray, elem: str, loc: Location) -> None:
    """Values an element type can hold: numbers for a float, in-range integers for an integer."""
    fmt = FORMATS[elem]
    if arr.dtype.kind not in ("fiub" if fmt.is_float else "iub"):
        raise _error(loc, f"{what} has dtype {arr.dtype}, which cannot hold {elem} values")
    if fmt.is_int and arr.size and elem != "i1" and (
            arr.min() < fmt.min_value or arr.max() > fmt.max_finite):
        raise _error(loc, f"{what} has values in [{arr.min()}, {arr.max()}], outside the "
                          f"{elem} range [{int(fmt.min_value)}, {int(fmt.max_finite)}]")


def load_inputs(path: str, names: list[str], types: list[TensorType],
                locs: list[Location]) -> list[np.ndarray]:
    """The function's arguments from an .npz keyed by argument name, each checked against its
    declared type; a problem is reported at the argument (`locs`) and names the file."""
    arrays = open_npz(Path(path), Location(path, 0, 0), "inputs")
    out = []
    for name, t, loc in zip(names, types, locs, strict=True):
        if name not in arrays:
            have = ", ".join(sorted(arrays)) or "none"
            raise _error(loc, f"input '{name}' is missing from {path} (it has: {have})")
        arr = arrays[name]
        if tuple(arr.shape) != t.shape:
            raise _error(loc, f"input '{name}' in {path} has shape {list(arr.shape)} but the "
                              f"function takes {list(t.shape)}")
        check_values(f"input '{name}' in {path}", arr, t.elem, loc)
        check_finite(f"input '{name}' in {path}", arr, loc)
        out.append(arr)
    return out


def check_finite(what: str, arr: np.ndarray, loc: Location = UNKNOWN) -> None:
    if arr.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        if bad:
            raise _error(loc, f"{what} has {bad} NaN or infinite value{'s' * (bad != 1)}; "
                              f"the fp32 reference needs finite inputs")
