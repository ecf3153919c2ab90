"""One backward launch at a training shape, for ``ncu`` (the ``ncu`` stage of tools/gpu_run.sh).

It compiles first, then runs the measured launch between cudaProfilerStart/Stop so ncu can skip the compile-time
launches.
K3_BWD_KERNEL=rows|stats_apply|tiles forces one backward kernel (default: the policy's choice);
K3_BWD_CONFIG='{"kernel": "rows", ...}' gives the whole BackwardConfig instead; K3_BWD_MASK=001 an output_mask."""
import json
import os

import torch

import k3_ops  # noqa: F401
from k3_ops.backends import cuda

T, K, C, H = int(os.environ.get("K3_BWD_T", 4096)), int(os.environ.get("K3_BWD_K", 8)), 8, 7168
g = torch.Generator(device="cuda").manual_seed(0)
p = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
b = torch.randn(T, C, H, device="cuda", dtype=torch.bfloat16, generator=g)
gy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
w = torch.ones(H, device="cuda")
mask = [c == "1" for c in os.environ.get("K3_BWD_MASK", "111")]
kernel = os.environ.get("K3_BWD_KERNEL")
config = cuda.BackwardConfig(kernel=kernel) if kernel else None
if os.environ.get("K3_BWD_CONFIG"):
    config = cuda.BackwardConfig(**json.loads(os.environ["K3_BWD_CONFIG"]))
cuda.attn_res_backward(gy, p, b, w, w, K, 1e-6, mask, config=config)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
cuda.attn_res_backward(gy, p, b, w, w, K, 1e-6, mask, config=config)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
