"""The mp op set: each op declared once with its signature, type rule, reference semantics and cost.

An `OpDef` is the single place that knows an op: how many operands it takes, which attributes
(with kinds and defaults), how its result types follow from its operands (`infer`), what it
computes (`reference`, numpy, ONNX semantics where ONNX has the op), how many FLOPs it costs,
which compute precisions it may be lowered to, and its traits (a contraction, a conversion, ...).
The verifier, the passes, the cost model and the backend all read these declarations; none of
them re-derives an op's rules, and the op categories they test for are computed from the traits
at the end of this module. The machinery (`OpDef`, the registry, attribute checking) is the IR
layer's (mplower.ir.opdef); importing this module registers the mp ops there.

One module per op family (DESIGN.md §2): linalg, elementwise, normalization, data_movement,
pooling, quantization, indexing, reductions, scatter, qlinear, activations; the rules they share in common.
"""

from __future__ import annotations

# The families register their ops in this order (OPS and WEIGHTED keep it).
# isort: off
from mplower.dialect.mp import common  # noqa: F401
from mplower.dialect.mp import linalg  # noqa: F401
from mplower.dialect.mp import elementwise  # noqa: F401
from mplower.dialect.mp import normalization  # noqa: F401
from mplower.dialect.mp import data_movement  # noqa: F401
from mplower.dialect.mp import pooling  # noqa: F401
from mplower.dialect.mp import quantization  # noqa: F401
from mplower.dialect.mp import indexing  # noqa: F401
from mplower.dialect.mp import activations  # noqa: F401
from mplower.dialect.mp import qlinear  # noqa: F401
from mplower.dialect.mp import reductions  # noqa: F401
from mplower.dialect.mp import scatter  # noqa: F401
# isort: on
from mplower.dialect.mp.quantization import SCALE_FORMATS, SCALE_RECIPES
from mplower.ir.opdef import OPS, OpError, Trait, ops_with

# ---------------------------------------------------------------------------------------------
# Op categories: every set of ops the lowering, the passes and the backend test for, derived
# from the traits declared above and nowhere else written out.

CONTRACTIONS = ops_with(Trait.CONTRACTION)
CONVERSIONS = ops_with(Trait.CONVERSION)
DATA_MOVEMENT = ops_with(Trait.DATA_MOVEMENT)
ACCUMULATING = ops_with(Trait.ACCUMULATES)  # ops whose precision Decision carries an accumulator
COMPUTE_HEAVY = ops_with(Trait.COMPUTE_HEAVY)  # the first and last stay f32 (keep_first_last)
QUANTIZABLE = ops_with(Trait.QUANTIZABLE)
TYPE_CARRYING = ops_with(Trait.TYPE_CARRYING)
VALUE_PRESERVING = ops_with(Trait.VALUE_PRESERVING)
# The ops with a weight operand, in declaration order (pass options print them).
WEIGHTED: tuple[str, ...] = tuple(n for n, op in OPS.items() if op.weight_operand is not None)
# Their weight operand: one index for all of them (sparsify and lower-sparse index operands with
# it), which this unpacking checks when the dialect is imported.
(WEIGHT_OPERAND,) = {OPS[n].weight_operand for n in WEIGHTED}


__all__ = [
           "ACCUMULATING",
           "COMPUTE_HEAVY",
           "CONTRACTIONS",
           "CONVERSIONS",
           "DATA_MOVEMENT",
           "QUANTIZABLE",
           "SCALE_FORMATS",
           "SCALE_RECIPES",
           "TYPE_CARRYING",
           "VALUE_PRESERVING",
           "WEIGHTED",
           "WEIGHT_OPERAND",
           "OpError",
]
