"""Launch policies: how a checked kimi_k3 call becomes kernel launches, on NVIDIA GPUs and on Ascend NPUs.

Every call takes one straight path: trivial cases (no kernel) -> outputs -> **plan** -> **launch**. The plan step is
pure (call metadata and device facts in, a frozen plan out; no triton, no GPU), the launch step turns a plan and
the tensors into launches. The modules, by concern (arrows point down the list, never up):

- ``cuda_table.py``  the CUDA launch table: which kernel and configuration each (T, K) gets, rule by rule.
- ``cuda_plan.py``   the CUDA plan step: a table entry resolved for a shape and a device (``Plan``), the serving
                     calls' plan, each kernel's grid and compile-time constants; the backward's plan.
- ``npu_plan.py``    the NPU plan step: Unified Buffer budgets, forward and backward plans.
- ``_fused.py``      ``FusedArgs``: what a fused call adds to a forward launch (its tensors, options and flags).
- ``_forward.py``    a forward launch's kernel arguments, the same for both devices.
- ``_backward.py``   the backward launch, the same for both devices.
- ``_launch.py``     the compiled-kernel cache and the recorder of the C++ replay cache.
- ``cuda.py``        the CUDA policy: the ops' entry points, device facts, cached plans, the launch step.
- ``npu.py``         the NPU policy (PrivateUse1, triton-ascend): entry points, device queries, the launch step.

Plan modules import no launch code and no triton; ``cuda.py`` and ``npu.py`` import triton (and, for the NPU,
triton-ascend) at their own import, so they are imported only from inside the registered kernels
(``k3_ops._registration``), never when ``k3_ops`` is imported. Kernels (``k3_ops.kernels``) know nothing of
torch.library or of these policies.

This package module holds the torch-level helpers every backend shares: the compile options every launch passes,
the cases that never launch a kernel, weight preparation, the stride arithmetic behind the kernels' compile keys,
and the backward plan both devices resolve to.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .. import reference

__all__ = [
    "TRITON_COMPILE_OPTIONS",
    "KERNEL_IO_DTYPES",
    "next_power_of_2",
    "cdiv",
    "trivial_attn_res",
    "prepare_weights",
    "stride_vec",
    "hidden_strided",
    "BackwardPlan",
]

#: Compile options every Triton launch of the kernels passes as keyword arguments, whatever the installed Triton's
#: defaults. ``enable_fp_fusion``: a * b + c contracted to one FMA (one rounding). The kernels' accuracy and speed
#: were measured with it, and it is only Triton's default so far: 3.9 warns that ``TRITON_DEFAULT_FP_FUSION``
#: turns it off in 3.10, which would silently change both. The interpreter accepts and ignores these options.
#: triton-ascend's launches leave them out (``npu.compile_options``).
TRITON_COMPILE_OPTIONS: Mapping[str, object] = MappingProxyType({"enable_fp_fusion": True})

# Dtypes the Triton kernels read and write natively. fp64 goes to the reference on every device.
KERNEL_IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b (``triton.cdiv``, for the modules that do not import triton)."""
    return (a + b - 1) // b


def trivial_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, num_valid_blocks: int, eps: float) -> torch.Tensor | None:
    """The attn_res cases that never launch a kernel, identical on every device; None when a kernel must run.

    - fp64 inputs: ``reference.attn_res_reference`` (computes in fp64 on the tensors' own device).
    - T = 0: a new empty [0, H] tensor of prefix_sum's dtype.
    - K = 0: ``prefix_sum.clone(memory_format=torch.contiguous_format)``, bit-exact (p = 1 exactly).
    Arguments must already have passed ``k3_ops._C.check_attn_res``.
    """
    if prefix_sum.dtype == torch.float64:
        return reference.attn_res_reference(prefix_sum, block_residual, norm_weight, proj_weight,
                                            num_valid_blocks, eps)
    if prefix_sum.size(0) == 0:
        return torch.empty((0, prefix_sum.size(1)), dtype=prefix_sum.dtype, device=prefix_sum.device)
    if num_valid_blocks == 0:
        return prefix_sum.clone(memory_format=torch.contiguous_format)
    return None


def prepare_weights(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two [H] weight vectors as the kernels load them: contiguous, in a dtype the kernels read.

    ``proj_weight`` [1, H] is read as [H] (a contiguous [1, H] is passed as it is). Weights of dtypes other than
    bf16/fp16/fp32 are cast to fp32 (a tiny [H] op); the kernels fold ``w = norm_weight * proj_weight`` in FP32
    themselves. Both are no-ops
    (no copy, no launch) for the usual contiguous bf16/fp16/fp32 parameters.
    """
    def one(t: torch.Tensor) -> torch.Tensor:
        # The usual case returns the parameter itself (no view, no copy): the kernels read H contiguous values
        # from its data pointer, which is what a contiguous [H] or [1, H] tensor is. Anything else is converted
        # per call, so an in-place update of a parameter is always seen.
        if t.dtype in KERNEL_IO_DTYPES and t.is_contiguous():
            return t
        t = t.reshape(-1)
        if t.dtype not in KERNEL_IO_DTYPES:
            t = t.to(torch.float32)
        return t.contiguous()

    return one(norm_weight), one(proj_weight)


def stride_vec(dtype: torch.dtype, strides: Sequence[int]) -> int:
    """The VEC the kernels multiply their token/block strides back by (see docs/kernels.md, "VEC trick").

    Strides are never compile-time constants (that would recompile per token count), so Triton cannot see
    that a row starts on a 16-byte boundary. Passing ``stride // VEC`` and multiplying by the constexpr VEC in
    the kernel restores that knowledge: 8 elements for 2-byte dtypes and 4 for fp32 (16 bytes) when every
    stride is a multiple of it, otherwise 1 (correct, just narrower loads).
    """
    vec = 16 // dtype.itemsize
    for s in strides:
        if s % vec:
            return 1
    return vec


def hidden_strided(*tensors_and_dims: tuple[torch.Tensor, int]) -> bool:
    """True when some tensor's hidden dimension (given as ``(tensor, dim)``) is not unit-stride.

    A size-1 hidden dimension counts as unit-stride whatever its stride says (it is never stepped).
    The kernels handle non-unit hidden strides correctly through a constexpr flag (a second, slower compiled
    variant, compiled on first use); unit stride is the fast path that ``warmup`` compiles ahead of time.
    """
    for t, d in tensors_and_dims:
        if t.size(d) > 1 and t.stride(d) != 1:
            return True
    return False


@dataclass(frozen=True)
class BackwardPlan:
    """One resolved backward launch, as both policies' plan steps make it (``cuda_plan.backward_plan``,
    ``npu_plan.backward_plan``) and ``_backward.run_attn_res_backward`` launches it. The compile key is block_h,
    k_pad, num_warps plus dtypes and flags.

    num_programs: programs of the gradient kernel, each walking a contiguous token range (bounded by the device).
    block_h: hidden tile (power of two); k_pad: candidate tile height, next_power_of_2(K + 1).
    acc64: FP64 statistics, softmax backward and weight-gradient accumulation (see ``attn_res_bwd_kernel``).
    df: the same statistics and softmax backward in double-float FP32 arithmetic (devices without FP64); the
        weight gradient then accumulates in FP32. Neither: plain FP32.
    launch_options: extra launch keyword arguments (``num_warps`` on CUDA, ``multibuffer`` under triton-ascend).
    compile_options: keyword arguments every launch of this backward passes (default: the shared
        ``TRITON_COMPILE_OPTIONS``; the NPU policy passes its own ``npu.compile_options()``).
    num_stages: software-pipelining depth of the kernel's two chunk loops (1: none).
    kernel: "tiles" (``attn_res_bwd_kernel``, every device), "rows" (``attn_res_bwd_rows_kernel``, CUDA, H <=
        block_h = next_power_of_2(H)), "stats_apply" (CUDA, H <= block_h: ``attn_res_bwd_stats_kernel`` with
        num_programs, launch_options and num_stages, then ``attn_res_bwd_apply_kernel`` on a
        (apply_programs, cdiv(H, apply_block)) grid with apply_options and apply_num_stages) or "single_read" (the
        CUDA C++ kernel of csrc_cuda/attn_res_bwd.cu; num_programs programs, FP64 workspace).
    prefix_row_sum: "tiles" only: grad_prefix_sum's row taken out of the dv tile by an exact masked sum and stored
        through a plain row pointer (``attn_res_bwd_kernel``'s PREFIX_ROW_SUM: the form triton-ascend lowers).
    vectors_per_thread: "single_read" only: 0, the token's rows stay in shared memory (one 16-byte column vector
        per thread and row); 1 or 2, they sit in registers, that many 16-byte vectors per thread and row; 3
        (``cuda_plan.RING_LAYOUT``), a shared-memory ring of row slots, the weight gradient reduced in the kernel
        (no reduction launch).
    scalars_programs: "stats_apply" only: programs of ``attn_res_bwd_scalars_kernel`` (0: apply_programs x
        chunks), each walking a contiguous token range.
    reduce_options: launch options of the weight-gradient reduction (empty: launch_options). Its FP64 tiles
        want several warps whatever the gradient kernel uses.
    """

    num_programs: int
    block_h: int
    k_pad: int
    acc64: bool
    df: bool = False
    launch_options: tuple[tuple[str, object], ...] = field(default=())
    num_stages: int = 1
    kernel: str = "tiles"
    apply_programs: int = 0
    apply_block: int = 0
    apply_options: tuple[tuple[str, object], ...] = field(default=())
    apply_num_stages: int = 1
    reduce_options: tuple[tuple[str, object], ...] = field(default=())
    scalars_programs: int = 0
    vectors_per_thread: int = 0
    compile_options: tuple[tuple[str, object], ...] = field(default=tuple(TRITON_COMPILE_OPTIONS.items()))
    prefix_row_sum: bool = False
