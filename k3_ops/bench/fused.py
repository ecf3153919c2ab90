"""Section ``fused``: the serving call ``fused_attn_res`` over the mix section's grid, beside the unfused sequence.

Every call has an addend, writes the snapshot into slot K when K < capacity (what a block boundary does) and
applies the output RMSNorm. The reference row ``unfused`` runs the same call as torch's add, the snapshot copy,
``attn_res`` and torch's RMSNorm (``common.unfused``). "of BW" counts the bytes the call must move: prefix,
addend and K candidate rows read; new_prefix, the output and the snapshot written, per token. On a GPU the rows
``floor`` and ``floor_stream`` are the measured floor under the call in its two geometries (``k3_ops.bench.floor``).
"""
from __future__ import annotations

import torch

from .common import Ops, Options, Problem, bytes_moved, environment, k3_ops_ops, measure, progress, unfused
from .mix import DEFAULTS as MIX_DEFAULTS
from .timing import Timer

DEFAULTS = {**MIX_DEFAULTS, "all": {**MIX_DEFAULTS["all"], "layouts": ["token"]}}


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None) -> dict:
    """Time ``ops[name].fused`` for every name that has one (default: the registered op) and, with
    ``opts.refs``, the unfused sequence built on the first name's ``attn_res``."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    impls = {n: o.fused for n, o in ops.items() if o.fused is not None}
    first_mix = next((o.attn_res for o in ops.values() if o.attn_res is not None), None)
    if opts.refs and first_mix is not None:
        impls["unfused"] = unfused(first_mix)
    if opts.refs and device.type == "cuda":
        from .floor import fused_floor, fused_floor_stream

        impls["floor"], impls["floor_stream"] = fused_floor, fused_floor_stream
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    layouts = opts.pick(DEFAULTS, "layouts")
    dtype = opts.io_dtype
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    rows, notes = [], []
    with torch.inference_mode(), progress(len(layouts) * len(ks) * len(tokens), "fused", opts.progress) as bar:
        for layout in layouts:
            problem = Problem(max(tokens), cap, H, dtype, device, layout, opts.w_dtype)
            for K in ks:
                problem.poison(K)
                timer.after_heavy_work()
                write = K if K < cap else -1
                for T in tokens:
                    where = f"{layout}-major T={T} K={K}"
                    bar.step(where)
                    row = {"layout": layout, "T": T, "K": K, "write": write,
                           "bytes": bytes_moved(T, H, dtype.itemsize, K + 2, 2 + (write >= 0))}
                    measure(timer, impls, problem.fused_args(T, K, write), row, bw, opts.plain, notes, where)
                    first = next(iter(impls))
                    if "us:unfused" in row and first != "unfused":
                        row["vs_unfused"] = row["us:unfused"] / row[f"us:{first}"]
                    rows.append(row)
                problem.restore(K)
            del problem
            if device.type == "cuda":
                torch.cuda.empty_cache()
    names = list(impls)
    columns = [["layout", "layout", ""], ["T", "T", "d"], ["K", "K", "d"], ["write", "slot written", "d"]]
    columns += [[f"us:{n}", f"{n} us", ".2f"] for n in names]
    if opts.plain and timer.is_cuda:
        columns += [[f"plain:{n}", f"{n} plain us", ".2f"] for n in names]
    columns += [[f"bw:{n}", f"{n} of BW", ".3f"] for n in names]
    if any("vs_unfused" in r for r in rows):
        columns.append(["vs_unfused", "unfused / " + names[0], ".2f"])
    timing = "CUDA-graph replay" if timer.mode == "graph" else "wall time per call"
    return {"section": "fused", "title": "fused_attn_res (add + snapshot + mix + RMSNorm)",
            "environment": environment(device), "limits": limits,
            "params": {"dtype": opts.dtype, "weight_dtype": opts.weight_dtype or opts.dtype, "hidden": H,
                       "capacity": cap, "timing": timing, "nan_in_unused_slots": True},
            "columns": columns, "rows": rows, "notes": notes,
            "plot": {"series": [n for n in names if n not in ("unfused", "floor", "floor_stream")] or names}}
