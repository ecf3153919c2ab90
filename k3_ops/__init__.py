"""k3_ops: Kimi K3 Block AttnRes as PyTorch custom ops (``torch.ops.kimi_k3``).

Importing this package loads ``k3_ops._C`` (the schemas and Meta kernels, C++) and then
``k3_ops._registration`` (device kernels and autograd, Python). Triton, torch_npu and triton-ascend
are imported only when a kernel for their device first runs.
"""
from __future__ import annotations

import torch  # noqa: F401  (first: loads libtorch / libc10, which _C links against)

# _C defines the kimi_k3 schemas and Meta kernels; _registration then attaches the CPU / CUDA / PrivateUse1 kernels.
from . import _C, _registration  # noqa: F401
from .ops import (
    FusedAttnResOutputs,
    apply_attn_res,
    attn_res,
    fused_attn_res,
    fused_attn_res_,
    fused_attn_res_full,
    warmup,
)

__version__ = "0.1.0"
__all__ = ["attn_res", "apply_attn_res", "fused_attn_res", "fused_attn_res_", "fused_attn_res_full",
           "FusedAttnResOutputs", "warmup", "__version__"]
