"""Section ``host``: what one eager call costs the caller, beside a C++ op measured in the same run.

Per call and T (K = 8 by default): wall time per eager call (N back-to-back calls, then one synchronize: host
cost and device time together, whichever is longer), and the graph-replay time of the same call (the device
time alone, launch cost amortised). "wall / graph" near 1 means the call is device-bound; far above 1, the
host path is what the caller waits for. Calls: ``torch.add`` of two [T, H] tensors (a C++ op: the yardstick, the
floor of an eager call), ``attn_res``, ``fused_attn_res`` (addend, snapshot, output norm), ``fused_attn_res_`` (the
same, the prefix updated in place, on its own copy of the prefix) and one training step (forward, then
``torch.autograd.grad`` of prefix_sum).
"""
from __future__ import annotations

import torch

from .common import Ops, Options, Problem, environment, k3_ops_ops, progress, section_params
from .timing import Timer

DEFAULTS = {
    "all": {"hidden": 7168, "capacity": 9, "blocks": [8], "layouts": ["token"]},
    "gpu": {"tokens": [1, 1024]},
    "cpu": {"tokens": [1, 64]},
    "quick": {"tokens": [1]},
    "quick-cpu": {"hidden": 256},
}
EAGER_CALLS = 300  # back-to-back calls per wall-time batch on a GPU


def _calls(ops: Ops, problem: Problem, T: int, K: int, write: int) -> dict:
    """name -> zero-argument callable for each call this ops set has."""
    calls = {}
    args = problem.attn_res_args(T, K)
    if ops.attn_res is not None:
        calls["attn_res"] = lambda: ops.attn_res(*args)
    fargs = problem.fused_args(T, K, write)
    if ops.fused is not None:
        calls["fused_attn_res"] = lambda: ops.fused(*fargs)
    if ops.fused_inplace is not None:
        iargs = (fargs[0].clone(), *fargs[1:])
        calls["fused_attn_res_"] = lambda: ops.fused_inplace(*iargs)
    if ops.attn_res is not None:
        leaf = args[0].detach().requires_grad_(True)
        grad_out = torch.ones_like(args[0])

        def train_step():
            with torch.enable_grad():
                out = ops.attn_res(leaf, *args[1:])
                return torch.autograd.grad(out, leaf, grad_out)

        calls["fwd+bwd"] = train_step
    return calls


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None) -> dict:
    """Wall time per eager call and graph-replay time of each call of every name in ``ops`` (default: the
    registered ops), with torch.add first."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    eager_calls = (50 if opts.quick else EAGER_CALLS) if timer.is_cuda else None
    limits = timer.limits()
    rows, notes = [], []
    problem = Problem(max(tokens), cap, H, opts.io_dtype, device, "token", opts.w_dtype)
    jobs = [(T, K) for K in ks for T in tokens]
    with torch.no_grad(), progress(len(jobs) * (1 + len(ops)), "host", opts.progress) as bar:
        for K in ks:
            problem.poison(K)
            write = K if K < cap else -1
            for T in tokens:
                a, b = problem.prefix[:T], problem.addend[:T]
                named = [("torch", {"torch.add": lambda a=a, b=b: torch.add(a, b)})]
                named += [(n, _calls(o, problem, T, K, write)) for n, o in ops.items()]
                for impl, calls in named:
                    bar.step(f"{impl} T={T} K={K}")
                    for call, fn in calls.items():
                        row = {"impl": impl, "call": call, "T": T, "K": K}
                        row["wall_us"] = timer.wall(fn, eager_calls)
                        row["spread"] = timer.last.relative
                        if timer.last.wide:
                            notes.append(f"wide spread: {impl} {call} at T={T}: interquartile range "
                                         f"{100 * timer.last.relative:.0f} % of the median")
                        if timer.is_cuda:
                            try:
                                row["graph_us"] = timer.graph(fn)
                            except Exception as e:  # noqa: BLE001  (a call that cannot be captured is a finding)
                                row["graph_us"] = None
                                notes.append(f"{impl} {call} T={T}: no graph replay ({type(e).__name__}: {e})"[:300])
                                torch.cuda.synchronize(device)
                            if row["graph_us"]:
                                row["ratio"] = row["wall_us"] / row["graph_us"]
                        rows.append(row)
            problem.restore(K)
    del problem
    for row in rows:
        floor = next((r["wall_us"] for r in rows if r["call"] == "torch.add" and r["T"] == row["T"]), None)
        if floor and row["call"] != "torch.add":
            row["floor_us"], row["floor_frac"] = floor, floor / row["wall_us"]
    columns = [["impl", "impl", ""], ["call", "call", ""], ["T", "T", "d"], ["K", "K", "d"],
               ["wall_us", "eager wall us/call", ".1f"], ["spread", "IQR/median", ".2f"],
               ["floor_frac", "torch.add / call", ".2f"]]
    if timer.is_cuda:
        columns += [["graph_us", "graph replay us", ".2f"], ["ratio", "wall / graph", ".2f"]]
    timing = (f"wall time per call of {eager_calls} back-to-back eager calls + one sync; graph replay"
              if timer.is_cuda else "wall time per eager call")
    return {"section": "host", "title": "host cost of one eager call", "environment": environment(device),
            "limits": limits,
            "params": section_params(opts, timer, H, cap, [], timing=timing, eager_calls=eager_calls),
            "columns": columns, "rows": rows, "notes": notes}
