"""The register tile of mplower's float matrix product: the micro-kernel and its epilogues.

Each tile of TILE_ROWS rows by one panel of b (TILE_ROWS x _VECTORS vectors of 64 bytes)
keeps its accumulators in vector registers over K or a slice of it (`_micro`, LLVM vector IR
without fast-math flags, so that LLVM may neither contract nor reorder: a rounded product then
a rounded sum per step, k = 0 .. K-1 in order, each SIMD lane one output column). The GEMM
driver (mplower.numerics.gemm) and the implicit-GEMM convolution (mplower.numerics.conv_gemm)
both sum through these kernels, so every output element is the same function of its own row
and column in either. `_stored_kernel` is the variant that starts from +0 and applies the
epilogue (scale, bias, relu; bf16 or f16 rounding, amax, 8-bit quantization) to the registers
as it stores them. Which instructions the hand-written IR uses is chosen for the CPU numba
compiles for (mplower.numerics.cpu), never between results.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mplower.numerics import jitcache  # noqa: F401  (before the first jitted function)
from mplower.numerics.cpu import compile_target

# The register tile: TILE_ROWS output rows x _VECTORS vectors of 64 bytes (16 float32 or 8
# float64 columns), 16 accumulators that stay in registers over the whole of K. The sizes change
# the speed only, never a result.
TILE_ROWS, _VECTORS, _VECTOR_BYTES = 8, 2, 64


def _micro_kernel(rows: int):
    """An intrinsic `micro(a, a_offset, lda, panel, panel_offset, ldp, tile, tile_offset, ldt,
    depth, zero)` for `rows` output rows: t[r, :] += a[a_offset + r * lda + k] * panel[
    panel_offset + k * ldp + :] for k = 0 .. depth-1 in that order, over a (rows, cols) tile
    held in registers, where t[r, :] is tile[tile_offset + r * ldt:][:cols], starting from +0
    instead of t's contents when `zero` is non-zero (so t may be the result itself).

    Written as LLVM vector IR because numba's loops cannot keep an accumulator tile in
    registers: each lane is one output column, and each step is an `fmul` then an `fadd`
    without fast-math flags, so LLVM may neither fuse (FMA) nor reorder them."""

    @intrinsic
    def micro(typingctx, a, a_offset, lda, panel, panel_offset, ldp, tile, tile_offset, ldt,
              depth, zero):
        sig = types.void(a, a_offset, lda, panel, panel_offset, ldp, tile, tile_offset, ldt,
                         depth, zero)
        width = 8 if a.dtype == types.float64 else 4
        fty = ir.DoubleType() if width == 8 else ir.FloatType()
        lanes = _VECTOR_BYTES // width
        return sig, _codegen(rows, lanes, ir.VectorType(fty, lanes))
    return micro


def _codegen(rows: int, lanes: int, vty: ir.VectorType, fused: bool = False):
    i64 = ir.IntType(64)

    def codegen(context, builder, signature, args):
        if fused:  # operands by address (`address`), the first argument their dtype
            (_, av, a_off, lda_v, pv, p_off, ldp, tv, t_off, ldt, kk, sv, hv, e_off, relu,
             width, post, qv, qpv) = args
            zero = ir.Constant(i64, 1)
            a_ptr, p_ptr, t_ptr = (builder.gep(builder.inttoptr(at, vty.element.as_pointer()),
                                               [offset])
                                   for at, offset in ((av, a_off), (pv, p_off), (tv, t_off)))
        else:
            av, a_off, lda_v, pv, p_off, ldp, tv, t_off, ldt, kk, zero = args
            a_ptr, p_ptr, t_ptr = (
                builder.gep(context.make_array(signature.args[i])(context, builder, v).data,
                            [offset])
                for i, v, offset in ((0, av, a_off), (3, pv, p_off), (6, tv, t_off)))

        def vector_at(base, offset):
            return builder.bitcast(builder.gep(base, [offset]), vty.as_pointer())

        def const(v):
            return ir.Constant(i64, v)

        slots = [(r, v) for r in range(rows) for v in range(_VECTORS)]

        def at(r, v):
            return builder.add(builder.mul(const(r), ldt), const(v * lanes))

        # Read the tile only when not starting from zero: a load of the (cold) result that a
        # select then discards still stalls every accumulator on a cache miss.
        start_at_zero = builder.icmp_signed("!=", zero, const(0))
        from_memory = builder.append_basic_block("gemm_load")
        ready = builder.append_basic_block("gemm_init")
        zero_block = builder.block
        builder.cbranch(start_at_zero, ready, from_memory)
        builder.position_at_end(from_memory)
        loaded = {rv: builder.load(vector_at(t_ptr, at(*rv)), align=4) for rv in slots}
        builder.branch(ready)
        builder.position_at_end(ready)
        init = {}
        for rv in slots:
            init[rv] = builder.phi(vty)
            init[rv].add_incoming(ir.Constant(vty, None), zero_block)
            init[rv].add_incoming(loaded[rv], from_memory)
        if fused:
            # The same rows of the next panel: the tile's next neighbour to the right, which
            # the hardware prefetchers miss among M (row) streams; stores to lines not in the
            # cache would otherwise wait on memory for every tile.
            for r, v in slots:
                _prefetch(builder, vector_at(t_ptr, builder.add(at(r, v),
                                                                const(_VECTORS * lanes))),
                          write=True)
        # Where the compile target has AVX-512 (cpu.Target.wide), vector v > 0 reads its
        # row's value from a copy of a's address that LLVM cannot see through (an empty
        # asm), so that each load has one use and folds into the fmul as an embedded
        # broadcast instead of a broadcast instruction per row and k, which took FP-pipe
        # time on this Zen 4 VM: 8 vbroadcastss, 16 vmulps and 16 vaddps ran in 19.2-19.9 TSC
        # cycles, with the broadcasts embedded 13.9-14.9, as 16 FMAs (13.3). Elsewhere (AVX2
        # has no embedded broadcast) each row is loaded once. The arithmetic, and so every
        # bit, is the same either way.
        a_alt = a_ptr
        if compile_target().wide:
            a_alt = builder.inttoptr(builder.asm(ir.FunctionType(i64, [i64]), "", "=r,0",
                                                 [builder.ptrtoint(a_ptr, i64)], False),
                                     a_ptr.type)
        entry = builder.block
        loop = builder.append_basic_block("gemm_k")
        done = builder.append_basic_block("gemm_done")
        builder.cbranch(builder.icmp_signed(">", kk, const(0)), loop, done)
        builder.position_at_end(loop)
        k = builder.phi(i64)
        acc = {rv: builder.phi(vty) for rv in slots}
        row = builder.mul(k, ldp)
        b = [builder.load(vector_at(p_ptr, builder.add(row, const(v * lanes))), align=4)
             for v in range(_VECTORS)]
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
        new = {}
        for r in range(rows):
            at_k = builder.add(builder.mul(const(r), lda_v), k)
            for v in range(_VECTORS):
                x = builder.load(builder.gep(a_alt if v else a_ptr, [at_k]))
                x = builder.insert_element(ir.Constant(vty, ir.Undefined), x,
                                           ir.Constant(ir.IntType(32), 0))
                x = builder.shuffle_vector(x, ir.Constant(vty, ir.Undefined), zeros)
                new[r, v] = builder.fadd(acc[r, v], builder.fmul(x, b[v]))
        k_next = builder.add(k, const(1))
        k.add_incoming(const(0), entry)
        k.add_incoming(k_next, loop)
        for rv in slots:
            acc[rv].add_incoming(init[rv], entry)
            acc[rv].add_incoming(new[rv], loop)
        builder.cbranch(builder.icmp_signed("<", k_next, kk), loop, done)
        builder.position_at_end(done)
        final = {}
        for rv in slots:
            final[rv] = builder.phi(vty)
            final[rv].add_incoming(init[rv], entry)
            final[rv].add_incoming(new[rv], loop)
        largest = ir.Constant(ir.IntType(32), 0)
        if fused:
            final = _fused_epilogue(builder, final, rows, vty, (sv, hv, e_off, relu))
            stored = builder.append_basic_block("gemm_stored")
            if isinstance(vty.element, ir.FloatType):
                final, largest = _post_epilogue(builder, final, lanes, post, width)
                # Bit 3 of `post`: the tile quantized to 8-bit integers, stored at q instead.
                quantized = builder.append_basic_block("gemm_quantized")
                floats = builder.append_basic_block("gemm_floats")
                builder.cbranch(builder.icmp_signed("!=", builder.and_(post, const(8)),
                                                    const(0)), quantized, floats)
                builder.position_at_end(quantized)
                _store_quantized(builder, final, lanes, width, qv, qpv, t_off, at)
                builder.branch(stored)
                builder.position_at_end(floats)
            # The columns below `width` only: a partial panel (the last of the pixels) stores
            # through a lane mask, so that it too takes this path.
            partial = builder.append_basic_block("gemm_partial")
            whole = builder.append_basic_block("gemm_whole")
            builder.cbranch(builder.icmp_signed("<", width, const(_VECTORS * lanes)), partial,
                            whole)
            builder.position_at_end(partial)
            i1v = ir.VectorType(ir.IntType(1), lanes)
            mask_store = builder.module.declare_intrinsic(
                f"llvm.masked.store.v{lanes}{'f64' if lanes == 8 else 'f32'}.p0",
                fnty=ir.FunctionType(ir.VoidType(), [vty, vty.as_pointer(), ir.IntType(32),
                                                     i1v]))
            limit = _broadcast(builder, width, lanes)
            for (r, v), value in final.items():
                lane = ir.Constant(ir.VectorType(i64, lanes), [v * lanes + j for j in range(lanes)])
                builder.call(mask_store, [value, vector_at(t_ptr, at(r, v)),
                                          ir.Constant(ir.IntType(32), 4),
                                          builder.icmp_signed("<", lane, limit)])
            builder.branch(stored)
            builder.position_at_end(whole)
        for (r, v), value in final.items():
            builder.store(value, vector_at(t_ptr, at(r, v)), align=4)
        if fused:
            builder.branch(stored)
            builder.position_at_end(stored)
            return largest
        return context.get_dummy_value()
    return codegen


def _broadcast(builder, value, lanes):
    """A vector of `lanes` copies of the scalar `value`."""
    vty = ir.VectorType(value.type, lanes)
    return builder.shuffle_vector(
        builder.insert_element(ir.Constant(vty, ir.Undefined), value,
                               ir.Constant(ir.IntType(32), 0)),
        ir.Constant(vty, ir.Undefined),
        ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def _post_epilogue(builder, final, lanes, post, width):
    """What a float32 tile's outputs get after `_fused_epilogue`, in registers: if bit 0 of
    `post` is set, bf16's rounding (rounding.rounded_bits' non-saturating bf16 path: nearest
    even on the bit pattern, a NaN made bf16's quiet NaN with its sign); if bit 2 is set,
    non-saturating f16's (`_half_round_trip`); if bit 1 is set, the largest magnitude as a
    bit pattern (sign cleared, compared unsigned, as rounding.amax takes it) of the outputs
    in the first `width` columns, after the rounding, returned as an i32 (0 if the bit is
    clear). Each is decided once per tile
    by a branch (`_when`), so a tile without them runs the same instructions as before."""
    i32 = ir.IntType(32)
    uty = ir.VectorType(i32, lanes)
    vty = next(iter(final.values())).type

    def splat(v):
        return ir.Constant(uty, [v] * lanes)

    def flagged(bit):
        return builder.icmp_signed("!=", builder.and_(post, ir.Constant(post.type, bit)),
                                   ir.Constant(post.type, 0))

    def bf16(values):
        rounded = {}
        for rv, value in values.items():
            u = builder.bitcast(value, uty)
            magnitude = builder.and_(u, splat(0x7FFFFFFF))
            odd = builder.and_(builder.lshr(u, splat(16)), splat(1))
            near = builder.and_(builder.add(builder.add(u, splat(0x7FFF)), odd),
                                splat(0xFFFF0000))
            nan = builder.or_(builder.and_(u, splat(0x80000000)), splat(0x7FC00000))
            r = builder.select(builder.icmp_unsigned(">", magnitude, splat(0x7F800000)), nan,
                               near)
            rounded[rv] = builder.bitcast(r, vty)
        return rounded

    def f16(values):
        native = compile_target().half
        return {rv: _half_round_trip(builder, value, native) for rv, value in values.items()}

    def measure(_):
        limit = _broadcast(builder, width, lanes)
        umax = builder.module.declare_intrinsic(
            f"llvm.umax.v{lanes}i32", fnty=ir.FunctionType(uty, [uty, uty]))
        most = splat(0)
        for (r, v), value in out.items():
            lane = ir.Constant(ir.VectorType(width.type, lanes),
                               [v * lanes + j for j in range(lanes)])
            bits = builder.and_(builder.bitcast(value, uty), splat(0x7FFFFFFF))
            bits = builder.select(builder.icmp_signed("<", lane, limit), bits, splat(0))
            most = builder.call(umax, [most, bits])
        reduce = builder.module.declare_intrinsic(
            f"llvm.vector.reduce.umax.v{lanes}i32", fnty=ir.FunctionType(i32, [uty]))
        return {"largest": builder.call(reduce, [most])}

    out = _when(builder, flagged(1), final, bf16, "post_bf16")
    out = _when(builder, flagged(4), out, f16, "post_f16")
    largest = _when(builder, flagged(2), {"largest": ir.Constant(i32, 0)}, measure,
                    "post_measure")["largest"]
    return out, largest


def _half_round_trip(builder, value, native: bool):
    """A float32 vector rounded to float16 and back: IEEE nearest-even with subnormals and
    inf on overflow; a NaN keeps its sign and top ten payload bits, made quiet. A NaN here
    is quiet, made by the epilogue's arithmetic, and so keeps what numpy's float16 cast and
    rounding._round_one keep; only a signalling NaN, which never gets here, would differ.

    `native`: the CPU's conversion there and back (F16C's vcvtps2ph and vcvtph2ps, AArch64's
    fcvtn and fcvtl). Otherwise the same bits from float32 operations alone (a target
    without the conversion would call a runtime function numba does not link, cpu.py): in
    float16's normal range, nearest-even on the bit pattern (13 bits dropped; a carry past
    65504 reaches 0x47800000, inf's place); below 2^-14, |x| + 0.5 - 0.5, whose ulp at 0.5 is
    float16's smallest subnormal 2^-24, so that the add rounds once, to nearest even, and the
    subtraction is exact (rounding._round_one's subnormal step). Checked against the native
    path and numpy by tests/test_cpu_targets.py."""
    lanes = value.type.count
    if native:
        return builder.fpext(builder.fptrunc(value, ir.VectorType(ir.HalfType(), lanes)),
                             value.type)
    uty = ir.VectorType(ir.IntType(32), lanes)

    def splat(v):
        return ir.Constant(uty, [v] * lanes)

    u = builder.bitcast(value, uty)
    magnitude = builder.and_(u, splat(0x7FFFFFFF))
    odd = builder.and_(builder.lshr(magnitude, splat(13)), splat(1))
    normal = builder.and_(builder.add(builder.add(magnitude, splat(0xFFF)), odd),
                          splat(0xFFFFE000))
    normal = builder.select(builder.icmp_unsigned(">=", normal, splat(0x47800000)),
                            splat(0x7F800000), normal)
    point_five = ir.Constant(value.type, [0.5] * lanes)
    tiny = builder.fsub(builder.fadd(builder.bitcast(magnitude, value.type), point_five),
                        point_five)
    rounded = builder.select(builder.icmp_unsigned("<", magnitude, splat(0x38800000)),
                             builder.bitcast(tiny, uty), normal)
    rounded = builder.or_(rounded, builder.and_(u, splat(0x80000000)))
    nan = builder.or_(builder.and_(u, splat(0xFFFFE000)), splat(0x00400000))
    return builder.bitcast(builder.select(builder.icmp_unsigned(">", magnitude,
                                                                splat(0x7F800000)),
                                          nan, rounded), value.type)


def _rint(builder, value, native: bool):
    """A float32 vector rounded to integers, nearest even (llvm.rint in the default rounding
    mode). `native`: the instruction (SSE4.1's roundps, AArch64's frintx); otherwise, where
    LLVM would call libm's rintf once per lane (cpu.py), (|x| + 2^23) - 2^23 with x's sign,
    exact below 2^23, where every float32 at or beyond it (and inf, NaN) is its own rint."""
    lanes = value.type.count
    if native:
        fn = builder.module.declare_intrinsic(f"llvm.rint.v{lanes}f32",
                                              fnty=ir.FunctionType(value.type, [value.type]))
        return builder.call(fn, [value])
    uty = ir.VectorType(ir.IntType(32), lanes)
    u = builder.bitcast(value, uty)
    magnitude = builder.bitcast(builder.and_(u, ir.Constant(uty, [0x7FFFFFFF] * lanes)),
                                value.type)
    shift = ir.Constant(value.type, [float(1 << 23)] * lanes)
    whole = builder.bitcast(builder.fsub(builder.fadd(magnitude, shift), shift), uty)
    whole = builder.bitcast(builder.or_(whole, builder.and_(u, ir.Constant(
        uty, [0x80000000] * lanes))), value.type)
    return builder.select(builder.fcmp_ordered("<", magnitude, shift), whole, value)


def _store_quantized(builder, final, lanes, width, q_addr, qp_addr, offset, at):
    """A float32 tile's outputs (after the epilogue) quantized as quant._quantize_one does,
    each lane in float32: rint(y / scale) (nearest even) + zero point, clamped to [lowest,
    highest], a NaN made the zero point, then converted to an integer whose low 8 bits are
    stored in the first `width` columns of the uint8 array at q_addr, from element `offset`
    on at the tile's element offsets (`at`); qp_addr holds (scale, zero point, lowest,
    highest) as float32. The integer quantize's bits, without the float32 result."""
    f32, i8, i32 = ir.FloatType(), ir.IntType(8), ir.IntType(32)
    qp = builder.inttoptr(qp_addr, f32.as_pointer())
    scale, zero, lowest, highest = (
        _broadcast(builder, builder.load(builder.gep(qp, [ir.Constant(ir.IntType(64), i)])),
                   lanes) for i in range(4))
    base = builder.gep(builder.inttoptr(q_addr, i8.as_pointer()), [offset])
    module = builder.module
    native_rint = compile_target().rint
    bty, mty = ir.VectorType(i8, lanes), ir.VectorType(ir.IntType(1), lanes)
    store = module.declare_intrinsic(
        f"llvm.masked.store.v{lanes}i8.p0",
        fnty=ir.FunctionType(ir.VoidType(), [bty, bty.as_pointer(), i32, mty]))
    limit = _broadcast(builder, width, lanes)
    for (r, v), y in final.items():
        q = builder.fadd(_rint(builder, builder.fdiv(y, scale), native_rint), zero)
        nan = builder.fcmp_unordered("uno", q, q)
        q = builder.select(builder.fcmp_ordered(">", q, highest), highest, q)
        q = builder.select(builder.fcmp_ordered("<", q, lowest), lowest, q)
        q = builder.select(nan, zero, q)
        values = builder.trunc(builder.fptosi(q, ir.VectorType(i32, lanes)), bty)
        lane = ir.Constant(ir.VectorType(width.type, lanes), [v * lanes + j for j in range(lanes)])
        pointer = builder.bitcast(builder.gep(base, [at(r, v)]), bty.as_pointer())
        builder.call(store, [values, pointer, ir.Constant(i32, 1),
                             builder.icmp_signed("<", lane, limit)])


def _when(builder, flag, values, transform, name):
    """`values` (IR values by key) where `flag` is false, transform(values) where it is true:
    one branch, then a phi per value."""
    start = builder.block
    then = builder.append_basic_block(name)
    done = builder.append_basic_block(name + "_done")
    builder.cbranch(flag, then, done)
    builder.position_at_end(then)
    changed = transform(values)
    then_end = builder.block
    builder.branch(done)
    builder.position_at_end(done)
    merged = {}
    for key, value in values.items():
        merged[key] = builder.phi(value.type)
        merged[key].add_incoming(value, start)
        merged[key].add_incoming(changed[key], then_end)
    return merged


def _prefetch(builder, pointer, write: bool) -> None:
    """A hint that the cache line at `pointer` is about to be read or written."""
    i32 = ir.IntType(32)
    pointer = builder.bitcast(pointer, ir.IntType(8).as_pointer())
    fn = builder.module.declare_intrinsic(
        "llvm.prefetch.p0", fnty=ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]))
    builder.call(fn, [pointer, ir.Constant(i32, int(write)), ir.Constant(i32, 3),
                      ir.Constant(i32, 1)])


@intrinsic
def address(typingctx, array):
    """The address of array's data, an integer: what the per-tile kernels (`_stored_kernel`)
    take instead of arrays. An array handed to an inlined function is a new reference, an
    atomic increment and decrement of its count on every call: per tile, on counts that every
    thread of a conv updates, they took 45% of a 16 -> 64-channel 1x1 conv's time (perf,
    one thread). The arrays stay alive in the caller, which holds them."""
    sig = types.int64(array)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))
    return sig, codegen


@intrinsic
def prefetch_read(typingctx, array, index):
    """A hint that array.flat[index] is about to be read (nothing if it lies outside)."""
    sig = types.void(array, index)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        _prefetch(builder, builder.gep(data, [args[1]]), write=False)
        return context.get_dummy_value()
    return sig, codegen


def _fused_epilogue(builder, final, rows, vty, args):
    """`_store`'s epilogue on the accumulators before they are stored: y = acc * s + h, then
    relu (+0 where y <= 0, NaN kept), with s and h of row r at s[e_off + r] and h[e_off + r] in
    the tile's type. An absent scale is s = 1 and an absent bias h = -0.0, which give every
    sum back unchanged (sums are never signalling NaNs), so one code path serves all."""
    sv, hv, e_off, relu = args
    s_ptr, h_ptr = (builder.inttoptr(v, vty.element.as_pointer()) for v in (sv, hv))
    lanes = vty.count
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    # relu as a vector of flags, all lanes equal: +0 where it is set and y <= 0 (ordered: NaN
    # stays).
    clamp = builder.icmp_signed("!=", relu, ir.Constant(relu.type, 0))
    clamp = builder.shuffle_vector(
        builder.insert_element(ir.Constant(ir.VectorType(ir.IntType(1), lanes), None), clamp,
                               ir.Constant(ir.IntType(32), 0)),
        ir.Constant(ir.VectorType(ir.IntType(1), lanes), None), zeros)
    out = {}
    for r in range(rows):
        s, h = (builder.shuffle_vector(
            builder.insert_element(
                ir.Constant(vty, ir.Undefined),
                builder.load(builder.gep(ptr, [builder.add(e_off, ir.Constant(e_off.type, r))])),
                ir.Constant(ir.IntType(32), 0)),
            ir.Constant(vty, ir.Undefined), zeros) for ptr in (s_ptr, h_ptr))
        for v in range(_VECTORS):
            y = builder.fadd(builder.fmul(final[r, v], s), h)
            low = builder.and_(builder.fcmp_ordered("<=", y, ir.Constant(vty, None)), clamp)
            out[r, v] = builder.select(low, ir.Constant(vty, None), y)
    return out


_micro = _micro_kernel(TILE_ROWS)
_micro_row = _micro_kernel(1)  # the rows past the last full tile, one at a time


def _stored_kernel(rows: int):
    """An intrinsic `stored(dtype, a, a_offset, lda, panel, panel_offset, ldp, c, c_offset,
    ldc, depth, s, h, e_offset, relu, columns, post, q, qp)`, where a, panel, c, s and h are
    the addresses (`address`) of arrays of `dtype`: `_micro_kernel(rows)` from +0, with
    `_fused_epilogue` and, for float32, `_post_epilogue` (bf16 or f16 rounding, the amax, as the
    bits of `post` ask) applied to the registers as they are stored into c (its first `columns`
    columns), so that a tile costs no second pass over its outputs; where bit 3 of `post` is
    set, a float32 tile is quantized instead and stored at the same elements of the uint8
    array at address q (`_store_quantized`, qp the address of its parameters), c untouched.
    Returns the amax bits (`_post_epilogue`'s; 0 unless measured)."""

    @intrinsic
    def stored(typingctx, dtype, a, a_offset, lda, panel, panel_offset, ldp, c, c_offset, ldc,
               depth, s, h, e_offset, relu, columns, post, q, qp):
        sig = types.uint32(dtype, a, a_offset, lda, panel, panel_offset, ldp, c, c_offset, ldc,
                           depth, s, h, e_offset, relu, columns, post, q, qp)
        width = 8 if dtype.dtype == types.float64 else 4
        fty = ir.DoubleType() if width == 8 else ir.FloatType()
        lanes = _VECTOR_BYTES // width
        return sig, _codegen(rows, lanes, ir.VectorType(fty, lanes), fused=True)
    return stored


# A conv's rows past its last full tile in blocks of 4, 2 and 1 rows, each block reading the
# panel once (instead of once per row).
_stored8, _stored4, _stored2, _stored1 = (_stored_kernel(r) for r in (8, 4, 2, 1))


def _panel_columns(dtype: np.dtype) -> int:
    """The columns of a register tile (and of a packed panel of b) for operands of `dtype`."""
    return _VECTORS * _VECTOR_BYTES // dtype.itemsize



@njit(cache=True, nogil=True, inline="always")
def _finish_tile(a, a_offset, source, offset, ldp, c, cf, batch, i0, j0, cols, chunk, scale,
                 bias, relu, tile, total):
    """Rows i0 .. i0 + TILE_ROWS - 1 (those below M) and columns j0 .. j0 + cols - 1 (those below
    N) of matrix `batch` of c (B, M, N): the rows of a (K long) from flat index a_offset on,
    times the (K, cols) panel at flat index `offset` of source (rows ldp apart), summed in
    _micro's order and stored through the epilogue into c (cf: its flat view); `tile` and
    `total` are scratch of TILE_ROWS * cols. The arrays are read through their data pointers
    (C-contiguous, any rank)."""
    m, kk, n = c.shape[1], a.shape[-1], c.shape[2]
    if chunk >= kk and i0 + TILE_ROWS <= m and j0 + cols <= n and c.itemsize == a.itemsize:
        # A full tile: the registers go straight to the result, the epilogue runs there.
        _micro(a, a_offset, kk, source, offset, ldp, c, (batch * m + i0) * n + j0, n, kk, 1)
        if scale.size or bias.size or relu:
            _epilogue_in_place(cf, m, n, batch, i0, j0, cols, scale, bias, relu)
    elif chunk >= kk:
        _sweep(a, a_offset, kk, source, offset, ldp, tile, 0, kk, m - i0, cols)
        _store(tile, cf, m, n, batch, i0, min(TILE_ROWS, m - i0), j0, cols, scale, bias, relu)
    else:
        total[:] = 0
        for k0 in range(0, kk, chunk):
            _sweep(a, a_offset, kk, source, offset, ldp, tile, k0, min(chunk, kk - k0),
                   m - i0, cols)
            total += tile
        _store(total, cf, m, n, batch, i0, min(TILE_ROWS, m - i0), j0, cols, scale, bias,
               relu)


@njit(cache=True, nogil=True, inline="always")
def _sweep(a, a_offset, kk, source, offset, ldp, tile, k0, depth, rows, cols):
    """tile (rows `cols` apart) = the products of k = k0 .. k0 + depth - 1, in that order,
    summed from +0, for `rows` rows."""
    if rows >= TILE_ROWS:
        _micro(a, a_offset + k0, kk, source, offset + k0 * ldp, ldp, tile, 0, cols,
               depth, 1)
    else:
        for r in range(rows):
            _micro_row(a, a_offset + r * kk + k0, kk, source, offset + k0 * ldp,
                       ldp, tile, r * cols, cols, depth, 1)


@njit(cache=True, nogil=True, inline="always")
def _epilogue_in_place(flat, m, n, batch, i0, j0, cols, scale, bias, relu):
    """`_store`'s epilogue over a full tile already in c (a float sum in c's type), without a
    branch in the loop so that it vectorizes: an absent scale multiplies by 1 and an absent
    bias adds -0.0, both of which give every value (-0.0 and NaN included) back unchanged.
    flat is c (B, m, n) flattened."""
    g = batch % max(1, scale.shape[0], bias.shape[0])
    zero = np.float32(0)
    for r in range(TILE_ROWS):
        base = (batch * m + i0 + r) * n + j0
        s = scale[g, i0 + r] if scale.size else np.float32(1)
        h = bias[g, i0 + r] if bias.size else np.float32(-0.0)
        # Unsigned indices: numba's wrap-around of negative ones keeps loops like this one
        # from vectorizing (several times slower).
        for j in range(np.uint64(base), np.uint64(base + cols)):
            v = flat[j] * s + h if scale.size else flat[j] + h
            flat[j] = zero if relu and v <= 0 else v


@njit(cache=True, nogil=True, inline="always")
def _store(tile, flat, m, n, batch, i0, rows, j0, cols, scale, bias, relu):
    """`rows` rows of the tile (`cols` apart) into c at (batch, i0, j0), through the epilogue:
    for output row i (channel (batch % G) * M + i of the (G, M) tables `scale` and `bias`, each
    empty when absent) y = float32(sum) * scale, then y + bias, then relu as np.maximum(y, 0)
    (NaN kept, -0 to +0): each a float operation, rounded once, as the separate ops compute
    them. No branch in the loops (an absent bias adds -0.0, which changes no value). flat is
    c (B, m, n) flattened."""
    width = min(cols, n - j0)
    g = batch % max(1, scale.shape[0], bias.shape[0])
    zero = np.float32(0)
    for r in range(rows):
        # Unsigned indices, as in _epilogue_in_place.
        base, row = np.uint64((batch * m + i0 + r) * n + j0), np.uint64(r * cols)
        h = bias[g, i0 + r] if bias.size else np.float32(-0.0)
        if scale.size:
            s = scale[g, i0 + r]
            for j in range(np.uint64(width)):
                v = np.float32(tile[row + j]) * s + h
                flat[base + j] = zero if relu and v <= 0 else v
        elif bias.size or relu:
            for j in range(np.uint64(width)):
                v = tile[row + j] + h
                flat[base + j] = zero if relu and v <= 0 else v
        else:
            for j in range(np.uint64(width)):
                flat[base + j] = tile[row + j]


