"""Section ``mix``: the plain ``attn_res`` over the serving grid, token-major and block-major.

Each (layout, T, K) call on a preallocated buffer (NaN in slots >= K), timed per call with the run's main method
(CUDA-graph replay on a GPU); "of BW" = bytes the call must move ((K + 1) rows read, one written, per token) /
time / the same run's copy bandwidth. Reference columns (token-major only): the eager FP32 formula
(``k3_ops.reference.attn_res_reference``) and, on a GPU, ``torch.compile`` of it and the measured floor under the
call in its two geometries (``floor``, ``floor_stream``: ``k3_ops.bench.floor``).
"""
from __future__ import annotations

import torch

from .. import reference
from .common import Ops, Options, Problem, bytes_moved, environment, k3_ops_ops, measure, progress
from .timing import Timer

SERVING_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
DEFAULTS = {
    "all": {"hidden": 7168, "capacity": 9, "blocks": [1, 2, 4, 8], "layouts": ["token", "block"]},
    "gpu": {"tokens": SERVING_TOKENS},
    "cpu": {"tokens": [1, 16, 128], "blocks": [1, 8]},
    "quick": {"tokens": [1, 8], "blocks": [1, 4]},
    "quick-cpu": {"hidden": 256},
}


def reference_impls(device: torch.device) -> dict:
    """The formulas a kernel is compared with: eager FP32 PyTorch, and torch.compile of it on a GPU (on a CPU
    that would time Inductor's CPU code, which no deployment of this op runs). Differentiable (the train section
    takes its steps from them)."""
    refs = {"eager": reference.attn_res_reference}
    if device.type == "cuda":
        refs["compile"] = torch.compile(reference.attn_res_reference)
    return refs


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None,
        refs: dict | None = None) -> dict:
    """Time ``ops[name].attn_res`` for every name (default: the registered op) and the ``refs`` formulas
    (default: ``reference_impls``; none with ``opts.refs`` False); returns the result dict of ``writer``."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    kernels = {n: o.attn_res for n, o in ops.items() if o.attn_res is not None}
    if refs is None:
        refs = reference_impls(device) if opts.refs else {}
        if opts.refs and device.type == "cuda":
            from .floor import mix_floor, mix_floor_stream

            # The floors under the call, two geometries (bench.floor): not formulas of the op.
            refs["floor"], refs["floor_stream"] = mix_floor, mix_floor_stream
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    layouts = opts.pick(DEFAULTS, "layouts")
    dtype = opts.io_dtype
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    rows, notes = [], []
    with torch.no_grad(), progress(len(layouts) * len(ks) * len(tokens), "mix", opts.progress) as bar:
        for layout in layouts:
            problem = Problem(max(tokens), cap, H, dtype, device, layout, opts.w_dtype)
            for K in ks:
                problem.poison(K)
                timer.after_heavy_work()
                for T in tokens:
                    bar.step(f"{layout}-major T={T} K={K}")
                    row = {"layout": layout, "T": T, "K": K, "bytes": bytes_moved(T, H, dtype.itemsize, K + 1, 1)}
                    impls = dict(kernels)
                    if layout == "token" and not (opts.max_ref_tokens and T > opts.max_ref_tokens):
                        impls.update(refs)
                    measure(timer, impls, problem.attn_res_args(T, K), row, bw, opts.plain, notes,
                             f"{layout}-major T={T} K={K}")
                    first = next(iter(kernels), None)
                    if first and "us:compile" in row:
                        row["vs_compile"] = row["us:compile"] / row[f"us:{first}"]
                    rows.append(row)
                problem.restore(K)
            del problem
            if device.type == "cuda":
                torch.cuda.empty_cache()
    names = list(kernels) + [n for n in refs if any(f"us:{n}" in r for r in rows)]
    columns = [["layout", "layout", ""], ["T", "T", "d"], ["K", "K", "d"]]
    columns += [[f"us:{n}", f"{n} us", ".2f"] for n in names]
    if opts.plain and timer.is_cuda:
        columns += [[f"plain:{n}", f"{n} plain us", ".2f"] for n in names]
    columns += [[f"bw:{n}", f"{n} of BW", ".3f"] for n in names if n in kernels]
    if any("vs_compile" in r for r in rows):
        columns.append(["vs_compile", "compile / " + next(iter(kernels)), ".2f"])
    timing = "CUDA-graph replay" if timer.mode == "graph" else "wall time per call"
    return {"section": "mix", "title": "attn_res (plain mix)", "environment": environment(device),
            "limits": limits,
            "params": {"dtype": opts.dtype, "weight_dtype": opts.weight_dtype or opts.dtype, "hidden": H,
                       "capacity": cap, "timing": timing, "nan_in_unused_slots": True},
            "columns": columns, "rows": rows, "notes": notes, "plot": {"series": list(kernels)}}
