"""The dialects. Importing this package registers their ops in `mplower.ir.opdef.OPS`.

The IR layer (parser, verifier) never imports a dialect; whatever needs ops to exist (the passes,
the backend, the frontends, the CLI commands) imports `mplower.dialect` first.
"""

from mplower.dialect import mp  # noqa: F401  (registers the mp ops)
