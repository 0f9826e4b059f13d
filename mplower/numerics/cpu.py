"""The CPU that numba compiles mplower's kernels for, and which instructions it has.

numba compiles for this machine unless NUMBA_CPU_NAME names another CPU (`generic` for a cache
that any x86-64 can load), with NUMBA_CPU_FEATURES's features where that is set (numba sets it
to "" for `generic`: the named CPU's own features) and this machine's otherwise. The kernels
written as LLVM IR by hand (gemm_kernel's micro-kernel and its epilogue) pick their instructions for
that target, never for the host: an operation the target has no instruction for becomes a
call into a compiler runtime library, and numba's JIT does not link the ones that float16
conversions need (`__truncsfhf2`, `__extendhfsf2`), which left every relocation of the
compiled conv kernel unapplied: under NUMBA_CPU_NAME=generic (no F16C) its first call jumped
to address 0. Each question below is answered by LLVM itself, from the assembly of a probe
function compiled for the target machine numba uses, so a CPU name implies what LLVM says it
implies (x86-64-v2 has SSE4.1's rounding but no F16C; AArch64 has both) and nothing is
assumed from the host. The answers choose between a fast path and a portable one that
computes the same bits (gemm_kernel.py), never between results.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from llvmlite import binding, ir


@dataclass(frozen=True)
class Target:
    """What the kernels' hand-written IR may use on one compile target. `half`: float32 <->
    float16 conversions compile to instructions (F16C, AArch64), not to runtime calls.
    `rint`: llvm.rint on float32 vectors does (SSE4.1, AArch64), not a libm call per lane.
    `wide`: 64-byte vectors are native (AVX-512), where a load folds into an arithmetic
    instruction as an embedded broadcast."""

    half: bool
    rint: bool
    wide: bool


def jit_disabled() -> bool:
    """Whether numba runs njit functions as Python (NUMBA_DISABLE_JIT): mplower's kernels
    cannot run then, their LLVM IR intrinsics having no Python form."""
    from numba.core import config

    return bool(config.DISABLE_JIT)


def numba_target() -> tuple[str, str, str]:
    """(triple, CPU name, feature string) of the code numba compiles now, by numba's own rule
    (numba.core.codegen.JITCPUCodegen)."""
    from numba.core import codegen, config

    name = config.CPU_NAME or "host"
    if name == "host":
        name = binding.get_host_cpu_name()
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None \
        else codegen.get_host_cpu_features()
    return binding.get_process_triple(), name, features


def compile_target() -> Target:
    """The kernels' Target for the CPU numba compiles for now (`numba_target`)."""
    return probe(*numba_target())


@functools.cache
def probe(triple: str, cpu: str, features: str) -> Target:
    """The Target of LLVM's target machine for `triple`, `cpu` and `features`: each answer
    read from the assembly of a small function compiled for it."""
    from numba.core import codegen

    codegen.initialize_llvm()
    binding.initialize_all_targets()
    binding.initialize_all_asmprinters()
    machine = binding.Target.from_triple(triple).create_target_machine(
        cpu=cpu, features=features, opt=2, reloc="static", codemodel="jitdefault")

    def assembly(step) -> str:
        module = ir.Module()
        module.triple = triple
        vty = ir.VectorType(ir.FloatType(), 16)
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [vty.as_pointer()]), "probe")
        builder = ir.IRBuilder(fn.append_basic_block())
        value = builder.load(fn.args[0], align=4)
        builder.store(step(builder, value), fn.args[0], align=4)
        builder.ret_void()
        return machine.emit_assembly(binding.parse_assembly(str(module)))

    def calls_out(asm: str) -> bool:
        # The probe is a leaf: any call in it is a runtime or libm call (x86 call/callq,
        # AArch64 bl/blr).
        ops = (line.split()[0] for line in asm.splitlines()
               if line.startswith("\t") and line.strip() and not line.strip().startswith("."))
        return any(op.startswith("call") or op in ("bl", "blr") for op in ops)

    def half(builder, value):
        return builder.fpext(builder.fptrunc(value, ir.VectorType(ir.HalfType(), 16)),
                             value.type)

    def rint(builder, value):
        fn = builder.module.declare_intrinsic("llvm.rint.v16f32",
                                              fnty=ir.FunctionType(value.type, [value.type]))
        return builder.call(fn, [value])

    return Target(half=not calls_out(assembly(half)), rint=not calls_out(assembly(rint)),
                  wide="zmm" in assembly(lambda builder, value: builder.fadd(value, value)))
