"""mplower as an ONNX backend (`onnx.backend.base.Backend`): import, optionally lower, execute.

`prepare` takes a ModelProto and returns a rep whose `run` imports it (mplower.frontends), runs
an optional precision plan (`precision="bf16"` runs `assign-precision{policy=bf16},insert-casts`;
`pipeline=` takes any pass pipeline) and executes it on mplower's executor, so that
`onnx.backend.test.BackendTest` runs against mplower as it does against other runtimes.

The IR is static, so a rep specializes the model on what it learns from each call: the shapes
of the inputs (dynamic dimensions become the actual ones) and the values of the inputs the IR
carries as attributes (a Reshape target or Slice bounds fed as graph inputs, which the importer
names through StaticInputsNeeded). Each specialization is imported once and cached. Outputs come
back in the ONNX element type of each graph output (an ArgMax's INT64, a BFLOAT16 as
ml_dtypes.bfloat16), values exactly those of mplower's execution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.backend.base import Backend, BackendRep

from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.onnx.importer import (
    StaticInputsNeeded,
    import_model,
    op_key,
    unsupported_ops,
)

_MAX_SPECIALIZATIONS = 16


def precision_pipeline(precision: str | None, pipeline: str | None) -> str | None:
    """The pass pipeline of a rep: an explicit one, or the plan of a policy sheet."""
    if pipeline is not None:
        return pipeline
    if precision is None or precision == "fp32":
        return None
    return f"assign-precision{{policy={precision}}},insert-casts"


class MplowerRep(BackendRep):
    """A prepared model: `run(inputs)` returns its outputs as a list of numpy arrays."""

    def __init__(self, model: onnx.ModelProto, pipeline: str | None, file: str):
        self.model = model
        self.pipeline = pipeline
        self.file = file
        inits = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in inits]
        self.static: set[str] = set()
        self._programs: dict[tuple, tuple[Any, Any]] = {}
        shapes = _declared_shapes(model, self.input_names)
        if shapes is not None:  # fully static: import now so that errors surface in prepare
            try:
                self._program(shapes, {})
            except StaticInputsNeeded as e:
                self.static.update(e.names)

    def run(self, inputs: Any, **kwargs: Any) -> list[np.ndarray]:
        if isinstance(inputs, dict):
            arrays = {k: _array(v) for k, v in inputs.items()}
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            if len(inputs) > len(self.input_names):
                raise DiagnosticError.at(_loc(self.file), (
                    f"{len(inputs)} inputs given; the model takes {len(self.input_names)}"))
            arrays = {n: _array(v) for n, v in zip(self.input_names, inputs)}
        missing = [n for n in self.input_names if n not in arrays]
        if missing:
            raise DiagnosticError.at(_loc(self.file), f"missing input(s): {', '.join(missing)}")
        shapes = {n: tuple(a.shape) for n, a in arrays.items()}
        while True:
            static = {n: arrays[n] for n in sorted(self.static)}
            try:
                imported, program = self._program(shapes, static)
                break
            except StaticInputsNeeded as e:
                if set(e.names) <= self.static:
                    raise
                self.static.update(e.names)
        feeds = [_executor_value(arrays[n]) for n in imported.inputs]
        outs = program.run(feeds, reference=False).outputs
        return [np.asarray(y).astype(helper.tensor_dtype_to_np_dtype(t), copy=False)
                for y, t in zip(outs, imported.output_types)]

    def _program(self, shapes: dict[str, tuple[int, ...]], static: dict[str, np.ndarray]):
        key = (tuple(sorted(shapes.items())),
               tuple((n, a.dtype.str, a.shape, a.tobytes()) for n, a in sorted(static.items())))
        hit = self._programs.get(key)
        if hit is not None:
            return hit
        from mplower.backend.executor import Program
        from mplower.passes.insert_casts import materialize

        imported = import_model(self.model, self.file, input_shapes=shapes, static_inputs=static,
                                inline_weights=True)
        module = imported.module
        if self.pipeline:
            _run_pipeline(module, self.pipeline)
        materialize(module)  # a pipeline that only annotates a plan: insert-casts, as `run` does
        program = Program(module)
        if len(self._programs) >= _MAX_SPECIALIZATIONS:
            self._programs.pop(next(iter(self._programs)))
        self._programs[key] = (imported, program)
        return imported, program


def _run_pipeline(module, pipeline: str) -> None:
    from mplower.backend.executor import reference_runner
    from mplower.pass_manager import PassContext, PassManager, PipelineError, parse_pipeline

    try:
        passes = parse_pipeline(pipeline)
    except PipelineError as e:
        raise ValueError(str(e)) from None
    PassManager(passes).run(module, PassContext(runner=reference_runner))


def _declared_shapes(model: onnx.ModelProto, names: list[str]) -> dict | None:
    """Input shapes when every dimension is fixed in the model, else None."""
    out = {}
    by_name = {i.name: i for i in model.graph.input}
    for n in names:
        tt = by_name[n].type.tensor_type
        if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
            return None
        out[n] = tuple(d.dim_value for d in tt.shape.dim)
    return out


def _array(v: Any) -> np.ndarray:
    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)


def _executor_value(a: np.ndarray) -> np.ndarray:
    """An input as the executor holds values: narrow floats (ml_dtypes) as float32, int4 as
    int8; everything else as it is."""
    if a.dtype.kind == "V" or a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return a.astype(np.float32)
    if a.dtype.name in ("int4", "uint4"):
        return a.astype(np.int8)
    return a


def _loc(file: str) -> Location:
    return Location(file, 0, 0)


class MplowerBackend(Backend):
    """`prepare(model, device="CPU", precision=None, pipeline=None)`."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device) and not unsupported_ops(model.graph)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", precision: str | None = None,
                pipeline: str | None = None, **kwargs: Any) -> MplowerRep:
        if not cls.supports_device(device):
            raise ValueError(f"mplower runs on the CPU only, not on {device}")
        if isinstance(model, (str, bytes)):
            model = onnx.load_model_from_string(model) if isinstance(model, bytes) \
                else onnx.load(model)
        name = model.graph.name or "model"
        return MplowerRep(model, precision_pipeline(precision, pipeline), f"<{name}>")

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> list[np.ndarray]:
        """One node as a one-node model (the inputs give the types and shapes)."""
        arrays = [_array(x) for x in inputs]
        names = [n for n in node.input if n]
        ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
               for n, a in zip(names, arrays)]
        opset = kwargs.pop("opset_version", None) or onnx.defs.onnx_opset_version()
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        types = onnx.shape_inference.infer_node_outputs(
            schema, node, {v.name: v.type for v in ins})
        outs = [onnx.helper.make_value_info(o, types[o]) for o in node.output if o]
        graph = helper.make_graph([node], f"node_{op_key(node)}", ins, outs)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(node.domain, opset)])
        return cls.prepare(model, device, **kwargs).run(arrays)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper().split(":")[0] == "CPU"


prepare = MplowerBackend.prepare
run_model = MplowerBackend.run_model
run_node = MplowerBackend.run_node
supports_device = MplowerBackend.supports_device
is_compatible = MplowerBackend.is_compatible
