"""Tensor parallelism for the serving call: the all-reduce of the per-rank partial addend, then fused_attn_res_.

Under tensor parallelism a Kimi K3 decoder layer's attention and MoE outputs are partial sums, one per rank; the
layer all-reduces them and the AttnRes step adds the sum to the running residual. ``k3_ops.fused_attn_res_(...,
tp_group=group)`` (and ``fused_attn_res``) take the partial and the group and run::

    addend = kimi_k3::tp_all_reduce(partial, group_name)    # the sum over the ranks, rounded to the I/O dtype
    kimi_k3::fused_attn_res_(prefix_sum, addend, ...)        # today's add, snapshot, mix, norm

``tp_all_reduce`` is one op (schema in csrc_meta/library.cpp) whose kernel picks its path by ``tp_plan``:

- ``"fused"`` (CUDA, small messages): the one-shot all-reduce kernel (kernels/tp_all_reduce.py): one launch that
  copies the partial into this rank's symmetric buffer, meets the peers at a signal-pad barrier and sums every
  rank's rows over NVLink in rank order in FP32. Never NVLink multicast: this module sets
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (unless set) before it allocates, and calls no multicast API.
- ``"fallback"`` (larger messages, the CPU, other devices): ``torch.distributed.all_reduce`` (NCCL, gloo) of a
  copy of the partial; the caller's partial is never written.

The workspace: per (group, device) one symmetric buffer of bytes (``workspace``), allocated and rendezvous'd on
first use (a collective: every rank of the group calls the op with the same T, so they allocate together), grown
the same way when a larger message needs it, and never freed. Growing it is refused during CUDA-graph capture:
call ``warmup`` before capture. A producer may write its partial straight into the buffer (``partial_buffer``)
to skip the copy.

Determinism: the fused path's sum is the same bits on every rank (one fixed order). NCCL's is too, but in its own
order and, for bf16 / fp16, rounded to the dtype after each hop, so the two agree bit for bit for world size 2
(one addition, commutative) and within a few ulps of the sum beyond. docs/tp.md.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["ONE_SHOT_MAX_BYTES", "tp_plan", "forced_plan", "group_name_of", "world_size_of", "all_reduce",
           "reduce_addend", "fallback_all_reduce", "Workspace", "workspace", "partial_buffer", "warmup"]

#: The largest per-rank message (T * H * element size, bytes) the one-shot path takes, by world size; above it NCCL's
#: all-reduce runs. One-shot makes every rank read world_size - 1 full messages over NVLink, against NCCL's ring
#: that moves 2 (world_size - 1) / world_size of one, so it wins only where launch and hop latency dominate. Seeded
#: from vLLM's custom all-reduce rule (one-shot below 512 KiB at 4 GPUs, 256 KiB at 8) and not yet tuned on our
#: kernel: ``python -m k3_ops.bench tp`` under torchrun measures both paths side by side for the retune.
ONE_SHOT_MAX_BYTES = {1: 1 << 30, 2: 1 << 20, 4: 512 << 10, 8: 256 << 10}
_DEFAULT_ONE_SHOT_MAX_BYTES = 256 << 10  # other world sizes
_PLANS = ("fused", "fallback")
_forced: str | None = None


def tp_plan(T: int, H: int, world_size: int, dtype: torch.dtype, device: torch.device) -> str:
    """``"fused"`` (the one-shot symmetric-memory kernel) or ``"fallback"`` (torch.distributed.all_reduce) for one
    all-reduce of a [T, H] partial of ``dtype`` on ``device`` over ``world_size`` ranks. A pure function of its
    arguments (the same on every rank, so all ranks take the same path), unless ``forced_plan`` is active."""
    if _forced is not None:
        return _forced
    if torch.device(device).type != "cuda" or dtype == torch.float64:
        return "fallback"
    limit = ONE_SHOT_MAX_BYTES.get(int(world_size), _DEFAULT_ONE_SHOT_MAX_BYTES)
    return "fused" if T * H * dtype.itemsize <= limit else "fallback"


@contextlib.contextmanager
def forced_plan(plan: str | None) -> Iterator[None]:
    """Within the block every ``tp_all_reduce`` takes ``plan`` whatever the size rule says, and a group of one
    rank runs it too (instead of passing the partial through): for tests and benchmarks. Enter it on every rank.
    """
    global _forced
    if plan is not None and plan not in _PLANS:
        raise ValueError(f"plan must be one of {', '.join(_PLANS)} or None, got {plan!r}")
    previous, _forced = _forced, plan
    try:
        yield
    finally:
        _forced = previous


def group_name_of(group) -> str:
    """The group name of a ``ProcessGroup`` or a group name (``str``), as the op's schema takes it."""
    if isinstance(group, str):
        return group
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or its group name (str), got "
                        f"{type(group).__name__}")
    return name


def _resolve(group_name: str):
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(group_name)


def world_size_of(group) -> int:
    return (_resolve(group) if isinstance(group, str) else group).size()


def reduce_addend(addend: torch.Tensor | None, group) -> torch.Tensor | None:
    """The serving call's addend from this rank's partial: the sum over ``group``; the partial itself on a group of
    one rank (no kernel, no copy) and None without an addend. What ``fused_attn_res_(..., tp_group=)`` calls."""
    if addend is None or (_forced is None and world_size_of(group) == 1):
        return addend
    return torch.ops.kimi_k3.tp_all_reduce.default(addend, group_name_of(group))


def all_reduce(partial: torch.Tensor, group) -> torch.Tensor:
    """``kimi_k3::tp_all_reduce``: the sum of every rank's ``partial`` [T, H] (bf16 / fp16 / fp32 / fp64, any
    strides, never written) over ``group`` (a ProcessGroup or its name), as a new contiguous [T, H] of partial's
    dtype on every rank. Call it on every rank with the same shape and dtype."""
    return torch.ops.kimi_k3.tp_all_reduce.default(partial, group_name_of(group))


def fallback_all_reduce(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """The fallback path: torch.distributed.all_reduce (SUM) of a contiguous copy of ``partial``."""
    import torch.distributed as dist

    out = torch.empty(partial.shape, dtype=partial.dtype, device=partial.device)
    out.copy_(partial)
    dist.all_reduce(out, group=_resolve(group_name))
    return out


# --------------------------------------------------------------------------------------------------------------
# The symmetric-memory workspace (CUDA).
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workspace:
    """One rank's symmetric buffer for one group on one device, and what the kernel needs of it.

    buffer: uint8 [nbytes], this rank's symmetric allocation (partials are stored at its start, [T, H] contiguous).
    handle: the rendezvous handle. buffer_ptrs / signal_pad_ptrs: int64 [world_size] on the device, every rank's
    buffer and signal pad addresses (device tensors made once, so a captured graph reads them by address).
    max_programs: the most programs one launch may use, so that every (program, rank) pair has its signal-pad
    slot.
    """

    group_name: str
    rank: int
    world_size: int
    nbytes: int
    buffer: torch.Tensor
    handle: object
    buffer_ptrs: torch.Tensor
    signal_pad_ptrs: torch.Tensor
    max_programs: int


_WORKSPACES: dict[tuple[str, int], Workspace] = {}
# Program b of every rank must be resident at once for the barriers to complete: 128 programs of 8 warps fit on every
# GPU with NVLink peers (108 SMs on an A100, 132 on an H100, several such programs per SM); beyond it each program
# loops over more rows.
_MAX_PROGRAMS = 128
_MIN_WORKSPACE_BYTES = 1 << 20


def workspace(group_name: str, device: torch.device, min_bytes: int) -> Workspace:
    """This rank's workspace for ``group_name`` on ``device`` holding at least ``min_bytes``: the cached one, or a
    new one (a collective over the group: symmetric allocation plus rendezvous) when there is none or it is too
    small. Refused during CUDA-graph capture, where nothing may be allocated: call ``warmup`` first."""
    device = torch.device(device)
    key = (group_name, device.index if device.index is not None else torch.cuda.current_device())
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.nbytes >= min_bytes:
        return ws
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"tp_all_reduce needs a symmetric workspace of {min_bytes} bytes for group {group_name!r} "
                           f"on {device}, which holds {0 if ws is None else ws.nbytes}; it cannot grow during "
                           "CUDA-graph capture: call k3_ops.tp.warmup(group, hidden_size, dtype, device, "
                           "max_num_tokens) before capturing")
    # Peer loads only: no multicast object is created or used (see the module docstring).
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _SymmetricMemory

    nbytes = max(_MIN_WORKSPACE_BYTES, 1 << (int(min_bytes) - 1).bit_length())  # powers of two: few regrowths
    with torch.cuda.device(key[1]):
        # An allocation of its own (not symm_mem.empty's shared pool), so its signal pad is ours alone.
        buffer = _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, torch.device("cuda", key[1]))
        handle = symm_mem.rendezvous(buffer, group_name)
        world = handle.world_size
        # The handle's buffer pointers are its allocations' bases; the buffer sits at the same offset in every
        # rank's allocation (identical allocations), so each peer's copy of it is base + that offset.
        offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
        if not 0 <= offset < handle.buffer_size:
            raise RuntimeError(f"the symmetric buffer of group {group_name!r} lies outside its rendezvous "
                               f"allocation: offset {offset}, allocation size {handle.buffer_size}")
        pad_slots = symm_mem.get_signal_pad_size() // 4
        ws = Workspace(group_name, handle.rank, world, nbytes, buffer, handle,
                       torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64,
                                    device=buffer.device),
                       torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=buffer.device),
                       max(1, min(_MAX_PROGRAMS, pad_slots // world)))
    _WORKSPACES[key] = ws
    return ws


def partial_buffer(group, T: int, H: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A [T, H] contiguous view of this rank's workspace: a producer that writes its partial here (e.g. a GEMM's
    ``out=``) saves the fused path its copy. Call it on every rank (it may allocate, a collective). The view is
    overwritten by every tp_all_reduce on the group; a later, larger workspace does not include it (the op then
    copies it as any other tensor)."""
    ws = workspace(group_name_of(group), torch.device(device), T * H * dtype.itemsize)
    return ws.buffer[: T * H * dtype.itemsize].view(dtype).view(T, H)


def warmup(group, hidden_size: int, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
           max_num_tokens: int = 8192) -> None:
    """Before CUDA-graph capture: allocate the group's workspace for the largest message the fused path takes up to
    ``max_num_tokens`` and compile the kernel (one all-reduce of zeros). A collective: call it on every rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    name = group_name_of(group)
    world = world_size_of(group)
    T = max_num_tokens
    while T > 1 and tp_plan(T, hidden_size, world, dtype, device) != "fused":
        T //= 2
    if tp_plan(T, hidden_size, world, dtype, device) == "fused":
        workspace(name, device, T * hidden_size * dtype.itemsize)
        all_reduce(torch.zeros(1, hidden_size, dtype=dtype, device=device), name)
