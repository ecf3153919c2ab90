"""The lean launch path shared by the CUDA and PrivateUse1 policies: launch a @triton.jit kernel through its
compiled handle, cached per compile key, without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds every argument, computes Triton's specialisation key and looks the
compiled kernel up on each call: tens of microseconds of host time for the kernels here (about 30 arguments).
``launch`` does that once per compile key (the first call of a key goes through the JIT, which compiles or loads
the kernel and returns its ``CompiledKernel``) and afterwards calls the compiled kernel's launcher directly with
the arguments in the kernel's parameter order.

The key is everything Triton itself specialises on for these kernels: the kernel, its constexprs and launch
options, each tensor argument's dtype and 16-byte alignment (Triton assumes the alignment a pointer had when it
compiled), which optional arguments are None, and the plain ints that are not in ``do_not_specialize`` (the
caller passes them in ``key``). Token counts, K and strides are runtime ints of these kernels (never specialised),
so they never enter the key: a cached launch serves every T and K, which is what makes ``warmup`` cover graph
capture (capture then only reuses cached handles).

Where the direct launch is not known to match the installed Triton's launcher convention (the Triton interpreter,
Triton < 3.3 such as triton-ascend 3.2), ``launch`` calls the JIT launch every time: the same arguments, the same
results, only the host time differs.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["launch", "cache_size", "clear_cache", "direct_launch_supported"]

_cache: dict[tuple, _Compiled] = {}
_lock = threading.Lock()
_direct: bool | None = None


def direct_launch_supported() -> bool:
    """Whether the installed Triton's ``CompiledKernel.run`` takes all bound arguments in parameter order and the
    launch hooks from ``triton.knobs`` (Triton >= 3.3), the convention ``launch`` relies on."""
    global _direct
    if _direct is None:
        import triton
        from packaging.version import Version

        _direct = Version(triton.__version__.split("+")[0]) >= Version("3.3") and hasattr(triton, "knobs")
    return _direct


class _Compiled:
    """A compiled variant: its launcher, handle, packed metadata and the parameter layout of its arguments."""

    __slots__ = ("run", "function", "packed", "index", "defaults", "knobs")

    def __init__(self, kernel, compiled, constexprs: dict[str, Any], kwargs: dict[str, Any]):
        import triton

        self.run = compiled.run
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.knobs = triton.knobs.runtime
        params = kernel.params
        self.index = {p.name: i for i, p in enumerate(params)}
        # Every parameter the caller does not pass positionally: its constexpr value, else its default (keyword
        # runtime arguments are filled in per call).
        self.defaults = [constexprs.get(p.name, p.default) for p in params]
        for name in kwargs:
            self.defaults[self.index[name]] = None


def _arg_key(value) -> Any:
    # What Triton specialises a tensor argument on: dtype and 16-byte alignment; None is its own case.
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    return type(value)


def launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any], constexprs: dict[str, Any],
           key: tuple, *, interpreted: bool, stream: int | None = None) -> None:
    """Launch ``kernel[grid](*args, **kwargs, **constexprs)``.

    args: the leading positional arguments. kwargs: further runtime arguments by name (tensors or None, ints,
    floats). constexprs: compile-time arguments and launch options (num_warps, ...), the same for every call of
    one ``key``. key: a hashable tuple that, with the tensors' dtypes and alignments, identifies the compiled
    variant (the plan's compile key plus any specialised int such as H). interpreted: run through the JIT
    every time (the Triton interpreter). stream: the raw stream to launch on (CUDA: the current stream of the
    tensors' device); None asks Triton's driver.
    """
    if interpreted or not direct_launch_supported():
        kernel[grid](*args, **kwargs, **constexprs)
        return
    full_key = (id(kernel), key, tuple(map(_arg_key, args)), tuple((k, _arg_key(v)) for k, v in kwargs.items()))
    entry = _cache.get(full_key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs, **constexprs)
        if hasattr(compiled, "function") and hasattr(kernel, "params"):  # a JITFunction's CompiledKernel
            with _lock:
                _cache[full_key] = _Compiled(kernel, compiled, constexprs, kwargs)
        return
    knobs = entry.knobs
    if knobs.launch_enter_hook is not None or knobs.launch_exit_hook is not None:
        # A profiler's hooks want Triton's launch metadata: let the JIT build it.
        kernel[grid](*args, **kwargs, **constexprs)
        return
    values = list(args)
    values.extend(entry.defaults[len(args):])
    if kwargs:
        index = entry.index
        for name, value in kwargs.items():
            values[index[name]] = value
    if stream is None:
        import triton

        device = triton.runtime.driver.active.get_current_device()
        stream = triton.runtime.driver.active.get_current_stream(device)
    gx = grid[0]
    gy = grid[1] if len(grid) > 1 else 1
    gz = grid[2] if len(grid) > 2 else 1
    entry.run(gx, gy, gz, stream, entry.function, entry.packed, None, None, None, *values)


def cache_size() -> int:
    """Number of compiled variants with a cached direct launch."""
    return len(_cache)


def clear_cache() -> None:
    """Forget the cached launches (the compiled kernels stay in Triton's own caches)."""
    with _lock:
        _cache.clear()
