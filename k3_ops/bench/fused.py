"""Section ``fused``: the serving call over the mix section's grid, warm and cold L2, beside the unfused sequence.

Every call has an addend, writes the snapshot into slot K when K < capacity (what a block boundary does) and
applies the output RMSNorm. Two forms of the op: ``fused_attn_res`` (the new prefix a new tensor) and, as
``<name>_inplace``, ``fused_attn_res_`` (the new prefix stored into the prefix, as vLLM's model calls it; timed on
its own copy of the prefix). The reference row ``unfused`` (warm only) runs the same call as torch's add, the
snapshot copy, ``attn_res`` and torch's RMSNorm (``common.unfused``). "of BW" counts the bytes the call must move:
prefix, addend and K candidate rows read; new_prefix, the output and the snapshot written, per token. On a GPU the
rows ``floor``, ``floor_stream`` and ``floor_row`` are the measured floors under the call in their three geometries
(``k3_ops.bench.floor``), and the L2 states, the floor and limit columns are the mix section's.
"""
from __future__ import annotations

import torch

from .common import (
    Ops,
    Options,
    Problem,
    bytes_moved,
    environment,
    floor_cells,
    floor_columns,
    k3_ops_ops,
    l2_modes,
    measure,
    measure_cold,
    progress,
    section_params,
    timing_columns,
    unfused,
)
from .mix import DEFAULTS as MIX_DEFAULTS
from .mix import cold_sets
from .timing import Timer

# On a GPU the mix grid less T = 16384, plus T = 8192: the prefill size of the public comparison.
DEFAULTS = {**MIX_DEFAULTS, "all": {**MIX_DEFAULTS["all"], "layouts": ["token"]},
            "gpu": {"tokens": [1, 8, 64, 256, 512, 1024, 4096, 8192]},
            "full-gpu": {**MIX_DEFAULTS["full-gpu"], "layouts": ["token"]},
            "cpu": {**MIX_DEFAULTS["cpu"], "layouts": ["token"]},
            "quick": {**MIX_DEFAULTS["quick"], "layouts": ["token"]}}


def floor_impls() -> dict:
    """The measured floors under the fused call, by row name (``common.FLOOR_NAMES``): CUDA only."""
    from .floor import fused_floor, fused_floor_row, fused_floor_stream

    return {"floor": fused_floor, "floor_stream": fused_floor_stream, "floor_row": fused_floor_row}


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None) -> dict:
    """Time ``ops[name].fused`` and ``ops[name].fused_inplace`` for every name that has them (default: the
    registered ops), the floors and, with ``opts.refs``, the unfused sequence built on the first name's
    ``attn_res``, in every L2 state of ``opts.l2`` (default cold; warm alone on a CPU)."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    is_cuda = device.type == "cuda"
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    kernels = {n: o.fused for n, o in ops.items() if o.fused is not None}
    inplace = {f"{n}_inplace": o.fused_inplace for n, o in ops.items() if o.fused_inplace is not None}
    first_mix = next((o.attn_res for o in ops.values() if o.attn_res is not None), None)
    refs = {"unfused": unfused(first_mix)} if opts.refs and first_mix is not None else {}
    floors = floor_impls() if opts.refs and is_cuda else {}
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    layouts, modes = opts.pick(DEFAULTS, "layouts"), l2_modes(opts, device)
    dtype, w_dtype = opts.io_dtype, opts.w_dtype
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    first = next(iter(kernels), None) or next(iter(inplace), None)
    rows, notes = [], []
    total = len(layouts) * len(ks) * len(tokens) * len(modes)
    with torch.inference_mode(), progress(total, "fused", opts.progress) as bar:
        for layout in layouts:
            problem = Problem(max(tokens), cap, H, dtype, device, layout, w_dtype) if "warm" in modes else None
            # The in-place call's own prefix: it stores a new prefix on every call.
            scratch = problem.prefix.clone() if problem is not None else None
            for K in ks:
                if problem is not None:
                    problem.poison(K)
                timer.after_heavy_work()
                write = K if K < cap else -1
                for T in tokens:
                    for l2 in modes:
                        where = f"{layout}-major T={T} K={K} {l2} L2"
                        bar.step(where)
                        row = {"layout": layout, "l2": l2, "T": T, "K": K, "write": write,
                               "bytes": bytes_moved(T, H, dtype.itemsize, K + 2, 2 + (write >= 0))}
                        if l2 == "warm":
                            args = problem.fused_args(T, K, write)
                            measure(timer, {**kernels, **refs, **floors}, args, row, bw, opts.plain, notes, where)
                            measure(timer, inplace, (scratch[:T], *args[1:]), row, bw, opts.plain, notes, where)
                        else:
                            sets, row_sets = cold_sets(timer, T, K, H, cap, dtype, w_dtype, layout,
                                                       K + 2 + (write >= 0), 3)
                            row.update(row_sets)
                            measure_cold(timer, {**kernels, **inplace, **floors},
                                         [sets.fused_args(i, K, write) for i in range(sets.n)], row, bw, notes, where)
                            del sets
                        floor_cells(row, first, limits)
                        if "us:unfused" in row and first in kernels:
                            row["vs_unfused"] = row["us:unfused"] / row[f"us:{first}"]
                        rows.append(row)
                if problem is not None:
                    problem.restore(K)
            del problem, scratch
            if is_cuda:
                torch.cuda.empty_cache()
    names = [n for n in (*kernels, *inplace, *refs, *floors) if any(f"us:{n}" in r for r in rows)]
    ours = [n for n in (*kernels, *inplace) if n in names]
    columns = [["layout", "layout", ""], ["l2", "L2", ""], ["T", "T", "d"], ["K", "K", "d"],
               ["write", "slot written", "d"]]
    columns += timing_columns(names, first, opts.plain and is_cuda, ours) + floor_columns(rows, first)
    if any("vs_unfused" in r for r in rows):
        columns.append(["vs_unfused", "unfused / " + first, ".2f"])
    return {"section": "fused", "title": "fused_attn_res (add + snapshot + mix + RMSNorm)",
            "environment": environment(device), "limits": limits,
            "params": section_params(opts, timer, H, cap, modes, nan_in_unused_slots=True),
            "columns": columns, "rows": rows, "notes": notes,
            "plot": {"series": ours, "refs": [n for n in refs if n in names], "floor": bool(floors)}}
