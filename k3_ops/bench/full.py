"""Section ``full``: vLLM-Ascend's call forms on ``kimi_k3::fused_attn_res.full``, beside ``fused_attn_res``, warm
and cold L2.

Over the fused section's grid (token-major buffer, an addend, the snapshot into slot K when K < capacity, the output
RMSNorm): ``fused_attn_res`` (the baseline: the same call without the extra outputs), ``retmix`` (the pre-norm mix
returned as well: one more row written per token), ``sumout`` (the new prefix into a caller's buffer at token stride
2 H, the FP32-mix norm: form 4), ``nomix`` (``mix=False``: the add and the snapshot alone) and, for it, ``add_copy``
(torch's add and the snapshot copy, the two launches it replaces). The L2 states are the fused section's (``--l2``,
default cold on a GPU; warm alone on a CPU). Cold: every form rotates through the same input sets, sized so that the
rows the least-touching form reads and writes in its set (prefix, addend, the snapshot) exceed 3x the L2 together;
``sumout`` writes into a [T, 2 H] region of each set. Not in the main job: run ``python -m k3_ops.bench full`` on
the device. "of BW" counts each column's own bytes (``BYTES``).
"""
from __future__ import annotations

import torch

from .common import (
    Options,
    Problem,
    environment,
    l2_modes,
    measure,
    measure_cold,
    progress,
    section_params,
    timing_columns,
)
from .fused import DEFAULTS
from .mix import cold_sets
from .timing import Timer

#: Rows of H elements each form reads and writes per token, (read, written), the snapshot and the K block rows not
#: included: fused_attn_res and sumout read prefix and addend and write new prefix and output; retmix writes the mix
#: too; nomix and add_copy read prefix and addend and write the new prefix.
BYTES = {"fused_attn_res": (2, 2), "retmix": (2, 3), "sumout": (2, 2), "nomix": (2, 1), "add_copy": (2, 1)}
#: The forms that read no block row.
NO_MIX = ("nomix", "add_copy")


def _impls() -> dict:
    """Each form as ``fn(sum_out, prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps)``; ``sum_out`` is
    the [T, 2 H] region the ``sumout`` form stores its new prefix into (the others ignore it)."""
    import k3_ops

    def fused(sum_out, prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return k3_ops.fused_attn_res(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                     out_norm_weight=onw, out_norm_eps=onw_eps)

    def retmix(sum_out, prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return tuple(k3_ops.fused_attn_res_full(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                                out_norm_weight=onw, out_norm_eps=onw_eps, return_mix=True))

    def sumout(sum_out, prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return tuple(k3_ops.fused_attn_res_full(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                                out_norm_weight=onw, out_norm_eps=onw_eps, round_mix=False,
                                                sum_out=sum_out[:, :prefix.size(1)]))

    def nomix(sum_out, prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        return tuple(k3_ops.fused_attn_res_full(prefix, addend, blocks, nw, pw, K, eps, block_write_idx=write,
                                                mix=False))

    def add_copy(sum_out, prefix, addend, blocks, nw, pw, K, eps, write, onw, onw_eps):
        new_prefix = prefix + addend
        if write >= 0:
            blocks[:, write].copy_(new_prefix)
        return new_prefix

    return {"fused_attn_res": fused, "retmix": retmix, "sumout": sumout, "nomix": nomix, "add_copy": add_copy}


def _measure_forms(impls: dict, row: dict, K: int, T: int, H: int, itemsize: int, write: int, time) -> None:
    # Each form with its own byte count in row["bytes"] while it is timed (its "of BW" cell), the snapshot included.
    for name, fn in impls.items():
        read, written = BYTES[name]
        read += 0 if name in NO_MIX else K
        row["bytes"] = (read + written + (write >= 0)) * T * H * itemsize
        time({name: fn})
    del row["bytes"]


def run(opts: Options | None = None, timer: Timer | None = None, ops=None) -> dict:
    """Time each form per (T, K) in every L2 state of ``opts.l2``; ``ops`` is accepted for the sections' common
    signature (the forms are the registered op's)."""
    del ops
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    modes = l2_modes(opts, device)
    dtype, w_dtype = opts.io_dtype, opts.w_dtype
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    impls = _impls()
    rows, notes = [], []
    with torch.inference_mode(), progress(len(ks) * len(tokens) * len(modes), "full", opts.progress) as bar:
        problem = Problem(max(tokens), cap, H, dtype, device, "token", w_dtype) if "warm" in modes else None
        sum_out = torch.empty((max(tokens), 2 * H), dtype=dtype, device=device) if problem is not None else None
        for K in ks:
            if problem is not None:
                problem.poison(K)
            timer.after_heavy_work()
            write = K if K < cap else -1
            for T in tokens:
                for l2 in modes:
                    where = f"T={T} K={K} {l2} L2"
                    bar.step(where)
                    row = {"l2": l2, "T": T, "K": K, "write": write}
                    if l2 == "warm":
                        args = (sum_out[:T], *problem.fused_args(T, K, write))

                        def time(impl, args=args, row=row, where=where):
                            measure(timer, impl, args, row, bw, opts.plain, notes, where)
                    else:
                        sets, row_sets = cold_sets(timer, T, K, H, cap, dtype, w_dtype, "token",
                                                   2 + (write >= 0), 0)
                        row.update(row_sets)
                        outs = torch.empty((sets.n * T, 2 * H), dtype=dtype, device=device)
                        set_args = [(outs[i * T:(i + 1) * T], *sets.fused_args(i, K, write)) for i in range(sets.n)]

                        def time(impl, set_args=set_args, row=row, where=where):
                            measure_cold(timer, impl, set_args, row, bw, notes, where)
                    _measure_forms(impls, row, K, T, H, dtype.itemsize, write, time)
                    if l2 != "warm":
                        del sets, outs, set_args
                    row["retmix_vs_fused"] = row["us:retmix"] / row["us:fused_attn_res"]
                    row["nomix_vs_add_copy"] = row["us:nomix"] / row["us:add_copy"]
                    rows.append(row)
            if problem is not None:
                problem.restore(K)
        del problem, sum_out
    names = list(BYTES)
    columns = [["l2", "L2", ""], ["T", "T", "d"], ["K", "K", "d"], ["write", "slot written", "d"]]
    columns += timing_columns(names, "fused_attn_res", opts.plain and timer.is_cuda, names)
    columns += [["retmix_vs_fused", "retmix / fused_attn_res", ".2f"], ["nomix_vs_add_copy", "nomix / add_copy", ".2f"]]
    return {"section": "full", "title": "fused_attn_res.full (vLLM-Ascend's call forms)",
            "environment": environment(device), "limits": limits,
            "params": section_params(opts, timer, H, cap, modes, nan_in_unused_slots=True),
            "columns": columns, "rows": rows, "notes": notes}
