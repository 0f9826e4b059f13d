"""Lowered mplower modules to ONNX (see `core` for what the exported graph computes).

The emitters live by op family in the sibling modules; importing this package registers them
all in `EMITTERS`. A new op is one `@emitter` function in its family's module.
"""

from mplower.onnx.exporter import (  # noqa: F401  (registers the emitters)
    activations,
    emitters,
    fused,
    indexing_ops,
    qlinear,
    reductions,
)
from mplower.onnx.exporter.core import (
    EMITTERS,
    NARROW_FLOATS,
    ONNX_TYPE,
    OPSET,
    Exported,
    check_and_serialize,
    emitter,
    export_module,
)

__all__ = ["EMITTERS", "NARROW_FLOATS", "ONNX_TYPE", "OPSET", "Exported", "check_and_serialize",
           "emitter", "export_module"]
