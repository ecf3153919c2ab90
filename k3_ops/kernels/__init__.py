"""@triton.jit kernels of the kimi_k3 ops, nothing else (no torch glue, no launch policy).

``attn_res_fwd``: forward kernels (CUDA rows / split, Ascend NPU). Launch policies that pick and launch them
live in ``k3_ops.backends``. Importing this package does not import triton; importing a kernel module does.
"""
