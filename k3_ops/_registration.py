"""Attach device kernels to the kimi_k3 schemas (their autograd is C++: csrc_meta/autograd.cpp).

The schemas and Meta kernels live in C++ (csrc_meta/library.cpp) and are loaded with k3_ops._C.
This module is the only place that binds Python kernels to dispatch keys:

    CPU          -> k3_ops.reference        (the FP32 formula, also the test oracle)
    CUDA         -> k3_ops.backends.cuda    (Triton launch policy for NVIDIA GPUs); in a CUDA build of k3_ops._C
                    the CUDA key holds a C++ kernel (csrc_cuda/launch_cache.cpp) that replays recorded launches
                    and calls these Python kernels, through backends/_launch.py's recorder, for the rest
    PrivateUse1  -> k3_ops.backends.npu     (Triton launch policy for Ascend NPUs, triton-ascend)

Every kernel first runs the shared C++ argument checks (the very ones the Meta kernels run), so an
eager call and a traced call reject the same input with the same message, before anything is written.
Backends are imported on first use: importing k3_ops never imports triton, torch_npu or triton-ascend.
"""
from __future__ import annotations

import torch

from . import _C, reference

_lib = torch.library.Library("kimi_k3", "IMPL")


def _raise(violation) -> None:
    """Raise what a ``_C.check_*`` function returned: None (valid) or (is_type_error, message) for the first
    rule the arguments break, the same rule and message the Meta kernel raises at trace time."""
    if violation is not None:
        is_type_error, message = violation
        raise (TypeError if is_type_error else ValueError)(message)


def _attn_res_cpu(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
    _raise(_C.check_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps))
    return reference.attn_res_reference(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)


_lib.impl("attn_res", _attn_res_cpu, "CPU")


def _attn_res_cuda(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
    _raise(_C.check_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps))
    from .backends import cuda  # lazy: importing k3_ops never imports triton

    return cuda.attn_res_forward(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)


def _attn_res_npu(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
    _raise(_C.check_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps))
    from .backends import npu  # lazy: importing k3_ops never imports torch_npu or triton-ascend

    return npu.attn_res_forward(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)


_CUDA_KERNELS: dict = {}  # op name -> Python CUDA kernel


def _impl_cuda(name: str, fn) -> None:
    # In a CUDA build the C++ kernel already holds the CUDA key and gets fn as its Python path (_bind_cuda, below).
    if getattr(_C, "set_cuda_kernels", None) is not None:
        _CUDA_KERNELS[name] = fn
    else:
        _lib.impl(name, fn, "CUDA")


_impl_cuda("attn_res", _attn_res_cuda)
_lib.impl("attn_res", _attn_res_npu, "PrivateUse1")


# --- fused_attn_res and fused_attn_res.quant: the serving variant (out of place) ---------------------------
# Kernels take the schema's arguments in order; the dispatcher may drop trailing arguments that equal
# their defaults, hence the defaults here. Each checks before anything is written, so a rejected call
# leaves block_residual untouched.
def _fused_attn_res_cpu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                        block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res(*args))
    return reference.fused_attn_res_reference(*args, round_mix=round_mix)


def _fused_attn_res_cuda(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                         block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res(*args))
    from .backends import cuda  # lazy: importing k3_ops never imports triton

    return cuda.fused_attn_res(*args, round_mix=round_mix)


def _fused_attn_res_npu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                        block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res(*args))
    from .backends import npu  # lazy: importing k3_ops never imports torch_npu or triton-ascend

    return npu.fused_attn_res(*args, round_mix=round_mix)


def _fused_attn_res_quant_cpu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                              block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, out_dtype,
                              round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res_quant(*args, out_dtype))
    return reference.fused_attn_res_quant_reference(*args, out_dtype=out_dtype, round_mix=round_mix)


def _fused_attn_res_quant_cuda(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                               block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, out_dtype,
                               round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res_quant(*args, out_dtype))
    from .backends import cuda  # lazy: importing k3_ops never imports triton

    return cuda.fused_attn_res_quant(*args, out_dtype=out_dtype, round_mix=round_mix)


def _fused_attn_res_quant_npu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                              block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, out_dtype,
                              round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res_quant(*args, out_dtype))
    from .backends import npu  # lazy: importing k3_ops never imports torch_npu or triton-ascend

    return npu.fused_attn_res_quant(*args, out_dtype=out_dtype, round_mix=round_mix)


# --- fused_attn_res.full: every output of the serving call switchable (vLLM-Ascend's call forms) -----------
def _full_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
               out_norm_weight, out_norm_eps, return_mix, mix, sum_out) -> tuple:
    # Checked before anything is written (block_residual, sum_out); returns the positional arguments.
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res_full(*args, return_mix, mix, sum_out))
    return args


def _fused_attn_res_full_cpu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                             block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, round_mix=True,
                             return_mix=False, mix=True, sum_out=None):
    args = _full_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                      block_write_idx, out_norm_weight, out_norm_eps, return_mix, mix, sum_out)
    return reference.fused_attn_res_full_reference(*args, round_mix=round_mix, return_mix=return_mix, mix=mix,
                                                   sum_out=sum_out)


def _fused_attn_res_full_cuda(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                              block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, round_mix=True,
                              return_mix=False, mix=True, sum_out=None):
    args = _full_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                      block_write_idx, out_norm_weight, out_norm_eps, return_mix, mix, sum_out)
    from .backends import cuda  # lazy: importing k3_ops never imports triton

    return cuda.fused_attn_res_full(*args, round_mix=round_mix, return_mix=return_mix, mix=mix, sum_out=sum_out)


def _fused_attn_res_full_npu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                             block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, round_mix=True,
                             return_mix=False, mix=True, sum_out=None):
    args = _full_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                      block_write_idx, out_norm_weight, out_norm_eps, return_mix, mix, sum_out)
    from .backends import npu  # lazy: importing k3_ops never imports torch_npu or triton-ascend

    return npu.fused_attn_res_full(*args, round_mix=round_mix, return_mix=return_mix, mix=mix, sum_out=sum_out)


# --- fused_attn_res_: the in-place serving call (vLLM's contract) -------------------------------------------
def _fused_attn_res_inplace_cpu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, out_dtype=None,
                                round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res_inplace(*args, out_dtype))
    return reference.fused_attn_res_inplace_reference(*args, out_dtype=out_dtype, round_mix=round_mix)


def _fused_attn_res_inplace_cuda(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                 block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, out_dtype=None,
                                 round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res_inplace(*args, out_dtype))
    from .backends import cuda  # lazy: importing k3_ops never imports triton

    return cuda.fused_attn_res_(*args, out_dtype=out_dtype, round_mix=round_mix)


def _fused_attn_res_inplace_npu(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, out_dtype=None,
                                round_mix=True):
    args = (prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
            out_norm_weight, out_norm_eps)
    _raise(_C.check_fused_attn_res_inplace(*args, out_dtype))
    from .backends import npu  # lazy: importing k3_ops never imports torch_npu or triton-ascend

    return npu.fused_attn_res_(*args, out_dtype=out_dtype, round_mix=round_mix)


def _register_inference_op(name: str, cpu, cuda, npu) -> None:
    # The device kernels. The Autograd kernel (refuse where a backward would be recorded, else go on) and the
    # ADInplaceOrView kernel (bump the version counter of every Tensor(a!) argument) are C++:
    # csrc_meta/autograd.cpp.
    _lib.impl(name, cpu, "CPU")
    _impl_cuda(name, cuda)
    _lib.impl(name, npu, "PrivateUse1")


_register_inference_op("fused_attn_res", _fused_attn_res_cpu, _fused_attn_res_cuda, _fused_attn_res_npu)
_register_inference_op("fused_attn_res.quant", _fused_attn_res_quant_cpu, _fused_attn_res_quant_cuda,
                       _fused_attn_res_quant_npu)
_register_inference_op("fused_attn_res.full", _fused_attn_res_full_cpu, _fused_attn_res_full_cuda,
                       _fused_attn_res_full_npu)
_register_inference_op("fused_attn_res_", _fused_attn_res_inplace_cpu, _fused_attn_res_inplace_cuda,
                       _fused_attn_res_inplace_npu)


# --- tp_all_reduce: the tensor-parallel sum of the serving call's addend (k3_ops/tp.py) ---------------------
def _tp_all_reduce_cpu(partial, group_name):
    _raise(_C.check_tp_all_reduce(partial, group_name))
    from . import tp

    return tp.fallback_all_reduce(partial, group_name)


def _tp_all_reduce_cuda(partial, group_name):
    _raise(_C.check_tp_all_reduce(partial, group_name))
    from .backends import tp_cuda  # lazy: importing k3_ops never imports triton

    return tp_cuda.tp_all_reduce(partial, group_name)


# Bound straight to the CUDA key, never to the C++ launch cache (_impl_cuda): a collective must run on every call,
# it cannot be replayed from a recorded launch. No NPU kernel: torch.distributed's HCCL all-reduce is the way there.
_lib.impl("tp_all_reduce", _tp_all_reduce_cpu, "CPU")
_lib.impl("tp_all_reduce", _tp_all_reduce_cuda, "CUDA")


# --- attn_res_backward and autograd ---------------------------------------------------------------------
def _attn_res_backward_cpu(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                           output_mask):
    _raise(_C.check_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                      num_valid_blocks, eps))
    return reference.attn_res_backward_reference(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                 num_valid_blocks, eps, output_mask)


def _attn_res_backward_cuda(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                            output_mask):
    _raise(_C.check_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                      num_valid_blocks, eps))
    from .backends import cuda  # lazy: importing k3_ops never imports triton

    return cuda.attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                  eps, output_mask)


def _attn_res_backward_npu(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                           output_mask):
    _raise(_C.check_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                      num_valid_blocks, eps))
    from .backends import npu  # lazy: importing k3_ops never imports torch_npu or triton-ascend

    return npu.attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                 eps, output_mask)


_lib.impl("attn_res_backward", _attn_res_backward_cpu, "CPU")
_impl_cuda("attn_res_backward", _attn_res_backward_cuda)
_lib.impl("attn_res_backward", _attn_res_backward_npu, "PrivateUse1")


# Autograd of attn_res and attn_res_backward lives in C++ (csrc_meta/autograd.cpp): a Python Autograd kernel would
# run, and redispatch through Python, on every call with or without grad.


def _bind_cuda() -> None:
    if _CUDA_KERNELS:
        from .backends import _launch  # torch only: no triton import

        _C.set_cuda_kernels(_launch.record_call, dict(_CUDA_KERNELS))


_bind_cuda()


# The DTensor sharding rules of these ops sit beside their registration (a no-op without torch.distributed).
from . import _sharding  # noqa: E402, F401
