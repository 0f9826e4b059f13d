"""Parallel loops over independent outputs that never wait for a thread the OS has not run.

numba's prange (OpenMP here) hands each thread a fixed share and ends in a barrier: when
another process holds a core, as on a shared 2-core VM, a parallel region waits for the
descheduled thread's time slice (~16 ms measured) however little work it had. `run_blocks`
splits the range into blocks that threads claim one at a time: the calling thread works too,
and when a helper is late the caller simply claims every block itself. Blocks are independent
outputs computed by the same compiled, GIL-free (nogil) kernel whichever thread claims them, so
results are the same bits for any thread count and any schedule.

`run_units` is the same contract without a Python call per block: each thread makes one call
into the compiled kernel, which claims work units itself with an atomic fetch-add (`claim`) on
a counter the threads share, so units can be small (a few microseconds of work) and a late
thread's units are still taken by the others.

A helper never computes on the CPU of another thread of the same call. Some Linux schedulers
(this VM's guest kernel packs vCPUs: `sched_vcpu_pack` on its command line) wake an idle
process's threads onto one CPU: after 50 ms without work, a ShuffleNet call found its helper
on the caller's CPU for up to half of its parallel loops and ran 20% slower. A helper that
finds itself on a CPU taken in the call moves to the caller's other allowed CPUs
(`_apart`), as OpenMP's OMP_PROC_BIND and onnxruntime's thread affinities keep threads
apart; which thread computes which unit does not change any result.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
from collections.abc import Callable

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# Blocks per thread: enough for a late helper's share to be picked up by the others, few
# enough that the Python-level claim (~1 us) stays negligible against a block's work.
_BLOCKS_PER_THREAD = 8

_tasks: queue.SimpleQueue = queue.SimpleQueue()
_helpers: list[threading.Thread] = []
_start_lock = threading.Lock()
_pid = os.getpid()  # a forked child inherits the list but not the threads


def _cpu_reader() -> Callable[[], int] | None:
    """The C library's sched_getcpu (the CPU the calling thread runs on), or None where there
    is none or threads cannot be moved (os.sched_setaffinity is Linux only)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError, TypeError):
        return None
    getcpu.argtypes, getcpu.restype = [], ctypes.c_int
    return getcpu


_getcpu = _cpu_reader()


def _apart(taken: set[int], lock: threading.Lock, caller: int) -> None:
    """Move this helper thread off the CPUs in `taken` (those the call's other threads run
    on) to the others that thread `caller` (a native id) may run on, if it is on one and
    there are others; then add its CPU to `taken`."""
    here = _getcpu()
    with lock:
        if here not in taken:
            taken.add(here)
            return
    try:
        free = os.sched_getaffinity(caller) - taken
        if free:
            os.sched_setaffinity(0, free)  # moves this thread at once
    except OSError:  # the caller has exited its cpuset, or a sandbox forbids it
        return
    with lock:
        taken.add(_getcpu())


def _helper(tasks: queue.SimpleQueue) -> None:
    while True:
        tasks.get()()


def _ensure_helpers(count: int) -> None:
    global _tasks, _pid
    with _start_lock:
        if _pid != os.getpid():
            _tasks, _pid = queue.SimpleQueue(), os.getpid()
            _helpers.clear()
        while len(_helpers) < count:
            t = threading.Thread(target=_helper, args=(_tasks,), name="mplower-worker", daemon=True)
            t.start()
            _helpers.append(t)


def _share(threads: int, total: int, step: Callable[[], int]) -> None:
    """step() on this thread and on threads - 1 helpers at once, each call doing pieces of
    `total` and returning how many it did. Returns when they add up to total (a helper that
    starts late finds nothing left and returns 0), or re-raises the first error a call
    raised."""
    lock = threading.Lock()
    finished = threading.Event()
    state = {"done": 0, "error": None}
    caller, native = threading.get_ident(), threading.get_native_id()
    taken = set() if _getcpu is None else {_getcpu()}

    def work() -> None:
        done = 0
        try:
            if taken and threading.get_ident() != caller:
                _apart(taken, lock, native)
            done = step()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            state["error"] = e
            finished.set()
        with lock:
            state["done"] += done
            if state["done"] == total:
                finished.set()

    _ensure_helpers(threads - 1)
    for _ in range(threads - 1):
        _tasks.put(work)
    work()
    finished.wait()
    if state["error"] is not None:
        raise state["error"]


def run_blocks(kernel: Callable[..., None], count: int, *args) -> None:
    """kernel(*args, start, stop) over consecutive blocks covering range(count), on up to
    numba.get_num_threads() threads; `kernel` must be a nogil njit function whose blocks
    write disjoint outputs. Returns when every block is done; re-raises a block's error."""
    threads = min(numba.get_num_threads(), count)
    if threads <= 1:
        kernel(*args, 0, count)
        return
    blocks = min(count, threads * _BLOCKS_PER_THREAD)
    bounds = [count * i // blocks for i in range(blocks + 1)]
    claim = itertools.count()

    def step() -> int:
        done = 0
        while (i := next(claim)) < blocks:
            kernel(*args, bounds[i], bounds[i + 1])
            done += 1
        return done

    _share(threads, blocks, step)


@intrinsic
def claim(typingctx, counter):
    """counter[0] += 1 as one atomic step, returning the value before: the next unclaimed
    work unit of `run_units`."""
    sig = types.int64(counter)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return sig, codegen


@intrinsic
def borrowed(typingctx, array):
    """`array` without its reference count: the same data, shape and strides, with no
    memory-info pointer, as an array made from a raw pointer (numba.carray) has. numba counts
    references to arrays as it binds them, on every call of an inlined function that takes
    one: an atomic increment and decrement, on a count every thread of a parallel kernel
    updates when they share the array. Per tile or per plane those took a tenth to a half of
    some kernels' time (perf, docs/benchmarks.md); on a borrowed array they are a test of a
    null pointer. The caller must keep `array` itself alive while the borrowed one is used:
    an argument of the kernel, or a local it goes on using after the last use of the view."""
    sig = array(array)

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(signature.return_type)(context, builder)
        for field in ("nitems", "itemsize", "data", "shape", "strides"):
            setattr(out, field, getattr(view, field))
        out.meminfo = ir.Constant(out.meminfo.type, None)
        out.parent = ir.Constant(out.parent.type, None)
        return out._getvalue()
    return sig, codegen


def run_units(kernel: Callable[..., int], units: int, *args) -> None:
    """kernel(*args, counter, units) on up to numba.get_num_threads() threads at once, each
    call claiming units with `claim(counter)` until it gets one >= units and returning how
    many it did; `kernel` must be a nogil njit function whose units write disjoint outputs.
    Returns when every unit is done; re-raises a thread's error."""
    # The counter alone on its cache line (element 8 of 24: at least 64 bytes of the array on
    # either side), so that claims never contend with writes to a neighbouring allocation.
    counter = np.zeros(24, np.int64)[8:9]
    threads = min(numba.get_num_threads(), units)
    if threads <= 1:
        kernel(*args, counter, units)
        return
    _share(threads, units, lambda: kernel(*args, counter, units))
