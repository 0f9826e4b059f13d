"""The dialects. Importing this package registers their ops in `mplower.ir.opdef.OPS`.

The IR layer (parser, verifier) never imports a dialect; whatever needs ops to exist (the passes,
the backend, the frontends, the CLI commands) imports `mplower.dialect` first.
"""

# fused imports mp first: the mp ops, then the fused ops of the `fuse` pass.
from mplower.dialect import fused, mp  # noqa: F401  (registers their ops)
