"""Attach device kernels (and, in later sections, autograd) to the kimi_k3 schemas.

The schemas and Meta kernels live in C++ (csrc_meta/library.cpp) and are loaded with k3_ops._C.
This module is the only place that binds Python kernels to dispatch keys:

    CPU          -> k3_ops.reference        (the FP32 formula, also the test oracle)
    CUDA         -> k3_ops.backends.cuda    (Triton launch policy for NVIDIA GPUs)
    PrivateUse1  -> k3_ops.backends.npu     (Triton launch policy for Ascend NPUs, triton-ascend)

Every kernel first runs the shared C++ argument checks (the very ones the Meta kernels run), so an
eager call and a traced call reject the same input with the same message, before anything is written.
Backends are imported on first use: importing k3_ops never imports triton, torch_npu or triton-ascend.
"""
from __future__ import annotations

import torch

from . import _C, reference

_lib = torch.library.Library("kimi_k3", "IMPL")


def _attn_res_cpu(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
    _C.check_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
    return reference.attn_res_reference(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)


_lib.impl("attn_res", _attn_res_cpu, "CPU")
