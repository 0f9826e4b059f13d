"""Weights and inputs `.npz` files that lie: read only what the model names, check before inflating.

The archives are built byte by byte with numpy.lib.format and zipfile, so that a member can
claim in its npy header far more data than it holds; a test that inflated or allocated such a
member would fail (or take gigabytes), which is how the tests show that it never happens.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import sequential_matmul

from mplower.io.npz import NpzArchive
from mplower.ir.diagnostics import DiagnosticError, Location

MATMUL_IR = """module @m attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<4x8xf32>) -> tensor<4x3xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<8x3xf32>
    %y = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
    return %y : tensor<4x3xf32>
  }
}
"""
W = np.arange(24, dtype=np.float32).reshape(8, 3) / 8
X = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
HUGE = 2 ** 40  # elements; as float32 that is 4 TiB


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    """The npy header np.save writes for an array of `shape` (version 1.0)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def npy(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr)
    return buf.getvalue()


def write_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "m.ir").write_text(MATMUL_IR)
    np.savez(tmp_path / "in.npz", x=X)
    return tmp_path / "m.ir"


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Names of the zip members opened for reading, in order."""
    names: list[str] = []
    real = zipfile.ZipFile.open

    def spy(self, name, mode="r", *args, **kwargs):
        if mode == "r":
            names.append(name if isinstance(name, str) else name.filename)
        return real(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    return names


def assert_error(res, *fragments: str) -> None:
    assert res.rc == 1, res.err
    assert "Traceback" not in res.err and "internal error" not in res.err
    for f in fragments:
        assert f in res.err, res.err


def saved_outputs(path: Path) -> np.ndarray:
    with np.load(path) as z:
        return z["output_0"]


def test_members_the_model_does_not_name_are_never_opened(cli, model, tmp_path, opened) -> None:
    # `unused` claims 2 GiB of float32 but holds 4 bytes: reading it would fail or allocate.
    lie = npy_header((2 ** 29,)) + b"\0" * 4
    write_zip(tmp_path / "w.npz", {"w.npy": npy(W), "unused.npy": lie})
    write_zip(tmp_path / "in.npz", {"junk.npy": lie, "x.npy": npy(X)})
    out = tmp_path / "o.npz"
    res = cli("run", model, "--inputs", tmp_path / "in.npz", "--save-outputs", out)
    assert res.rc == 0, res.err
    assert "unused.npy" not in opened and "junk.npy" not in opened
    assert set(opened) == {"w.npy", "x.npy"}
    np.testing.assert_array_equal(saved_outputs(out), sequential_matmul(X, W))


def test_weight_header_claiming_2_to_the_40_elements_is_refused_at_the_constant(
        cli, model, tmp_path) -> None:
    npz = write_zip(tmp_path / "w.npz", {"w.npy": npy_header((HUGE,)) + b"\0" * 16})
    res = cli("run", model, "--inputs", tmp_path / "in.npz")
    assert_error(res, f"{model}:3:", f"weight 'w' has shape [{HUGE}] in {npz} but the IR "
                                     f"declares [8, 3]")


def test_input_header_claiming_2_to_the_40_elements_is_refused_at_the_argument(
        cli, model, tmp_path) -> None:
    np.savez(tmp_path / "w.npz", w=W)
    inputs = write_zip(tmp_path / "in.npz", {"x.npy": npy_header((HUGE, 8)) + b"\0" * 16})
    res = cli("run", model, "--inputs", inputs)
    assert_error(res, f"{model}:2:", f"input 'x' in {inputs} has shape [{HUGE}, 8] but the "
                                     f"function takes [4, 8]")


def test_header_that_matches_the_ir_but_not_the_archive_is_refused_before_allocating(
        cli, tmp_path) -> None:
    # The IR really declares a 4 TiB constant; the member's header agrees but holds 16 bytes.
    ir = tmp_path / "big.ir"
    ir.write_text(f"""module attributes {{mp.weights = "w.npz"}} {{
  func.func @main() -> tensor<{HUGE}xf32> {{
    %w = mp.constant {{name = "w"}} : () -> tensor<{HUGE}xf32>
    return %w : tensor<{HUGE}xf32>
  }}
}}
""")
    npz = write_zip(tmp_path / "w.npz", {"w.npy": npy_header((HUGE,)) + b"\0" * 16})
    assert_error(cli("run", ir), f"{ir}:3:", f"weights file '{npz}': array 'w' is damaged: its "
                 f"header promises {4 * HUGE} bytes of data ({HUGE} float32) but the archive "
                 f"holds 16")


def test_member_with_more_data_than_its_header_promises_is_refused(cli, model, tmp_path) -> None:
    npz = write_zip(tmp_path / "w.npz", {"w.npy": npy(W) + b"\0" * 1000})
    assert_error(cli("run", model), f"{model}:3:", f"weights file '{npz}': array 'w' is "
                 "damaged: its header promises 96 bytes of data (8x3 float32) but the archive "
                 "holds 1096")


def test_memory_error_while_loading_names_the_file_and_the_weight(
        cli, model, tmp_path, monkeypatch) -> None:
    np.savez(tmp_path / "w.npz", w=W)

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(np.lib.format, "read_array", out_of_memory)
    res = cli("run", model, "--random-inputs")
    assert_error(res, f"{model}:3:", f"not enough memory to load array 'w' (96 bytes) from "
                                     f"weights file '{tmp_path / 'w.npz'}'")


def test_member_that_is_not_an_npy_array_is_a_diagnostic(cli, model, tmp_path) -> None:
    npz = write_zip(tmp_path / "w.npz", {"w": b"just some bytes"})
    assert_error(cli("run", model), f"{model}:3:",
                 f"weights file '{npz}': member 'w' is not a numpy array (.npy)")


def test_a_zip_bomb_member_inflates_no_further_than_the_size_the_archive_records(
        tmp_path) -> None:
    # The deflate stream holds W's npy and then 32 MiB of zeros, but the zip directory records
    # (with the matching CRC) only the npy's length, as a crafted archive would.
    good = npy(W)
    path = write_zip(tmp_path / "bomb.npz", {"w.npy": good + bytes(32 << 20)})
    data = bytearray(path.read_bytes())
    crc = zlib.crc32(good)
    local = data.index(b"PK\x03\x04")
    struct.pack_into("<I", data, local + 14, crc)
    struct.pack_into("<I", data, local + 22, len(good))
    central = data.index(b"PK\x01\x02")
    struct.pack_into("<I", data, central + 16, crc)
    struct.pack_into("<I", data, central + 24, len(good))
    path.write_bytes(bytes(data))
    loc = Location(str(path), 0, 0)
    with NpzArchive(path, loc) as archive:
        tracemalloc.start()
        try:
            arr = archive.read("w", loc)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    np.testing.assert_array_equal(arr, W)
    assert peak < 1 << 20  # a few zipfile buffers, never the 32 MiB the stream inflates to


def _run_mplower(*args: object) -> subprocess.CompletedProcess:
    # A child process, so that a read that blocks (the bug) fails the test instead of hanging it.
    return subprocess.run([sys.executable, "-m", "mplower", *map(str, args)],
                          check=False, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_as_inputs_or_weights_is_refused_without_waiting(model, tmp_path) -> None:
    np.savez(tmp_path / "w.npz", w=W)
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    res = _run_mplower("run", model, "--inputs", fifo)
    assert res.returncode == 1, res.stderr
    assert f"{fifo}: error: inputs file '{fifo}' is not a regular file" in res.stderr
    res = _run_mplower("run", model, "--weights", fifo)
    assert res.returncode == 1, res.stderr
    assert f"{model}:1:1: error: weights file '{fifo}' is not a regular file" in res.stderr


@pytest.mark.parametrize("special", ["directory", "/dev/zero"])
def test_directory_or_device_as_inputs_or_weights_is_refused(cli, model, tmp_path,
                                                             special) -> None:
    if special == "directory":
        path = tmp_path / "dir.npz"
        path.mkdir()
    else:
        path = Path(special)
        if not path.exists():
            pytest.skip(f"no {special}")
    np.savez(tmp_path / "w.npz", w=W)
    assert_error(cli("run", model, "--inputs", path),
                 f"{path}: error: inputs file '{path}' is not a regular file")
    assert_error(cli("run", model, "--weights", path),
                 f"{model}:1:1: error: weights file '{path}' is not a regular file")


def test_archive_header_reads_no_data_and_read_checks_the_recorded_size(tmp_path) -> None:
    # header() of a lying member succeeds (it reads no data); read() then refuses it.
    lie = npy_header((2 ** 29,)) + b"\0" * 4
    path = write_zip(tmp_path / "a.npz", {"a.npy": npy(W), "b.npy": lie})
    loc = Location(str(path), 0, 0)
    with NpzArchive(path, loc) as archive:
        assert archive.names == ["a", "b"]
        assert archive.header("b", loc) == ((2 ** 29,), np.dtype("<f4"))
        np.testing.assert_array_equal(archive.read("a", loc), W)
        with pytest.raises(DiagnosticError, match="array 'b' is damaged: its header promises "
                                                  "2147483648 bytes"):
            archive.read("b", loc)
