"""Number formats (formats.py) and their bit-exact numba kernels (rounding.py, quant.py).

Nothing is re-exported here on purpose: the IR imports `mplower.numerics.formats`, and pulling
the kernels (and with them numba, ~0.3 s) into every import of the package would slow down
tools that never execute a graph. Import `round_to` & co. from their modules.
"""
