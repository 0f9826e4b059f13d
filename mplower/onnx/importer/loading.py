"""Reading an ONNX file: the protobuf and its external data, which must stay beside it."""

from __future__ import annotations

from pathlib import Path
from stat import S_ISREG

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from mplower.ir.diagnostics import DiagnosticError, Location


def load_model(path: str | Path) -> onnx.ModelProto:
    """Read an ONNX file; external data only from inside the model's folder."""
    path = Path(path)
    loc = Location(str(path), 0, 0)
    try:
        if not S_ISREG(path.stat().st_mode):  # a FIFO would block the read, a device never end
            raise DiagnosticError.at(loc, "cannot read model: not a regular file")
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError:
        raise DiagnosticError.at(loc, "cannot read model: no such file") from None
    except OSError as e:
        raise DiagnosticError.at(loc, f"cannot read model: {e.strerror or e}") from None
    except (DecodeError, ValueError, RuntimeError, TypeError) as e:  # not an ONNX file
        raise DiagnosticError.at(loc, f"not a valid ONNX model: {type(e).__name__}: "
                                      f"{str(e)[:200]}") from None
    _load_external_data(model, path.resolve().parent, loc)
    return model


def _load_external_data(model: onnx.ModelProto, base: Path, loc: Location) -> None:
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor

    for t in _get_all_tensors(model):
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        rel = info.get("location", "")
        if "\0" in rel:  # no path can hold one; the OS would refuse it with a bare ValueError
            raise DiagnosticError.at(loc, f"tensor '{t.name}' keeps its data in {rel!r}, whose "
                                          f"name holds a NUL byte; refusing to read it")
        target = (base / rel).resolve()
        if not rel or Path(rel).is_absolute() or not target.is_relative_to(base):
            raise DiagnosticError.at(loc, f"tensor '{t.name}' keeps its data in '{rel}', "
                                          f"outside the model's folder {base}; refusing to read it")
        if not target.exists():
            raise DiagnosticError.at(loc, f"tensor '{t.name}': external data file '{rel}' "
                                          f"does not exist")
        if not target.is_file():  # a FIFO or a device would block the read or never end
            raise DiagnosticError.at(loc, f"tensor '{t.name}': external data file '{rel}' "
                                          f"is not a regular file")
        try:
            load_external_data_for_tensor(t, str(base))
        except (OSError, ValueError) as e:
            raise DiagnosticError.at(loc, f"tensor '{t.name}': cannot read external data "
                                          f"'{rel}': {e}") from None
        except MemoryError:
            raise DiagnosticError.at(loc, f"tensor '{t.name}': not enough memory to read its "
                                          f"external data '{rel}'") from None
        t.data_location = TensorProto.DEFAULT
        del t.external_data[:]
