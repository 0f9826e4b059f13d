"""The dialects. Importing this package registers their ops in `mplower.ir.opdef.OPS`.

The IR layer (parser, verifier) never imports a dialect; whatever needs ops to exist (the passes,
the backend, the frontends, the CLI commands) imports `mplower.dialect` first.
"""

# fused imports mp first: the mp ops, then the fused ops of the `fuse` pass; plan declares the
# values of the mp.* plan annotations.
from mplower.dialect import fused, fused_conv, mp, plan  # noqa: F401  (registers their ops)
