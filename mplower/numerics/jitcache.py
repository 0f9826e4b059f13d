"""numba's on-disk cache for the GEMM family's kernels, kept fresh across the files they inline.

numba keys a cached kernel by its own bytecode and stamps the cache's index with its own file's
modification time and size, so a change to a function it inlines from another file leaves the
cached machine code as it was: conv_gemm's and gemm's kernels inline gemm_kernel's tile
functions and intrinsics, and with them rounding's, quant's and workers' per-element steps and
cpu's choice of instructions. The kernels of the files in STAMPED are therefore stamped with
every file of this package instead: editing any of them recompiles those kernels, where the
editor would otherwise run stale code. Each file in STAMPED imports this module before its
first jitted function, so the locators below are in numba's list when it looks them up.
"""

from __future__ import annotations

import functools
from pathlib import Path

from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent
# The kernel files that inline code from other files of the package.
STAMPED = frozenset({"gemm_kernel.py", "gemm.py", "conv_gemm.py", "depthwise.py"})


@functools.cache
def package_stamp() -> tuple:
    """(name, mtime, size) of every Python file of the package, read once per process."""
    return tuple((p.name, p.stat().st_mtime, p.stat().st_size)
                 for p in sorted(_PACKAGE.glob("*.py")))


class _PackageStamped:
    """A numba cache locator for the files in STAMPED, with `package_stamp` as its stamp; any
    other file is left to numba's own locators."""

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file).resolve()
        if path.parent != _PACKAGE or path.name not in STAMPED:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self) -> tuple:
        return package_stamp()


# One per numba locator that serves a source file, in numba's order of preference
# (NUMBA_CACHE_DIR, the package's __pycache__, the user's cache folder).
_LOCATORS = [type("PackageStamped" + base.__name__, (_PackageStamped, base), {})
             for base in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                          caching.UserWideCacheLocator)]
# Newer numba names the class CacheImpl, older _CacheImpl (pyproject allows both).
_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl
_IMPL._locator_classes[:0] = _LOCATORS
