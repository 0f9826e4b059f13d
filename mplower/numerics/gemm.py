"""The one float matrix product of mplower, with a summation order that is mplower's own.

BLAS libraries pick their blocking, and with it the order in which an output's products are
summed, by CPU kernel (OPENBLAS_CORETYPE), thread count and matrix shape, and vectorize along
K so that a row's result depends on where it sits in its batch. With products that round (f32
operands, the fp32 reference) each of those changes the last bit. `matmul` fixes the order:

    c[i, j] = 0;  for k = 0, 1, ..., K-1:  c[i, j] = fl(c[i, j] + fl(a[i, k] * b[k, j]))

in the result's precision (float32, or float64 when an operand is float64), a rounded product
and a rounded sum per step, never a fused multiply-add. The kernel is a register-tiled GEMM in
the BLIS manner: b is packed into column panels (read in place where packing does not pay),
and each tile of TILE_ROWS rows by one panel keeps its accumulators in vector registers
(`_micro`, LLVM vector IR without fast-math flags, so LLVM may neither contract nor reorder)
over K or, packed, over a slice of K, then stores them in c, where the next slice continues
the same sums: sliced or not, each sum runs over k = 0 .. K-1 in order. Rows past the last
full tile run one at a time, and a product of fewer than TILE_ROWS rows streams b row by row
instead (`_rows`, batch-1 inference). A tile belongs to one thread (threads claim blocks of tiles,
mplower.numerics.workers.run_units), SIMD lanes are different output columns, and K is never
split between threads or sums, so every output element is the same function of its own row
of `a` and column of `b` whatever the thread count, the BLAS library, the CPU's vector width,
the tile a row lands in or the batch around it. tests/test_gemm.py checks every path bit for
bit against that loop written in numpy.

`conv_product` is the same product with b the im2col of an image, packed panel by panel from
the image (an implicit GEMM, mplower.numerics.conv). Its tiles start from +0 and apply the
epilogue to the registers as they store them (`_stored_kernel`), rows past the last full tile
in blocks of 4, 2 and 1.

Integer operands stay on np.matmul: numpy multiplies integers without BLAS, exactly.
`integer_matmul` gives the same exact products at float32 GEMM speed where the operands are
small (8-bit quantized values), by splitting K so that no partial sum leaves float32's integers.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mplower.numerics.cpu import compile_target
from mplower.numerics.quant import _quantize_one
from mplower.numerics.rounding import (
    MX_ROUNDING_FORMATS,
    _param_array,
    _param_tuple,
    plain_bf16,
    plain_f16,
    rounded_bits,
)
from mplower.numerics.workers import borrowed, claim, run_blocks, run_units

# The register tile: TILE_ROWS output rows x _VECTORS vectors of 64 bytes (16 float32 or 8
# float64 columns), 16 accumulators that stay in registers over the whole of K. The sizes change
# the speed only, never a result.
TILE_ROWS, _VECTORS, _VECTOR_BYTES = 8, 2, 64
# Below this many multiply-adds (about 0.1 ms on one core) one thread does the whole product:
# handing units to a worker (run_units) costs tens of microseconds. 2^25 (the threshold from
# before units were claimed inside compiled code) kept ShuffleNet's grouped 1x1 convs at batch
# 8 on one thread; 2^21 was no better and ShuffleNet b8 10% slower (docs/benchmarks.md).
SERIAL_BELOW = 1 << 23


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


@njit(cache=True, nogil=True)
def _pack(b, panels, q, cols, base):
    """Column panel q of the contiguous stack b (B, K, N), counted batch-major, into
    panels[base:] as (K, cols) contiguous, zero past N. Each row of the panel is one
    contiguous copy (unsigned indices, as in _epilogue_in_place, so that it vectorizes)."""
    kk, n = b.shape[1], b.shape[2]
    per = (n + cols - 1) // cols
    batch, j0 = q // per, (q % per) * cols
    width = np.uint64(min(cols, n - j0))
    flat = b.reshape(-1)
    for k in range(kk):
        src, dst = np.uint64((batch * kk + k) * n + j0), np.uint64(base + k * cols)
        for j in range(width):
            panels[dst + j] = flat[src + j]
        for j in range(width, np.uint64(cols)):
            panels[dst + j] = 0


@njit(cache=True, inline="always")
def _tile(a, b, c, cf, ia, ib, t, cols, chunk, scale, bias, relu, tile, total):
    """Output tile t of c (B, M, N) of a product whose b is not packed (`_repays_packing`):
    batch, then column panel, then row block, accumulated over all of K in
    _micro's order and stored through the epilogue (`_store`). Full panels are read from b in
    place, the last partial one is packed. With `chunk` < K (integer operands, see
    `integer_matmul`) each chunk of K is summed on its own, exactly, and the chunks add up in
    float64, exactly. cf is c.reshape(-1), made once per product rather than per tile (a
    reshape is a call into numba's runtime)."""
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    rows_t = (m + TILE_ROWS - 1) // TILE_ROWS
    per = (n + cols - 1) // cols
    batch, rest = t // (rows_t * per), t % (rows_t * per)
    p, i0 = rest // rows_t, (rest % rows_t) * TILE_ROWS
    j0 = p * cols
    a_offset = (ia[batch] * m + i0) * kk
    if j0 + cols <= n:
        _finish_tile(a, a_offset, b, ib[batch] * kk * n + j0, n, c, cf, batch, i0, j0, cols,
                     chunk, scale, bias, relu, tile, total)
        return
    source = np.zeros(kk * cols, b.dtype)
    _pack(b, source, ib[batch] * per + p, cols, 0)
    _finish_tile(a, a_offset, source, 0, cols, c, cf, batch, i0, j0, cols, chunk, scale,
                 bias, relu, tile, total)


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


# Tiles per work unit of an in-place product: a claim is an atomic on a cache line the threads
# share, a few tiles amortize it.
_TILES_PER_UNIT = 4


@njit(cache=True, nogil=True)
def _tile_units(a, b, c, ia, ib, cols, chunk, scale, bias, relu, counter, units):
    """A product whose b is not packed (`_repays_packing`): the tiles of c in `_tile`'s order,
    _TILES_PER_UNIT to a unit, for the units claimed from `counter` (workers.run_units);
    returns the number of units done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    a, b, c = borrowed(a), borrowed(b), borrowed(c)
    ia, ib, scale, bias = borrowed(ia), borrowed(ib), borrowed(scale), borrowed(bias)
    tile, total = np.empty(TILE_ROWS * cols, a.dtype), np.empty(TILE_ROWS * cols, np.float64)
    cf = c.reshape(-1)
    tiles = c.shape[0] * ((c.shape[1] + TILE_ROWS - 1) // TILE_ROWS) \
        * ((c.shape[2] + cols - 1) // cols)
    done = 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        for t in range(u * _TILES_PER_UNIT, min(tiles, (u + 1) * _TILES_PER_UNIT)):
            _tile(a, b, c, cf, ia, ib, t, cols, chunk, scale, bias, relu, tile, total)
        done += 1


def _gemm_in_place(a, b, c, ia, ib, cols, chunk, scale, bias, relu, serial):
    tiles = c.shape[0] * -(-c.shape[1] // TILE_ROWS) * -(-c.shape[2] // cols)
    args = (a, b, c, ia, ib, cols, chunk, scale, bias, relu)
    if serial:
        _tile_units(*args, np.zeros(1, np.int64), -(-tiles // _TILES_PER_UNIT))
    else:
        run_units(_tile_units, -(-tiles // _TILES_PER_UNIT), *args)


@njit(cache=True, nogil=True)
def _pack_blocks(b, panels, cols, q0, q1):
    for q in range(q0, q1):
        _pack(b, panels, q, cols, q * b.shape[1] * cols)


# The cache blocking of a packed product (the BLIS loop order), in units of _BLOCK_ROWS rows
# by _BLOCK_PANELS panels: K is swept in slices of _DEPTH, over which a slice of a panel
# (_DEPTH x cols, 32 KB of float32) stays in L1 while the unit's row tiles pass over it, and
# the unit's slice of a (_BLOCK_ROWS x _DEPTH, 256 KB) stays in L2 while its panels pass. A
# full tile's sums continue in c from one slice to the next (stored and reloaded as they are,
# exactly), so every sum keeps the module docstring's order. The sizes change the speed only.
_DEPTH, _BLOCK_ROWS, _BLOCK_PANELS = 256, 256, 8
# Units to aim for, so that two threads share a small product (or one with few blocks) and a
# late thread's share is picked up by the other: blocks are halved (rows first) until there
# are this many, down to one tile.
_MIN_UNITS = 16


def _blocks(c: np.ndarray, cols: int) -> tuple[int, int, int]:
    """(rows, panels) of a unit of `_block_units` for c (B, M, N), and the number of units:
    _BLOCK_ROWS by _BLOCK_PANELS, each halved (the one there are fewer blocks of first) while
    there are fewer than _MIN_UNITS units."""
    rows, panels = _BLOCK_ROWS, _BLOCK_PANELS
    m, per = c.shape[1], -(-c.shape[2] // cols)
    while c.shape[0] * -(-m // rows) * -(-per // panels) < _MIN_UNITS:
        if rows > TILE_ROWS and (panels == 1 or -(-m // rows) <= -(-per // panels)):
            rows //= 2
        elif panels > 1:
            panels //= 2
        else:
            break
    return rows, panels, c.shape[0] * -(-m // rows) * -(-per // panels)


@njit(cache=True, nogil=True)
def _block_units(a, panels, c, ia, ib, cols, block_rows, block_panels, chunk, scale, bias,
                 relu, counter, units):
    """The blocks of c (B, M, N) claimed from `counter` (workers.run_units): unit u is matrix
    u // (column blocks * row blocks), then a block of `block_panels` panels, then a block of
    `block_rows` rows (a multiple of TILE_ROWS); b is packed in `panels` (`_pack`). Full
    tiles of a float product run sliced over K (see _DEPTH); the rest (the last rows and
    panel, integer chunks) as `_finish_tile` does for any tile. Returns the number of units
    done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    a, panels, c = borrowed(a), borrowed(panels), borrowed(c)
    ia, ib, scale, bias = borrowed(ia), borrowed(ib), borrowed(scale), borrowed(bias)
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    per = (n + cols - 1) // cols
    row_blocks = (m + block_rows - 1) // block_rows
    col_blocks = (per + block_panels - 1) // block_panels
    tile, total = np.empty(TILE_ROWS * cols, a.dtype), np.empty(TILE_ROWS * cols, np.float64)
    cf = c.reshape(-1)
    sliced = chunk >= kk > 0 and c.itemsize == a.itemsize
    epilogue = scale.size or bias.size or relu
    done = 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        batch, rest = u // (row_blocks * col_blocks), u % (row_blocks * col_blocks)
        jb, rb = rest // row_blocks, rest % row_blocks
        i_start, i_end = rb * block_rows, min(m, (rb + 1) * block_rows)
        p_start, p_end = jb * block_panels, min(per, (jb + 1) * block_panels)
        # Rows in full tiles, panels full of columns: the sliced tiles when `sliced`.
        i_full = i_start + (i_end - i_start) // TILE_ROWS * TILE_ROWS if sliced else i_start
        p_full = min(p_end, n // cols) if sliced else p_start
        a_base, q_base = ia[batch] * m * kk, ib[batch] * per
        for k0 in range(0, kk if sliced else 0, _DEPTH):
            depth = min(_DEPTH, kk - k0)
            last = k0 + depth == kk
            for p in range(p_start, p_full):
                offset = ((q_base + p) * kk + k0) * cols
                for i0 in range(i_start, i_full, TILE_ROWS):
                    _micro(a, a_base + i0 * kk + k0, kk, panels, offset, cols, c,
                           (batch * m + i0) * n + p * cols, n, depth, 1 if k0 == 0 else 0)
                    if last and epilogue:
                        _epilogue_in_place(cf, m, n, batch, i0, p * cols, cols, scale, bias,
                                           relu)
        for p in range(p_start, p_end):
            for i0 in range(i_start, i_end, TILE_ROWS):
                if p < p_full and i0 < i_full:
                    continue
                _finish_tile(a, a_base + i0 * kk, panels, (q_base + p) * kk * cols, cols, c,
                             cf, batch, i0, p * cols, cols, chunk, scale, bias, relu, tile,
                             total)
        done += 1


# Packing b is a pass over it (two where it leaves the cache), repaid where each panel is read
# by many rows, or b is narrow (fewer than _WIDE panels): on one thread 64 x 576 @ 576 x 25088
# (a conv's im2col shape) ran at half speed packed, 256 x 1024 @ 1024 x 1568 at two thirds,
# 1024 x 768 @ 768 x 3072 30% faster. A weight packed once (PackedMatrix) is always read packed.
_PACK_ROWS, _WIDE = 512, 8


def _repays_packing(rows: int, n: int, cols: int) -> bool:
    """Whether a product whose b (N columns) is read by `rows` rows packs b on each call."""
    return rows >= _PACK_ROWS or -(-n // cols) < _WIDE


def _gemm_packed(a, b, c, ia, ib, cols, chunk, scale, bias, relu, serial, panels=None):
    """A product of more than 2 * TILE_ROWS rows whose b is packed (`_repays_packing`), which
    also keeps the rows of a panel clear of the cache aliasing of a power-of-two stride (b's
    rows read in place 12 KB apart: a quarter of BERT's GEMM speed lost)."""
    packed = panels is not None  # b's panels as `PackedMatrix` made them
    if not packed:
        panels = _pack_all(b, cols, serial)
    rows, per_unit, units = _blocks(c, cols)
    args = (a, panels, c, ia, ib, cols, rows, per_unit, chunk, scale, bias, relu)
    if serial:
        _block_units(*args, np.zeros(1, np.int64), units)
    else:
        run_units(_block_units, units, *args)


def _pack_all(b: np.ndarray, cols: int, serial: bool) -> np.ndarray:
    """Every column panel of the stack b (B, K, N), batch-major, each (K, cols) (`_pack`)."""
    count = b.shape[0] * -(-b.shape[2] // cols)
    panels = np.empty(count * b.shape[1] * cols, b.dtype)
    if serial:
        _pack_blocks(b, panels, cols, 0, count)
    else:
        run_blocks(_pack_blocks, count, b, panels, cols)
    return panels


class PackedMatrix:
    """A matrix b (K, N) in the form the product reads it, made once for the many products
    with one weight (the executor packs its constant weights): `matmul(a, packed)` gives
    a @ b with the same bits, without converting and packing b on every call. `dtype` is the
    precision the products run in (float32 or float64); an integer b must be exact in it."""

    def __init__(self, b: np.ndarray, dtype: np.dtype) -> None:
        if np.ndim(b) != 2:
            raise ValueError(f"PackedMatrix: b must be 2-D, not {np.shape(b)}")
        self.dtype = np.dtype(dtype)
        self.stack = np.ascontiguousarray(np.asarray(b).reshape((1,) + np.shape(b)), self.dtype)
        self.shape = self.stack.shape[1:]
        self.panels = _pack_all(self.stack, _panel_columns(self.dtype),
                                self.stack.size < SERIAL_BELOW)


# Fewer rows than a register tile: each row streams b once, row by row, its outputs in chunks
# of _CHUNK columns (in L1) accumulated in memory. Same order: k outer, one product and one sum
# per step, lanes along the columns.
_CHUNK = 512


@njit(cache=True)
def _rows(a, b, c, ia, ib, t, chunk, scale, bias, relu):
    """Chunk t of c (B, M, N) (batch, then row, then column chunk), swept over k, K split
    into exact chunks for integer operands as in `_tile`, stored through the epilogue."""
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    chunks = (n + _CHUNK - 1) // _CHUNK
    batch, rest = t // (m * chunks), t % (m * chunks)
    i, j0 = rest // chunks, (rest % chunks) * _CHUNK
    j1 = min(j0 + _CHUNK, n)
    x = a[ia[batch], i]
    w = b[ib[batch]]
    y = np.zeros(j1 - j0, a.dtype)
    if chunk >= kk:
        _row_sweep(x, w, y, j0, 0, kk)
        _store(y, c.reshape(-1), m, n, batch, i, 1, j0, j1 - j0, scale, bias, relu)
    else:
        total = np.zeros(j1 - j0, np.float64)
        for k0 in range(0, kk, chunk):
            y[:] = 0
            _row_sweep(x, w, y, j0, k0, min(kk, k0 + chunk))
            total += y
        _store(total, c.reshape(-1), m, n, batch, i, 1, j0, j1 - j0, scale, bias, relu)


@njit(cache=True)
def _row_sweep(x, w, y, j0, k0, k1):
    for k in range(k0, k1):
        xk = x[k]
        row = w[k, j0:j0 + y.size]
        for j in range(y.size):
            y[j] += xk * row[j]


@njit(cache=True)
def _rows_serial(a, b, c, ia, ib, chunk, scale, bias, relu):
    for t in range(c.shape[0] * c.shape[1] * ((c.shape[2] + _CHUNK - 1) // _CHUNK)):
        _rows(a, b, c, ia, ib, t, chunk, scale, bias, relu)


@njit(cache=True, nogil=True)
def _rows_blocks(a, b, c, ia, ib, chunk, scale, bias, relu, t0, t1):
    for t in range(t0, t1):
        _rows(a, b, c, ia, ib, t, chunk, scale, bias, relu)


def _rows_parallel(a, b, c, ia, ib, chunk, scale, bias, relu):
    run_blocks(_rows_blocks, c.shape[0] * c.shape[1] * ((c.shape[2] + _CHUNK - 1) // _CHUNK),
               a, b, c, ia, ib, chunk, scale, bias, relu)


def _batches(x: np.ndarray, batch: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """x as a contiguous (B, rows, cols) stack of its own matrices, and for each of the
    `batch` products (flattened) the index of its matrix: broadcasting without copies."""
    own = x.shape[:-2]
    stack = np.ascontiguousarray(x.reshape((int(np.prod(own)),) + x.shape[-2:]), dtype)
    index = np.arange(stack.shape[0], dtype=np.int64).reshape(own)
    return stack, np.ascontiguousarray(np.broadcast_to(index, batch).reshape(-1))


_NONE = np.zeros((0, 0), np.float32)


def _epilogue_table(v: np.ndarray | None, dtype: np.dtype, rows: int) -> np.ndarray:
    """A per-output-row vector (length G * rows, G groups of `rows` rows) as the (G, rows)
    table `_store` reads, or an empty one."""
    if v is None:
        return _NONE.astype(dtype)
    return np.ascontiguousarray(np.asarray(v, dtype).reshape(-1, rows))


def _product(a: np.ndarray, b: np.ndarray, work: np.dtype, out: np.dtype, chunk: int | None,
             scale: np.ndarray | None, bias: np.ndarray | None, relu: bool) -> np.ndarray:
    """The shared body of `matmul` and `integer_matmul`: c = epilogue(a @ b) in `out`."""
    packed = b if isinstance(b, PackedMatrix) else None
    if packed is not None and packed.dtype != work:
        raise ValueError(f"matmul: b is packed for {packed.dtype}, the product runs in {work}")
    if a.ndim == 0 or len(b.shape) == 0:
        raise ValueError("matmul: operands must have at least one dimension")
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = packed.stack[0] if packed is not None else b[:, None] if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ValueError(f"matmul: contraction mismatch: {a.shape} @ {b.shape}")
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    (m, k), n = a2.shape[-2:], b2.shape[-1]
    sa, ia = _batches(a2, batch, work)
    sb, ib = _batches(b2, batch, work) if packed is None else (
        packed.stack, np.zeros(int(np.prod(batch)), np.int64))
    epilogue = scale is not None or bias is not None or relu
    c = np.empty((ia.size, m, n), out) if k or epilogue else np.zeros((ia.size, m, n), out)
    if c.size:
        # An epilogue over an empty contraction still has its rows of zeros to finish.
        chunk = k if chunk is None else chunk
        tables = (max(chunk, 1), _epilogue_table(scale, np.float32, m),
                  _epilogue_table(bias, work if scale is None else np.float32, m), relu)
        serial = c.size * max(k, 1) < SERIAL_BELOW
        if m < TILE_ROWS:
            (_rows_serial if serial else _rows_parallel)(sa, sb, c, ia, ib, *tables)
        elif m <= 2 * TILE_ROWS or packed is None and not _repays_packing(
                m * ia.size // sb.shape[0], n, _panel_columns(work)):
            _gemm_in_place(sa, sb, c, ia, ib, _panel_columns(work), *tables, serial)
        else:
            _gemm_packed(sa, sb, c, ia, ib, _panel_columns(work), *tables, serial,
                         None if packed is None else packed.panels)
    y = c.reshape(batch + (m, n))
    if a.ndim == 1:
        y = y[..., 0, :]
    if len(b.shape) == 1:
        y = y[..., 0]
    return y


def matmul(a: np.ndarray, b: np.ndarray, *, bias: np.ndarray | None = None,
           relu: bool = False) -> np.ndarray:
    """np.matmul(a, b) (batch broadcasting, 1-D operands) in the fixed order of the module
    docstring for float operands (float32, or float64 if either is); integers as np.matmul.

    `bias` (one value per row of the result, or per row of every matrix of the batch, in
    batch-major order) and `relu` are applied as each output is stored, the float operations
    `y + bias` and np.maximum(y, 0) would do: the same bits without another pass over memory."""
    if isinstance(b, PackedMatrix):
        a = np.asarray(a)
        return _product(a, b, np.result_type(a, b.dtype), b.dtype, None, None, bias, relu)
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a, b)
    if dtype.kind != "f":
        y = np.matmul(a, b)
        if bias is not None:
            y = y + np.asarray(bias).reshape(-1, 1)
        return np.maximum(y, 0) if relu else y
    dtype = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    return _product(a, b, dtype, dtype, None, None, bias, relu)


# Work units to aim for when a convolution has few pixel panels (batch 1, late layers): its
# output channels are then split into blocks too, so that two threads still share the work.
# The convolution's kernels live here, not in conv.py, because numba's cache of a file is not
# invalidated when a function it inlines from another file changes (TILE_ROWS, _finish_tile).
_UNITS = 32
# How far ahead (in panels) the rows of an in-place panel are prefetched: 8 images of a 1x1
# 128->16 conv at 55x55 on one thread took 1.13 ms without, 0.83 / 0.83 / 0.81 ms at 2 / 4 /
# 8 panels (min of 36 runs each, interleaved).
_PREFETCH_PANELS = 4
# Consecutive pixel panels per work unit, each row tile running over all of them, so that each
# output row is written in runs of up to 8 panels (1 KiB) instead of one (128 bytes), while the
# packed panels of a span fit in _SPAN_BYTES (a quarter of this Zen 5 core's L2; a span of
# ResNet-50's 3x3 256-channel panels, 295 KB each, is one panel, as before). 1, 2, 4 and 8
# measured in docs/benchmarks.md.
_SPAN, _SPAN_BYTES = 8, 1 << 18
# A 1x1 conv of this many output channels or more packs its panels too: each packed panel then
# serves that many rows from contiguous memory (in place, a panel's K rows lie a plane apart).
# SqueezeNet's final 1000x512 conv at batch 8 took 5.95 against 6.71 ms, ResNet-50's 512->1024
# 23.7 against 25.9; 16 to 256 channels were as fast or faster in place (docs/benchmarks.md).
_PACK_1X1_ROWS = 512
# So does one of _PACK_1X1_DEEP input channels or more whose input (_PACK_1X1_BYTES or more)
# is beyond this VM's caches: a panel's K rows then lie on K pages, more than the first-level
# TLB holds, each row read from memory, while `_convert_span` reads each plane's run for a
# span of panels once. Batch 8, two threads, medians of 25 interleaved calls: SqueezeNet's
# 128->16 at 55x55 2.77 against 4.33 ms, ResNet-50's 256->64 at 56x56 11.7 against 13.0,
# 512->128 at 28x28 8.8 against 10.4; smaller inputs were level or slower (512->256 at 14x14,
# 3.2 MB: 6.5 against 5.5; 128->16 at batch 1: 0.37 against 0.31).
_PACK_1X1_DEEP, _PACK_1X1_BYTES = 128, 8 << 20


@njit(cache=True, nogil=True)
def _tap_offsets(x, shape):
    """For each row (c, ky, kx) of the im2col, c * KH * KW + ky * KW + kx, where its pixels
    start in the planes of one image and group of x (`_pack_panel`), computed once per
    convolution instead of per panel (the column phase is a division)."""
    cg, kh, kw, sw, dh, dw = shape[0], shape[1], shape[2], shape[4], shape[5], shape[6]
    plane, wq = x.shape[2] * x.shape[3], x.shape[3]
    taps = np.empty(cg * kh * kw, np.int64)
    row = 0
    for c in range(cg):
        for ky in range(kh):
            for kx in range(kw):
                taps[row] = (c * sw + kx * dw % sw) * plane + ky * dh * wq + kx * dw // sw
                row += 1
    return taps


@njit(cache=True, nogil=True)
def _pack_panel(x, panel, at, stride, image, channel0, shape, taps, q0, width, starts,
                offsets, lengths):
    """Output pixels q0 .. q0 + width - 1 (row-major, within Ho*Wo) of the im2col of image
    `image`, input channels channel0 .. channel0 + Cg - 1, into panel[at:] as (K, width) rows
    `stride` apart, row (c, ky, kx) at c * KH * KW + ky * KW + kx, starting at `taps`
    (`_tap_offsets`) in the image's planes. shape = (Cg, KH, KW, sh, sw, dh, dw, Ho, Wo); x is
    the padded input with its columns split into sw phases, (N, C * sw, Hp, Wp / sw), plane
    c * sw + p holding columns p, p + sw, ... of channel c, so that the pixels of a kernel tap
    along an output row are contiguous whatever the stride. A panel's pixels lie in runs along
    output rows; each run of a tap is copied as one loop."""
    sh, wo = shape[3], shape[8]
    wq = x.shape[3]
    flat = x.reshape(-1)
    runs, j = 0, 0
    while j < width:
        oy, ox = (q0 + j) // wo, (q0 + j) % wo
        starts[runs], offsets[runs] = j, oy * sh * wq + ox
        lengths[runs] = min(width - j, wo - ox)
        j += lengths[runs]
        runs += 1
    base = (image * x.shape[1] + channel0 * shape[4]) * x.shape[2] * wq
    for row in range(taps.size):
        src, dst = base + taps[row], at + row * stride
        for r in range(runs):
            # Unsigned indices, as in _epilogue_in_place.
            d, o = np.uint64(dst + starts[r]), np.uint64(src + offsets[r])
            for t in range(np.uint64(lengths[r])):
                panel[d + t] = flat[o + t]


@njit(cache=True, nogil=True, inline="always")
def _convert_span(flat, src, plane, panel, at, kk, cols, count):
    """`count` consecutive full panels of a 1x1 stride-1 conv whose pixels start at flat[src]
    (its K rows a plane apart) into panel[at + j * K * cols:] as (K, cols) each, converted to
    the panel's type: each plane's run of count * cols pixels read once, in order, instead of
    a panel's cols pixels from each of K planes in turn (K strided streams, a page each, per
    panel). A single panel is a span of one."""
    for k in range(kk):
        s = np.uint64(src + k * plane)
        for j in range(count):
            d, o = np.uint64(at + j * kk * cols + k * cols), np.uint64(j * cols)
            for t in range(np.uint64(cols)):
                panel[d + t] = flat[s + o + t]


@njit(cache=True, nogil=True, inline="always")
def _zero_columns(panel, at, stride, rows, first, cols):
    """Columns first .. cols - 1 of `rows` panel rows (stride apart) from panel[at] on: +0."""
    for row in range(rows):
        for t in range(at + row * stride + first, at + row * stride + cols):
            panel[t] = 0


@njit(cache=True, nogil=True)
def _conv_units(x, flat, w, c, shape, groups, cols, span, rows_per_unit, chunk, scale, bias,
                relu, post_s, post_h, channel0, rounding, rbits, rpa, parts, merged, qp, qout,
                counter, units):
    """The work units of the conv's result, channels channel0 .. channel0 + O/G - 1 of c
    (N * G, C, Ho*Wo) (all of c unless the result is written into a concatenation, see
    conv_product's `into`), claimed from `counter`: unit u is image-group
    u // (spans * blocks) (batch index n * G + g), then a span of `span` consecutive pixel
    panels, then a block of rows_per_unit output channels, so that consecutive units share
    their panels and a thread that claims them in a row packs them once. Each row tile runs
    over the span's panels in turn: its rows are written `span` panels long, a few long
    streams instead of many short ones. With `parts` (one per unit), parts[u] is the largest
    |result| of unit u as a float32 bit pattern with the sign cleared (rbits: c's bits).

    `merged` (one group, sums stored once): the panels run over the pixels of all images in
    turn, so that an image's last panel is filled with the next image's first pixels instead
    of lanes that compute nothing (a 7x7 output fills 49 of 64 lanes alone); a panel that
    spans images is packed, and its tiles are summed in `tile` and copied to each image.
    With `qout` (not empty: c's shape, flattened), each tile is quantized into it instead (qp
    = scale, zero point, lowest, highest): in its registers as it is stored
    (`_store_quantized`, c left untouched), or, where it is summed in chunks or spans images,
    from c while in L1 (`_quantize_run`). Returns the number of units done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays: the
    # inlined per-tile functions would otherwise count references to them on every call.
    x, flat, w, c, scale, bias = (borrowed(x), borrowed(flat), borrowed(w), borrowed(c),
                                  borrowed(scale), borrowed(bias))
    rbits, rpa, parts, qp, qout = (borrowed(rbits), borrowed(rpa), borrowed(parts),
                                   borrowed(qp), borrowed(qout))
    m, pixels, kk, c_rows = w.shape[1], c.shape[2], w.shape[2], c.shape[1]
    images = c.shape[0]  # the images, where `merged`
    total = images * pixels if merged else pixels
    panels = (total + cols - 1) // cols
    spans = (panels + span - 1) // span
    blocks = (m + rows_per_unit - 1) // rows_per_unit
    panel = np.empty(span * kk * cols, w.dtype)
    tile, total64 = np.empty(TILE_ROWS * cols, w.dtype), np.empty(TILE_ROWS * cols, np.float64)
    starts, offsets, lengths = (np.empty(cols, np.int64), np.empty(cols, np.int64),
                                np.empty(cols, np.int64))
    sources, ldps = np.empty(span, np.int64), np.empty(span, np.int64)
    # Per panel of the span: its first image (batch index), pixel and pixel count there, and
    # whether it runs on into the following images.
    firsts, q0s, widths = (np.empty(span, np.int64), np.empty(span, np.int64),
                           np.empty(span, np.int64))
    spanning = np.zeros(span, np.bool_)
    rp = _param_tuple(rpa)
    # A 1x1 stride-1 conv's im2col is its input: full panels are read there in place (packing
    # them, a strided gather over K planes, cost more than it saved), from `flat` (x
    # flattened), which is empty where x has another type than w (8-bit integers), the conv
    # has _PACK_1X1_ROWS output channels or more, or a deep input beyond the caches
    # (_PACK_1X1_DEEP): those panels are copied (converted), a span of full panels of one
    # image a plane at a time, any other full one on its own (`_convert_span`).
    one_by_one = shape[1] == shape[2] == shape[3] == shape[4] == 1
    in_place = one_by_one and flat.size > 0
    cf, plane = c.reshape(-1), x.shape[2] * x.shape[3]
    xf = x.reshape(-1)
    taps = _tap_offsets(x, shape)
    direct = chunk >= kk and c.itemsize == w.itemsize
    # bf16's or f16's rounding and the amax in the tile's registers as it is stored
    # (`_post_epilogue`, float32 only), else over the stored tile while it is in L1
    # (`_finish_run`, `late`): the same bits. Any other rounding comes before the amax, so
    # both are then late.
    fast = c.itemsize == 4 and (not rounding or plain_bf16(rp) or plain_f16(rp))
    post = 0
    if fast:
        post = (2 if parts.size else 0) | (0 if not rounding else 1 if plain_bf16(rp) else 4)
    late = (rounding or parts.size > 0) and not fast
    # A tile stored once into c with `qout` is quantized in its registers instead (bit 3).
    stored_post = post | 8 if qout.size else post
    # The per-tile kernels take addresses (`address`); these arrays live until the return.
    w_at, c_at, tile_at, s_at, h_at = (address(w), address(c), address(tile), address(post_s),
                                       address(post_h))
    flat_at, panel_at, q_at, qp_at = address(flat), address(panel), address(qout), address(qp)
    packed, done = -1, 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        q, block = u // blocks, u % blocks
        if merged:
            batch, p0 = 0, q * span
        else:
            batch, p0 = q // spans, (q % spans) * span
        largest = np.uint32(0)
        g = batch % groups
        count = min(span, panels - p0)
        if q != packed:
            for j in range(count):
                start = (p0 + j) * cols
                firsts[j], q0s[j] = batch + start // pixels, start % pixels
                widths[j] = min(cols, pixels - q0s[j])
                spanning[j] = merged and widths[j] < cols and firsts[j] + 1 < images
            # Full panels of one image, copied (converted): its pixels are contiguous in each
            # of the K planes, copied a plane at a time for the whole span (`_convert_span`).
            spanned = one_by_one and not in_place and firsts[count - 1] == firsts[0] \
                and widths[count - 1] == cols
            if spanned:
                _convert_span(xf, (firsts[0] * kk) * plane + q0s[0], plane, panel, 0, kk,
                              cols, count)
                for j in range(count):
                    sources[j], ldps[j] = -1 - j * kk * cols, cols
            for j in range(0 if spanned else count):
                if in_place and widths[j] == cols:
                    sources[j], ldps[j] = (firsts[j] * kk) * plane + q0s[j], plane
                    # An in-place panel's K rows lie a plane apart, too many streams for the
                    # hardware prefetchers: ask for the rows of the panel _PREFETCH_PANELS
                    # ahead.
                    for k in range(kk):
                        for f in range(0, cols, cols // _VECTORS):
                            prefetch_read(flat, sources[j] + _PREFETCH_PANELS * cols
                                           + k * plane + f)
                    continue
                sources[j], ldps[j] = -1 - j * kk * cols, cols
                at, image, q1, filled = j * kk * cols, firsts[j], q0s[j], 0
                if one_by_one and widths[j] == cols:
                    _convert_span(xf, (firsts[j] * kk) * plane + q0s[j], plane, panel, at,
                                  kk, cols, 1)
                    continue
                while True:  # the pixels of this image, then of the next ones if merged
                    width = min(cols - filled, pixels - q1)
                    _pack_panel(x, panel, at + filled, cols, image // groups, g * shape[0],
                                shape, taps, q1, width, starts, offsets, lengths)
                    filled += width
                    image, q1 = image + 1, 0
                    if not spanning[j] or filled == cols or image >= images:
                        break
                if filled < cols:
                    _zero_columns(panel, at, cols, kk, filled, cols)
            packed = q
        for i0 in range(block * rows_per_unit, min(m, (block + 1) * rows_per_unit),
                        TILE_ROWS):
            rows = min(TILE_ROWS, m - i0)
            for j in range(count):
                if not direct:
                    # A packed panel's offset in `panel` is stored as -1 - offset.
                    source, offset = (flat, sources[j]) if sources[j] >= 0 else \
                        (panel, -1 - sources[j])
                    _finish_tile(w, (g * m + i0) * kk, source, offset, ldps[j], c, cf,
                                 firsts[j], i0, q0s[j], cols, chunk, scale, bias, relu, tile,
                                 total64)
                    if qout.size:
                        _quantize_run(cf, qout, (firsts[j] * m + i0) * pixels + q0s[j], rows,
                                      widths[j], pixels, qp)
                    continue
                source, offset = (flat_at, sources[j]) if sources[j] >= 0 else \
                    (panel_at, -1 - sources[j])
                if not spanning[j]:
                    at = (firsts[j] * c_rows + channel0 + i0) * pixels + q0s[j]
                    largest = max(largest, _stored_tile(
                        w.dtype, w_at, (g * m + i0) * kk, kk, source, offset, ldps[j], c_at,
                        at, pixels, s_at, h_at, g * m + i0, relu, rows, widths[j], stored_post,
                        q_at, qp_at))
                    if late:
                        largest = _finish_run(rbits, at, rows, widths[j], pixels, rounding, rp,
                                              parts.size > 0, largest)
                    continue
                # Summed in `tile`, then each image's columns copied to it.
                _stored_tile(w.dtype, w_at, (g * m + i0) * kk, kk, source, offset, ldps[j],
                             tile_at, 0, cols, s_at, h_at, g * m + i0, relu, rows, cols, 0, q_at,
                             qp_at)
                image, q1, filled = firsts[j], q0s[j], 0
                while filled < cols and image < images:
                    width = min(cols - filled, pixels - q1)
                    at = (image * c_rows + channel0 + i0) * pixels + q1
                    for r in range(rows):
                        for t in range(width):
                            cf[at + r * pixels + t] = tile[r * cols + filled + t]
                    if rounding or parts.size:
                        largest = _finish_run(rbits, at, rows, width, pixels, rounding, rp,
                                              parts.size > 0, largest)
                    if qout.size:
                        _quantize_run(cf, qout, at, rows, width, pixels, qp)
                    filled += width
                    image, q1 = image + 1, 0
        if parts.size:
            parts[u] = largest
        done += 1


@njit(cache=True, nogil=True, inline="always")
def _quantize_run(cf, qout, at, rows, width, ldc, qp):
    """The `width` columns of `rows` rows (ldc apart) of cf from `at` on, just stored and
    still in L1, quantized into qout at the same places: quant._quantize_one with scale
    qp[0], zero point qp[1] and range qp[2] .. qp[3], the integer quantize's bits."""
    s, z, lo, hi = qp[0], qp[1], qp[2], qp[3]
    for r in range(rows):
        row = np.uint64(at + r * ldc)
        for t in range(np.uint64(width)):
            qout[row + t] = _quantize_one(cf[row + t], s, z, lo, hi)[0]


@njit(cache=True, nogil=True, inline="always")
def _finish_run(rbits, at, rows, width, ldc, rounding, rp, measure, largest):
    """The `width` columns of `rows` rows (ldc apart) stored at rbits[at:] (a float32
    result's bits), still in L1: rounded as round_to rounds them if `rounding`, and, if
    `measure`, `largest` raised to their largest magnitude as a bit pattern (as rounding.amax
    takes it, after the rounding). Returns `largest`."""
    if rounding:
        for r in range(rows):
            # Unsigned indices, as in _epilogue_in_place.
            row = np.uint64(at + r * ldc)
            for t in range(np.uint64(width)):
                rbits[row + t] = rounded_bits(rbits[row + t], rp)
    if measure:
        for r in range(rows):
            row = np.uint64(at + r * ldc)
            for t in range(np.uint64(width)):
                largest = max(largest, np.uint32(rbits[row + t] & np.uint32(0x7FFFFFFF)))
    return largest


@njit(cache=True, nogil=True, inline="always")
def _stored_tile(dtype, a, a_offset, kk, source, offset, ldp, c, c_offset, ldc, s, h, e_offset,
                 relu, rows, width, post, q, qp):
    """`rows` (1 .. TILE_ROWS) rows and the first `width` columns of a tile summed from +0
    straight into c through the fused epilogue (`_stored_kernel`, with `post`, q and qp): a
    full tile at once, fewer rows in blocks of 4, 2 and 1. a, source, c, s and h are
    addresses (`address`) of arrays of `dtype`. Returns the largest amax bits of the blocks
    (0 unless `post` measures)."""
    if rows == TILE_ROWS:
        return _stored8(dtype, a, a_offset, kk, source, offset, ldp, c, c_offset, ldc, kk, s,
                        h, e_offset, relu, width, post, q, qp)
    r, largest = 0, np.uint32(0)
    if rows >= 4:
        largest = max(largest, _stored4(dtype, a, a_offset, kk, source, offset, ldp, c,
                                        c_offset, ldc, kk, s, h, e_offset, relu, width, post,
                                        q, qp))
        r = 4
    if rows - r >= 2:
        largest = max(largest, _stored2(dtype, a, a_offset + r * kk, kk, source, offset, ldp, c,
                                        c_offset + r * ldc, ldc, kk, s, h, e_offset + r, relu,
                                        width, post, q, qp))
        r += 2
    if rows > r:
        largest = max(largest, _stored1(dtype, a, a_offset + r * kk, kk, source, offset, ldp, c,
                                        c_offset + r * ldc, ldc, kk, s, h, e_offset + r, relu,
                                        width, post, q, qp))
    return largest


def conv_product(x: np.ndarray, wmat: np.ndarray, shape: tuple[int, ...], groups: int,
                 out: np.dtype, chunk: int, scale: np.ndarray | None, bias: np.ndarray | None,
                 relu: bool, into: tuple[np.ndarray, int] | None = None,
                 rounding: str | None = None, amax: list | None = None,
                 quantize: tuple[np.ndarray, np.dtype] | None = None) -> np.ndarray:
    """The convolution of the padded x with the weights `wmat` (G, O/G, K) as c (N * G, O/G,
    Ho*Wo) in `out`: the product of the weights and the im2col of each image and group
    (mplower.numerics.conv), without materializing the im2col. shape = (Cg, KH, KW, sh, sw,
    dh, dw, Ho, Wo); x is (N, C * sw, Hp, Wp / sw), its columns split into sw phases as
    `_pack_panel` reads them (a 1x1 conv has stride 1), in wmat's type or in an 8-bit integer
    type, which the panels convert as they are packed; chunk, scale, bias and relu as in
    `_product`.

    `into` = (y, c0): write the result into channels c0 .. c0 + O - 1 of y (N, C, Ho*Wo)
    instead, a float result of one group (a concatenation along channels, without the copy);
    returns y. `rounding` (a format of rounding.round_to, not an MX one) rounds each float32
    result after its epilogue, as round_to would (the same kernel), while its tile is in
    cache; only where each sum is stored once (float32 sums over all of K). `amax` (a list)
    gets rounding.amax of the result, taken from each tile as it is stored (after the
    rounding), where each sum is stored once; elsewhere it is left empty. `quantize` =
    (qp, dtype), a float32 result and no `into`: returns the result quantized to `dtype` (an
    8-bit integer type) with qp = (scale, zero point, lowest, highest) as float32, each tile
    as it is stored (`_quantize_run`), instead of the result."""
    n, m, kk = x.shape[0], wmat.shape[1], wmat.shape[2]
    if quantize is not None and (into is not None or out != np.float32
                                 or np.dtype(quantize[1]).itemsize != 1):
        raise ValueError("conv_product: quantize takes a float32 result, not `into`, to an "
                         "8-bit integer type")
    if into is None:
        c, channel0 = np.empty((n * groups, m, shape[7] * shape[8]), out), 0
    else:
        c, channel0 = into
        if groups != 1 or c.dtype != out or out != wmat.dtype or chunk < kk \
                or not c.flags.c_contiguous or c.shape[0] != n \
                or c.shape[2] != shape[7] * shape[8] or not 0 <= channel0 <= c.shape[1] - m:
            raise ValueError("conv_product: `into` takes a float result of one group, "
                             "within the channels of a contiguous (N, C, Ho*Wo) array")
    cols = _panel_columns(wmat.dtype)
    # One run of panels over the pixels of all images where an image leaves lanes idle
    # (`_conv_units`' `merged`: one group, float sums over all of K stored once).
    merged = groups == 1 and n > 1 and c.shape[2] % cols != 0 and chunk >= kk \
        and out == wmat.dtype
    runs = 1 if merged else n * groups
    panels = -(-c.shape[2] * (n if merged else 1) // cols)
    # Spans of up to _SPAN panels, while that leaves _UNITS units or more.
    span = max(1, min(_SPAN, _SPAN_BYTES // max(1, kk * cols * wmat.itemsize),
                      runs * panels // _UNITS))
    spans = runs * -(-panels // span)
    tiles = (m + TILE_ROWS - 1) // TILE_ROWS
    split = min(tiles, -(-_UNITS // spans))
    rows_per_unit = TILE_ROWS * -(-tiles // split)
    blocks = -(-m // rows_per_unit)
    scale = _epilogue_table(scale, np.float32, m)
    bias = _epilogue_table(bias, wmat.dtype if scale.size == 0 else np.float32, m)
    # The fused epilogue's per-channel factors (`_fused_epilogue`) in the tile's type, exact:
    # it runs only where c has that type.
    post_s = (np.ones(groups * m, wmat.dtype) if scale.size == 0
              else scale.astype(wmat.dtype).ravel())
    post_h = (np.full(groups * m, -0.0, wmat.dtype) if bias.size == 0
              else bias.astype(wmat.dtype).ravel())
    if rounding is not None and (out != np.float32 or wmat.dtype != np.float32 or chunk < kk
                                 or rounding in MX_ROUNDING_FORMATS):
        raise ValueError("conv_product: rounding applies to float32 sums over all of K, to "
                         "a format of _round_one")
    tiled_amax = amax is not None and out == np.float32 and wmat.dtype == np.float32 \
        and chunk >= kk and into is None
    parts = np.zeros(spans * blocks if tiled_amax else 0, np.uint32)
    in_place = x.dtype == wmat.dtype and m < _PACK_1X1_ROWS \
        and not (kk >= _PACK_1X1_DEEP and x.nbytes >= _PACK_1X1_BYTES)
    flat = x.reshape(-1) if in_place else np.empty(0, wmat.dtype)
    args = (x, flat, wmat, c, tuple(int(v) for v in shape), groups, cols, span, rows_per_unit,
            chunk, scale, bias, relu, post_s, post_h, channel0, rounding is not None,
            c.reshape(-1).view(np.uint32) if rounding is not None or tiled_amax else _NO_BITS,
            _param_array(rounding or "bf16", False), parts, merged)
    # One compiled signature for both 8-bit types: int8 values written to uint8 wrap to
    # their two's-complement bits.
    q = None if quantize is None else np.empty(c.shape, np.uint8)
    args += (_NO_QP, _NO_Q) if q is None else (quantize[0], q.reshape(-1))
    if n * groups * m * c.shape[2] * max(kk, 1) < SERIAL_BELOW:
        _conv_units(*args, np.zeros(1, np.int64), spans * blocks)
    else:
        run_units(_conv_units, spans * blocks, *args)
    if tiled_amax:
        amax[:] = [amax_of_bits(parts.max() if parts.size else np.uint32(0))]
    return c if q is None else q.view(quantize[1])


def amax_of_bits(largest: np.uint32) -> float:
    """The amax (rounding.amax) whose largest |x| bit pattern is `largest`: NaN above +inf."""
    return float("nan") if largest > _F32_INF_BITS else float(np.uint32(largest).view(np.float32))


_F32_INF_BITS = 0x7F800000


_NO_BITS = np.zeros(0, np.uint32)
_NO_QP, _NO_Q = np.zeros(4, np.float32), np.empty(0, np.uint8)

# Every integer of magnitude up to 2**24 is a float32, so is every sum and product of such
# integers that stays within it: in that range float32 arithmetic is integer arithmetic.
F32_EXACT = 1 << 24


def int_magnitude(x: np.ndarray) -> int:
    """A bound on |x| for an integer-valued array, as a Python int: its type's for 8-bit
    integers (128 for i8: no pass over the data, and the K chunks it gives are within 2% of
    the data's), else max |x| (no int8 wrap-around)."""
    bound = _BYTE_BOUNDS.get(x.dtype)
    if bound is not None:
        return bound
    return max(abs(int(x.min())), abs(int(x.max()))) if x.size else 0


# int_magnitude's bound of each 8-bit type: a lookup, not an np.iinfo per call (a conv of a
# static int8 plan asked for it four times, 64 calls per ShuffleNet inference).
_BYTE_BOUNDS = {np.dtype(t): max(-int(np.iinfo(t).min), int(np.iinfo(t).max))
                for t in (np.int8, np.uint8)}


def integer_matmul(a: np.ndarray, b: np.ndarray, bound: int | None = None, *,
                   scale: np.ndarray | None = None, bias: np.ndarray | None = None,
                   relu: bool = False) -> np.ndarray:
    """np.matmul of integer-valued operands (integer arrays, or float32 arrays holding
    integers), exactly, as int64. `bound` bounds |a| * |b| where the caller knows it.

    With |a| <= A and |b| <= B every partial sum of `chunk` = 2**24 // (A * B) products is an
    integer below 2**24, so the float32 GEMM computes each K chunk exactly, whatever its
    summation order; inside each register tile the chunks add up in float64, exactly (far below
    2**53). That is np.matmul's result bit for bit, at float32 speed. Larger operands fall back
    to np.matmul in int64.

    With `scale` and/or `bias` (one float32 per row, as `matmul`'s bias) and `relu` the result
    is float32: float32(y) * scale + bias, then relu, each step rounded as DequantizeLinear
    (of the int32 sum, zero point 0), Add and Relu round it, applied as each sum is stored."""
    a, b = np.asarray(a), np.asarray(b)
    k = a.shape[-1]
    if bound is None:
        bound = int_magnitude(a) * int_magnitude(b)
    epilogue = scale is not None or bias is not None or relu
    if bound > F32_EXACT or max(a.ndim, b.ndim) < 2:
        if epilogue:
            raise ValueError("integer_matmul: an epilogue needs operands within float32's "
                             "integers")
        return np.matmul(a.astype(np.int64), b.astype(np.int64))
    f32 = np.dtype(np.float32)
    return _product(a, b, f32, f32 if epilogue else np.dtype(np.int64),
                    F32_EXACT // bound if bound else k, scale, bias, relu)
