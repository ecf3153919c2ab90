"""CUDA launch policy of ``kimi_k3::tp_all_reduce``: the size rule (k3_ops.tp.tp_plan), then the one-shot kernel
(kernels/tp_all_reduce.py) on the group's symmetric workspace, or torch.distributed.all_reduce.

The per-call path is: plan, workspace lookup (a dict hit after the first call), allocate the output, one launch.
The grid depends on T and the world size only (the same on every rank, which the kernel's blockwise barrier
needs); nothing per call is a compile key (T, H, rank and strides are runtime arguments).
"""
from __future__ import annotations

import torch

from .. import tp
from ..kernels.tp_all_reduce import tp_one_shot_all_reduce_kernel
from . import next_power_of_2

__all__ = ["tp_all_reduce", "one_shot_all_reduce"]

_MAX_BLOCK_H = 4096  # one masked tile per row chunk: 8 KiB of bf16 per rank and load


def tp_all_reduce(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """kimi_k3::tp_all_reduce on a CUDA tensor; arguments already checked."""
    T, H = partial.shape
    world = tp.world_size_of(group_name)
    if tp.tp_plan(T, H, world, partial.dtype, partial.device) == "fallback":
        return tp.fallback_all_reduce(partial, group_name)
    return one_shot_all_reduce(partial, tp.workspace(group_name, partial.device, T * H * partial.element_size()))


def one_shot_all_reduce(partial: torch.Tensor, ws: tp.Workspace) -> torch.Tensor:
    """The sum over the workspace's ranks of every rank's [T, H] ``partial``, in rank order in FP32, rounded to its
    dtype: a new contiguous [T, H]. ``partial`` is copied into the workspace unless it is the workspace's own
    [T, H] view (``tp.partial_buffer``)."""
    T, H = partial.shape
    out = torch.empty((T, H), dtype=partial.dtype, device=partial.device)
    if T == 0:
        return out
    in_place = (partial.data_ptr() == ws.buffer.data_ptr() and partial.is_contiguous())
    block_h = min(next_power_of_2(H), _MAX_BLOCK_H)
    grid = (min(T, ws.max_programs),)
    with torch.cuda.device(partial.device):
        tp_one_shot_all_reduce_kernel[grid](
            partial, partial.stride(0), partial.stride(1), out, ws.buffer_ptrs, ws.signal_pad_ptrs, T, H, ws.rank,
            WORLD_SIZE=ws.world_size, BLOCK_H=block_h, COPY=not in_place, num_warps=8 if block_h >= 2048 else 4)
    return out
