"""The lean launch path shared by the CUDA and PrivateUse1 policies: launch a @triton.jit kernel through its
compiled handle, cached per compile key, without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds every argument, computes Triton's specialisation key and looks the
compiled kernel up on each call: host time that a decode-size call waits for, with about 30 arguments per kernel
here (docs/kernels.md, "Launch path").
``launch`` does that once per compile key (the first call of a key goes through the JIT, which compiles or loads
the kernel and returns its ``CompiledKernel``) and afterwards calls the compiled kernel's launcher directly with
the arguments in the kernel's parameter order.

The key is everything Triton itself specialises on for these kernels: the kernel, its constexprs and launch
options (the caller's ``key``), each tensor argument's dtype and 16-byte alignment (Triton assumes the alignment a
pointer had when it compiled), which optional arguments are None, and for every int parameter not in
``do_not_specialize`` whether it is 1 or a multiple of 16. Token counts, K and strides are runtime ints of these
kernels (in ``do_not_specialize``), so they never enter the key: a cached launch serves every T and K, which is
what makes ``warmup`` cover graph capture (capture then only reuses cached handles).

Recording (CUDA builds of k3_ops._C): the C++ CUDA kernel of every kimi_k3 op (csrc_cuda/launch_cache.cpp) calls
the op's Python kernel through ``record_call`` the first time it sees a call's metadata. While that call runs,
``launch`` notes every launch (compiled function, grid, block, shared memory, PDL, arguments), ``scratch`` every
buffer the launches use besides the op's inputs and outputs, and ``launch_native`` the CUDA C++ kernels; any
other device work of the policy (a copy, a cast, a JIT launch outside ``launch``) calls ``unrecordable``. The
recipe names each pointer argument by its role (input i, output j, scratch k), so that C++ replays it for later
calls with the same metadata without entering Python.

Where the direct launch is not known to match the installed Triton's launcher convention (the Triton interpreter,
Triton < 3.3 such as triton-ascend 3.2), ``launch`` calls the JIT launch every time: the same arguments, the same
results, only the host time differs.
"""
from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["launch", "launch_native", "scratch", "unrecordable", "record_call", "cache_size", "clear_cache",
           "direct_launch_supported"]

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

    __slots__ = ("run", "function", "packed", "index", "defaults", "knobs", "params", "launch")

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
        self.params, self.launch = _replay_layout(kernel, compiled)


#: Bytes and packing of each scalar parameter type Triton's launcher passes (others are not recorded).
_SCALAR_PACK = {"i32": ("<I", 0xFFFFFFFF), "u32": ("<I", 0xFFFFFFFF), "i64": ("<Q", (1 << 64) - 1),
                "u64": ("<Q", (1 << 64) - 1), "fp32": ("<f", None), "fp64": ("<d", None)}


def _replay_layout(kernel, compiled) -> tuple[tuple | None, tuple | None]:
    """What C++ needs to launch ``compiled`` as Triton's launcher does: the non-constexpr parameters in order as
    (position, type) from the compiled source's signature, and (function, block, shared, num_ctas, pdl,
    cooperative). (None, None) when the kernel needs something the replay does not do (global or profile scratch,
    tensor descriptors, oversized shared memory, a parameter type it does not pack)."""
    src, md = getattr(compiled, "src", None), getattr(compiled, "metadata", None)
    signature = getattr(src, "signature", None)
    if not isinstance(signature, dict) or md is None:
        return None, None
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0) or md.shared > 228 * 1024:
        return None, None
    if getattr(md, "tensordesc_meta", None) or "gsan" in getattr(md, "instrumentation_mode", ""):
        return None, None
    params = []
    for i, p in enumerate(kernel.params):
        ty = signature.get(p.name)
        if ty == "constexpr":
            continue
        if not isinstance(ty, str) or not (ty.startswith("*") or ty in _SCALAR_PACK):
            return None, None
        params.append((i, ty))
    launch = (int(compiled.function), 32 * md.num_warps, int(md.shared), int(getattr(md, "num_ctas", 1)),
              bool(getattr(md, "launch_pdl", False)), bool(getattr(md, "launch_cooperative_grid", False)))
    return tuple(params), launch


class _Recorder:
    """The launches of one op call, for C++ replay (see the module docstring)."""

    def __init__(self):
        self.launches: list[tuple] = []  # ("triton", launch, grid, [(type, value)]) | ("single_read", ...)
        self.scratch: list[torch.Tensor] = []
        self.valid = True

    def recipe(self, inputs: tuple, outputs: tuple) -> tuple | None:
        """(scratch specs, launches) with every pointer named by role: (0 constant, bits), (1 input, position),
        (2 output, position), (3 scratch, number), (4 null); None when some pointer has no role."""
        if not self.valid or not self.launches:
            return None
        roles: dict[int, tuple[int, int]] = {}

        def name(tensors, role: int) -> bool:
            for i, t in enumerate(tensors):
                if isinstance(t, torch.Tensor) and t.numel() > 0:
                    if t.data_ptr() in roles:
                        return False  # two roles at one address: ambiguous
                    roles[t.data_ptr()] = (role, i)
            return True

        if not (name(inputs, 1) and name(outputs, 2) and name(self.scratch, 3)):
            return None

        def pointer(t) -> tuple[int, int, int] | None:
            ptr = t.data_ptr() if isinstance(t, torch.Tensor) else int(t or 0)
            if ptr == 0:
                return (4, 0, 0)
            role = roles.get(ptr)
            return None if role is None else (role[0], role[1], 0)

        launches = []
        for entry in self.launches:
            if entry[0] in NATIVE_KERNELS:
                slots = [(4, 0, 0) if t is None else pointer(t) for t in entry[1]]
                if any(s is None for s in slots):
                    return None
                launches.append((entry[0], slots, entry[2], entry[3]))
                continue
            _, launch, grid, values = entry
            args = []
            for ty, value in values:
                if ty.startswith("*"):
                    slot = pointer(value)
                    if slot is None:
                        return None
                    args.append(slot)
                else:
                    fmt, mask = _SCALAR_PACK[ty]
                    raw = struct.pack(fmt, value & mask if mask else value)
                    args.append((0, 0, int.from_bytes(raw, "little")))
            function, block, shared, num_ctas, pdl, coop = launch
            launches.append(("triton", function, list(grid), block, shared, num_ctas, pdl, coop, args))
        scratch = [(list(t.shape), list(t.stride()), t.dtype) for t in self.scratch]
        return scratch, launches


_local = threading.local()
_recording = 0  # recordings in progress on any thread (launch's fast check)


def _recorder() -> _Recorder | None:
    return getattr(_local, "recorder", None) if _recording else None


def unrecordable() -> None:
    """The policy does device work that no recipe can replay (a copy, a cast, a launch outside ``launch``): the
    call being recorded, if any, keeps the Python path."""
    rec = _recorder()
    if rec is not None:
        rec.valid = False


def scratch(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty(shape)`` for a buffer the launches fill before they read it (never read uninitialised): a
    replay allocates a new one of the same layout."""
    t = torch.empty(shape, dtype=dtype, device=device)
    rec = _recorder()
    if rec is not None:
        rec.scratch.append(t)
    return t


#: The CUDA C++ kernels a recipe can replay (csrc_cuda/launch_cache.cpp), by the name ``launch_native`` takes.
NATIVE_KERNELS = ("single_read", "cluster_fwd")


def launch_native(name: str, tensors: tuple, ints: tuple[int, ...], floats: tuple[float, ...]) -> None:
    """Note a launch of one of k3_ops._C's CUDA C++ kernels (the caller launches it): "single_read", the
    backward of csrc_cuda/attn_res_bwd.cu, with its 10 tensors (or None), (K, tokens_per_prog, grid,
    vectors_per_thread) and (eps,); "cluster_fwd", the forward of csrc_cuda/attn_res_cluster.cu, with (prefix,
    blocks, norm_weight, proj_weight, out, addend, new_prefix, out_norm_weight, scale; each of the last four or
    None), (K, cluster_size, pdl, write_idx, inplace_prefix, norm_rounded_mix, fp8_kind, norm_gram) and (eps,
    out_eps, fp8_max, gram_tau)."""
    rec = _recorder()
    if rec is not None:
        if name not in NATIVE_KERNELS:
            rec.valid = False
        else:
            rec.launches.append((name, tuple(tensors), tuple(int(i) for i in ints), tuple(float(f) for f in floats)))


def record_call(fn, args: tuple, kwargs: dict, record: bool):
    """Run one op's Python kernel ``fn(*args, **kwargs)`` for the C++ CUDA kernel; returns (its result, the
    recipe of its launches or None, ``triton.knobs.runtime`` or None). Nothing is recorded unless ``record``."""
    global _recording
    if not record:
        return fn(*args, **kwargs), None, None
    rec = _Recorder()
    with _lock:
        _recording += 1
    _local.recorder = rec
    try:
        result = fn(*args, **kwargs)
    finally:
        _local.recorder = None
        with _lock:
            _recording -= 1
    outputs = result if isinstance(result, tuple) else (result,)
    # The inputs by schema position: the C++ kernel passes the keyword-only arguments (fused_attn_res.full's sum_out)
    # in schema order after the positional ones.
    recipe = rec.recipe((*args, *kwargs.values()), outputs) if direct_launch_supported() else None
    knobs = None
    if recipe is not None:
        import triton

        knobs = triton.knobs.runtime
    return result, recipe, knobs


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
    rec = _recorder()
    if interpreted or not direct_launch_supported():
        if rec is not None:
            rec.valid = False
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
            entry = _Compiled(kernel, compiled, constexprs(), kwargs)
            with _lock:
                _cache[full_key] = entry
            if rec is not None:
                _note(rec, entry, grid, _values(entry, args, kwargs))
        elif rec is not None:
            rec.valid = False
        return
    knobs = entry.knobs
    if _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):
        # A profiler's hooks want Triton's launch metadata: let the JIT build it.
        if rec is not None:
            rec.valid = False
        kernel[grid](*args, **kwargs, **constexprs())
        return
    values = _values(entry, args, kwargs)
    if rec is not None:
        _note(rec, entry, grid, values)
    if stream is None:
        import triton

        device = triton.runtime.driver.active.get_current_device()
        stream = triton.runtime.driver.active.get_current_stream(device)
    entry.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, entry.function,
              entry.packed, None, None, None, *values)


def _values(entry: _Compiled, args: tuple, kwargs: dict) -> list:
    # Every parameter's value in the kernel's order: the positional arguments, then defaults and keywords.
    values = list(args)
    values.extend(entry.defaults[len(args):])
    if kwargs:
        index = entry.index
        for name, value in kwargs.items():
            values[index[name]] = value
    return values


def _note(rec: _Recorder, entry: _Compiled, grid: tuple, values: list) -> None:
    if entry.params is None:
        rec.valid = False
        return
    rec.launches.append(("triton", entry.launch, tuple(grid), [(ty, values[i]) for i, ty in entry.params]))


def cache_size() -> int:
    """Number of compiled variants with a cached direct launch."""
    return len(_cache)


def clear_cache() -> None:
    """Forget the cached launches and the C++ launch recipes (the compiled kernels stay in Triton's own caches)."""
    with _lock:
        _cache.clear()
    clear_recipes()


def clear_recipes() -> None:
    """Forget the C++ CUDA kernels' launch recipes (after a change to the launch policy: each key's next call runs
    the Python policy again)."""
    from .. import _C

    clear = getattr(_C, "clear_launch_recipes", None)
    if clear is not None:
        clear()
