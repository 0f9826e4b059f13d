"""ONNX models to mplower modules: static shapes, folded constants, the mp op set.

`import_model` reads an ONNX model (any opset the installed onnx knows), keeps the
graph outputs asked for and only the nodes that feed them, fixes every dynamic input dimension
(`input_shapes`, else a dynamic leading batch dimension becomes 1), runs ONNX's own checker and
shape inference, and then walks the nodes in order. A node whose inputs are all known at import
time is folded (onnx's ReferenceEvaluator computes it), so the shape subgraphs of exporters
(Shape, Gather on shapes, Unsqueeze, Concat, ConstantOfShape, Range, Trilu of a constant, Where
and Equal on constants), Reshape targets, Slice bounds and weight generators become plain
constants, and the module holds no op whose operands are all constants. Index tensors (INT64
token ids, an attention mask) that are graph inputs stay real i64 values. Every other node
becomes mp ops whose result types come from the op definitions themselves, so the module
verifies by construction. Large constants are named weights (written to an .npz by the
caller), small ones inline `dense<>`.

An op type the importer has no rule for is collected, and one diagnostic lists every such type
with its count before anything is converted. Values that the IR carries as attributes (a Reshape
target, quantization scales) must be constants; when one depends on a graph input instead, the
error names those inputs (`StaticInputsNeeded`), which lets the ONNX backend bind them and retry.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.plan import OUTPUT_NAMES
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.opdef import OPS, OpError
from mplower.ir.types import DenseAttr, TensorType, tensor, value_dtype
from mplower.ir.verifier import verify
from mplower.numerics.formats import FORMATS, QUANT_STORAGE

MIN_OPSET = 1
MAX_OPSET = onnx.defs.onnx_opset_version()

# ONNX element types the IR has a type for, both ways.
ELEM_OF_ONNX = {
    TensorProto.FLOAT: "f32", TensorProto.DOUBLE: "f64", TensorProto.FLOAT16: "f16",
    TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT8E4M3FN: "f8E4M3FN",
    TensorProto.FLOAT8E5M2: "f8E5M2", TensorProto.INT32: "i32", TensorProto.INT8: "i8",
    TensorProto.UINT8: "ui8", TensorProto.INT4: "i4", TensorProto.BOOL: "i1",
    TensorProto.INT64: "i64", TensorProto.INT16: "i16", TensorProto.UINT16: "ui16",
    TensorProto.UINT32: "ui32", TensorProto.UINT64: "ui64",
}
ONNX_OF_ELEM = {e: t for t, e in ELEM_OF_ONNX.items()}
# Constants of at most this many elements, and splats of any size, are written inline as
# dense<>; the others are named weights.
INLINE_LIMIT = 8


def onnx_type_name(t: int) -> str:
    return TensorProto.DataType.Name(t) if t in TensorProto.DataType.values() else str(t)


@dataclass(frozen=True)
class Const:
    """A value known at import time (initializer, Constant, or folded)."""

    array: np.ndarray  # as numpy_helper gives it (ml_dtypes for bf16, f8, int4)


@dataclass(frozen=True)
class Run:
    """A value computed at run time by an mp op or passed as an argument."""

    value: tuple[int, int]
    type: TensorType
    onnx_type: int  # the ONNX element type it stands for


@dataclass(frozen=True)
class Unbound:
    """A graph input whose element type the IR lacks (INT64, UINT16, ...): usable only where
    the importer needs a constant, which binds it (StaticInputsNeeded)."""

    name: str
    onnx_type: int
    shape: tuple[int, ...]


@dataclass
class Imported:
    module: Module
    weights: dict[str, np.ndarray]  # npz contents for the named constants
    inputs: list[str]  # ONNX names of the function arguments, in order
    input_types: list[int]  # their ONNX element types
    outputs: list[str]  # ONNX names of the results, in order
    output_types: list[int]  # their ONNX element types


class StaticInputsNeeded(DiagnosticError):
    """A value the IR carries as an attribute depends on these graph inputs."""

    def __init__(self, names: list[str], diagnostic: Diagnostic):
        super().__init__(diagnostic)
        self.names = names


# ---------------------------------------------------------------------------------------------
# Entry points


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


def import_model(model: onnx.ModelProto, file: str = "<model>", *,
                 input_shapes: dict[str, tuple[int, ...]] | None = None,
                 outputs: Sequence[str] | None = None,
                 static_inputs: dict[str, np.ndarray] | None = None,
                 inline_weights: bool = False) -> Imported:
    """Convert `model` to a verified Module; see the module docstring.

    `static_inputs` binds graph inputs to values known at import (the backend's int64 shape
    and axes inputs). With `inline_weights` every constant is inline (no weights file).
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # pruning and fixing input shapes edit the graph
    return _Importer(copy, file, input_shapes or {}, outputs, static_inputs or {},
                     inline_weights).run()


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`NAME=1x3x224x224` (a scalar: `NAME=`) as (name, dims); ValueError if malformed."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise ValueError(f"--input-shape takes NAME=DxDx..., got '{text}'")
    if not dims:
        return name, ()
    try:
        shape = tuple(int(d) for d in dims.split("x"))
    except ValueError:
        raise ValueError(f"--input-shape {name}: dimensions must be integers separated by 'x', "
                         f"got '{dims}'") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"--input-shape {name}: dimensions must be >= 0, got '{dims}'")
    return name, shape


def op_key(node: onnx.NodeProto) -> str:
    """The op type as the coverage tables name it: `Conv`, or `domain::Op` off the default."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def unsupported_ops(graph: onnx.GraphProto) -> Counter:
    """Op types (with counts) that the importer has no rule for, subgraphs included."""
    counts: Counter = Counter()
    for node in graph.node:
        key = op_key(node)
        if key not in HANDLERS:
            counts[key] += 1
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                counts.update(unsupported_ops(g))
    return counts


# ---------------------------------------------------------------------------------------------
# The importer


_NAME_BAD = re.compile(r"[^A-Za-z0-9_$.\-]")


def _ssa_name(name: str) -> str:
    s = _NAME_BAD.sub("_", name) or "v"
    return s


class _Importer:
    def __init__(self, model: onnx.ModelProto, file: str, input_shapes: dict,
                 outputs: Sequence[str] | None, static_inputs: dict, inline_weights: bool):
        self.model = model
        self.file = file
        self.loc = Location(file, 0, 0)
        self.input_shapes = dict(input_shapes)
        self.wanted = list(outputs) if outputs is not None else None
        self.static_inputs = dict(static_inputs)
        self.inline = inline_weights
        self.env: dict[str, Const | Run] = {}
        self.materialized: dict[str, Run] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.const_of_node: dict[int, np.ndarray] = {}  # mp.constant node -> its array
        self.f = Function("main", self.loc)
        self.node: onnx.NodeProto | None = None

    # ---- diagnostics ---------------------------------------------------------------------
    def error(self, message: str) -> DiagnosticError:
        if self.node is not None:
            n = self.node
            message = f"node '{n.name or n.output[0]}' ({op_key(n)}): {message}"
        return DiagnosticError.at(self.loc, message)

    # ---- the walk ------------------------------------------------------------------------
    def run(self) -> Imported:
        g = self.model.graph
        self.opset = self._opset()
        self._check_single_assignment()
        nodes = self._pruned_nodes()
        bad = unsupported_ops(g)
        if bad:
            listing = ", ".join(f"{k} ({v})" for k, v in sorted(bad.items()))
            raise DiagnosticError.at(self.loc, f"the model uses {len(bad)} op type(s) that "
                                               f"mplower cannot import: {listing}")
        inits = {t.name: t for t in g.initializer}
        needed = {i for n in nodes for i in n.input if i}
        needed.update(self.out_names)
        for t in g.initializer:
            if t.name in needed:
                self.env[t.name] = Const(self._tensor_array(t))
        args, arg_types = self._arguments(inits, needed)
        self._shape_inference()
        self.consumers = Counter(i for n in nodes for i in n.input if i)
        for name in self.out_names:
            self.consumers[name] += 1
        for node in nodes:
            self.node = node
            self._convert(node)
        self.node = None
        values, types, onnx_types = [], [], []
        for name in self.out_names:
            v = self.env.get(name)
            if v is None:
                raise DiagnosticError.at(self.loc, f"graph output '{name}' is never computed")
            if isinstance(v, Unbound):
                raise DiagnosticError.at(self.loc, f"output '{name}' is input '{v.name}', whose "
                                                   f"element type "
                                                   f"{onnx_type_name(v.onnx_type)} the IR lacks")
            r = self.as_run(v, name)
            values.append(r.value)
            types.append(r.type)
            onnx_types.append(r.onnx_type)
        self.f.result_types = types
        # What the model calls its results, for `mplower run --output-names onnx`.
        self.f.attrs[OUTPUT_NAMES] = tuple(self.out_names)
        self.f.append_op(RETURN, values, {}, [], loc=self.loc)
        module = Module(name=_ssa_name(g.name) if g.name else None, path=self.file,
                        loc=self.loc)
        module.functions["main"] = self.f
        self._check_output_shapes(types)
        verify(module)
        return Imported(module, self.weights, args, arg_types, list(self.out_names), onnx_types)

    def _opset(self) -> int:
        version = None
        for imp in self.model.opset_import:
            if imp.domain in ("", "ai.onnx"):
                version = imp.version
        if version is None:
            raise DiagnosticError.at(self.loc, "the model imports no version of the default "
                                               "ONNX domain (ai.onnx)")
        if not MIN_OPSET <= version <= MAX_OPSET:
            raise DiagnosticError.at(self.loc, f"the model uses ai.onnx opset {version}; mplower "
                                               f"imports opsets {MIN_OPSET} to {MAX_OPSET}")
        return version

    def _check_single_assignment(self) -> None:
        """Every value has one producer. Pruning and the walk look values up by name, so a
        second writer would silently replace the first (ONNX's checker says so too, but only
        after pruning has already dropped one of them)."""
        g = self.model.graph
        written: dict[str, str] = {i.name: "a graph input" for i in g.input}
        written.update((t.name, "an initializer") for t in g.initializer)
        for index, node in enumerate(g.node):
            for name in node.output:
                if not name:
                    continue  # an optional output left out
                here = f"node '{node.name or node.output[0]}' (#{index}, {op_key(node)})"
                if name in written:
                    raise DiagnosticError.at(self.loc, f"{here} writes '{name}', which is "
                                                       f"already {written[name]}; a value must "
                                                       f"have one producer")
                written[name] = f"written by {here}"

    def _pruned_nodes(self) -> list[onnx.NodeProto]:
        g = self.model.graph
        all_outputs = [o.name for o in g.output]
        if self.wanted is None:
            self.out_names = all_outputs
        else:
            unknown = [w for w in self.wanted if w not in all_outputs]
            if unknown:
                raise DiagnosticError.at(self.loc, f"--outputs names {', '.join(map(repr, unknown))}"
                                                   f", which the model does not output; its "
                                                   f"outputs are {', '.join(map(repr, all_outputs))}")
            if not self.wanted:
                raise DiagnosticError.at(self.loc, "--outputs needs at least one output name")
            self.out_names = list(self.wanted)
        producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
        keep: set[int] = set()
        stack = [producer[o] for o in self.out_names if o in producer]
        while stack:
            i = stack.pop()
            if i in keep:
                continue
            keep.add(i)
            stack.extend(producer[x] for x in _node_inputs(g.node[i]) if x in producer)
        kept = [n for i, n in enumerate(g.node) if i in keep]
        outputs = {o.name: o for o in g.output}
        del g.output[:]
        g.output.extend(outputs[o] for o in self.out_names)
        del g.node[:]
        g.node.extend(kept)
        self.producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
        return list(g.node)

    def _arguments(self, inits: dict, needed: set[str]) -> tuple[list[str], list[int]]:
        g = self.model.graph
        names, types = [], []
        known = [i.name for i in g.input if i.name not in inits]
        for name in self.input_shapes:
            if name not in known:
                raise DiagnosticError.at(self.loc, f"--input-shape names '{name}', which is not "
                                                   f"an input of the model (inputs: "
                                                   f"{', '.join(map(repr, known)) or 'none'})")
        for vi in g.input:
            if vi.name in inits:
                continue
            tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if tt is None:
                raise DiagnosticError.at(self.loc, f"input '{vi.name}' is not a tensor; mplower "
                                                   f"imports tensor inputs only")
            shape = self._input_shape(vi)
            self._fix_input_shape(vi, shape)
            if vi.name in self.static_inputs:
                arr = np.asarray(self.static_inputs[vi.name])
                self.env[vi.name] = Const(arr.astype(helper.tensor_dtype_to_np_dtype(
                    tt.elem_type), copy=False))
                continue
            if vi.name not in needed:
                continue  # pruned away with the outputs that used it
            elem = ELEM_OF_ONNX.get(tt.elem_type)
            if elem is None:
                self.env[vi.name] = Unbound(vi.name, tt.elem_type, shape)
                continue
            t = tensor(shape, elem)
            arg = self.f.add_arg(self.f.fresh_name(_ssa_name(vi.name)), t, self.loc)
            self.env[vi.name] = Run((arg, 0), t, tt.elem_type)
            names.append(vi.name)
            types.append(tt.elem_type)
        return names, types

    def _input_shape(self, vi: onnx.ValueInfoProto) -> tuple[int, ...]:
        tt = vi.type.tensor_type
        given = self.input_shapes.get(vi.name)
        if vi.name in self.static_inputs:
            given = tuple(np.shape(self.static_inputs[vi.name]))
        if not tt.HasField("shape"):
            if given is None:
                raise DiagnosticError.at(self.loc, f"input '{vi.name}' has no shape; give one "
                                                   f"with --input-shape {vi.name}=DxDx...")
            return tuple(given)
        dims = list(tt.shape.dim)
        for k, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value < 0:
                raise DiagnosticError.at(self.loc, f"input '{vi.name}' has a negative dimension "
                                                   f"{k} ({d.dim_value}); ONNX dimensions are "
                                                   f">= 0")
        if given is not None:
            if len(given) != len(dims):
                raise DiagnosticError.at(self.loc, f"--input-shape {vi.name} has rank "
                                                   f"{len(given)} but the input has rank "
                                                   f"{len(dims)}")
            for k, (d, v) in enumerate(zip(dims, given)):
                if d.HasField("dim_value") and d.dim_value != v:
                    raise DiagnosticError.at(self.loc, (
                        f"--input-shape {vi.name} sets dimension {k} to {v}, but the model "
                        f"fixes it to {d.dim_value}"))
            return tuple(given)
        shape = []
        for k, d in enumerate(dims):
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif k == 0:
                shape.append(1)  # a dynamic batch dimension
            else:
                what = f"'{d.dim_param}'" if d.dim_param else "unknown"
                raise DiagnosticError.at(self.loc, (
                    f"input '{vi.name}' has a dynamic dimension {k} ({what}); fix it with "
                    f"--input-shape {vi.name}=" + "x".join(
                        str(x.dim_value) if x.HasField("dim_value") else ("1" if i == 0 else "N")
                        for i, x in enumerate(dims))))
        return tuple(shape)

    @staticmethod
    def _fix_input_shape(vi: onnx.ValueInfoProto, shape: tuple[int, ...]) -> None:
        tt = vi.type.tensor_type
        tt.shape.Clear()
        for d in shape:
            tt.shape.dim.add().dim_value = d

    def _shape_inference(self) -> None:
        """ONNX's shape inference over the fixed input shapes, then ONNX's checker: both reject
        inconsistent models with ONNX's own message, and the inferred static shapes of the
        outputs are checked against ours at the end."""
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model, strict_mode=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
            raise DiagnosticError.at(self.loc, f"ONNX shape inference rejects the model: "
                                               f"{_first_line(e)}") from None
        try:
            onnx.checker.check_model(inferred)
        except onnx.checker.ValidationError as e:
            raise DiagnosticError.at(self.loc, f"the ONNX checker rejects the model: "
                                               f"{_first_line(e)}") from None
        self.inferred: dict[str, tuple[int, ...]] = {}
        for vi in list(inferred.graph.output) + list(inferred.graph.value_info):
            tt = vi.type.tensor_type
            if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
                self.inferred[vi.name] = tuple(d.dim_value for d in tt.shape.dim)

    def _check_output_shapes(self, types: list[TensorType]) -> None:
        for name, t in zip(self.out_names, types):
            want = self.inferred.get(name)
            if want is not None and want != t.shape:
                raise DiagnosticError.at(self.loc, (
                    f"output '{name}': mplower computes shape {list(t.shape)} but ONNX shape "
                    f"inference says {list(want)}"))

    # ---- values --------------------------------------------------------------------------
    def _tensor_array(self, t: TensorProto) -> np.ndarray:
        if t.data_type == TensorProto.STRING:
            raise DiagnosticError.at(self.loc, f"tensor '{t.name}' holds strings; mplower "
                                               f"imports numeric tensors only")
        if any(d < 0 for d in t.dims):  # numpy would read -1 as "whatever is left"
            raise DiagnosticError.at(self.loc, f"tensor '{t.name}' has negative dimensions "
                                               f"{list(t.dims)}; ONNX dimensions are >= 0")
        try:
            return numpy_helper.to_array(t)
        except (ValueError, TypeError, KeyError) as e:
            raise DiagnosticError.at(self.loc, f"cannot read tensor '{t.name}': {e}") from None
        except MemoryError:
            raise DiagnosticError.at(self.loc, f"not enough memory to read tensor "
                                               f"'{t.name}' {list(t.dims)}") from None

    def input(self, i: int) -> Const | Run | None:
        node = self.node
        if i >= len(node.input) or not node.input[i]:
            return None
        name = node.input[i]
        v = self.env.get(name)
        if v is None:
            raise self.error(f"input '{name}' is not defined before this node")
        return v

    def need(self, i: int) -> Const | Run:
        v = self.input(i)
        if v is None:
            raise self.error(f"input #{i} is required")
        return v

    def const(self, i: int, what: str) -> np.ndarray | None:
        """Input `i` as a constant array (None if absent); a runtime value is an error that
        names the graph inputs it depends on."""
        v = self.input(i)
        if v is None or isinstance(v, Const):
            return None if v is None else v.array
        raise self.not_constant(self.node.input[i], what)

    def need_tensor(self, i: int) -> Const | Run:
        """Input `i` (required) as a constant or a value of an IR type."""
        v = self.need(i)
        if isinstance(v, Unbound):
            raise self.error(f"input '{v.name}' has element type {onnx_type_name(v.onnx_type)}, "
                             f"which the IR has no type for (it has "
                             f"{', '.join(ONNX_OF_ELEM)})")
        return v

    def not_constant(self, name: str, what: str) -> DiagnosticError:
        roots = self._graph_inputs_under(name)
        msg = (f"{what} ('{name}') must be a constant (an initializer, or computed from "
               f"initializers): the IR carries it as an attribute")
        if not roots:
            return self.error(msg)
        msg += f"; it depends on graph input(s) {', '.join(map(repr, roots))}"
        return StaticInputsNeeded(roots, self.error(msg).diagnostics[0])

    def _graph_inputs_under(self, name: str) -> list[str]:
        g = self.model.graph
        inputs = {i.name for i in g.input}
        seen, stack, roots = set(), [name], []
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in inputs and isinstance(self.env.get(v), (Run, Unbound)):
                roots.append(v)
            elif v in self.producer:
                stack.extend(x for x in _node_inputs(g.node[self.producer[v]]) if x)
        return sorted(roots)

    def as_run(self, v: Const | Run, name: str = "") -> Run:
        if isinstance(v, Run):
            return v
        if name and name in self.materialized:
            return self.materialized[name]
        r = self.constant(v.array, name or "const")
        if name:
            self.materialized[name] = r
        return r

    def constant(self, arr: np.ndarray, hint: str) -> Run:
        """An mp.constant holding `arr` (named weight, or inline when small)."""
        arr = np.asarray(arr)
        onnx_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        elem = ELEM_OF_ONNX.get(onnx_type)
        if elem is None:
            raise self.error(f"constant '{hint}' has element type {onnx_type_name(onnx_type)}, "
                             f"which the IR has no type for")
        t = tensor(arr.shape, elem)
        values = arr.astype(value_dtype(elem))
        dense = DenseAttr(np.ascontiguousarray(values), t)
        if self.inline or arr.size <= INLINE_LIMIT or dense.is_splat:
            attrs: dict[str, Any] = {"value": dense}
        else:
            key = self._weight_key(hint)
            self.weights[key] = _storage(values, elem)
            attrs = {"name": key}
        node = self.f.append_op("mp.constant", [], attrs, [t],
                                self.f.fresh_name(_ssa_name(hint)), self.loc)
        self.const_of_node[node] = arr
        return Run((node, 0), t, onnx_type)

    def _weight_key(self, hint: str) -> str:
        key, k = hint, 1
        while key in self.weights:
            key = f"{hint}_{k}"
            k += 1
        return key

    def emit(self, op: str, operands: Sequence[Run], attrs: dict | None = None,
             declared: TensorType | None = None, hint: str = "",
             onnx_type: int | None = None) -> Run:
        """Append an mp op; its result type comes from the op's own rule."""
        attrs = attrs or {}
        in_types = [r.type for r in operands]
        try:
            types = OPS[op].infer(in_types, attrs, [declared] if declared else [])
        except OpError as e:
            raise self.error(f"cannot express as {op}: {e.message}") from None
        hint = hint or (self.node.output[0] if self.node is not None else op)
        node = self.f.append_op(op, [r.value for r in operands], attrs, types,
                                self.f.fresh_name(_ssa_name(hint)), self.loc)
        t = types[0]
        if onnx_type is None:
            onnx_type = ONNX_OF_ELEM[t.elem]
        return Run((node, 0), t, onnx_type)

    def run_input(self, i: int) -> Run:
        return self.as_run(self.need_tensor(i), self.node.input[i])

    # ---- one node ------------------------------------------------------------------------
    def _convert(self, node: onnx.NodeProto) -> None:
        ins = [self.env.get(x) if x else None for x in node.input]
        for x, v in zip(node.input, ins):
            if x and v is None:
                raise self.error(f"input '{x}' is not defined before this node")
        names = {a.name for a in node.attribute}
        if {"broadcast", "axis"} <= names:  # before opset 7: broadcast B from an axis of A
            raise self.error("legacy broadcasting along an axis (opset < 7) is not numpy "
                             "broadcasting; convert the model to opset 7 or later "
                             "(onnx.version_converter)")
        present = [v for v in ins if v is not None]
        if node.op_type not in _NO_FOLD and all(isinstance(v, Const) for v in present) \
                and present:
            outs = self._fold(node, ins)
        else:
            outs = HANDLERS[op_key(node)](self, node)
        for name, v in zip(node.output, outs):
            if name and v is not None:
                self.env[name] = v
        for k, name in enumerate(node.output):
            if name and self.consumers.get(name) and (k >= len(outs) or outs[k] is None):
                raise self.error(f"output #{k} ('{name}') is not supported")

    def _fold(self, node: onnx.NodeProto, ins: list) -> list[Const]:
        if node.op_type in _FAST_FOLD:
            return [Const(a) for a in _FAST_FOLD[node.op_type](self, node, ins)]
        from onnx.reference import ReferenceEvaluator

        names = [f"in{i}" for i in range(len(ins))]
        feeds = {}
        inputs = []
        for n, v in zip(names, ins):
            if v is None:
                continue
            feeds[n] = v.array
            inputs.append(helper.make_tensor_value_info(
                n, helper.np_dtype_to_tensor_dtype(v.array.dtype), v.array.shape))
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend(n if v is not None else "" for n, v in zip(names, ins))
        outs = [f"out{i}" if o else "" for i, o in enumerate(node.output)]
        del copy.output[:]
        copy.output.extend(outs)
        graph = helper.make_graph([copy], "fold", inputs,
                                  [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None)
                                   for o in outs if o])
        opsets = [helper.make_opsetid(o.domain, max(o.version, _FOLD_OPSET.get(
            node.op_type, 0)) if o.domain in ("", "ai.onnx") else o.version)
            for o in self.model.opset_import]
        model = helper.make_model(graph, opset_imports=opsets,
                                  ir_version=self.model.ir_version or 8)
        try:
            results = ReferenceEvaluator(model).run(None, feeds)
        except Exception as e:  # noqa: BLE001  (any op implementation may raise anything)
            raise self.error(f"cannot fold this node over its constant inputs: "
                             f"{type(e).__name__}: {str(e)[:200]}") from None
        it = iter(results)
        return [Const(np.asarray(next(it))) if o else None for o in outs]


# Ops that onnx's ReferenceEvaluator implements only from a later version, whose later versions
# compute what the earlier ones did on every input the earlier ones take (they add types and
# attributes with defaults): folded at that version. QuantizeLinear/DequantizeLinear-13 (what
# opset-13 QDQ models hold) have no implementation of their own.
_FOLD_OPSET = {"QuantizeLinear": 19, "DequantizeLinear": 19}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _node_inputs(node: onnx.NodeProto) -> list[str]:
    """Inputs of a node and the outer values its subgraphs read."""
    names = list(node.input)
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for n in g.node:
                names.extend(_node_inputs(n))
    return names


def _storage(values: np.ndarray, elem: str) -> np.ndarray:
    """How a weight is stored in the npz: float values as float32 (f64 as float64), integers
    in their own width, i1 as bool."""
    if FORMATS[elem].is_float:
        return values.astype(np.float64 if elem == "f64" else np.float32)
    if elem == "i1":
        return values.astype(np.bool_)
    return values.astype(FORMATS[elem].storage if elem != "i4" else np.int8)


# ---------------------------------------------------------------------------------------------
# Attributes


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        out[a.name] = v
    return out


# ---------------------------------------------------------------------------------------------
# Handlers: one per ONNX op type; each returns the node's outputs (Const, Run or None).

Handler = Callable[[_Importer, onnx.NodeProto], list]
HANDLERS: dict[str, Handler] = {}
_NO_FOLD = {"Dropout", "LRN"}  # identity at inference / onnx's reference gets LRN wrong


def handler(*names: str):
    def register(fn: Handler) -> Handler:
        for n in names:
            HANDLERS[n] = fn
        return fn
    return register


def _same_onnx(imp: _Importer, a: Run, b: Run) -> None:
    if a.onnx_type != b.onnx_type:
        raise imp.error(f"operands have element types {onnx_type_name(a.onnx_type)} and "
                        f"{onnx_type_name(b.onnx_type)}")


_BINARY = {"Add": "mp.add", "Sub": "mp.sub", "Mul": "mp.mul", "Div": "mp.div"}


@handler("Add", "Sub", "Mul", "Div")
def _binary(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    if node.op_type == "Div" and FORMATS[a.type.elem].is_int:
        # ONNX integer division truncates toward zero. In f64 the quotient of two integers
        # below 2^31 never rounds across an integer, and mp.cast truncates: exact.
        fa = imp.emit("mp.cast", [a], declared=a.type.with_elem("f64"), hint=node.input[0])
        fb = imp.emit("mp.cast", [b], declared=b.type.with_elem("f64"), hint=node.input[1])
        q = imp.emit("mp.div", [fa, fb])
        return [imp.emit("mp.cast", [q], declared=q.type.with_elem(a.type.elem),
                         onnx_type=a.onnx_type)]
    return [imp.emit(_BINARY[node.op_type], [a, b], onnx_type=a.onnx_type)]


_VARIADIC = {"Sum": "mp.add", "Max": "mp.maximum", "Min": "mp.minimum"}


@handler("Sum", "Max", "Min")
def _variadic(imp: _Importer, node: onnx.NodeProto) -> list:
    vals = [imp.run_input(i) for i in range(len(node.input)) if node.input[i]]
    acc = vals[0]
    for v in vals[1:]:
        _same_onnx(imp, acc, v)
        acc = imp.emit(_VARIADIC[node.op_type], [acc, v], onnx_type=acc.onnx_type)
    return [acc]


_UNARY = {"Neg": "mp.neg", "Relu": "mp.relu", "Sigmoid": "mp.sigmoid", "Tanh": "mp.tanh",
          "Exp": "mp.exp", "Log": "mp.log", "Sqrt": "mp.sqrt", "Erf": "mp.erf"}


@handler(*_UNARY)
def _unary(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    return [imp.emit(_UNARY[node.op_type], [x], onnx_type=x.onnx_type)]


@handler("Reciprocal")
def _reciprocal(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    one = imp.constant(np.ones((), helper.tensor_dtype_to_np_dtype(x.onnx_type)), "one")
    return [imp.emit("mp.div", [one, x], onnx_type=x.onnx_type)]


@handler("Gelu")
def _gelu(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    approx = _attrs(node).get("approximate", "none")
    return [imp.emit("mp.gelu", [x], {"approximate": approx}, onnx_type=x.onnx_type)]


@handler("Identity")
def _identity(imp: _Importer, node: onnx.NodeProto) -> list:
    return [imp.need(0)]


@handler("Dropout")
def _dropout(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.need_tensor(0)
    a = _attrs(node)
    training = bool(a.get("is_test", 1) == 0) if imp.opset < 7 else False
    if imp.opset >= 12:
        t = imp.const(2, "training_mode")
        training = bool(t) if t is not None else False
        ratio = imp.const(1, "ratio")
        ratio = float(ratio) if ratio is not None else 0.5
    else:
        ratio = float(a.get("ratio", 0.5))
    if training and ratio > 0:
        raise imp.error("training-mode dropout is random; mplower imports inference graphs")
    shape = x.array.shape if isinstance(x, Const) else x.type.shape
    return [x, Const(np.ones(shape, np.bool_))]


def _shape_of(v: Const | Run | Unbound) -> tuple[int, ...]:
    if isinstance(v, Const):
        return tuple(v.array.shape)
    return v.shape if isinstance(v, Unbound) else v.type.shape


@handler("Shape")
def _shape(imp: _Importer, node: onnx.NodeProto) -> list:
    shape = _shape_of(imp.need(0))
    a = _attrs(node)
    r = len(shape)
    start, end = a.get("start", 0), a.get("end", r)
    start, end = (max(0, min(r, s + r if s < 0 else s)) for s in (start, end))
    return [Const(np.array(shape[start:end], np.int64))]


@handler("Constant")
def _constant(imp: _Importer, node: onnx.NodeProto) -> list:
    return [Const(_constant_value(imp, node))]


def _constant_value(imp: _Importer, node: onnx.NodeProto) -> np.ndarray:
    a = _attrs(node)
    if isinstance(a.get("value"), TensorProto):
        return imp._tensor_array(a["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in a:
            return np.array(a[key], dtype)
    raise imp.error(f"Constant with {', '.join(a) or 'no value'} is not supported "
                    f"(numeric value, value_float(s), value_int(s) are)")


# The most elements a tensor computed at import time may have: the importer holds it in memory
# whole (2^31 f32 elements are 8 GiB); a larger fill is a model error, not a weight.
FOLD_LIMIT = 2 ** 31


@handler("ConstantOfShape")
def _constant_of_shape(imp: _Importer, node: onnx.NodeProto) -> list:
    shape = imp.const(0, "the shape")
    return [Const(_fill(imp, node, shape))]


def _fill(imp: _Importer, node: onnx.NodeProto, shape: np.ndarray) -> np.ndarray:
    a = _attrs(node)
    value = imp._tensor_array(a["value"]) if "value" in a else np.zeros(1, np.float32)
    dims = tuple(int(d) for d in np.reshape(shape, -1))
    if any(d < 0 for d in dims):
        raise imp.error(f"shape {list(dims)} has a negative dimension")
    if math.prod(dims) > FOLD_LIMIT:
        raise imp.error(f"shape {list(dims)} has {math.prod(dims)} elements, more than the "
                        f"{FOLD_LIMIT} (2^31) that import folds into a constant")
    try:
        return np.full(dims, value.reshape(-1)[0], value.dtype)
    except MemoryError:
        raise imp.error(f"not enough memory for a tensor of shape {list(dims)} "
                        f"({math.prod(dims)} elements)") from None


_FAST_FOLD: dict[str, Callable[[_Importer, onnx.NodeProto, list], list[np.ndarray]]] = {
    "Identity": lambda imp, node, ins: [ins[0].array],
    "ConstantOfShape": lambda imp, node, ins: [_fill(imp, node, ins[0].array)],
}


@handler("Cast", "CastLike")
def _cast(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    if node.op_type == "Cast":
        to = a["to"]
    else:  # the element type of the second input (the expanded function graphs use it)
        like = imp.need(1)
        to = like.onnx_type if isinstance(like, (Run, Unbound)) else \
            helper.np_dtype_to_tensor_dtype(like.array.dtype)
    elem = ELEM_OF_ONNX.get(to)
    if elem is None:
        raise imp.error(f"Cast to {onnx_type_name(to)}: the IR has no such element type")
    if to == x.onnx_type:
        return [x]
    attrs = {}
    if elem.startswith("f8") and not a.get("saturate", 1):
        attrs["saturate"] = False
    return [imp.emit("mp.cast", [x], attrs, declared=x.type.with_elem(elem), onnx_type=to)]


# ---- contractions ----------------------------------------------------------------------------


@handler("MatMul")
def _matmul(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    if not FORMATS[a.type.elem].is_float:
        raise imp.error(f"MatMul of {onnx_type_name(a.onnx_type)} tensors: mp.matmul takes "
                        f"float operands (int8 only as MatMulInteger)")
    return [imp.emit("mp.matmul", [a, b], onnx_type=a.onnx_type)]


@handler("Gemm")
def _gemm(imp: _Importer, node: onnx.NodeProto) -> list:
    at = _attrs(node)
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    operands = []
    for i, trans in ((0, at.get("transA", 0)), (1, at.get("transB", 0))):
        v = imp.need_tensor(i)
        if isinstance(v, Const):
            arr = v.array.T if trans else v.array
            if i == 1 and alpha != 1.0 and arr.dtype.kind == "f":
                arr = (arr.astype(np.float64) * alpha).astype(arr.dtype)
                alpha = 1.0
            operands.append(imp.constant(np.ascontiguousarray(arr), node.input[i]))
        else:
            operands.append(imp.emit("mp.transpose", [v], {"perm": (1, 0)},
                                     hint=f"{node.input[i]}_t", onnx_type=v.onnx_type)
                            if trans else v)
    a, b = operands
    _same_onnx(imp, a, b)
    y = imp.emit("mp.matmul", [a, b], onnx_type=a.onnx_type)
    if alpha != 1.0:
        y = imp.emit("mp.mul", [y, _scalar(imp, alpha, y)], onnx_type=y.onnx_type)
    c = imp.need_tensor(2) if imp.input(2) is not None else None
    if c is not None and beta != 0.0:
        if isinstance(c, Const):
            arr = c.array if beta == 1.0 else (c.array.astype(np.float64) * beta).astype(
                c.array.dtype)
            c = imp.constant(arr, node.input[2])
        elif beta != 1.0:
            c = imp.emit("mp.mul", [c, _scalar(imp, beta, c)], onnx_type=c.onnx_type)
        y = imp.emit("mp.add", [y, c], onnx_type=y.onnx_type)
    return [y]


def _scalar(imp: _Importer, value: float, like: Run) -> Run:
    return imp.constant(np.array(value, helper.tensor_dtype_to_np_dtype(like.onnx_type)),
                        "scalar")


def _window_attrs(imp: _Importer, node: onnx.NodeProto, spatial: tuple[int, ...],
                  kernel: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """(strides, pads [begin..., end...], dilations) with auto_pad resolved."""
    a = _attrs(node)
    r = len(spatial)
    strides = list(a.get("strides", [1] * r))
    dilations = list(a.get("dilations", [1] * r))
    pads = list(a.get("pads", [0] * (2 * r)))
    auto = a.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * r)
        for k in range(r):
            out = -(-spatial[k] // strides[k])
            total = max((out - 1) * strides[k] + (kernel[k] - 1) * dilations[k] + 1
                        - spatial[k], 0)
            small = total // 2
            pads[k], pads[k + r] = (small, total - small) if auto == "SAME_UPPER" \
                else (total - small, small)
    elif auto == "VALID":
        pads = [0] * (2 * r)
    elif auto != "NOTSET":
        raise imp.error(f"auto_pad '{auto}' is not an ONNX value")
    if len(strides) != r or len(dilations) != r or len(pads) != 2 * r:
        raise imp.error("strides, dilations and pads must match the spatial rank")
    return strides, pads, dilations


def _to_2d(imp: _Importer, x: Run, hint: str) -> Run:
    """(N, C, L) as (N, C, 1, L): 1-D windows run as 2-D ones of height 1."""
    n, c, length = x.type.shape
    return imp.emit("mp.reshape", [x], declared=tensor((n, c, 1, length), x.type.elem),
                    hint=hint, onnx_type=x.onnx_type)


def _from_2d(imp: _Importer, y: Run) -> Run:
    n, c, _, length = y.type.shape
    return imp.emit("mp.reshape", [y], declared=tensor((n, c, length), y.type.elem),
                    onnx_type=y.onnx_type)


@handler("Conv")
def _conv(imp: _Importer, node: onnx.NodeProto) -> list:
    x, w = imp.run_input(0), imp.need_tensor(1)
    rank = x.type.rank
    if rank not in (3, 4):
        raise imp.error(f"{rank - 2}-D convolution: mp.conv2d takes 1-D (as 2-D) and 2-D only")
    wshape = _shape_of(w)
    kernel = tuple(_attrs(node).get("kernel_shape", wshape[2:]))
    strides, pads, dilations = _window_attrs(imp, node, x.type.shape[2:], kernel)
    if rank == 3:
        x = _to_2d(imp, x, f"{node.input[0]}_2d")
        w = Const(w.array[:, :, None, :]) if isinstance(w, Const) else _to_2d(
            imp, w, f"{node.input[1]}_2d")
        strides, dilations = [1] + strides, [1] + dilations
        pads = [0, pads[0], 0, pads[1]]
    w = imp.as_run(w, node.input[1] if rank == 4 else f"{node.input[1]}_2d")
    operands = [x, w]
    if imp.input(2) is not None:
        operands.append(imp.run_input(2))
    for o in operands[1:]:
        _same_onnx(imp, x, o)
    attrs = {"strides": tuple(strides), "padding": (pads[0], pads[1], pads[2], pads[3]),
             "dilations": tuple(dilations), "groups": int(_attrs(node).get("group", 1))}
    y = imp.emit("mp.conv2d", operands, attrs, onnx_type=x.onnx_type)
    return [_from_2d(imp, y) if rank == 3 else y]


@handler("BatchNormalization")
def _batch_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    eps = float(a.get("epsilon", 1e-5))
    if a.get("training_mode", 0):
        return _batch_norm_training(imp, node, eps, float(a.get("momentum", 0.9)))
    if any(imp.consumers.get(o) for o in node.output[1:] if o):
        raise imp.error("the running mean/variance outputs exist in training mode only")
    x = imp.run_input(0)
    params = [imp.need_tensor(i) for i in range(1, 5)]
    c = x.type.shape[1]
    bshape = (c,) + (1,) * (x.type.rank - 2)
    if all(isinstance(p, Const) for p in params):
        scale, bias, mean, var = (p.array.astype(np.float64) for p in params)
        s = scale / np.sqrt(var + eps)
        t = bias - mean * s
        dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
        folded = _fold_into_conv(imp, x, s, t, dtype)
        if folded is not None:
            return [folded]
        sc = imp.constant(s.astype(dtype).reshape(bshape), f"{node.input[1]}_scale")
        sh = imp.constant(t.astype(dtype).reshape(bshape), f"{node.input[2]}_shift")
        y = imp.emit("mp.mul", [x, sc], hint=f"{node.output[0]}_scaled", onnx_type=x.onnx_type)
        return [imp.emit("mp.add", [y, sh], onnx_type=x.onnx_type)]
    scale, bias, mean, var = (
        imp.emit("mp.reshape", [imp.as_run(p, node.input[i + 1])],
                 declared=tensor(bshape, x.type.elem), hint=f"{node.input[i + 1]}_b")
        for i, p in enumerate(params))
    inv = imp.emit("mp.rsqrt", [imp.emit("mp.add", [var, _scalar(imp, eps, x)])])
    centered = imp.emit("mp.sub", [x, mean], hint=f"{node.output[0]}_centered")
    y = imp.emit("mp.mul", [centered, imp.emit("mp.mul", [inv, scale])])
    return [imp.emit("mp.add", [y, bias], onnx_type=x.onnx_type)]


def _batch_norm_training(imp: _Importer, node: onnx.NodeProto, eps: float,
                         momentum: float) -> list:
    """training_mode = 1: normalize with the batch statistics and return the updated running
    mean and variance (population variance, as ONNX defines it)."""
    x = imp.run_input(0)
    c, r = x.type.shape[1], x.type.rank
    bshape = (c,) + (1,) * (r - 2)
    axes = (0, *range(2, r))
    scale, bias = (imp.emit("mp.reshape", [imp.run_input(i)], declared=tensor(bshape, x.type.elem))
                   for i in (1, 2))
    mean = imp.emit("mp.reduce_mean", [x], {"axes": axes, "keepdims": True}, hint="batch_mean")
    d = imp.emit("mp.sub", [x, mean])
    var = imp.emit("mp.reduce_mean", [imp.emit("mp.mul", [d, d])],
                   {"axes": axes, "keepdims": True}, hint="batch_var")
    inv = imp.emit("mp.rsqrt", [imp.emit("mp.add", [var, _scalar(imp, eps, x)])])
    y = imp.emit("mp.add", [imp.emit("mp.mul", [d, imp.emit("mp.mul", [inv, scale])]), bias],
                 onnx_type=x.onnx_type)
    outs: list = [y]
    for stat, i in ((mean, 3), (var, 4)):
        running = imp.run_input(i)
        flat = _reshape_to(imp, stat, (c,))
        outs.append(imp.emit("mp.add", [
            imp.emit("mp.mul", [running, _scalar(imp, momentum, x)]),
            imp.emit("mp.mul", [flat, _scalar(imp, 1.0 - momentum, x)])],
            onnx_type=x.onnx_type))
    return outs


def _fold_into_conv(imp: _Importer, x: Run, s: np.ndarray, t: np.ndarray,
                    dtype: np.dtype) -> Run | None:
    """BatchNormalization after a Conv whose weights are constants and whose result nothing
    else reads: one conv with scaled weights and a shifted bias."""
    f = imp.f
    conv = x.value[0]
    if f.op(conv) != "mp.conv2d" or imp.consumers.get(imp.node.input[0], 0) != 1:
        return None
    operands = f.operands(conv)
    consts = [imp.const_of_node.get(v[0]) for v in operands[1:]]
    if any(cst is None for cst in consts):
        return None
    w = consts[0].astype(np.float64)
    b = consts[1].astype(np.float64) if len(consts) > 1 else np.zeros(w.shape[0])
    w2 = (w * s.reshape(-1, 1, 1, 1)).astype(dtype)
    b2 = (b * s + t).astype(dtype)
    attrs = dict(f.attrs_of(conv))
    name = f.data(conv)["name"]
    f.erase(conv)
    for v in operands[1:]:
        if not f.has_uses(v[0]):  # the old weights, unless another op shares them
            imp.const_of_node.pop(v[0], None)
            key = f.attrs_of(v[0]).get("name")
            f.erase(v[0])
            if key is not None:
                imp.weights.pop(key, None)
            for name in [k for k, r in imp.materialized.items() if r.value == v]:
                del imp.materialized[name]
    wr = imp.constant(w2, f"{name}_weight_bn")
    br = imp.constant(b2, f"{name}_bias_bn")
    xin = Run(operands[0], f.type_of(operands[0]), x.onnx_type)
    return imp.emit("mp.conv2d", [xin, wr, br], attrs, hint=name, onnx_type=x.onnx_type)


@handler("LayerNormalization")
def _layer_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    x = imp.run_input(0)
    axis = int(a.get("axis", -1))
    eps = float(a.get("epsilon", 1e-5))
    r = x.type.rank
    if not -r <= axis < r:
        raise imp.error(f"axis {axis} is out of range for rank {r}")
    axis %= r
    norm_shape = x.type.shape[axis:]
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    params = []
    for i, default in ((1, 1.0), (2, 0.0)):
        p = imp.need_tensor(i) if imp.input(i) is not None else None
        if p is None:
            p = Const(np.full(norm_shape, default, dtype))
        if isinstance(p, Const) and p.array.shape != norm_shape:
            p = Const(np.broadcast_to(p.array, norm_shape).copy())
        params.append(imp.as_run(p, node.input[i] if i < len(node.input) and node.input[i]
                                 else ("ones" if i == 1 else "zeros")))
    y = imp.emit("mp.layer_norm", [x, *params], {"axis": axis, "epsilon": eps},
                 onnx_type=x.onnx_type)
    outs: list = [y]
    if any(imp.consumers.get(o) for o in node.output[1:] if o):
        axes = tuple(range(axis, r))
        mean = imp.emit("mp.reduce_mean", [x], {"axes": axes, "keepdims": True},
                        hint=node.output[1] or "mean")
        d = imp.emit("mp.sub", [x, mean])
        var = imp.emit("mp.reduce_mean", [imp.emit("mp.mul", [d, d])],
                       {"axes": axes, "keepdims": True})
        inv = imp.emit("mp.rsqrt", [imp.emit("mp.add", [var, _scalar(imp, eps, x)])],
                       hint=node.output[2] if len(node.output) > 2 and node.output[2]
                       else "inv_std")
        outs += [mean, inv]
    return outs


@handler("LRN")
def _lrn(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    attrs = {"size": int(a["size"]), "alpha": float(a.get("alpha", 1e-4)),
             "beta": float(a.get("beta", 0.75)), "bias": float(a.get("bias", 1.0))}
    return [imp.emit("mp.lrn", [x], attrs, onnx_type=x.onnx_type)]


@handler("Softmax", "LogSoftmax")
def _softmax(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    op = "mp.softmax" if node.op_type == "Softmax" else "mp.log_softmax"
    r = x.type.rank
    if imp.opset >= 13:
        axis = int(_attrs(node).get("axis", -1))
        return [imp.emit(op, [x], {"axis": axis}, onnx_type=x.onnx_type)]
    # Before opset 13 the input is coerced to 2-D: [prod(dims[:axis]), prod(dims[axis:])].
    axis = int(_attrs(node).get("axis", 1))
    axis = axis + r if axis < 0 else axis
    if axis == r - 1:
        return [imp.emit(op, [x], {"axis": -1}, onnx_type=x.onnx_type)]
    shape = x.type.shape
    flat = imp.emit("mp.reshape", [x], declared=tensor(
        (math.prod(shape[:axis]), math.prod(shape[axis:])), x.type.elem),
        hint=f"{node.input[0]}_2d")
    y = imp.emit(op, [flat], {"axis": -1})
    return [imp.emit("mp.reshape", [y], declared=x.type, onnx_type=x.onnx_type)]


# ---- pooling ---------------------------------------------------------------------------------


def _pool_geometry(imp: _Importer, node: onnx.NodeProto, x: Run):
    a = _attrs(node)
    spatial = x.type.shape[2:]
    kernel = tuple(a["kernel_shape"])
    if len(kernel) != len(spatial):
        raise imp.error(f"kernel_shape {list(kernel)} does not match the input {x.type}")
    strides, pads, dilations = _window_attrs(imp, node, spatial, kernel)
    r = len(spatial)
    extra = [0] * r
    if a.get("ceil_mode", 0):
        for k in range(r):
            ek = (kernel[k] - 1) * dilations[k] + 1
            span = spatial[k] + pads[k] + pads[k + r] - ek
            out = -(-span // strides[k]) + 1
            if (out - 1) * strides[k] >= spatial[k] + pads[k]:
                out -= 1  # the last window would start in the end padding
            extra[k] = max(0, (out - 1) * strides[k] + ek - (spatial[k] + pads[k] + pads[k + r]))
    return kernel, strides, pads, dilations, extra


def _pool_counts(size: int, kernel: int, stride: int, dilation: int, begin: int, end: int,
                 extra: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output position along one axis: window taps on real elements, and taps inside the
    padded extent (ceil mode's extra end padding excluded)."""
    out = (size + begin + end + extra - ((kernel - 1) * dilation + 1)) // stride + 1
    taps = np.arange(out)[:, None] * stride - begin + np.arange(kernel)[None, :] * dilation
    real = ((taps >= 0) & (taps < size)).sum(axis=1)
    padded = ((taps >= -begin) & (taps < size + end)).sum(axis=1)
    return real, padded


@handler("MaxPool", "AveragePool")
def _pool(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if len(node.output) > 1 and node.output[1] and imp.consumers.get(node.output[1]):
        raise imp.error("the Indices output of MaxPool is not supported")
    r = x.type.rank - 2
    if r < 1:
        raise imp.error(f"pooling needs an (N, C, spatial...) input, got {x.type}")
    kernel, strides, pads, dilations, extra = _pool_geometry(imp, node, x)
    is_max = node.op_type == "MaxPool"
    ends = [pads[k + r] + extra[k] for k in range(r)]
    direct = r <= 2 and all(d == 1 for d in dilations) and all(
        max(pads[k], ends[k]) < kernel[k] for k in range(r))
    if direct:
        # mp's 2-D pools as they are (1-D as height 1): the common case keeps one op.
        lift = r == 1
        y = _to_2d(imp, x, f"{node.input[0]}_2d") if lift else x
        k2, s2 = ((1, *kernel), (1, *strides)) if lift else (tuple(kernel), tuple(strides))
        b2, e2 = ((0, pads[0]), (0, ends[0])) if lift else ((pads[0], pads[1]), tuple(ends))
        attrs = {"kernel": k2, "strides": s2, "padding": (b2[0], b2[1], e2[0], e2[1])}
        y = imp.emit("mp.max_pool2d" if is_max else "mp.avg_pool2d", [y], attrs,
                     onnx_type=x.onnx_type)
        y = _from_2d(imp, y) if lift else y
    else:
        # Max and average pooling are separable: one 1-D pass per spatial axis.
        y = x
        for k in range(r):
            if kernel[k] == strides[k] == 1 and pads[k] == ends[k] == 0:
                continue
            y = _pool_axis(imp, y, k, is_max, kernel[k], strides[k], pads[k], ends[k],
                           dilations[k])
    if not is_max and _attrs(node).get("count_include_pad", 0):
        real, padded = np.ones((1, 1)), np.ones((1, 1))
        for k in range(r):
            c = _pool_counts(x.type.shape[2 + k], kernel[k], strides[k], dilations[k], pads[k],
                             pads[k + r], extra[k])
            real, padded = np.multiply.outer(real, c[0]), np.multiply.outer(padded, c[1])
        ratio = real / padded  # mp pools divide by the real elements; ONNX by the padded window
        if not np.all(ratio == 1):
            dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
            y = imp.emit("mp.mul", [y, imp.constant(ratio.astype(dtype),
                                                    f"{node.output[0]}_divisor")],
                         onnx_type=x.onnx_type)
    return [y]


def _pool_axis(imp: _Importer, x: Run, k: int, is_max: bool, kernel: int, stride: int,
               begin: int, end: int, dilation: int) -> Run:
    """Pool spatial axis `k` of x alone, as a 2-D pool over (that axis, 1)."""
    shape = x.type.shape
    n, c, sp = shape[0], shape[1], shape[2:]
    mid, length, trail = c * math.prod(sp[:k]), sp[k], math.prod(sp[k + 1:])
    v = _reshape_to(imp, x, (n, mid, length, trail))
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    if dilation == 1 and max(begin, end) < kernel:
        attrs = {"kernel": (kernel, 1), "strides": (stride, 1), "padding": (begin, 0, end, 0)}
        y = imp.emit("mp.max_pool2d" if is_max else "mp.avg_pool2d", [v], attrs,
                     onnx_type=x.onnx_type)
    elif is_max:
        y = _dilated_max(imp, v, kernel, stride, begin, end, dilation, dtype)
    else:
        w = imp.constant(np.ones((mid, 1, kernel, 1), dtype), "ones")
        attrs = {"strides": (stride, 1), "padding": (begin, 0, end, 0),
                 "dilations": (dilation, 1), "groups": mid}
        sums = imp.emit("mp.conv2d", [v, w], attrs, hint="window_sum")
        out = sums.type.shape[2]
        taps = np.arange(out)[:, None] * stride - begin + np.arange(kernel)[None, :] * dilation
        real = ((taps >= 0) & (taps < length)).sum(axis=1)
        inv = imp.constant((1.0 / real).astype(dtype).reshape(1, 1, out, 1), "inv_count")
        y = imp.emit("mp.mul", [sums, inv], onnx_type=x.onnx_type)
    out_shape = (n, c, *sp[:k], y.type.shape[2], *sp[k + 1:])
    return _reshape_to(imp, y, out_shape)


def _dilated_max(imp: _Importer, v: Run, kernel: int, stride: int, begin: int, end: int,
                 dilation: int, dtype: np.dtype) -> Run:
    """Max over dilated windows along axis 2: pad with the lowest value, then the maximum of
    one strided slice per tap."""
    n, m, length, t = v.type.shape
    low = -np.inf if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min
    parts = []
    if begin:
        parts.append(imp.constant(np.full((n, m, begin, t), low, dtype), "pad_low"))
    parts.append(v)
    if end:
        parts.append(imp.constant(np.full((n, m, end, t), low, dtype), "pad_low"))
    padded = imp.emit("mp.concat", parts, {"axis": 2}, hint="padded") if len(parts) > 1 else v
    total = length + begin + end
    out = (total - ((kernel - 1) * dilation + 1)) // stride + 1
    acc = None
    for j in range(kernel):
        first = j * dilation
        attrs = {"starts": (0, 0, first, 0), "ends": (n, m, first + (out - 1) * stride + 1, t),
                 "steps": (1, 1, stride, 1)}
        tap = imp.emit("mp.slice", [padded], attrs, hint="tap")
        acc = tap if acc is None else imp.emit("mp.maximum", [acc, tap], hint="window_max")
    return Run(acc.value, acc.type, v.onnx_type)


@handler("GlobalAveragePool")
def _global_avg_pool(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    return [imp.emit("mp.global_avg_pool", [x], onnx_type=x.onnx_type)]


# ---- data movement ---------------------------------------------------------------------------


def _reshape_to(imp: _Importer, x: Run, shape: Sequence[int]) -> Run:
    shape = tuple(int(d) for d in shape)
    if shape == x.type.shape:
        return x
    return imp.emit("mp.reshape", [x], declared=tensor(shape, x.type.elem),
                    onnx_type=x.onnx_type)


@handler("Reshape")
def _reshape(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if imp.opset < 5:
        target = list(_attrs(node)["shape"])
    else:
        target = [int(d) for d in imp.const(1, "the target shape")]
    allowzero = _attrs(node).get("allowzero", 0)
    shape = list(target)
    for k, d in enumerate(target):
        if d == 0 and not allowzero:
            if k >= x.type.rank:
                raise imp.error(f"target shape {target} copies dimension {k}, which the input "
                                f"{x.type} lacks")
            shape[k] = x.type.shape[k]
    if any(d < -1 for d in shape):
        raise imp.error(f"target shape {target} has a negative dimension other than -1")
    if shape.count(-1) > 1:
        raise imp.error(f"target shape {target} has more than one -1")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or x.type.size % known:
            raise imp.error(f"cannot reshape {x.type} to {target}")
        shape[shape.index(-1)] = x.type.size // known
    if math.prod(shape) != x.type.size:
        raise imp.error(f"cannot reshape {x.type} ({x.type.size} elements) to {target}")
    return [_reshape_to(imp, x, shape)]


@handler("Flatten")
def _flatten(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axis = int(_attrs(node).get("axis", 1))
    return [imp.emit("mp.flatten", [x], {"axis": axis}, onnx_type=x.onnx_type)]


def _axes(imp: _Importer, node: onnx.NodeProto, input_index: int, since: int,
          rank: int) -> list[int] | None:
    """Axes from the attribute (before opset `since`) or the input, normalized; None if absent."""
    if imp.opset < since:
        raw = _attrs(node).get("axes")
    else:
        raw = imp.const(input_index, "axes")
    if raw is None:
        return None
    out = []
    for ax in np.asarray(raw).reshape(-1).tolist():
        if not -rank <= ax < rank:
            raise imp.error(f"axis {ax} is out of range for rank {rank}")
        out.append(ax % rank)
    return out


@handler("Squeeze")
def _squeeze(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axes = _axes(imp, node, 1, 13, x.type.rank)
    shape = x.type.shape
    if axes is None:
        axes = [k for k, d in enumerate(shape) if d == 1]
    for ax in axes:
        if shape[ax] != 1:
            raise imp.error(f"cannot squeeze dimension {ax} of {x.type}: it is not 1")
    return [_reshape_to(imp, x, [d for k, d in enumerate(shape) if k not in axes])]


@handler("Unsqueeze")
def _unsqueeze(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axes = imp.const(1, "axes") if imp.opset >= 13 else _attrs(node).get("axes")
    axes = [int(a) for a in np.asarray(axes).reshape(-1)]
    r = x.type.rank + len(axes)
    axes = sorted(a % r if -r <= a < r else a for a in axes)
    shape = list(x.type.shape)
    for ax in axes:
        if not 0 <= ax < r:
            raise imp.error(f"axis {ax} is out of range for output rank {r}")
        shape.insert(ax, 1)
    return [_reshape_to(imp, x, shape)]


@handler("Transpose")
def _transpose(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    perm = tuple(_attrs(node).get("perm", reversed(range(x.type.rank))))
    return [imp.emit("mp.transpose", [x], {"perm": perm}, onnx_type=x.onnx_type)]


@handler("Concat")
def _concat(imp: _Importer, node: onnx.NodeProto) -> list:
    vals = [imp.run_input(i) for i in range(len(node.input)) if node.input[i]]
    for v in vals[1:]:
        _same_onnx(imp, vals[0], v)
    axis = int(_attrs(node).get("axis", 1))  # required from opset 4 on; 1 before
    return [imp.emit("mp.concat", vals, {"axis": axis}, onnx_type=vals[0].onnx_type)]


@handler("Slice")
def _slice(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    shape = x.type.shape
    r = len(shape)
    if imp.opset < 10:
        a = _attrs(node)
        starts, ends = list(a["starts"]), list(a["ends"])
        axes = list(a.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts = imp.const(1, "starts").reshape(-1).tolist()
        ends = imp.const(2, "ends").reshape(-1).tolist()
        axes_arr = imp.const(3, "axes")
        axes = axes_arr.reshape(-1).tolist() if axes_arr is not None else list(range(len(starts)))
        steps_arr = imp.const(4, "steps")
        steps = steps_arr.reshape(-1).tolist() if steps_arr is not None else [1] * len(starts)
    full_s, full_e, full_st = [0] * r, list(shape), [1] * r
    for ax, s, e, st in zip(axes, starts, ends, steps):
        if not -r <= ax < r:
            raise imp.error(f"axis {ax} is out of range for rank {r}")
        ax %= r
        if st == 0:
            raise imp.error("a slice step of 0")
        # Beyond +-(dim + 1) every bound clamps the same way: keep the attribute small.
        bound = shape[ax] + 1
        full_s[ax] = max(-bound, min(bound, int(s)))
        full_e[ax] = max(-bound, min(bound, int(e)))
        full_st[ax] = int(st)
    if full_s == [0] * r and full_e == list(shape) and full_st == [1] * r:
        return [x]
    attrs = {"starts": tuple(full_s), "ends": tuple(full_e), "steps": tuple(full_st)}
    return [imp.emit("mp.slice", [x], attrs, onnx_type=x.onnx_type)]


# ---- reductions ------------------------------------------------------------------------------

_REDUCE = {"ReduceMean": ("mp.reduce_mean", 18), "ReduceSum": ("mp.reduce_sum", 13),
           "ReduceMax": ("mp.reduce_max", 18)}


@handler(*_REDUCE)
def _reduce(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    op, since = _REDUCE[node.op_type]
    a = _attrs(node)
    axes = _axes(imp, node, 1, since, x.type.rank)
    keep = bool(a.get("keepdims", 1))
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return [x]
        axes = []
    attrs = {"axes": tuple(axes), "keepdims": keep}
    reduced = axes or range(x.type.rank)
    if op == "mp.reduce_max" and any(x.type.shape[ax] == 0 for ax in reduced):
        # The maximum of nothing is ONNX's -inf (the lowest value): known from the shapes alone.
        shape = tuple(1 if k in reduced else d for k, d in enumerate(x.type.shape) if keep
                      or k not in reduced)
        dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
        low = -np.inf if dtype.kind == "f" else (False if dtype.kind == "b"
                                                 else np.iinfo(dtype).min)
        return [Const(np.full(shape, low, dtype))]
    if x.type.elem == "i1":  # reduce booleans as 0/1 bytes
        wide = imp.emit("mp.cast", [x], declared=x.type.with_elem("ui8"))
        y = imp.emit(op, [wide], attrs)
        return [imp.emit("mp.cast", [y], declared=y.type.with_elem("i1"), onnx_type=x.onnx_type)]
    return [imp.emit(op, [x], attrs, onnx_type=x.onnx_type)]


@handler("ArgMax")
def _argmax(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    axis = int(a.get("axis", 0))
    keep = bool(a.get("keepdims", 1))
    if not -x.type.rank <= axis < x.type.rank:
        raise imp.error(f"axis {axis} is out of range for {x.type}")
    axis %= x.type.rank
    if not a.get("select_last_index", 0):
        idx = imp.emit("mp.argmax", [x], {"axis": axis, "keepdims": keep})
        return [_as_int64(imp, idx)]
    # The last maximum is the first one of the reversed axis, counted from the end.
    n = x.type.shape[axis]
    starts = [0] * x.type.rank
    ends = list(x.type.shape)
    steps = [1] * x.type.rank
    starts[axis], ends[axis], steps[axis] = -1, -(n + 1), -1
    rev = imp.emit("mp.slice", [x], {"starts": tuple(starts), "ends": tuple(ends),
                                     "steps": tuple(steps)}, hint=f"{node.input[0]}_reversed")
    idx = imp.emit("mp.argmax", [rev], {"axis": axis, "keepdims": keep})
    last = imp.constant(np.array(n - 1, np.int32), "last_index")
    return [_as_int64(imp, imp.emit("mp.sub", [last, idx]))]


def _as_int64(imp: _Importer, idx: Run) -> Run:
    """mp.argmax's i32 index as the INT64 ONNX's ArgMax returns."""
    return imp.emit("mp.cast", [idx], declared=idx.type.with_elem("i64"))


# ---- quantization ----------------------------------------------------------------------------


def _quant_params(imp: _Importer, node: onnx.NodeProto, rank: int, blocked: bool = False):
    """(attributes, scale, zero point, axis); `blocked`: the caller takes block_size, whose
    scale and zero point have the input's rank (mp.quantize's blocked form)."""
    a = _attrs(node)
    if a.get("block_size", 0) and not blocked:
        raise imp.error("blocked quantization (block_size) to float8 is not supported")
    scale = imp.const(1, "the scale")
    zp = imp.const(2, "the zero point")
    axis = int(a.get("axis", 1))
    if a.get("block_size", 0):
        if not -rank <= axis < rank:
            raise imp.error(f"axis {axis} is out of range for rank {rank}")
        if scale.ndim != rank or (zp is not None and zp.shape != scale.shape):
            raise imp.error("blocked scale and zero point must have the rank of the input")
        return a, scale, zp, axis % rank
    if scale.ndim > 1 or (zp is not None and zp.ndim > 1):
        raise imp.error("scale and zero point must be scalars or 1-D (per axis)")
    if scale.size > 1:
        if not -rank <= axis < rank:
            raise imp.error(f"axis {axis} is out of range for rank {rank}")
        axis %= rank
    return a, scale, zp, axis


def _number_attr(arr: np.ndarray, elem: str) -> Any:
    arr = np.asarray(arr)
    if arr.size == 1:
        v = arr.reshape(-1)[0]
        return float(v) if FORMATS[elem].is_float else int(v)
    vals = arr.reshape(-1).astype(value_dtype(elem))
    return DenseAttr(vals, tensor(vals.shape, elem))


def _along(arr: np.ndarray, rank: int, axis: int) -> np.ndarray:
    if arr.size == 1:
        return arr.reshape(())
    shape = [1] * rank
    shape[axis] = arr.size
    return arr.reshape(shape)


@handler("QuantizeLinear")
def _quantize(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    zp0 = imp.const(2, "the zero point")  # its type is the quantized type
    q_elem = None if zp0 is None else ELEM_OF_ONNX.get(helper.np_dtype_to_tensor_dtype(zp0.dtype))
    integer = q_elem is None or (q_elem in FORMATS and FORMATS[q_elem].is_int)
    a, scale, zp, axis = _quant_params(imp, node, x.type.rank, blocked=integer)
    if zp is not None:
        qtype = helper.np_dtype_to_tensor_dtype(zp.dtype)
    else:
        qtype = int(a.get("output_dtype", 0)) or TensorProto.UINT8
    elem = ELEM_OF_ONNX.get(qtype)
    if elem is None or elem in ("f32", "f64", "f16", "bf16", "i32", "i1"):
        raise imp.error(f"quantization to {onnx_type_name(qtype)}: mplower quantizes to "
                        f"INT8, UINT8, INT4, FLOAT8E4M3FN and FLOAT8E5M2")
    if elem.startswith("f8"):
        if zp is not None and np.any(zp.astype(np.float32) != 0):
            raise imp.error("a float8 zero point must be 0")
        s = imp.constant(_along(scale, x.type.rank, axis).astype(
            helper.tensor_dtype_to_np_dtype(x.onnx_type)), f"{node.input[1]}")
        q = imp.emit("mp.div", [x, s], hint=f"{node.output[0]}_scaled")
        attrs = {} if a.get("saturate", 1) else {"saturate": False}
        return [imp.emit("mp.cast", [q], attrs, declared=q.type.with_elem(elem),
                         onnx_type=qtype)]
    if a.get("block_size", 0):  # one scale per block along axis (ONNX opset 21)
        attrs = {"scale": DenseAttr(scale.astype(np.float32), tensor(scale.shape, "f32")),
                 "axis": axis, "block_size": int(a["block_size"])}
        if zp is not None:
            attrs["zero_point"] = DenseAttr(zp.astype(np.int64), tensor(zp.shape, elem))
        return [imp.emit("mp.quantize", [x], attrs, declared=x.type.with_elem(elem),
                         onnx_type=qtype)]
    attrs = {"scale": _number_attr(scale.astype(np.float32), "f32")}
    if zp is not None:
        attrs["zero_point"] = _number_attr(zp.astype(np.int64), elem)
    if scale.size > 1:
        attrs["axis"] = axis
    return [imp.emit("mp.quantize", [x], attrs, declared=x.type.with_elem(elem),
                     onnx_type=qtype)]


def _blocked_dequantize(imp: _Importer, node: onnx.NodeProto, x: Run) -> Run:
    """(x - zero_point) * scale with one scale per block of `block_size` elements along
    `axis`: the parameters repeated to x's shape, then plain f32 arithmetic (exact as ONNX)."""
    a = _attrs(node)
    block, rank = int(a["block_size"]), x.type.rank
    axis = int(a.get("axis", 1))
    if not -rank <= axis < rank:
        raise imp.error(f"axis {axis} is out of range for rank {rank}")
    axis %= rank
    scale = imp.const(1, "the scale")
    zp = imp.const(2, "the zero point")
    n = x.type.shape[axis]

    def expand(v: np.ndarray) -> np.ndarray:
        if v.ndim != rank:
            raise imp.error("blocked scale and zero point must have the rank of the input")
        return np.repeat(v, block, axis=axis).take(range(n), axis=axis)
    out_type = int(a.get("output_dtype", 0)) or helper.np_dtype_to_tensor_dtype(scale.dtype)
    out_elem = ELEM_OF_ONNX.get(out_type)
    if out_elem is None or not FORMATS[out_elem].is_float or not FORMATS[x.type.elem].is_int:
        raise imp.error("blocked dequantization takes an integer input and a float scale")
    dtype = helper.tensor_dtype_to_np_dtype(out_type)
    y = imp.emit("mp.cast", [x], declared=x.type.with_elem(out_elem), hint=f"{node.input[0]}_wide")
    if zp is not None and np.any(zp != 0):
        y = imp.emit("mp.sub", [y, imp.constant(expand(zp).astype(dtype), node.input[2])])
    s = imp.constant(expand(scale).astype(dtype), node.input[1])
    return imp.emit("mp.mul", [y, s], onnx_type=out_type)


@handler("DequantizeLinear")
def _dequantize(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if _attrs(node).get("block_size", 0):
        return [_blocked_dequantize(imp, node, x)]
    a, scale, zp, axis = _quant_params(imp, node, x.type.rank)
    out_type = int(a.get("output_dtype", 0)) or helper.np_dtype_to_tensor_dtype(scale.dtype)
    out_elem = ELEM_OF_ONNX.get(out_type)
    if out_elem is None or not FORMATS[out_elem].is_float:
        raise imp.error(f"dequantization to {onnx_type_name(out_type)} is not supported")
    if x.type.elem.startswith("f8"):
        if zp is not None and np.any(zp.astype(np.float32) != 0):
            raise imp.error("a float8 zero point must be 0")
        wide = imp.emit("mp.cast", [x], declared=x.type.with_elem(out_elem),
                        hint=f"{node.input[0]}_wide")
        s = imp.constant(_along(scale, x.type.rank, axis).astype(
            helper.tensor_dtype_to_np_dtype(out_type)), f"{node.input[1]}")
        return [imp.emit("mp.mul", [wide, s], onnx_type=out_type)]
    if x.type.elem not in QUANT_STORAGE:
        raise imp.error(f"dequantization of {onnx_type_name(x.onnx_type)} is not supported")
    attrs = {"scale": _number_attr(scale.astype(np.float32), "f32")}
    if zp is not None:
        attrs["zero_point"] = _number_attr(zp.astype(np.int64), x.type.elem)
    if scale.size > 1:
        attrs["axis"] = axis
    return [imp.emit("mp.dequantize", [x], attrs, declared=x.type.with_elem(out_elem),
                     onnx_type=out_type)]


# ---- indexing, masks and the rest of what transformer exporters emit --------------------------


@handler("Gather", "GatherElements")
def _gather(imp: _Importer, node: onnx.NodeProto) -> list:
    data, idx = imp.run_input(0), imp.run_input(1)
    op = "mp.gather" if node.op_type == "Gather" else "mp.gather_elements"
    axis = int(_attrs(node).get("axis", 0))
    return [imp.emit(op, [data, idx], {"axis": axis}, onnx_type=data.onnx_type)]


@handler("GatherND")
def _gather_nd(imp: _Importer, node: onnx.NodeProto) -> list:
    data, idx = imp.run_input(0), imp.run_input(1)
    attrs = {"batch_dims": int(_attrs(node).get("batch_dims", 0))}
    return [imp.emit("mp.gather_nd", [data, idx], attrs, onnx_type=data.onnx_type)]


@handler("Where")
def _where(imp: _Importer, node: onnx.NodeProto) -> list:
    cond, x, y = (imp.run_input(i) for i in range(3))
    _same_onnx(imp, x, y)
    return [imp.emit("mp.where", [cond, x, y], onnx_type=x.onnx_type)]


_COMPARE = {"Equal": "mp.equal", "Less": "mp.less", "LessOrEqual": "mp.less_equal",
            "Greater": "mp.greater", "GreaterOrEqual": "mp.greater_equal",
            "And": "mp.logical_and", "Or": "mp.logical_or", "Xor": "mp.logical_xor"}


@handler(*_COMPARE)
def _compare(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    return [imp.emit(_COMPARE[node.op_type], [a, b], onnx_type=TensorProto.BOOL)]


@handler("Not")
def _not(imp: _Importer, node: onnx.NodeProto) -> list:
    return [imp.emit("mp.logical_not", [imp.run_input(0)], onnx_type=TensorProto.BOOL)]


@handler("IsNaN", "IsInf")
def _is_special(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if node.op_type == "IsNaN":
        return [imp.emit("mp.isnan", [x], onnx_type=TensorProto.BOOL)]
    a = _attrs(node)
    attrs = {"detect_negative": bool(a.get("detect_negative", 1)),
             "detect_positive": bool(a.get("detect_positive", 1))}
    return [imp.emit("mp.isinf", [x], attrs, onnx_type=TensorProto.BOOL)]


@handler("Expand")
def _expand(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    target = tuple(int(d) for d in imp.const(1, "the shape").reshape(-1))
    try:  # ONNX broadcasts both ways: a 1 in the target keeps x's dimension
        shape = np.broadcast_shapes(x.type.shape, target)
    except ValueError:
        raise imp.error(f"{x.type} does not broadcast with the shape {list(target)}") from None
    if shape == x.type.shape:
        return [x]
    return [imp.emit("mp.expand", [x], declared=tensor(shape, x.type.elem),
                     onnx_type=x.onnx_type)]


@handler("Pow")
def _pow(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.need_tensor(1)
    dtype = helper.tensor_dtype_to_np_dtype(a.onnx_type)
    if isinstance(b, Const):  # a mixed-type exponent (x ** 3 of GELU-tanh is INT64 or FLOAT)
        b = imp.constant(b.array.astype(dtype), node.input[1])
    elif b.onnx_type != a.onnx_type:
        b = imp.emit("mp.cast", [b], declared=b.type.with_elem(a.type.elem), hint=node.input[1])
    return [imp.emit("mp.pow", [a, b], onnx_type=a.onnx_type)]


@handler("Trilu")
def _trilu(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    k = imp.const(1, "k")
    attrs = {"upper": bool(_attrs(node).get("upper", 1)),
             "k": int(k.reshape(-1)[0]) if k is not None else 0}
    return [imp.emit("mp.trilu", [x], attrs, onnx_type=x.onnx_type)]


@handler("CumSum")
def _cumsum(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    attrs = {"axis": int(imp.const(1, "the axis").reshape(-1)[0]),
             "exclusive": bool(a.get("exclusive", 0)), "reverse": bool(a.get("reverse", 0))}
    return [imp.emit("mp.cumsum", [x], attrs, onnx_type=x.onnx_type)]


@handler("Split")
def _split(imp: _Importer, node: onnx.NodeProto) -> list:
    """One mp.split, a result per output (unused outputs too: the sizes say where the used
    ones start)."""
    x = imp.run_input(0)
    a = _attrs(node)
    r = x.type.rank
    axis = int(a.get("axis", 0))
    if not -r <= axis < r:
        raise imp.error(f"axis {axis} is out of range for rank {r}")
    axis %= r
    dim, parts = x.type.shape[axis], len(node.output)
    sizes = imp.const(1, "the split sizes") if imp.opset >= 13 else a.get("split")
    if sizes is not None and len(np.reshape(sizes, -1)):
        sizes = [int(s) for s in np.reshape(sizes, -1)]
        if len(sizes) != parts or sum(sizes) != dim or min(sizes) < 0:
            raise imp.error(f"split sizes {sizes} do not cut dimension {axis} ({dim}) into "
                            f"{parts} outputs")
    else:  # equal parts, the last one smaller (opset 18 num_outputs)
        step = -(-dim // parts)
        sizes = [max(0, min(step, dim - k * step)) for k in range(parts)]
    if parts == 1:
        return [x]
    first = imp.emit("mp.split", [x], {"axis": axis, "sizes": tuple(sizes)},
                     hint=next((o for o in node.output if o), "split"), onnx_type=x.onnx_type)
    split = first.value[0]
    return [Run((split, k), t, x.onnx_type) if name else None
            for k, (name, t) in enumerate(zip(node.output, imp.f.types(split)))]


@handler("Range")
def _range(imp: _Importer, node: onnx.NodeProto) -> list:
    """Position ids: the shape of a Range's result is its values, so it exists only as a
    constant (the walk folds a Range of constants; here one bound is a runtime value)."""
    start, limit, delta = (imp.const(i, what) for i, what in
                           enumerate(("Range's start", "Range's limit", "Range's delta")))
    return [Const(np.arange(start, limit, delta).astype(start.dtype))]


@handler("Size")
def _size(imp: _Importer, node: onnx.NodeProto) -> list:
    return [Const(np.array(math.prod(_shape_of(imp.need(0))), np.int64))]
