"""The outputs of the table's cluster-kernel calls, for an A/B of builds that must agree bit for bit (run.sh):
``python bits.py save FILE`` with one build's k3_ops first on sys.path, then ``python bits.py compare A B``.
DEV (default cuda) picks the device."""
from __future__ import annotations

import os
import sys

import torch

DEV = os.environ.get("DEV", "cuda")


def outputs() -> dict:
    import k3_ops
    res = {}
    H, cap = 7168, 9
    for wdt in (torch.bfloat16, torch.float32):
        for T, K in ((1, 2), (8, 2), (16, 2), (1, 3), (1, 4), (32, 4), (1, 5), (1, 8), (8, 8), (16, 8), (32, 8),
                     (64, 5), (64, 8)):
            g = torch.Generator().manual_seed(1000 * T + K)
            blocks = torch.randn(T, cap, H, generator=g).bfloat16().to(DEV)
            blocks[:, K:] = float("nan")
            prefix = torch.randn(T, H, generator=g).bfloat16().to(DEV)
            addend = torch.randn(T, H, generator=g).bfloat16().to(DEV)
            nw = (1 + 0.1 * torch.randn(H, generator=g)).to(wdt).to(DEV)
            pw = (torch.randn(H, generator=g) * 2 / H**0.5).to(wdt).to(DEV)
            onw = (1 + 0.1 * torch.randn(H, generator=g)).to(wdt).to(DEV)
            key = f"{str(wdt)[6:]}-T{T}-K{K}"
            res[f"plain-{key}"] = k3_ops.attn_res(prefix, blocks, nw, pw, K, 1e-6).cpu()
            write = K if K < cap else -1
            for norm in (True, False):
                b = blocks.clone()
                r = k3_ops.fused_attn_res(prefix, addend, b, nw, pw, K, 1e-6, block_write_idx=write,
                                          out_norm_weight=onw if norm else None,
                                          out_norm_eps=1e-6 if norm else None)
                for i, x in enumerate(r):
                    res[f"fused{'-norm' if norm else ''}{i}-{key}"] = x.cpu()
                res[f"fused{'-norm' if norm else ''}-blocks-{key}"] = b[:, : K + 1].cpu()
            b, p = blocks.clone(), prefix.clone()
            r = k3_ops.fused_attn_res_(p, addend, b, nw, pw, K, 1e-6, block_write_idx=write, out_norm_weight=onw,
                                       out_norm_eps=1e-6)
            res[f"inplace-out-{key}"], res[f"inplace-prefix-{key}"] = r[0].cpu(), p.cpu()
            res[f"inplace-blocks-{key}"] = b[:, : K + 1].cpu()
    if DEV == "cuda":
        torch.cuda.synchronize()
    return res


if __name__ == "__main__":
    if sys.argv[1] == "save":
        torch.save(outputs(), sys.argv[2])
    else:
        a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
        diff = [k for k in a if not torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k],
                                                 b[k].view(torch.uint8) if b[k].is_floating_point() else b[k])]
        print(f"bits: {len(a) - len(diff)} of {len(a)} outputs equal; differ: {diff[:12]}")
