"""The GEMM family's numba cache is stamped with every file its kernels inline from
(mplower.numerics.jitcache): a change to gemm_kernel.py must recompile conv_gemm's kernels,
which numba's own per-file stamp would leave stale."""

import os

import numba

from mplower.numerics import conv_gemm, depthwise, gemm, gemm_kernel, jitcache, rounding


def _kernels(module) -> list:
    return [v for v in vars(module).values()
            if isinstance(v, numba.core.registry.CPUDispatcher) and v._cache is not None
            and v.__module__ == module.__name__]


def test_gemm_family_kernels_are_stamped_with_the_whole_package() -> None:
    stamp = jitcache.package_stamp()
    names = {name for name, _, _ in stamp}
    assert {"gemm_kernel.py", "gemm.py", "conv_gemm.py", "rounding.py", "quant.py"} <= names
    for module in (gemm, conv_gemm, gemm_kernel, depthwise):
        kernels = _kernels(module)
        assert kernels or module is gemm_kernel
        for kernel in kernels:
            assert kernel._cache._cache_file._source_stamp == stamp, kernel


def test_a_change_to_an_inlined_file_changes_the_stamp(tmp_path, monkeypatch) -> None:
    for name in ("gemm_kernel.py", "conv_gemm.py"):
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(jitcache, "_PACKAGE", tmp_path)
    jitcache.package_stamp.cache_clear()
    try:
        before = jitcache.package_stamp()
        jitcache.package_stamp.cache_clear()
        st = (tmp_path / "gemm_kernel.py").stat()
        os.utime(tmp_path / "gemm_kernel.py", (st.st_atime, st.st_mtime + 5))
        assert jitcache.package_stamp() != before
    finally:
        jitcache.package_stamp.cache_clear()


def test_files_outside_the_family_keep_numbas_own_stamp() -> None:
    for kernel in _kernels(rounding):
        assert kernel._cache._cache_file._source_stamp != jitcache.package_stamp()
