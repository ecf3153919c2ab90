"""One-shot all-reduce of per-rank partials over symmetric memory (peer loads over NVLink, no multicast).

Every rank holds a symmetric buffer (torch.distributed._symmetric_memory: the same size on every rank, each
rank's buffer mapped into every peer's address space) and a signal pad beside it. One launch per rank:

1. each program copies its rows of the caller's partial into this rank's buffer (skipped when the partial already
   lives there, ``COPY=False``);
2. barrier A (release / acquire, system scope): program b of every rank has stored its rows;
3. each program loads its rows from every rank's buffer in rank order 0, 1, ..., world_size - 1, sums them in FP32
   and stores the sum rounded once to the I/O dtype: the same order on every rank, so every rank gets the same
   bits;
4. barrier B: program b of every rank has finished reading, so when this launch ends no peer still reads this
   rank's buffer and the next writer of it (the next call, or a producer writing its partial straight into it)
   may overwrite it.

Rows are dealt to programs round-robin (row t to program t % grid). The grid is a function of T and the world size
only, so program b covers the same rows on every rank and a barrier between programs of the same index suffices
(the blockwise barrier of torch's one-shot all-reduce, CUDASymmetricMemoryOps.cu); it needs program b of every rank
resident at once, so the grid stays below what any GPU of the group holds together (k3_ops/tp.py caps it). Signal
pad slot ``[b * world_size + src]`` of rank dst is the channel from program b of rank src to rank dst: 0 empty, 1
signalled. A sender CASes 0 -> 1 (waiting while its previous signal there is unconsumed), a receiver CASes
1 -> 0, so every slot is 0 again after each barrier and the same slots serve both barriers of every launch.

No torch here: the launch is k3_ops/backends/tp_cuda.py.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _blockwise_barrier(signal_pad_ptrs, block_id, rank, WORLD_SIZE: tl.constexpr, SEND_SEM: tl.constexpr,
                       WAIT_SEM: tl.constexpr):
    # The CTA barrier first: the release below is issued by one thread and must cover every thread's stores (and,
    # for barrier B, every thread's loads having returned).
    tl.debug_barrier()
    for peer in tl.static_range(WORLD_SIZE):
        pad = tl.load(signal_pad_ptrs + peer).to(tl.pointer_type(tl.int32))
        slot = pad + block_id * WORLD_SIZE + rank
        old = tl.atomic_cas(slot, 0, 1, sem=SEND_SEM, scope="sys")
        while old != 0:
            old = tl.atomic_cas(slot, 0, 1, sem=SEND_SEM, scope="sys")
    own = tl.load(signal_pad_ptrs + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD_SIZE):
        slot = own + block_id * WORLD_SIZE + peer
        old = tl.atomic_cas(slot, 1, 0, sem=WAIT_SEM, scope="sys")
        while old != 1:
            old = tl.atomic_cas(slot, 1, 0, sem=WAIT_SEM, scope="sys")
    tl.debug_barrier()


@triton.jit
def tp_one_shot_all_reduce_kernel(partial_ptr, stride_pt, stride_ph, out_ptr, buffer_ptrs, signal_pad_ptrs, T, H,
                                  rank, WORLD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, COPY: tl.constexpr):
    """out[t] = round(sum over ranks r = 0..WORLD_SIZE-1 of partial_r[t]) for the rows t of this program.

    partial_ptr: this rank's [T, H] partial at strides (stride_pt, stride_ph); read only with COPY. out_ptr: [T, H]
    contiguous, the I/O dtype (the partial's). buffer_ptrs / signal_pad_ptrs: int64 [WORLD_SIZE] device arrays of
    every rank's symmetric buffer (the partial rows at [t * H + h], I/O dtype) and signal pad (int32 slots). T, H,
    rank: runtime values (no recompilation per token count or rank); WORLD_SIZE, BLOCK_H and COPY are the compile
    key.
    """
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_H)
    dtype = out_ptr.dtype.element_ty
    local = tl.load(buffer_ptrs + rank).to(out_ptr.dtype)  # out_ptr's type: a pointer to the I/O dtype
    if COPY:
        for t in range(pid, T, grid):
            for h0 in range(0, H, BLOCK_H):
                h = h0 + offs
                mask = h < H
                v = tl.load(partial_ptr + t * stride_pt + h * stride_ph, mask=mask)
                tl.store(local + t * H + h, v, mask=mask)
    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE, "release", "acquire")
    for t in range(pid, T, grid):
        for h0 in range(0, H, BLOCK_H):
            h = h0 + offs
            mask = h < H
            # volatile: the peers' rows were written by other GPUs during this kernel; never serve them from a
            # cache line this SM may hold from before barrier A.
            first = tl.load(buffer_ptrs).to(out_ptr.dtype)
            acc = tl.load(first + t * H + h, mask=mask, other=0.0, volatile=True).to(tl.float32)
            for r in tl.static_range(1, WORLD_SIZE):
                peer = tl.load(buffer_ptrs + r).to(out_ptr.dtype)
                acc += tl.load(peer + t * H + h, mask=mask, other=0.0, volatile=True).to(tl.float32)
            tl.store(out_ptr + t * H + h, acc.to(dtype), mask=mask)
    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE, "release", "relaxed")
