"""The attn_res backward launch, shared by the CUDA and the NPU launch policies.

Their plan steps decide *how* to launch (a ``BackwardPlan``, backends/__init__.py: how many programs, the hidden
tile, warps or Ascend options; ``cuda_plan.backward_plan``, ``npu_plan.backward_plan``); this module does what is
identical on both devices: the trivial cases that never launch, output and workspace allocation, the stride
arithmetic, and the launches of ``k3_ops.kernels.attn_res_bwd`` (the gradient kernel, or the CUDA C++ single-read
kernel, then the fixed-order weight-gradient reduction, which the single-read kernel's ring layout does itself). The
reduction also applies the chain rule through ``w = norm_weight * proj_weight``: it writes each weight's gradient
(the folded weight's times the other weight) in the weight's own dtype, so no launch follows it.

Memory: besides the outputs themselves, one workspace [num_programs, H] (fp64; fp32 without FP64), where
num_programs is bounded by the device, not by T, and, only when grad_out's hidden dimension is not unit-stride
(e.g. the expanded gradient of ``out.sum()``), a contiguous copy of grad_out. Nothing of size T x K x H beyond
grad_block_residual.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import triton

from .. import reference
from ..kernels import attn_res_bwd as _bwd
from . import BackwardPlan, _launch, hidden_strided, next_power_of_2, prepare_weights, stride_vec
from .cuda_plan import RING_LAYOUT

__all__ = ["BackwardPlan", "trivial_attn_res_backward", "run_attn_res_backward", "REDUCE_BLOCK_P",
           "REDUCE_BLOCK_H"]

#: Tile of the weight-gradient reduction: rows of the workspace summed per step, columns per program. A narrow
#: column tile, so that the grid has enough programs (H / 32 = 224 at H = 7168) to spread the workspace's rows.
REDUCE_BLOCK_P = 64
REDUCE_BLOCK_H = 32


def trivial_attn_res_backward(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                              norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                              eps: float, output_mask: Sequence[bool]):
    """The backward cases that never launch a kernel, identical on every device; None when a kernel must run.

    fp64 inputs (computed in fp64 by the reference on the tensors' own device), T = 0, and K = 0 (p = 1 exactly:
    grad_prefix_sum is a contiguous copy of grad_out, grad_block_residual and both weights' gradients zeros).
    """
    if prefix_sum.dtype == torch.float64 or prefix_sum.size(0) == 0 or num_valid_blocks == 0:
        return reference.attn_res_backward_reference(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                     num_valid_blocks, eps, output_mask)
    return None


def run_attn_res_backward(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                          norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                          output_mask: Sequence[bool], plan: BackwardPlan,
                          raw: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate the outputs on prefix_sum's device and launch the backward kernels on ``raw`` views of them.

    Arguments are already checked (``k3_ops._C.check_attn_res_backward``) and non-trivial (see
    ``trivial_attn_res_backward``). ``raw`` maps a device tensor to the tensor handed to Triton (identity
    except for the NPU test seam). Returns the schema's (grad_prefix_sum, grad_block_residual, grad_norm_weight,
    grad_proj_weight).
    """
    want_prefix, want_blocks, want_norm, want_proj = (bool(m) for m in output_mask)
    want_w = want_norm or want_proj
    T, C, H = block_residual.shape
    K = int(num_valid_blocks)
    dev = prefix_sum.device
    nw, pw = prepare_weights(norm_weight, proj_weight)
    nothing = torch.empty((0,), dtype=prefix_sum.dtype, device=dev)
    grad_prefix = torch.empty((T, H), dtype=prefix_sum.dtype, device=dev) if want_prefix else nothing
    grad_blocks = (torch.empty((T, C, H), dtype=block_residual.dtype, device=dev) if want_blocks
                   else torch.empty((0,), dtype=block_residual.dtype, device=dev))
    # Each weight's gradient in its shape and dtype. The kernels store the dtypes they read (prepare_weights): a
    # weight of another dtype gets an FP32 [H] from them, cast after the launches.
    grad_norm, grad_proj = (torch.empty(t.shape if wanted else (0,), dtype=t.dtype, device=dev)
                            for t, wanted in ((norm_weight, want_norm), (proj_weight, want_proj)))

    def kernel_target(grad: torch.Tensor, prepared: torch.Tensor, wanted: bool) -> torch.Tensor:
        # What the kernels store into: the output itself wherever its dtype is the one the kernels read.
        if not wanted or grad.dtype == prepared.dtype:
            return grad
        return torch.empty((H,), dtype=prepared.dtype, device=dev)

    stored_norm, stored_proj = kernel_target(grad_norm, nw, want_norm), kernel_target(grad_proj, pw, want_proj)
    if not (want_prefix or want_blocks or want_w):
        return grad_prefix, grad_blocks, grad_norm, grad_proj

    folded = False  # the weight gradient reduced inside the gradient kernel (its ring layout)
    # The gradient kernel's token ranges (for "stats_apply": the apply kernel's; the statistics kernel has its own).
    tokens_per_prog = triton.cdiv(T, max(1, min(plan.apply_programs or plan.num_programs, T)))
    programs = triton.cdiv(T, tokens_per_prog)  # every program gets at least one token
    ws = (_launch.scratch((programs, H), torch.float64 if plan.acc64 else torch.float32, dev) if want_w
          else None)

    # Strides come from the tensors handed to Triton (under the NPU test seam the device tensors' own strides are
    # not the backing memory's).
    gy, x, blocks = raw(grad_out), raw(prefix_sum), raw(block_residual)
    if gy.size(1) > 1 and gy.stride(1) != 1:
        _launch.unrecordable()  # a copy outside the recorded launches
        gy = gy.contiguous()  # e.g. the expanded ones of out.sum(): the kernel reads unit-stride grad_out rows
    # Unwritten outputs get a stand-in pointer of the same dtype (never dereferenced: the flag is off), so that
    # masked calls do not add pointer-dtype variants to the compile key.
    gp = raw(grad_prefix) if want_prefix else gy
    gb = raw(grad_blocks) if want_blocks else gy
    h_strided = hidden_strided((x, 1), (blocks, 2))
    # The Triton interpreter (CPU tensors, or TRITON_INTERPRET=1) launches through the JIT every time.
    interpreted = x.device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"
    vec = stride_vec(x.dtype, (x.stride(0), blocks.stride(0), blocks.stride(1), gy.stride(0), H, C * H))
    args = (gy, x, blocks, raw(nw), raw(pw), gp, gb, raw(ws) if want_w else gy,
            T, K, C, H, float(eps), tokens_per_prog,
            gy.stride(0) // vec, x.stride(0) // vec, x.stride(1), blocks.stride(0) // vec, blocks.stride(1) // vec,
            blocks.stride(2), H // vec, (C * H) // vec, H // vec)
    compile_options = dict(plan.compile_options)
    flags = dict(BLOCK_H=plan.block_h, K_PAD=plan.k_pad, VEC=vec, H_STRIDED=h_strided, WRITE_PREFIX=want_prefix,
                 WRITE_BLOCKS=want_blocks, COMPUTE_DW=want_w, ACC64=plan.acc64, NUM_STAGES=plan.num_stages,
                 **dict(plan.launch_options), **compile_options)
    if plan.kernel == "stats_apply":
        assert plan.block_h >= H and not plan.df, "stats_apply is the CUDA whole-row plan and has no DF variant"
        _launch.unrecordable()  # JIT launches (large T, where the host path is not what the call waits for)
        # Three launches, tensors between them O(T x K): chunk partials of the statistics [T, chunks, 3, K_PAD],
        # then the per-token scalars [T, N_SCALARS, K_PAD] FP32.
        chunks = triton.cdiv(H, plan.apply_block)
        part = torch.empty((T, chunks, 3, plan.k_pad), dtype=torch.float64 if plan.acc64 else torch.float32,
                           device=dev)
        scalars = torch.empty((T, _bwd.N_SCALARS.value, plan.k_pad), dtype=torch.float32, device=dev)
        stats_tpp = triton.cdiv(T, max(1, min(plan.num_programs, T)))
        _bwd.attn_res_bwd_stats_kernel[(triton.cdiv(T, stats_tpp), chunks)](
            gy, x, blocks, raw(nw), raw(pw), raw(part), T, K, H, stats_tpp, *args[14:20],
            BLOCK_C=plan.apply_block, K_PAD=plan.k_pad, VEC=vec, H_STRIDED=h_strided, ACC64=plan.acc64,
            NUM_STAGES=plan.num_stages, **dict(plan.launch_options), **compile_options)
        sc_tpp = triton.cdiv(T, max(1, min(plan.scalars_programs or plan.apply_programs * chunks, T)))
        _bwd.attn_res_bwd_scalars_kernel[(triton.cdiv(T, sc_tpp),)](
            raw(part), raw(scalars), T, K, H, float(eps), chunks, sc_tpp, K_PAD=plan.k_pad,
            CHUNKS_PAD=next_power_of_2(chunks), ACC64=plan.acc64, num_warps=1, **compile_options)
        apply_args = args[:5] + (raw(scalars),) + args[5:12] + args[13:]  # no eps
        _bwd.attn_res_bwd_apply_kernel[(programs, chunks)](
            *apply_args, BLOCK_C=plan.apply_block, K_PAD=plan.k_pad, VEC=vec, H_STRIDED=h_strided,
            WRITE_PREFIX=want_prefix, WRITE_BLOCKS=want_blocks, COMPUTE_DW=want_w, ACC64=plan.acc64,
            NUM_STAGES=plan.apply_num_stages, **dict(plan.apply_options), **compile_options)
    elif plan.kernel == "single_read":
        # CUDA C++ (csrc_cuda/attn_res_bwd.cu): every token read once; the launch policy checked its layout rules.
        from .. import _C

        # The ring layout sums the weight gradient in the kernel (a cooperative launch): no reduction launch.
        folded = want_w and plan.vectors_per_thread == RING_LAYOUT
        single_read = (gy, x, blocks, nw, pw, grad_prefix if want_prefix else None,
                       grad_blocks if want_blocks else None, ws, stored_norm if folded and want_norm else None,
                       stored_proj if folded and want_proj else None)
        _launch.launch_native("single_read", single_read, (K, tokens_per_prog, programs, plan.vectors_per_thread),
                              (eps,))
        _C.attn_res_bwd_single_read(*single_read, K, float(eps), tokens_per_prog, programs, plan.vectors_per_thread)
    elif plan.kernel == "rows":
        assert plan.block_h >= H and not plan.df, "the rows backward holds a whole row and has no DF variant"
        _launch.launch(_bwd.attn_res_bwd_rows_kernel, (programs,), args, {}, (plan, *flags.items()), lambda: flags,
                       ntensors=8, interpreted=interpreted)
    else:
        tiles_flags = dict(flags, DF=plan.df and not plan.acc64, PREFIX_ROW_SUM=plan.prefix_row_sum)
        _launch.launch(_bwd.attn_res_bwd_kernel, (programs,), args, {}, (plan, *tiles_flags.items()),
                       lambda: tiles_flags, ntensors=8, interpreted=interpreted)
    if want_w and not folded:  # the ring reduced it in its own launch
        block = min(REDUCE_BLOCK_H, next_power_of_2(H))
        reduce_flags = dict(WRITE_NORM=want_norm, WRITE_PROJ=want_proj, BLOCK_P=REDUCE_BLOCK_P, BLOCK_H=block,
                            **dict(plan.reduce_options or plan.launch_options), **compile_options)
        # An output not asked for gets the other's pointer as a stand-in (never written: its flag is off).
        gn = raw(stored_norm if want_norm else stored_proj)
        gj = raw(stored_proj if want_proj else stored_norm)
        _launch.launch(_bwd.attn_res_bwd_dw_reduce_kernel, (triton.cdiv(H, block),),
                       (raw(ws), raw(nw), raw(pw), gn, gj, programs, H), {}, (plan, block, want_norm, want_proj),
                       lambda: reduce_flags, ntensors=5, interpreted=interpreted)
    for grad, stored in ((grad_norm, stored_norm), (grad_proj, stored_proj)):
        if stored is not grad:  # a weight dtype the kernels do not store: their FP32 product, rounded here
            _launch.unrecordable()
            grad.view(-1).copy_(stored)
    return grad_prefix, grad_blocks, grad_norm, grad_proj
