"""Section ``mix``: the plain ``attn_res`` over the serving grid, warm and cold L2.

Each (layout, T, K) call, NaN in slots >= K, timed per call with the run's main method: on a GPU CUDA-graph replay
with a warm L2 (one preallocated buffer, every (T, K) a view of it, the same inputs replayed) and with a cold L2
(``Timer.cold``: a rotation of input sets together more than 3x the L2, each with its own weights, as a decoder step
meets them); wall time per call on a CPU. "of BW" = bytes the call must move ((K + 1) rows read, one written, per
token) / time / the same run's copy bandwidth. Beside the op, on a GPU: the measured floors under the call in their
three geometries (``k3_ops.bench.floor``; the cell's floor is the fastest, ``floor_frac`` = floor / op) and the
simple limit graph node + bytes / copy bandwidth (``limit_frac`` = limit / op), warm and cold; the eager FP32
formula (``k3_ops.reference.attn_res_reference``) and ``torch.compile`` of it, warm and token-major only. On a CPU
the op is that formula (its CPU kernel), so no reference row is timed beside it.
"""
from __future__ import annotations

import torch

from .. import reference
from .common import (
    ColdSets,
    Ops,
    Options,
    Problem,
    bytes_moved,
    environment,
    floor_cells,
    floor_columns,
    footprint,
    k3_ops_ops,
    l2_modes,
    measure,
    measure_cold,
    progress,
    section_params,
    timing_columns,
)
from .timing import Timer, cold_set_count

SERVING_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
DEFAULTS = {
    "all": {"hidden": 7168, "capacity": 9, "blocks": [1, 2, 4, 8], "layouts": ["token"]},
    "gpu": {"tokens": [1, 8, 64, 256, 512, 1024, 4096, 16384]},
    "full-gpu": {"tokens": SERVING_TOKENS, "layouts": ["token", "block"]},
    "cpu": {"tokens": [1, 16, 128], "blocks": [1, 8], "layouts": ["token", "block"]},
    "quick": {"tokens": [1, 8], "blocks": [1, 4], "layouts": ["token", "block"]},
    "quick-cpu": {"hidden": 256},
}


def reference_impls(device: torch.device) -> dict:
    """The formulas a kernel is compared with on a GPU: eager FP32 PyTorch and torch.compile of it. Differentiable
    (the train section takes its steps from them). On a CPU only the eager formula (torch.compile there would time
    Inductor's CPU code, which no deployment of this op runs)."""
    refs = {"eager": reference.attn_res_reference}
    if device.type == "cuda":
        refs["compile"] = torch.compile(reference.attn_res_reference)
    return refs


def floor_impls() -> dict:
    """The measured floors under the plain call, by row name (``common.FLOOR_NAMES``): CUDA only."""
    from .floor import mix_floor, mix_floor_row, mix_floor_stream

    return {"floor": mix_floor, "floor_stream": mix_floor_stream, "floor_row": mix_floor_row}


def cold_sets(timer: Timer, T: int, K: int, H: int, cap: int, dtype: torch.dtype, w_dtype: torch.dtype,
              layout: str, rows: int, weights: int) -> tuple[ColdSets, dict]:
    """The input sets of one cold cell (a call touching ``rows`` [T, H] rows and ``weights`` weight vectors of its
    set) and what the row records of them: ``sets``, ``cold_ratio`` (the sets' touched bytes / L2)."""
    touched = footprint(T, H, dtype.itemsize, rows, weights, w_dtype.itemsize)
    l2 = timer.l2_bytes
    n = cold_set_count(touched, ColdSets.allocated(T, cap, H, dtype.itemsize, w_dtype.itemsize), l2)
    sets = ColdSets(n, T, cap, H, dtype, w_dtype, timer.device, layout, K)
    return sets, {"sets": n, "cold_ratio": n * touched / l2}


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None,
        refs: dict | None = None) -> dict:
    """Time ``ops[name].attn_res`` for every name (default: the registered op), the ``refs`` formulas (default:
    ``reference_impls`` on a GPU; none with ``opts.refs`` False) and the floors, in every L2 state of
    ``opts.l2`` (default cold; warm alone on a CPU); returns the result dict of ``writer``."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    is_cuda = device.type == "cuda"
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    kernels = {n: o.attn_res for n, o in ops.items() if o.attn_res is not None}
    if refs is None:
        refs = reference_impls(device) if opts.refs and is_cuda else {}
    floors = floor_impls() if opts.refs and is_cuda else {}
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    layouts, modes = opts.pick(DEFAULTS, "layouts"), l2_modes(opts, device)
    dtype, w_dtype = opts.io_dtype, opts.w_dtype
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    first = next(iter(kernels), None)
    rows, notes = [], []
    total = len(layouts) * len(ks) * len(tokens) * len(modes)
    with torch.no_grad(), progress(total, "mix", opts.progress) as bar:
        for layout in layouts:
            problem = Problem(max(tokens), cap, H, dtype, device, layout, w_dtype) if "warm" in modes else None
            for K in ks:
                if problem is not None:
                    problem.poison(K)
                timer.after_heavy_work()
                for T in tokens:
                    for l2 in modes:
                        where = f"{layout}-major T={T} K={K} {l2} L2"
                        bar.step(where)
                        row = {"layout": layout, "l2": l2, "T": T, "K": K,
                               "bytes": bytes_moved(T, H, dtype.itemsize, K + 1, 1)}
                        impls = {**kernels, **floors}
                        if l2 == "warm":
                            if layout == "token" and not (opts.max_ref_tokens and T > opts.max_ref_tokens):
                                impls.update(refs)
                            measure(timer, impls, problem.attn_res_args(T, K), row, bw, opts.plain, notes, where)
                        else:
                            sets, row_sets = cold_sets(timer, T, K, H, cap, dtype, w_dtype, layout, K + 1, 2)
                            row.update(row_sets)
                            measure_cold(timer, impls, [sets.attn_res_args(i, K) for i in range(sets.n)], row, bw,
                                         notes, where)
                            del sets
                        floor_cells(row, first, limits)
                        if first and "us:compile" in row:
                            row["vs_compile"] = row["us:compile"] / row[f"us:{first}"]
                        rows.append(row)
                if problem is not None:
                    problem.restore(K)
            del problem
            if is_cuda:
                torch.cuda.empty_cache()
    names = list(kernels) + [n for n in (*refs, *floors) if any(f"us:{n}" in r for r in rows)]
    columns = [["layout", "layout", ""], ["l2", "L2", ""], ["T", "T", "d"], ["K", "K", "d"]]
    columns += timing_columns(names, first, opts.plain and is_cuda, list(kernels)) + floor_columns(rows, first)
    if any("vs_compile" in r for r in rows):
        columns.append(["vs_compile", "compile / " + first, ".2f"])
    return {"section": "mix", "title": "attn_res (plain mix)", "environment": environment(device),
            "limits": limits,
            "params": section_params(opts, timer, H, cap, modes, nan_in_unused_slots=True),
            "columns": columns, "rows": rows, "notes": notes,
            "plot": {"series": list(kernels), "refs": [n for n in refs if any(f"us:{n}" in r for r in rows)],
                     "floor": bool(floors)}}
