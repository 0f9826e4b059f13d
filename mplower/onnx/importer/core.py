"""ONNX models to mplower modules: static shapes, folded constants, the mp op set.

`import_model` reads an ONNX model (any opset the installed onnx knows), keeps the
graph outputs asked for and only the nodes that feed them, fixes every dynamic input dimension
(`input_shapes`, else a dynamic leading batch dimension becomes 1), runs ONNX's own checker and
shape inference, and then walks the nodes in order. A node whose inputs are all known at import
time is folded (onnx's ReferenceEvaluator computes it, or the mp op's reference where that is
wrong; where the evaluator fails the node is imported as ops), so the shape subgraphs of exporters
(Shape, Gather on shapes, Unsqueeze, Concat, ConstantOfShape, Range, Trilu of a constant, Where
and Equal on constants), Reshape targets, Slice bounds and weight generators become plain
constants, and the module holds no op whose operands are all constants but those. Index tensors (INT64
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.plan import OUTPUT_NAMES
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.opdef import OPS, OpError
from mplower.ir.types import DenseAttr, TensorType, tensor, value_dtype
from mplower.ir.verifier import verify
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.contrib import (  # noqa: F401  (msft.py fills the table)
    CONTRIB_DEFAULT_DOMAIN,
    _domain,
    _move_contrib_ops,
)
from mplower.onnx.importer.declared import (
    dim_known,
    forget_unknown_dims,
    symbol_values,
    with_stand_ins,
)
from mplower.onnx.importer.loading import load_model  # noqa: F401  (the package's API)

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
    notes: list[str] = field(default_factory=list)  # what --eval-mode changed, per node


class StaticInputsNeeded(DiagnosticError):
    """A value the IR carries as an attribute depends on these graph inputs."""

    def __init__(self, names: list[str], diagnostic: Diagnostic):
        super().__init__(diagnostic)
        self.names = names


# ---------------------------------------------------------------------------------------------
# Entry points




def import_model(model: onnx.ModelProto, file: str = "<model>", *,
                 input_shapes: dict[str, tuple[int, ...]] | None = None,
                 outputs: Sequence[str] | None = None,
                 static_inputs: dict[str, np.ndarray] | None = None,
                 inline_weights: bool = False, eval_mode: bool = False) -> Imported:
    """Convert `model` to a verified Module; see the module docstring.

    `static_inputs` binds graph inputs to values known at import (the backend's int64 shape
    and axes inputs). With `inline_weights` every constant is inline (no weights file). With
    `eval_mode`, training-mode Dropout and BatchNormalization import as inference, each one
    changed named in `Imported.notes`.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # pruning and fixing input shapes edit the graph
    _move_contrib_ops(copy)
    imp = _Importer(copy, file, input_shapes or {}, outputs, static_inputs or {},
                    inline_weights)
    imp.eval_mode = eval_mode
    return imp.run()


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
    """The op type as the coverage tables name it: `Conv`, or `domain::Op` off the default
    (and for onnxruntime's ops in the default domain, CONTRIB_DEFAULT_DOMAIN)."""
    domain = _domain(node)
    return node.op_type if domain in ("", "ai.onnx") else f"{domain}::{node.op_type}"


def _sklearn_hint(bad: Counter, g: onnx.GraphProto) -> str:
    """skl2onnx computes a classifier's label output with ArrayFeatureExtractor (class index to
    label): the probabilities alone import, so say how to ask for them."""
    if "ai.onnx.ml::ArrayFeatureExtractor" not in bad:
        return ""
    probs = [o.name for o in g.output if "prob" in o.name.lower()] or ["probabilities"]
    return (f"; ArrayFeatureExtractor computes a scikit-learn classifier's label: import its "
            f"probabilities alone with --outputs {probs[0]}")


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
        self.eval_mode = False  # training-mode Dropout/BatchNormalization as inference
        self.notes: list[str] = []

    # ---- diagnostics ---------------------------------------------------------------------
    def eval_mode_note(self, what: str) -> None:
        """Record that --eval-mode imported this training-mode node as inference."""
        n = self.node
        self.notes.append(f"node '{n.name or n.output[0]}' ({op_key(n)}): {what}")

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
                                               f"mplower cannot import: {listing}"
                                               f"{_sklearn_hint(bad, g)}")
        inits = {t.name: t for t in g.initializer}
        needed = {i for n in nodes for i in _node_inputs(n) if i}  # subgraphs read outer values
        needed.update(self.out_names)
        for t in g.initializer:
            if t.name in needed:
                self.env[t.name] = Const(self._tensor_array(t))
        args, arg_types = self._arguments(inits, needed)
        self._shape_inference()
        self.consumers = Counter(i for n in nodes for i in _node_inputs(n) if i)
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
        return Imported(module, self.weights, args, arg_types, list(self.out_names), onnx_types,
                        self.notes)

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
        self.producer = {o: n for n in g.node for o in n.output if o}
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
        self.symbols = symbol_values(g, self.input_shapes, self.loc)
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
            if d.HasField("dim_value") and d.dim_value < -1:  # -1: exporters' "dynamic"
                raise DiagnosticError.at(self.loc, f"input '{vi.name}' has a negative dimension "
                                                   f"{k} ({d.dim_value}); ONNX dimensions are "
                                                   f">= 0")
        if given is not None:
            if len(given) != len(dims):
                raise DiagnosticError.at(self.loc, f"--input-shape {vi.name} has rank "
                                                   f"{len(given)} but the input has rank "
                                                   f"{len(dims)}")
            for k, (d, v) in enumerate(zip(dims, given)):
                if dim_known(d) and d.dim_value != v:
                    raise DiagnosticError.at(self.loc, (
                        f"--input-shape {vi.name} sets dimension {k} to {v}, but the model "
                        f"fixes it to {d.dim_value}"))
            return tuple(given)
        shape = []
        for k, d in enumerate(dims):
            if dim_known(d):
                shape.append(d.dim_value)
            elif d.dim_param in self.symbols:  # named by another input's --input-shape
                shape.append(self.symbols[d.dim_param])
            elif k == 0:
                shape.append(1)  # a dynamic batch dimension
            else:
                what = f"'{d.dim_param}'" if d.dim_param else "unknown"
                raise DiagnosticError.at(self.loc, (
                    f"input '{vi.name}' has a dynamic dimension {k} ({what}); fix it with "
                    f"--input-shape {vi.name}=" + "x".join(
                        str(x.dim_value) if dim_known(x) else ("1" if i == 0 else "N")
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
        forget_unknown_dims(self.model.graph)
        for node in self.model.graph.node:  # defaults that inference needs written out
            have = {a.name for a in node.attribute}
            for name, value in SPELLED_DEFAULTS.get(op_key(node), {}).items():
                if name not in have:
                    node.attribute.append(helper.make_attribute(name, value))
        try:
            inferred = onnx.shape_inference.infer_shapes(with_stand_ins(self.model),
                                                         strict_mode=True)
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
                stack.extend(x for x in _node_inputs(self.producer[v]) if x)
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
            if outs is None:  # onnx's reference cannot compute it: import it as mp ops
                outs = HANDLERS[op_key(node)](self, node)
        else:
            outs = HANDLERS[op_key(node)](self, node)
        for name, v in zip(node.output, outs):
            if name and v is not None:
                self.env[name] = v
        for k, name in enumerate(node.output):
            if name and self.consumers.get(name) and (k >= len(outs) or outs[k] is None):
                raise self.error(f"output #{k} ('{name}') is not supported")

    def _fold(self, node: onnx.NodeProto, ins: list) -> list[Const] | None:
        """The node's outputs computed at import, or None where onnx's ReferenceEvaluator
        fails on these inputs (its GatherElements, for one, breaks past 64 choices along the
        axis); the caller then imports the node as ops, whose errors are located diagnostics
        rather than the evaluator's Python exception."""
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
        except Exception:  # noqa: BLE001  (any op implementation may raise anything)
            return None
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
# Attribute defaults written into the nodes before ONNX's shape inference, which fails on their
# absence (MeanVarianceNormalization's function body reads `axes` without its default).
SPELLED_DEFAULTS: dict[str, dict[str, Any]] = {}
# Identity at inference / onnx's reference gets LRN wrong / subgraphs read outer values.
_NO_FOLD = {"Dropout", "LRN", "If", "Loop", "Scan"}


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


def _shape_of(v: Const | Run | Unbound) -> tuple[int, ...]:
    if isinstance(v, Const):
        return tuple(v.array.shape)
    return v.shape if isinstance(v, Unbound) else v.type.shape


# The most elements a tensor computed at import time may have: the importer holds it in memory
# whole (2^31 f32 elements are 8 GiB); a larger fill is a model error, not a weight.
FOLD_LIMIT = 2 ** 31


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
    "GatherElements": lambda imp, node, ins: _fold_as(imp, "mp.gather_elements", ins, {
        "axis": int(_attrs(node).get("axis", 0))}),
}


def _fold_as(imp: _Importer, op: str, ins: list, attrs: dict) -> list[np.ndarray]:
    """A node folded with the reference of the mp op it imports as (one definition of what
    it computes, which numpy evaluates at any size)."""
    arrays = [v.array for v in ins]
    try:
        OPS[op].infer([tensor(a.shape, ELEM_OF_ONNX.get(helper.np_dtype_to_tensor_dtype(
            a.dtype), "f32")) for a in arrays], attrs)
        return OPS[op].reference(arrays, attrs)
    except OpError as e:
        raise imp.error(e.message) from None


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


# ---- data movement ---------------------------------------------------------------------------


def _reshape_to(imp: _Importer, x: Run, shape: Sequence[int]) -> Run:
    shape = tuple(int(d) for d in shape)
    if shape == x.type.shape:
        return x
    return imp.emit("mp.reshape", [x], declared=tensor(shape, x.type.elem),
                    onnx_type=x.onnx_type)


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


def _as_int64(imp: _Importer, idx: Run) -> Run:
    """mp.argmax's i32 index as the INT64 ONNX's ArgMax returns."""
    return imp.emit("mp.cast", [idx], declared=idx.type.with_elem("i64"))

