"""ONNX models to mplower modules (see `core` for how a model is walked).

The handlers live by op family in the sibling modules; importing this package registers them
all in `HANDLERS`. A new ONNX op is one `@handler` function in its family's module.
"""

from mplower.onnx.importer import (  # noqa: F401  (registers the handlers)
    activations,
    control_flow,
    elementwise,
    indexing,
    indexing_ops,
    linalg,
    losses,
    msft,
    padding,
    pooling,
    pooling_more,
    qlinear,
    quantization,
    recurrent,
    reduce,
    reductions,
    sampling,
    sequence_ops,
    shape,
    signal,
    transformer_ops,
    vision,
)
from mplower.onnx.importer.core import (
    ELEM_OF_ONNX,
    HANDLERS,
    MAX_OPSET,
    MIN_OPSET,
    ONNX_OF_ELEM,
    Imported,
    StaticInputsNeeded,
    _ssa_name,
    handler,
    import_model,
    load_model,
    onnx_type_name,
    op_key,
    parse_input_shape,
    unsupported_ops,
)

__all__ = ["ELEM_OF_ONNX", "HANDLERS", "MAX_OPSET", "MIN_OPSET", "ONNX_OF_ELEM", "Imported",
           "StaticInputsNeeded", "_ssa_name", "handler", "import_model", "load_model",
           "onnx_type_name", "op_key", "parse_input_shape", "unsupported_ops"]
