"""The lean launch path shared by the CUDA and PrivateUse1 policies: launch a @triton.jit kernel through its
compiled handle, cached per compile key, without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds every argument, computes Triton's specialisation key and looks the
compiled kernel up on each call: tens of microseconds of host time for the kernels here (about 30 arguments).
``launch`` does that once per compile key (the first call of a key goes through the JIT, which compiles or loads
the kernel and returns its ``CompiledKernel``) and afterwards calls the compiled kernel's launcher directly with
the arguments in the kernel's parameter order.

The key is everything Triton itself specialises on for these kernels: the kernel, its constexprs and launch
options (the caller's ``key``), each tensor argument's dtype and 16-byte alignment (Triton assumes the alignment a
pointer had when it compiled), which optional arguments are None, and for every int parameter not in
``do_not_specialize`` whether it is 1 or a multiple of 16. Token counts, K and strides are runtime ints of these
kernels (in ``do_not_specialize``), so they never enter the key: a cached launch serves every T and K, which is
what makes ``warmup`` cover graph capture (capture then only reuses cached handles).

Where the direct launch is not known to match the installed Triton's launcher convention (the Triton interpreter,
Triton < 3.3 such as triton-ascend 3.2), ``launch`` calls the JIT launch every time: the same arguments, the same
results, only the host time differs.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
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


_specialised: dict[int, frozenset] = {}


def _specialised_ints(kernel) -> frozenset:
    """Positions and names of the parameters Triton specialises when they are ints (1, or a multiple of 16):
    every non-constexpr parameter not in the kernel's ``do_not_specialize``. Their specialisation is part of the
    cache key, so no cached launch ever runs a variant compiled for another value class."""
    spec = _specialised.get(id(kernel))
    if spec is None:
        params = getattr(kernel, "params", [])
        spec = _specialised[id(kernel)] = frozenset(
            x for i, p in enumerate(params) if not p.is_constexpr and not p.do_not_specialize for x in (i, p.name))
    return spec


def _hooked(hook) -> bool:
    # A launch hook is set: a callable, or a non-empty chain (Triton >= 3.4 keeps an always-present HookChain).
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _arg_key(value) -> Any:
    # What Triton specialises a tensor argument on: dtype and 16-byte alignment; None is its own case.
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    return type(value)


def launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any], key: tuple,
           constexprs: Callable[[], dict[str, Any]], *, ntensors: int, interpreted: bool,
           stream: int | None = None) -> None:
    """Launch ``kernel[grid](*args, **kwargs, **constexprs())``.

    args: the leading positional arguments, of which the first ``ntensors`` are tensors (the others ints and
    floats, never specialised by these kernels). kwargs: further runtime arguments by name (tensors or None, ints,
    floats). key: a hashable tuple identifying the compile-time configuration (constexprs and launch options);
    with the tensors' dtypes and alignments and the specialised ints it identifies the compiled variant.
    constexprs: builds the compile-time arguments and launch options (num_warps, ...) for ``key``; called only
    when the variant is not cached yet (or under the interpreter). interpreted: run through the JIT every time
    (the Triton interpreter). stream: the raw stream to launch on (CUDA: the current stream of the tensors'
    device); None asks Triton's driver.
    """
    if interpreted or not direct_launch_supported():
        kernel[grid](*args, **kwargs, **constexprs())
        return
    specialised = _specialised_ints(kernel)
    full_key = (id(kernel), key, *[(a.dtype, a.data_ptr() % 16 == 0) for a in args[:ntensors]],
                *[(k, _arg_key(v)) for k, v in kwargs.items()],
                *[(v == 1, v % 16 == 0) for i, v in enumerate(args) if i in specialised and isinstance(v, int)],
                *[(v == 1, v % 16 == 0) for k, v in kwargs.items() if k in specialised and isinstance(v, int)])
    entry = _cache.get(full_key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs, **constexprs())
        if hasattr(compiled, "function") and hasattr(kernel, "params"):  # a JITFunction's CompiledKernel
            with _lock:
                _cache[full_key] = _Compiled(kernel, compiled, constexprs(), kwargs)
        return
    knobs = entry.knobs
    if _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):
        # A profiler's hooks want Triton's launch metadata: let the JIT build it.
        kernel[grid](*args, **kwargs, **constexprs())
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
    entry.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, entry.function,
              entry.packed, None, None, None, *values)


def cache_size() -> int:
    """Number of compiled variants with a cached direct launch."""
    return len(_cache)


def clear_cache() -> None:
    """Forget the cached launches (the compiled kernels stay in Triton's own caches)."""
    with _lock:
        _cache.clear()
