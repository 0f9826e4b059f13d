"""Small CLI promises a new user relies on: `--version` and `run --save-outputs` key names."""

from __future__ import annotations

import platform
from importlib.metadata import version


def test_version_prints_mplower_and_its_numeric_libraries_and_exits_0(cli):
    r = cli("--version")
    assert r.rc == 0 and r.err == ""
    assert r.out == (f"mplower {version('mplower')}\n"
                     f"  with numpy {version('numpy')}, numba {version('numba')}, "
                     f"onnx {version('onnx')}, networkx {version('networkx')}, "
                     f"lark {version('lark')}; Python {platform.python_version()}\n")


def test_version_of_an_uninstalled_source_tree_says_so(cli, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version_without_mplower(dist: str) -> str:
        if dist == "mplower":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version_without_mplower)
    r = cli("--version")
    assert r.rc == 0
    assert r.out.split("\n")[0] == "mplower unknown (not installed)"
