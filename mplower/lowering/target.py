"""Target descriptions: which kernels a machine has, how fast they run, and how to fall back.

A target (a TOML sheet, docs/targets.md) says, per op and compute format, which kernels exist
(dense, 2:4 or 1:2 structured sparse, CSR), the peak throughput of each format, the memory
bandwidth and a fixed per-op overhead. `legalize` turns a requested (compute, accumulator,
kernel) into one the target can run, walking the fallback chains below and recording a reason
code for every step, so that the report can say why an op did not run as asked. `op_time` is
the roofline time of one kernel; mplower.lowering.cost groups a function's ops into the fused
kernels the target's compiler would launch (`fuse`) and prices each with it, using
`gemm_efficiency` (tile and wave quantization) for matmuls and convolutions, or the measured
rate of the op's kernel class (`kernel_class`, a sheet's `[rates.CLASS]`) where the sheet has one.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mplower.dialect.mp import SCALE_FORMATS
from mplower.dialect.plan import DENSE, TARGET
from mplower.ir.diagnostics import DiagnosticError, did_you_mean
from mplower.ir.graph import Module
from mplower.ir.types import TensorType
from mplower.lowering.tomlsheet import Bounds, KeyPath, Sheet, format_problem, locate
from mplower.lowering.tomlsheet import builtin_names as _builtin_names
from mplower.numerics.formats import COMPUTE_FORMATS, FORMATS

# Kernel kinds, as written in `mp.kernel`. The structured kinds name the pattern their data
# must have: NVIDIA sparse tensor cores take 2:4 for 16- and 8-bit inputs but 1:2 for tf32
# (cuSPARSELt, CUSPARSELT_SPARSITY_50_PERCENT), and a 2:4-pruned weight is not 1:2.
SPARSE_2_4 = "sparse_2_4"
SPARSE_1_2 = "sparse_1_2"
CSR = "csr"
KERNELS = (DENSE, SPARSE_2_4, SPARSE_1_2, CSR)
STRUCTURED_KERNEL = {"2:4": SPARSE_2_4, "1:2": SPARSE_1_2}  # sparse_pattern -> kernel
KERNEL_FOR_ENCODING: dict[str | None, str] = {None: DENSE, "2:4": SPARSE_2_4, "1:2": SPARSE_1_2,
                                              "csr": CSR}  # tensor encoding -> kernel

# The accumulators of matmul/conv/reductions (the compute formats are numerics.formats').
ACCUM_FORMATS = ("f32", "f16", "i32")

# Reason codes for legalize's fallbacks (documented in docs/targets.md).
NO_TF32_KERNEL = "no-tf32-kernel"
NO_BF16_KERNEL = "no-bf16-kernel"
NO_F16_KERNEL = "no-f16-kernel"
NO_FP8_KERNEL = "no-fp8-kernel"
NO_FP4_KERNEL = "no-fp4-kernel"
NO_MX_KERNEL = "no-mx-kernel"  # no tensor-core kernel that applies E8M0 / NVFP4 block scales
NO_INT8_KERNEL = "no-int8-kernel"
NO_F16_ACCUM = "no-f16-accum"
NO_SPARSE_KERNEL = "no-sparse-kernel"
REASON_CODES = (NO_TF32_KERNEL, NO_BF16_KERNEL, NO_F16_KERNEL, NO_FP8_KERNEL, NO_FP4_KERNEL,
                NO_MX_KERNEL, NO_INT8_KERNEL, NO_F16_ACCUM, NO_SPARSE_KERNEL)
# Reason codes of lower-sparse's dense decisions (docs/sparse.md), in the order it checks them:
# the second operand is computed, not a constant weight (attention's q @ k^T), and a sparse
# kernel needs the weight's zeros before the run; the target has no sparse kernel for the op at
# all; the weight fits none of the target's sparse kernels (no 2:4 / 1:2 pattern, too few
# zeros for CSR); none that it fits exists in the op's compute format; the weight is below the
# shape thresholds; the cost model says the sparse kernel would not be faster.
NO_CONSTANT_WEIGHT = "no-constant-weight"
PATTERN_INVALID = "pattern-invalid"
DTYPE_UNSUPPORTED = "dtype-unsupported"
TOO_SMALL = "too-small"
NOT_PROFITABLE = "not-profitable"
SPARSE_REASON_CODES = (NO_CONSTANT_WEIGHT, NO_SPARSE_KERNEL, PATTERN_INVALID, DTYPE_UNSUPPORTED,
                       TOO_SMALL, NOT_PROFITABLE)

# The fusions a target's compiler performs (a sheet's `fuse` list, docs/targets.md): `cast`
# folds mp.cast and `qdq` folds mp.quantize / mp.dequantize into the neighbouring kernel's
# loads or stores; `elementwise` merges chains of elementwise ops, and elementwise ops around a
# normalization, reduction or data-movement kernel, into one kernel; `epilogue` folds
# elementwise ops after a matmul/conv into it (bias, activation, residual), as TensorRT, XLA
# and Inductor do.
FUSE_CAST = "cast"
FUSE_QDQ = "qdq"
FUSE_ELEMENTWISE = "elementwise"
FUSE_EPILOGUE = "epilogue"
# `qdq-propagation` moves a quantize above the max_pool2d whose only use it is, which then runs
# in the quantized format (onnxruntime's QDQ propagation, TensorRT's Q/DQ propagation): a max
# commutes with a monotone quantize.
FUSE_QDQ_PROPAGATION = "qdq-propagation"
# `slice-concat` lets mp.slice and mp.concat fuse as elementwise ops do, any number of them in
# one kernel (XLA's loop fusion takes slices and concatenates; a rotary embedding's
# halves-swap is then one kernel with its multiplies, as serving engines write it).
FUSE_SLICE_CONCAT = "slice-concat"
# `attention` runs Q K^T, the elementwise ops after it (scale, mask), softmax and the product
# by V as one kernel whose scores never leave the chip (FlashAttention, Dao et al. 2022,
# arXiv:2205.14135; cuDNN's and TensorRT's fused attention): only Q, K, V, the mask and the
# output move.
FUSE_ATTENTION = "attention"
FUSIONS = (FUSE_CAST, FUSE_QDQ, FUSE_ELEMENTWISE, FUSE_EPILOGUE, FUSE_QDQ_PROPAGATION,
           FUSE_SLICE_CONCAT, FUSE_ATTENTION)

# Kernel classes (a sheet's `[rates.CLASS]` tables, docs/targets.md): ops whose kernels a runtime
# may run far from its format's GEMM peak or its memory bandwidth, so a sheet can give each a
# measured rate, in the op's FLOPs (as its op definition counts them) per second. A conv2d
# with groups is depthwise when every group has one input channel, else grouped.
CONV_DEPTHWISE = "conv_depthwise"
CONV_GROUPED = "conv_grouped"
MAX_POOL = "max_pool"
LRN = "lrn"
KERNEL_CLASSES = (CONV_DEPTHWISE, CONV_GROUPED, MAX_POOL, LRN)
_CLASS_OF_OP = {"mp.max_pool2d": MAX_POOL, "mp.lrn": LRN}


def kernel_class(op: str, attrs: Mapping[str, Any], ins: Sequence[TensorType]) -> str | None:
    """The kernel class (`KERNEL_CLASSES`) of op `op` with verified `attrs` and operand types
    `ins`, or None for an op of no class (a dense conv2d, a matmul, elementwise ops)."""
    if op == "mp.conv2d":
        groups = attrs.get("groups", 1)
        if groups == 1:
            return None
        return CONV_DEPTHWISE if ins and ins[0].rank == 4 and ins[0].shape[1] == groups \
            else CONV_GROUPED
    return _CLASS_OF_OP.get(op)

# One step of each fallback chain: format -> (next format, reason). fp8 and int8 fall to bf16,
# which keeps f32's range, before f32. f16 falls straight to f32: bf16 would drop 3 mantissa
# bits the user asked to keep. Every chain ends at f32, which every target must run densely.
FALLBACK: dict[str, tuple[str, str]] = {
    "f8E4M3FN": ("bf16", NO_FP8_KERNEL),
    "f8E5M2": ("bf16", NO_FP8_KERNEL),
    # fp4 (MXFP4, NVFP4) to bf16, not fp8: its sheet's block scales are fp4 scales. fp6
    # exists only as MXFP6.
    "f4E2M1FN": ("bf16", NO_FP4_KERNEL),
    "f6E2M3FN": ("bf16", NO_MX_KERNEL),
    "f6E3M2FN": ("bf16", NO_MX_KERNEL),
    "i8": ("bf16", NO_INT8_KERNEL),
    "f16": ("f32", NO_F16_KERNEL),
    "bf16": ("f32", NO_BF16_KERNEL),
    "tf32": ("f32", NO_TF32_KERNEL),
}
ACCUM_FALLBACK: dict[str, tuple[str, str]] = {"f16": ("f32", NO_F16_ACCUM)}

_BUILTIN_DIR = Path(__file__).parent.parent / "targets"  # package data of mplower


def base_accum(fmt: str) -> str:
    """The accumulator every target offers for `fmt`: exact i32 for integers, else f32."""
    return "i32" if FORMATS[fmt].is_int else "f32"


@dataclass(frozen=True)
class FormatPeak:
    """Peak throughput of one compute format, in FLOP/s (OP/s for integer formats).

    `sparse` is the dense-equivalent rate of the structured-sparse kernel, as NVIDIA quotes
    it ("with sparsity", 2x dense); `csr` is the rate on stored non-zeros.
    """

    dense: float
    sparse: float | None = None
    sparse_pattern: str = "2:4"
    csr: float | None = None
    accum: tuple[str, ...] = ()
    # Block-scale formats its tensor cores apply in the GEMM (mp.scaled_quant's scale_format):
    # f32 scales (per tensor, or per block applied by the kernel's epilogue as DeepGEMM does on
    # Hopper) always; e8m0 (MX) and nvfp4 only where the hardware has them (Blackwell).
    scales: tuple[str, ...] = ("f32",)
    # The fraction of `dense` that a large GEMM sustains (measured: a sheet's figure with its
    # source); the datasheet's peak when absent. Contractions are priced at peak x fraction.
    gemm_fraction: float = 1.0
    # The share of that sustained rate a weight-only GEMM reaches: activations in this format,
    # weights stored as narrower integers (w4a16, w8a16) and dequantized in the kernel's main
    # loop, where the conversion competes with the tensor cores (a runtime's kernel; 1.0 when
    # absent, a mixed-input kernel as fast as the plain one).
    weight_only_fraction: float = 1.0


@dataclass(frozen=True)
class KernelSet:
    """The formats that have a dense, a structured-sparse and a CSR kernel for some ops."""

    dense: frozenset[str]
    sparse: frozenset[str] = frozenset()
    csr: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Legal:
    """What an op runs as on a target; `reasons` lists one code per fallback step taken."""

    compute: str
    accum: str | None
    kernel: str
    reasons: tuple[str, ...] = ()

    @property
    def reason(self) -> str | None:
        """The reason codes joined by "," (one code in the common case), None if as asked."""
        return ",".join(self.reasons) or None

    @property
    def fallback(self) -> bool:
        return bool(self.reasons)


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    bandwidth: float  # bytes/s
    overhead_s: float  # fixed cost of every op (launch, dispatch)
    formats: Mapping[str, FormatPeak]
    ops: Mapping[str, KernelSet]  # ops listed in a [[kernels]] group
    default: KernelSet  # every other op
    source: str  # the sheet's absolute path, or "builtin:NAME"
    fuse: frozenset[str] = frozenset()  # FUSIONS the target's compiler performs
    # GEMM tiling of a GPU (output tile of one thread block, and the SMs that run tiles at
    # once); None on targets without it, whose GEMMs run at full efficiency.
    tile_m: int | None = None
    tile_n: int | None = None
    sm_count: int | None = None
    # Measured rate per kernel class and format (`[rates.CLASS]`), FLOP/s (OP/s) of the op's
    # own count; a class or format without one is priced by its format's peak.
    rates: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def class_rate(self, cls: str | None, fmt: str) -> float | None:
        """The sheet's measured rate of kernel class `cls` in `fmt`, or None."""
        return self.rates.get(cls, {}).get(fmt) if cls is not None else None
    # Board power at full load (the datasheet's TDP, cited in the sheet) for modeled energy:
    # joules per inference = board_power_w x modeled time. None where the sheet gives none.
    board_power_w: float | None = None

    def kernels(self, op: str, fmt: str) -> frozenset[str]:
        """The kernel kinds (`KERNELS`) the target has for `op` computing in `fmt`."""
        ks = self.ops.get(op, self.default)
        found = set()
        if fmt in ks.dense:
            found.add(DENSE)
        if fmt in ks.sparse:
            found.add(STRUCTURED_KERNEL[self.formats[fmt].sparse_pattern])
        if fmt in ks.csr:
            found.add(CSR)
        return frozenset(found)

    def has_kernel(self, op: str, fmt: str, kernel: str = DENSE) -> bool:
        return kernel in self.kernels(op, fmt)

    def accumulators(self, fmt: str) -> tuple[str, ...]:
        peak = self.formats.get(fmt)
        return peak.accum if peak is not None else (base_accum(fmt),)

    def gemm_fraction(self, fmt: str) -> float:
        """The sustained fraction of `fmt`'s peak a large GEMM reaches (1.0 if not given)."""
        p = self.formats.get(fmt)
        return p.gemm_fraction if p is not None else 1.0

    def weight_only_fraction(self, fmt: str) -> float:
        """The share of `fmt`'s sustained GEMM rate a weight-only GEMM reaches (1.0 if not
        given)."""
        p = self.formats.get(fmt)
        return p.weight_only_fraction if p is not None else 1.0

    def peak(self, fmt: str, kernel: str = DENSE) -> float:
        """Peak FLOP/s (OP/s) of `fmt` on `kernel`; ValueError if the target has no such kernel."""
        p = self.formats.get(fmt)
        rate = None
        if p is not None:
            if kernel == DENSE:
                rate = p.dense
            elif kernel == CSR:
                rate = p.csr
            elif kernel == STRUCTURED_KERNEL.get(p.sparse_pattern):
                rate = p.sparse
        if rate is None:
            raise ValueError(f"target '{self.name}' has no {kernel} {fmt} kernel")
        return rate

    def legalize(self, op: str, compute: str, accum: str | None, kernel: str = DENSE,
                 scale_format: str | None = None) -> Legal:
        """The closest (compute, accum, kernel) to the request that the target runs.

        The compute format walks `FALLBACK` until `op` has a dense kernel in it; a narrow
        float whose operands carry `scale_format` block scales the target's kernels for that
        format do not apply (`scales`) falls back to bf16 (`no-mx-kernel`); a sparse
        kernel missing in the resulting format falls back to dense; an integer compute format
        accumulates in i32 and a float one never does; an accumulator the target lacks for
        the format walks `ACCUM_FALLBACK`. `accum` is None for ops that do not accumulate.
        """
        if compute not in COMPUTE_FORMATS:
            raise ValueError(f"'{compute}' is not a compute format")
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel '{kernel}'")
        if accum is not None and accum not in ACCUM_FORMATS:
            raise ValueError(f"'{accum}' is not an accumulator format")
        reasons = []
        while not self.has_kernel(op, compute):
            compute, code = FALLBACK[compute]  # f32 always has a dense kernel (load checks it)
            reasons.append(code)
        if scale_format is not None and FORMATS[compute].is_float and FORMATS[compute].bits <= 8 \
                and scale_format not in self.formats[compute].scales:
            compute = "bf16"
            reasons.append(NO_MX_KERNEL)
            while not self.has_kernel(op, compute):
                compute, code = FALLBACK[compute]
                reasons.append(code)
        if kernel != DENSE and not self.has_kernel(op, compute, kernel):
            kernel = DENSE
            reasons.append(NO_SPARSE_KERNEL)
        if accum is not None:
            if FORMATS[compute].is_int or accum == "i32":
                accum = base_accum(compute)
            while accum not in self.accumulators(compute):
                accum, code = ACCUM_FALLBACK[accum]  # base_accum is always offered
                reasons.append(code)
        return Legal(compute, accum, kernel, tuple(reasons))

    def op_time(self, flops: int, nbytes: int, fmt: str, kernel: str = DENSE) -> float:
        """Roofline time of one op: max(compute time, memory time) + the per-op overhead.

        `flops` is the dense op's count for dense and structured kernels (their peak is
        dense-equivalent) and the count on stored non-zeros for CSR; `nbytes` is what the op
        reads and writes, in the formats and encodings it actually runs with.
        """
        return max(flops / self.peak(fmt, kernel), nbytes / self.bandwidth) + self.overhead_s

    def joules(self, time_s: float) -> float | None:
        """Modeled energy of `time_s` seconds at the board power; None without one."""
        return None if self.board_power_w is None else self.board_power_w * time_s

    def gemm_efficiency(self, m: int, n: int, batch: int = 1, k: int | None = None) -> float:
        """The fraction of peak a GEMM with an (m, n) output (`batch` of them) reaches on
        this target's tiles: tile quantization (the padding of the last tile row and column)
        times wave quantization (the idle SMs of the last wave), NVIDIA's "Matrix
        Multiplication Background User's Guide" (docs/targets.md). With its reduction depth
        `k` (a GEMM against a weight), fewer rows than a tile pad to 8, not to the tile, and a
        GEMM of fewer tiles than SMs is split along K. 1.0 without tiling."""
        if self.tile_m is None or self.tile_n is None or self.sm_count is None:
            return 1.0
        rows, cols = -(-m // self.tile_m), -(-n // self.tile_n)
        if rows == 0 or cols == 0 or batch == 0:
            return 1.0
        tile = (m * n) / (rows * self.tile_m * cols * self.tile_n)
        if k is not None and m < self.tile_m:
            # A skinny GEMM against a weight (a decode step's few rows) swaps its operands, so
            # the rows ride on the MMA's N side, which comes in multiples of 8 (PTX ISA,
            # wgmma.mma_async shapes m64nNk16, N a multiple of 8), not on a 128-row tile.
            tile = m / (-(-m // SKINNY_ROWS) * SKINNY_ROWS) * n / (cols * self.tile_n)
        tiles = batch * rows * cols
        if k is not None and tiles < self.sm_count:
            # Fewer tiles than SMs (a decode step's skinny GEMMs): cuBLAS and CUTLASS split
            # the reduction over the idle SMs (split-K), in slices at least a tile deep.
            tiles *= max(1, min(self.sm_count // tiles, k // self.tile_n))
        wave = tiles / (-(-tiles // self.sm_count) * self.sm_count)
        return tile * wave


SKINNY_ROWS = 8  # the row granularity of a skinny GEMM's swapped operands (gemm_efficiency)


def modeled_inferences_per_s(times: Iterable[float]) -> float:
    """Inferences per second of a function whose ops take `times` seconds, run one by one."""
    total = sum(times)
    return 1.0 / total if total > 0 else math.inf


def builtin_targets() -> list[str]:
    return _builtin_names(_BUILTIN_DIR)


def load_target(spec: str, *, module: Module | None = None,
                known_ops: Collection[str] | None = None) -> Target:
    """Load a built-in target by name or a target sheet by path (see docs/targets.md).

    `module`: the spec is that module's `mp.target`, so a path is relative to its IR file's
    folder and may not leave it; without it the spec was named by the user, relative to the
    current folder. `known_ops`, when given, is checked against every op name in the sheet.
    Every problem is a DiagnosticError located in the sheet.
    """
    path, source = locate(spec, "target", _BUILTIN_DIR, module,
                          "pass --target to use it deliberately")
    return _parse(Sheet.read(path), path.stem, source, known_ops)


def parse_target(text: str, path: str, known_ops: Collection[str] | None = None) -> Target:
    """The target sheet `text` (one being written, e.g. a measured one), named `path` in
    diagnostics, checked exactly as `load_target` checks a file."""
    return _parse(Sheet.parse(text, path), Path(path).stem, path, known_ops)


def module_target(module: Module, named: str | None,
                  known_ops: Collection[str] | None = None) -> Target:
    """The target to price `module` on: `named` on the command line, else the module's
    `mp.target` (recorded by legalize / lower-sparse), else generic."""
    if named is not None:
        return load_target(named, known_ops=known_ops)
    recorded = module.attrs.get(TARGET)
    if recorded is None:
        return load_target("generic", known_ops=known_ops)
    if not isinstance(recorded, str):
        raise DiagnosticError.at(module.attr_loc(TARGET),
                                 "module attribute mp.target must be a string")
    return load_target(recorded, module=module, known_ops=known_ops)


_TOP_KEYS = ("target", "formats", "kernels", "default", "rates")
_TARGET_KEYS = ("name", "description", "bandwidth", "overhead_s", "fuse", "tile_m", "tile_n",
                "sm_count", "board_power_w")
_TILING_KEYS = ("tile_m", "tile_n", "sm_count")
# Sane figures for a machine (docs/targets.md): today's fastest parts are near 1e16 FLOP/s and
# 1e13 bytes/s, so these leave room for decades and keep every modeled time finite and
# non-zero; below 1 FLOP/s or 1 byte/s is a typo for a unit.
PEAK_BOUNDS = Bounds(1, 1e21, " FLOP/s")
BANDWIDTH_BOUNDS = Bounds(1, 1e18, " bytes/s")
OVERHEAD_BOUNDS = Bounds(0, 1, " s")
TILING_BOUNDS = Bounds(1, 1e6, "")  # tile edges and SM counts: positive, far below a million
POWER_BOUNDS = Bounds(1e-3, 1e6, " W")  # from a microcontroller to a rack
_PEAK_KEYS = ("dense", "sparse", "sparse_pattern", "csr", "accum", "scales", "gemm_fraction",
               "weight_only_fraction")
FRACTION_BOUNDS = Bounds(0.01, 1, "")
_KERNEL_KEYS = ("dense", "sparse", "csr")


def _parse(sheet: Sheet, stem: str, source: str, known_ops: Collection[str] | None) -> Target:
    data = sheet.data
    sheet.check_keys(data, (), _TOP_KEYS)
    head = sheet.table(data, ("target",), required=True)
    sheet.check_keys(head, ("target",), _TARGET_KEYS)
    formats = {fmt: _format_peak(sheet, entry, ("formats", fmt))
               for fmt, entry in sheet.table(data, ("formats",), required=True).items()}

    ops: dict[str, KernelSet] = {}
    for i, group in enumerate(sheet.tables(data, ("kernels",))):
        kp: KeyPath = ("kernels", i)
        sheet.check_keys(group, kp, ("ops", *_KERNEL_KEYS))
        names = sheet.strings(group, (*kp, "ops"))
        if not names:
            raise sheet.error(kp, "a [[kernels]] group needs a non-empty 'ops' list")
        kernels = _kernel_set(sheet, group, kp, formats)
        for op in names:
            if known_ops is not None:
                sheet.choice(op, (*kp, "ops"), known_ops, "op")
            if op in ops:
                raise sheet.error((*kp, "ops"), f"op '{op}' is in two [[kernels]] groups",
                                  value=op)
            ops[op] = kernels
    default = sheet.table(data, ("default",), required=True)
    sheet.check_keys(default, ("default",), _KERNEL_KEYS)
    fuse = sheet.strings(head, ("target", "fuse"))
    for rule in fuse:
        sheet.choice(rule, ("target", "fuse"), FUSIONS, "fusion")
    tiling = {k: _integer(sheet, head, ("target", k)) for k in _TILING_KEYS}
    given = [k for k in _TILING_KEYS if tiling[k] is not None]
    if given and len(given) != len(_TILING_KEYS):
        raise sheet.error(("target", given[0]), "'tile_m', 'tile_n' and 'sm_count' go together")

    return Target(
        name=sheet.string(head, ("target", "name"), stem),
        description=sheet.string(head, ("target", "description"), ""),
        bandwidth=sheet.number(head, ("target", "bandwidth"), BANDWIDTH_BOUNDS, required=True),
        overhead_s=sheet.number(head, ("target", "overhead_s"), OVERHEAD_BOUNDS, 0.0),
        formats=formats,
        ops=ops,
        default=_kernel_set(sheet, default, ("default",), formats),
        source=source,
        fuse=frozenset(fuse),
        **tiling,
        rates=_rates(sheet, sheet.table(data, ("rates",))),
        board_power_w=sheet.number(head, ("target", "board_power_w"), POWER_BOUNDS),
    )


def _rates(sheet: Sheet, table: dict[str, Any]) -> dict[str, dict[str, float]]:
    rates: dict[str, dict[str, float]] = {}
    for cls, entry in table.items():
        kp: KeyPath = ("rates", cls)
        if cls not in KERNEL_CLASSES:
            raise sheet.error(kp, f"unknown kernel class '{cls}'"
                              f"{did_you_mean(cls, KERNEL_CLASSES)}")
        if not isinstance(entry, dict):
            raise sheet.error(kp, f"'rates.{cls}' must be a table")
        for fmt in entry:
            if (problem := format_problem(fmt, COMPUTE_FORMATS, "compute")) is not None:
                raise sheet.error((*kp, fmt), problem)
        rates[cls] = {fmt: sheet.number(entry, (*kp, fmt), PEAK_BOUNDS, required=True)
                      for fmt in entry}
    return rates


def _integer(sheet: Sheet, table: dict[str, Any], kp: KeyPath) -> int | None:
    value = sheet.number(table, kp, TILING_BOUNDS)
    if value is None:
        return None
    if not value.is_integer():
        raise sheet.error(kp, f"'{'.'.join(map(str, kp))}' must be an integer")
    return int(value)


def _format_peak(sheet: Sheet, entry: Any, kp: KeyPath) -> FormatPeak:
    fmt = str(kp[-1])
    if (problem := format_problem(fmt, COMPUTE_FORMATS, "compute")) is not None:
        raise sheet.error(kp, problem)
    if not isinstance(entry, dict):
        raise sheet.error(kp, f"'formats.{fmt}' must be a table")
    sheet.check_keys(entry, kp, _PEAK_KEYS)
    sparse = sheet.number(entry, (*kp, "sparse"), PEAK_BOUNDS)
    pattern = sheet.string(entry, (*kp, "sparse_pattern"), "2:4")
    sheet.choice(pattern, (*kp, "sparse_pattern"), STRUCTURED_KERNEL, "sparse pattern")
    if "sparse_pattern" in entry and sparse is None:
        raise sheet.error((*kp, "sparse_pattern"), "'sparse_pattern' needs a 'sparse' peak")
    base = base_accum(fmt)
    accum = sheet.strings(entry, (*kp, "accum")) or (base,)
    for acc in accum:
        sheet.format(acc, (*kp, "accum"), ACCUM_FORMATS, "accumulator")
        if FORMATS[acc].is_int != FORMATS[fmt].is_int:
            raise sheet.error((*kp, "accum"), f"{fmt} cannot accumulate in {acc}", value=acc)
    if base not in accum:
        raise sheet.error((*kp, "accum"), f"the accumulators of {fmt} must include {base}")
    scales = sheet.strings(entry, (*kp, "scales")) or ("f32",)
    for sf in scales:
        sheet.choice(sf, (*kp, "scales"), SCALE_FORMATS, "scale format")
    return FormatPeak(
        dense=sheet.number(entry, (*kp, "dense"), PEAK_BOUNDS, required=True),
        sparse=sparse,
        sparse_pattern=pattern,
        csr=sheet.number(entry, (*kp, "csr"), PEAK_BOUNDS),
        accum=accum,
        scales=scales,
        gemm_fraction=sheet.number(entry, (*kp, "gemm_fraction"), FRACTION_BOUNDS) or 1.0,
        weight_only_fraction=sheet.number(entry, (*kp, "weight_only_fraction"),
                                          FRACTION_BOUNDS) or 1.0,
    )


def _kernel_set(sheet: Sheet, table: dict[str, Any], kp: KeyPath,
                formats: Mapping[str, FormatPeak]) -> KernelSet:
    sets: dict[str, frozenset[str]] = {}
    for kind in _KERNEL_KEYS:
        fmts = sheet.strings(table, (*kp, kind))
        for fmt in fmts:
            sheet.format(fmt, (*kp, kind), COMPUTE_FORMATS, "compute")
            peak = formats.get(fmt)
            if peak is None:
                raise sheet.error((*kp, kind), f"format '{fmt}' has no [formats.{fmt}] table",
                                  value=fmt)
            if (kind == "sparse" and peak.sparse is None) or (kind == "csr" and peak.csr is None):
                raise sheet.error((*kp, kind), f"[formats.{fmt}] has no '{kind}' peak", value=fmt)
            if kind != "dense" and fmt not in sets["dense"]:
                raise sheet.error((*kp, kind), f"a {kind} {fmt} kernel needs a dense {fmt} "
                                  "kernel to fall back to", value=fmt)
        sets[kind] = frozenset(fmts)
    if "f32" not in sets["dense"]:
        raise sheet.error((*kp, "dense"), "every op needs a dense f32 kernel: it ends every "
                          "fallback chain")
    return KernelSet(**sets)
