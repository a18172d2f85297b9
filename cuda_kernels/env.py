"""Import guard for the CUDA kernels, and the few device helpers that differ between a real
GPU and Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set before numba.cuda is imported).

NumPy 2.5 removed `np.row_stack`, which numba-cuda <= 0.30 registers at import; with that
pair no kernel compiles. We refuse it with a clear message (the `cuda` extra pins
numpy<2.5) instead of patching NumPy behind the user's back.

Every kernel module does `from cuda_kernels.env import cuda, SIMULATOR, ...`; importing it
raises `CudaUnavailableError` when numba-cuda is missing or unusable.
"""

from __future__ import annotations

import numpy as np


class CudaUnavailableError(RuntimeError):
    """numba-cuda (or a usable NumPy for it) is not installed. The backend turns this into
    tf_async.errors.BadInputError; this package never imports tf_async."""


def _numpy_version() -> tuple[int, int]:
    major, minor = np.__version__.split(".")[:2]
    return int(major), int(minor)


def _check_numpy() -> None:
    if _numpy_version() >= (2, 5) and not hasattr(np, "row_stack"):
        raise CudaUnavailableError(
            f"NumPy {np.__version__} cannot be used with numba-cuda: NumPy 2.5 removed "
            "np.row_stack, which numba-cuda registers at import, so no CUDA kernel compiles. "
            "Install numpy<2.5 (pip install 'tf-async[cuda]' pins it)."
        )


def _import_cuda():  # returns the numba.cuda module
    _check_numpy()
    try:
        from numba import cuda as numba_cuda
    except ImportError as exc:
        raise CudaUnavailableError(
            f"numba-cuda is not installed ({exc}); install it with pip install 'tf-async[cuda]'"
        ) from exc
    _quiet_small_grids()
    return numba_cuda


def _quiet_small_grids() -> None:
    # Decode launches are small grids by design (a few rows); numba-cuda would warn on each.
    try:
        from numba.cuda.core import config as cuda_config
    except ImportError:
        return
    cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


cuda = _import_cuda()
def _detect_simulator() -> bool:
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", 0))


SIMULATOR: bool = _detect_simulator()
WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF


def _thread_safe_simulator_swap() -> None:
    """Numba's simulator runs each CUDA thread as a Python thread and, around every device
    function call, points the `cuda` global of the function's module at the launch's fake
    module, then back. Two threads in device functions of one module race: the first to
    return restores the real module while the other still runs, which then fails with
    "module 'numba.cuda' has no attribute 'shared'" (intermittently; more often on a loaded
    machine). This swap counts the threads inside each module and restores only when the
    last one leaves: the same fake module for every thread of a launch, no race."""
    import threading
    from contextlib import contextmanager

    try:
        from numba.cuda.simulator import kernel as sim_kernel
    except ImportError:  # another simulator layout: leave it as it is
        return
    if not hasattr(sim_kernel, "swapped_cuda_module"):
        return
    lock = threading.Lock()
    inside: dict[int, tuple[int, dict]] = {}

    @contextmanager
    def swapped_cuda_module(fn, fake_cuda_module):
        globs = fn.__globals__
        with lock:
            count, orig = inside.get(id(globs), (0, {}))
            if count == 0:
                orig = {k: v for k, v in globs.items() if v is cuda}
                globs.update({k: fake_cuda_module for k in orig})
            inside[id(globs)] = (count + 1, orig)
        try:
            yield
        finally:
            with lock:
                count, orig = inside[id(globs)]
                if count == 1:
                    globs.update(orig)
                    del inside[id(globs)]
                else:
                    inside[id(globs)] = (count - 1, orig)

    sim_kernel.swapped_cuda_module = swapped_cuda_module


def _thread_safe_simulator_shared() -> None:
    """The simulator hands each `cuda.shared.array` call site (file, line) one array per launch,
    created by the first thread that asks: `get`, then `np.empty` and store if missing. Two
    threads of a block asking at once can each create one, and each then works on its own
    array: the others never see its writes and read uninitialized memory (seen as wrong or
    huge values, intermittently, more often with a short GIL switch interval). This version
    does the lookup and the creation under a lock (and finds the caller from its frame, not by
    extracting the whole stack)."""
    import sys
    import threading

    try:
        from numba.core import types
        from numba.cuda.simulator.kernelapi import FakeCUDAShared
        from numba.np import numpy_support
    except ImportError:  # another simulator layout: leave it as it is
        return
    lock = threading.Lock()
    dynamic = FakeCUDAShared.array

    def array(self, shape, dtype):
        if shape == 0:  # dynamic shared memory: one buffer, nothing to create
            return dynamic(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    FakeCUDAShared.array = array  # type: ignore[method-assign]


if SIMULATOR:
    _thread_safe_simulator_swap()
    _thread_safe_simulator_shared()

if SIMULATOR:

    @cuda.jit(device=True)
    def float_as_int(x):
        return np.int32(np.array(x, dtype=np.float32).view(np.int32))

    @cuda.jit(device=True)
    def int_as_float(x):
        return np.float32(np.array(x, dtype=np.int32).view(np.float32))

    @cuda.jit(device=True)
    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    @cuda.jit(device=True)
    def add_rn(a, b):
        return np.float32(np.float32(a) + np.float32(b))

    @cuda.jit(device=True)
    def _shfl_xor(v, offset):
        # The simulator has no shuffles: exchange through one shared buffer. Every
        # thread of the block must call this (our kernels only reduce in uniform flow).
        buf = cuda.shared.array(1024, np.float32)
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        buf[tid] = v
        cuda.syncthreads()
        other = buf[tid ^ offset]
        cuda.syncthreads()
        return np.float32(other)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def float_as_int(x):
        return libdevice.float_as_int(x)

    @cuda.jit(device=True, inline=True)
    def int_as_float(x):
        return libdevice.int_as_float(x)

    @cuda.jit(device=True, inline=True)
    def mul_rn(a, b):
        """a * b rounded to float32, never contracted with an add into an FMA."""
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def add_rn(a, b):
        """a + b rounded to float32, never contracted with a multiply into an FMA."""
        return libdevice.fadd_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _shfl_xor(v, offset):
        return cuda.shfl_xor_sync(FULL_MASK, v, offset)


@cuda.jit(device=True)
def warp_sum(v):
    """Butterfly sum over the 32 lanes, offsets 16, 8, 4, 2, 1: every lane gets the same
    bits (a + b == b + a), and the order is fixed, so the result is batch-invariant."""
    offset = 16
    while offset > 0:
        v = v + _shfl_xor(v, offset)
        offset //= 2
    return v


@cuda.jit(device=True)
def block_sum(v, buf):
    """Sum of v over the block's threads (blockDim.x a power of two; buf: shared memory of at
    least blockDim.x floats): a fixed tree halving the threads, so every thread gets the same
    bits whatever the launch. buf is free again on return."""
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            buf[tid] = buf[tid] + buf[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def warp_max(v):
    """Butterfly max over the 32 lanes (exact, any order)."""
    offset = 16
    while offset > 0:
        v = max(v, _shfl_xor(v, offset))
        offset //= 2
    return v


# ---------------------------------------------------------------- kernels and their launch order
# Programmatic dependent launch (Hopper and later; cuda_kernels/graphs.py): in a CUDA graph
# whose kernel-to-kernel edges are programmatic, a kernel may start while the one before it
# still runs. So every kernel of this package begins by waiting for the kernels it depends on
# to finish (griddepcontrol.wait: at once when there are none, as in a plain launch) and then
# lets the next one start (griddepcontrol.launch_dependents): a kernel never reads or writes
# anything before its predecessors are done, and at most one kernel waits at a time.
PDL_NAME_PREFIX = "pdl__"  # the qualified name of every kernel made by `kernel`

if SIMULATOR:

    def kernel(fn=None, **options):
        """cuda.jit for a kernel of this package (the simulator has no launch order to keep)."""
        if fn is None:
            return lambda f: kernel(f, **options)
        return cuda.jit(**options)(fn) if options else cuda.jit(fn)

else:
    import inspect

    from numba import types as _types
    from numba.cuda.extending import intrinsic as _intrinsic

    def _has_pdl() -> bool:
        try:
            return tuple(cuda.get_current_device().compute_capability) >= (9, 0)
        except Exception:  # noqa: BLE001 - no device to ask: compile the plain kernel
            return False

    @_intrinsic
    def _enter(typingctx):
        """griddepcontrol.wait, then griddepcontrol.launch_dependents (sm_90+; nothing before)."""
        def codegen(context, builder, sig, args):
            if _has_pdl():
                from llvmlite import ir

                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                                   "griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;", "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
            return context.get_dummy_value()

        return _types.void(), codegen

    def kernel(fn=None, **options):
        """cuda.jit for a kernel of this package: `fn` runs after _enter() (see above), as a
        kernel named PDL_NAME_PREFIX + its name (cuda_kernels/graphs.py finds it by that)."""
        if fn is None:
            return lambda f: kernel(f, **options)
        body = cuda.jit(device=True)(fn)
        names = ", ".join(inspect.signature(fn).parameters)
        name = PDL_NAME_PREFIX + fn.__name__
        scope = {"__name__": fn.__module__, "_body": body, "_enter": _enter}
        exec(f"def {name}({names}):\n    _enter()\n    _body({names})\n", scope)  # noqa: S102
        wrapper = scope[name]
        wrapper.__module__ = fn.__module__
        wrapper.__doc__ = fn.__doc__
        return cuda.jit(**options)(wrapper) if options else cuda.jit(wrapper)
