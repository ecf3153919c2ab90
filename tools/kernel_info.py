"""Print registers, spills and shared memory of every compiled k3_ops Triton kernel in this process after
running a few representative shapes (compile keys), so tuning sees register pressure next to timings."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import k3_ops
from k3_ops.backends import cuda as backend
from k3_ops.kernels import attn_res_fwd


CONFIGS = {**json.loads((Path(__file__).parent / "tune_large.json").read_text()),
           **json.loads((Path(__file__).parent / "tune_small.json").read_text())}


def main() -> None:
    H = 7168
    for T, K in ((1, 8), (8, 8), (64, 8), (1024, 1), (1024, 8)):
        p = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(T, 9, H, device="cuda", dtype=torch.bfloat16)
        k3_ops.attn_res(p, b, torch.ones(H, device="cuda"), torch.ones(1, H, device="cuda"), K, 1e-6)
        for cfg in (backend.LaunchConfig(**kw) for kw in CONFIGS.values()):
            backend.attn_res_forward(p, b, torch.ones(H, device="cuda"), torch.ones(1, H, device="cuda"), K, 1e-6,
                                     config=cfg)
    torch.cuda.synchronize()
    for name in ("attn_res_rows_kernel", "attn_res_split_kernel", "attn_res_npu_kernel"):
        fn = getattr(attn_res_fwd, name)
        for dev_cache in fn.device_caches.values():
            for key, kernel in dev_cache[0].items():
                meta = kernel.metadata
                print(f"{name}: warps={meta.num_warps} regs={kernel.n_regs} spills={kernel.n_spills} "
                      f"shared={meta.shared} key=...{str(key)[-90:]}")


if __name__ == "__main__":
    main()
