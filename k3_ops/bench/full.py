"""Section ``full``: vLLM-Ascend's call forms on ``kimi_k3::fused_attn_res.full``, beside ``fused_attn_res``.

Over the fused section's grid (token-major buffer, an addend, the snapshot into slot K when K < capacity, the output
RMSNorm): ``fused_attn_res`` (the baseline: the same call without the extra outputs), ``retmix`` (the pre-norm mix
returned as well: one more row written per token), ``sumout`` (the new prefix into a caller's buffer at token stride
2 H, the FP32-mix norm: form 4), ``nomix`` (``mix=False``: the add and the snapshot alone) and, for it, ``add_copy``
(torch's add and the snapshot copy, the two launches it replaces). Not in the main job: run
``python -m k3_ops.bench full`` on the device. "of BW" counts each column's own bytes (``BYTES``).
"""
from __future__ import annotations

import torch

from .common import Options, Problem, environment, measure, progress
from .fused import DEFAULTS
from .timing import Timer

#: Rows of H elements each form reads and writes per token, (read, written), the snapshot not included:
#: fused_attn_res and sumout read prefix, addend and K blocks and write new prefix and output; retmix writes the mix
#: too; nomix reads prefix and addend and writes the new prefix.
BYTES = {"fused_attn_res": (2, 2), "retmix": (2, 3), "sumout": (2, 2), "nomix": (2, 1), "add_copy": (2, 1)}


def _impls(sum_out: torch.Tensor) -> dict:
    import k3_ops

    def fused(prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return k3_ops.fused_attn_res(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                     out_norm_weight=onw, out_norm_eps=onw_eps)

    def retmix(prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return tuple(k3_ops.fused_attn_res_full(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                                out_norm_weight=onw, out_norm_eps=onw_eps, return_mix=True))

    def sumout(prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return tuple(k3_ops.fused_attn_res_full(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                                out_norm_weight=onw, out_norm_eps=onw_eps, round_mix=False,
                                                sum_out=sum_out[:prefix.size(0), :prefix.size(1)]))

    def nomix(prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return tuple(k3_ops.fused_attn_res_full(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                                mix=False))

    def add_copy(prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        new_prefix = prefix + addend
        if write >= 0:
            blocks[:, write].copy_(new_prefix)
        return new_prefix

    return {"fused_attn_res": fused, "retmix": retmix, "sumout": sumout, "nomix": nomix, "add_copy": add_copy}


def run(opts: Options | None = None, timer: Timer | None = None, ops=None) -> dict:
    """Time each form per (T, K); ``ops`` is accepted for the sections' common signature (the forms are the
    registered op's)."""
    del ops
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    dtype = opts.io_dtype
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    rows, notes = [], []
    with torch.inference_mode(), progress(len(ks) * len(tokens), "full", opts.progress) as bar:
        problem = Problem(max(tokens), cap, H, dtype, device, "token", opts.w_dtype)
        sum_out = torch.empty((max(tokens), 2 * H), dtype=dtype, device=device)
        impls = _impls(sum_out)
        for K in ks:
            problem.poison(K)
            timer.after_heavy_work()
            write = K if K < cap else -1
            for T in tokens:
                where = f"T={T} K={K}"
                bar.step(where)
                row = {"T": T, "K": K, "write": write}
                for name, fn in impls.items():
                    read, written = BYTES[name]
                    read += 0 if name in ("nomix", "add_copy") else K
                    row["bytes"] = (read + written + (write >= 0)) * T * H * dtype.itemsize
                    measure(timer, {name: fn}, problem.fused_args(T, K, write), row, bw, opts.plain, notes, where)
                del row["bytes"]
                row["retmix_vs_fused"] = row["us:retmix"] / row["us:fused_attn_res"]
                row["nomix_vs_add_copy"] = row["us:nomix"] / row["us:add_copy"]
                rows.append(row)
            problem.restore(K)
        del problem
    names = list(BYTES)
    columns = [["T", "T", "d"], ["K", "K", "d"], ["write", "slot written", "d"]]
    columns += [[f"us:{n}", f"{n} us", ".2f"] for n in names]
    if opts.plain and timer.is_cuda:
        columns += [[f"plain:{n}", f"{n} plain us", ".2f"] for n in names]
    columns += [[f"bw:{n}", f"{n} of BW", ".3f"] for n in names]
    columns += [["retmix_vs_fused", "retmix / fused_attn_res", ".2f"], ["nomix_vs_add_copy", "nomix / add_copy", ".2f"]]
    timing = "CUDA-graph replay" if timer.mode == "graph" else "wall time per call"
    return {"section": "full", "title": "fused_attn_res.full (vLLM-Ascend's call forms)",
            "environment": environment(device), "limits": limits,
            "params": {"dtype": opts.dtype, "weight_dtype": opts.weight_dtype or opts.dtype, "hidden": H,
                       "capacity": cap, "timing": timing, "nan_in_unused_slots": True},
            "columns": columns, "rows": rows, "notes": notes}
