"""The executor's view of weights and inputs: loaded safely, checked against the IR's types.

Finding and reading the weights file (path confinement, `allow_pickle=False`) is
mplower.io.npz's; this adds what execution needs on top: values an element type can hold
(in-range integers) and inputs keyed by argument name; a finite input that its argument's type
cannot hold is refused after the cast (executor.Program.prepare_inputs). Every problem is a
located diagnostic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mplower.io.npz import NpzArchive, WeightStore
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.types import TensorType
from mplower.numerics.formats import FORMATS


def _error(loc: Location, message: str) -> DiagnosticError:
    return DiagnosticError(Diagnostic(loc, message))


class Weights(WeightStore):
    """Named constants of a module (mplower.io.npz), also checked against the element type."""

    def get(self, name: str, t: TensorType, loc: Location) -> np.ndarray:  # type: ignore[override]
        """The array named `name`, checked against the constant's declared type `t`."""
        arr = super().get(name, t.shape, loc)
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
    declared type; a problem is reported at the argument (`locs`) and names the file. Only the
    arguments' arrays are read, each after its header matched the argument's shape."""
    out = []
    with NpzArchive(Path(path), Location(path, 0, 0), "inputs") as archive:
        for name, t, loc in zip(names, types, locs, strict=True):
            if name not in archive:
                have = ", ".join(sorted(archive.names)) or "none"
                raise _error(loc, f"input '{name}' is missing from {path} (it has: {have})")
            shape, _ = archive.header(name, loc)
            if shape != t.shape:
                hint = (f"; `mplower run --batch-inputs` runs its rows batch by batch, or retype "
                        f"the model with set-batch{{size={shape[0]}}}"
                        if len(shape) == t.rank and t.rank and shape[0] > t.shape[0]
                        and shape[1:] == t.shape[1:] else "")
                raise _error(loc, f"input '{name}' in {path} has shape {list(shape)} but the "
                                  f"function takes {list(t.shape)}{hint}")
            arr = archive.read(name, loc)
            check_values(f"input '{name}' in {path}", arr, t.elem, loc)
            out.append(arr)
    return out
