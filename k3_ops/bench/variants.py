"""``python -m k3_ops.bench variants``: the alternatives a launch-table cell could take, timed beside its entry.

A cell is named by a shape, ``TxK`` (``--cells 256x4,512x1``): the launch-table entry that holds T tokens and K
valid blocks, timed at exactly that T and K. For each cell the entry is replaced in turn by each alternative
(``alternatives``: the per-token kernel's plans, the rows kernel, the streaming and cluster kernels, the split
path, each where it can run the shape; ``--configs`` adds your own) through the table's public tuning entry
(``set_launch_config``), and the registered ops are timed as a user calls them: the plain op, ``fused_attn_res``
and the in-place ``fused_attn_res_`` (``--calls``), warm and/or cold L2 (``--l2``, the sections' methods: cold
rotates input sets together more than 3x the L2, the same sets for every alternative). The entry itself is timed
first and again last (``table``, ``table_again``): the spread between the two is the run's noise. ``--floors``
adds the floor kernels (``bench.floor``, the row geometry in each of its forms), ``--layer`` the 24-layer step at
the cell's T with each alternative in the table (in place, warm or with the cold step's flushes). The entry is
restored after each alternative. Prints one table, writes ``variants.json`` and ``variants.md`` under ``--out``;
``--dry-run`` lists each cell's entry and alternatives, and the path each resolves to here, without timing (any
machine).
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from functools import partial

import torch

from . import layer as layer_section
from . import writer
from .common import ColdSets, Options, Problem, environment, footprint, k3_ops_ops
from .plan import path_of
from .timing import Timer, cold_set_count

__all__ = ["parse_cells", "alternatives", "table_cell", "replaced_entry", "short", "dry_run", "run", "main", "CALLS"]

CALLS = ("plain", "fused", "inplace")


def parse_cells(text: str) -> list[tuple[int, int]]:
    """``"256x4,512x1"`` -> [(256, 4), (512, 1)]."""
    cells = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a cell is TxK with integers T >= 1, K >= 0 (e.g. 256x4), got {item!r}")
        T, K = int(parts[0]), int(parts[1])
        if T < 1:
            raise ValueError(f"a cell's T must be >= 1, got {item!r}")
        cells.append((T, K))
    if not cells:
        raise ValueError(f"--cells names no cell: {text!r}")
    return cells


def table_cell(T: int, K: int) -> tuple[int, int]:
    """The (T bucket, K bucket) of the launch-table entry that holds T tokens and K valid blocks."""
    from ..backends.cuda import K_BUCKETS, T_BUCKETS, bucket

    return bucket(T, T_BUCKETS), bucket(max(K, 1), K_BUCKETS)


@contextmanager
def replaced_entry(T: int, K: int, config):
    """The launch table with ``config`` in the entry of (T, K) (None: as it is); yields the entry it replaced and
    puts that back on exit."""
    from ..backends.cuda import set_launch_config

    t_bucket, k_bucket = table_cell(T, K)
    if config is None:
        own = set_launch_config(t_bucket, k_bucket, _probe())
        set_launch_config(t_bucket, k_bucket, own)
        yield own
        return
    own = set_launch_config(t_bucket, k_bucket, config)
    try:
        yield own
    finally:
        set_launch_config(t_bucket, k_bucket, own)


def _probe():
    from ..backends.cuda import LaunchConfig

    return LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1)


def alternatives(T: int, K: int, own) -> dict:
    """name -> LaunchConfig: the plans an entry holding (T, K) could take instead of ``own``, each where its
    kernel can run the shape at all (a shape a native kernel cannot run still times its fallback: see the
    ``runs`` column); the ones equal to ``own`` left out."""
    from ..backends.cuda import LaunchConfig

    def token(rows: int, warps: int, stages: int = 1, first: bool = False) -> LaunchConfig:
        return LaunchConfig(kernel="token", rows_per_tile=rows, num_warps=warps, num_stages=stages,
                            prefix_first=first)

    rows_w4 = LaunchConfig(kernel="rows", num_warps=4, ctas_per_sm=2, prefetch=0, num_stages=3)
    alts = {}
    if K <= 8:
        alts["one_tile_w8"] = token(0, 8)
        alts["one_tile_w16"] = token(0, 16)
    if K >= 2:
        alts["tiles2_w8"] = token(2, 8)
        alts["tiles4_w8"] = token(4, 8)
    alts.update(row_w4_s3=token(1, 4, 3), row_w4_s3_pf=token(1, 4, 3, True), row_w4_s4_pf=token(1, 4, 4, True),
                row_w8_s3_pf=token(1, 8, 3, True))
    if T >= 256:
        alts["rows_w4_c2_s3"] = rows_w4
        alts["rows_w8_c1_s3"] = LaunchConfig(kernel="rows", num_warps=8, ctas_per_sm=1, prefetch=0, num_stages=3)
    if 1 <= K <= 8 and T >= 64:
        alts["stream"] = LaunchConfig(kernel="stream", min_k=1, fallback=rows_w4)
    if 1 <= K <= 8 and T <= 512:
        for size in (8, 4, 2):
            alts[f"cluster{size}"] = LaunchConfig(kernel="cluster", cluster_size=size, min_k=1, fallback=token(4, 8))
    if T <= 16 and K + 1 <= 16:
        alts["split"] = LaunchConfig(kernel="split", chunk=512)
    return {name: cfg for name, cfg in alts.items() if cfg != own}


def short(config) -> str:
    """A LaunchConfig by the fields that differ from the defaults (its fallback likewise)."""
    import dataclasses

    base = type(config)()
    knobs = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "kernel" or value != getattr(base, f.name):
            knobs.append(f"{f.name}={short(value) if f.name == 'fallback' else repr(value)}")
    return "(" + ", ".join(knobs) + ")"


def _config(knobs: dict):
    from ..backends.cuda import LaunchConfig

    knobs = dict(knobs)
    if isinstance(knobs.get("fallback"), dict):
        knobs["fallback"] = _config(knobs["fallback"])
    return LaunchConfig(**knobs)


def _runs(T: int, K: int, H: int, device: torch.device, config) -> str:
    from ..backends.cuda import choose_config

    path, shape = path_of(choose_config(T, K, H, device, config))
    return f"{path} ({shape})" if shape else path


def _floors(call: str, every_form: bool) -> dict:
    from . import floor

    if call == "plain":
        base = {"floor_tile": floor.mix_floor, "floor_stream": floor.mix_floor_stream}
        row = floor.mix_floor
    else:
        base = {"floor_tile": floor.fused_floor, "floor_stream": floor.fused_floor_stream}
        row = floor.fused_floor
    forms = floor.ROW_FORMS if every_form else ((floor.ROW_WARPS, floor.ROW_STAGES),)
    base.update({f"floor_row_w{w}_s{s}": floor.row_form(row, w, s) for w, s in forms})
    return base


def _args(problem, call: str, T: int, K: int, cap: int, scratch=None, i: int | None = None) -> tuple:
    write = K if K < cap else -1
    if call == "plain":
        return problem.attn_res_args(T, K) if i is None else problem.attn_res_args(i, K)
    args = problem.fused_args(T, K, write) if i is None else problem.fused_args(i, K, write)
    return (scratch[:T], *args[1:]) if scratch is not None else args


def run(cells: list[tuple[int, int]], *, opts: Options, calls: tuple[str, ...] = ("plain", "fused"),
        only: list[str] | None = None, configs: dict | None = None, floors: bool = False, layer: bool = False,
        timer: Timer | None = None) -> dict:
    """Time every alternative of every cell (see the module docstring); returns a ``writer`` result."""
    opts = opts.resolved()
    device = opts.torch_device
    if device.type != "cuda":
        raise RuntimeError(f"variants times the CUDA launch plans: it needs a CUDA device, got {device} "
                           "(--dry-run lists the alternatives anywhere)")
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = k3_ops_ops()
    fns = {"plain": ops.attn_res, "fused": ops.fused, "inplace": ops.fused_inplace}
    H, cap = opts.hidden or 7168, opts.capacity or 9
    dtype, w_dtype = opts.io_dtype, opts.w_dtype
    modes = list(opts.l2 or ["cold"])
    limits = timer.limits()
    rows, notes = [], []
    torch.backends.cuda.matmul.allow_tf32 = False
    for T, K in cells:
        with replaced_entry(T, K, None) as own:
            pass
        alts = alternatives(T, K, own)
        alts.update({name: _config(knobs) for name, knobs in (configs or {}).items()})
        if only:
            alts = {n: c for n, c in alts.items() if n in only}
        plans = {"table": None, **alts, "table_again": None}
        problem = Problem(T, cap, H, dtype, device, "token", w_dtype)
        problem.poison(K)
        scratch = problem.prefix.clone()
        timer.after_heavy_work()
        for call in calls:
            fn = fns[call]
            nrows = K + 1 if call == "plain" else K + 2 + (K < cap)
            for l2 in modes:
                sets = None
                if l2 == "cold":
                    touched = footprint(T, H, dtype.itemsize, nrows, 2 if call == "plain" else 3, w_dtype.itemsize)
                    n = cold_set_count(touched, ColdSets.allocated(T, cap, H, dtype.itemsize, w_dtype.itemsize),
                                       timer.l2_bytes)
                    sets = ColdSets(n, T, cap, H, dtype, w_dtype, device, "token", K)
                timed = dict(plans)
                if floors and call != "inplace":
                    timed.update(_floors(call, every_form=True))
                table_us = None
                with torch.inference_mode():
                    for name, config in timed.items():
                        is_floor = name.startswith("floor_")
                        target = fn if not is_floor else timed[name]
                        with replaced_entry(T, K, None if is_floor else config):
                            runs = "floor kernel" if is_floor else _runs(T, K, H, device, None)
                            if sets is None:
                                us = timer.graph(partial(target, *_args(problem, call, T, K, cap,
                                                                        scratch if call == "inplace" else None)))
                            else:
                                us = timer.cold([partial(target, *_args(sets, call, T, K, cap, i=i))
                                                 for i in range(sets.n)])
                        row = {"T": T, "K": K, "call": call, "l2": l2, "variant": name, "runs": runs, "us": us,
                               "spread": timer.last.relative if timer.last else None,
                               "config": "" if config is None or is_floor else short(config)}
                        if name == "table":
                            table_us = us
                        if table_us:
                            row["vs_table"] = table_us / us
                        rows.append(row)
                        print(f"variants T={T} K={K} {call} {l2} {name}: {us:.2f} us ({runs})", flush=True)
                del sets
                torch.cuda.empty_cache()
        if layer:
            rows += _layer_rows(T, K, plans, opts, timer, modes, H, cap)
        del problem, scratch
        torch.cuda.empty_cache()
    columns = [["T", "T", "d"], ["K", "K", "d"], ["call", "call", ""], ["l2", "L2", ""], ["variant", "variant", ""],
               ["runs", "runs", ""], ["us", "us", ".2f"], ["vs_table", "table / variant", ".3f"],
               ["spread", "IQR/median", ".2f"]]
    return {"section": "variants", "title": "launch-table cells: the entry and its alternatives",
            "environment": environment(device), "limits": limits,
            "params": {"dtype": opts.dtype, "hidden": H, "capacity": cap, "timing": "CUDA-graph replay",
                       "l2": modes, "calls": list(calls)},
            "columns": columns, "rows": rows, "notes": notes}


def _layer_rows(T: int, K: int, plans: dict, opts: Options, timer: Timer, modes: list[str], H: int,
                cap: int) -> list[dict]:
    """The layer step at T (in place) with each plan in the (T, K) entry."""
    ops = k3_ops_ops()
    step = layer_section.Step(T, H, cap, layer_section.LAYERS, opts.io_dtype, opts.w_dtype, timer.device, "token")
    flush = layer_section.Flush(timer.l2_bytes, timer.device) if "cold" in modes else None
    rows, table_us = [], {}
    with torch.inference_mode():
        for l2 in modes:
            between = flush if l2 == "cold" else None
            flush_us = timer.graph(lambda: flush.run(step.calls())) if between is not None else 0.0
            for name, config in plans.items():
                with replaced_entry(T, K, config):
                    us = timer.graph(lambda b=between: step.run_inplace(ops.fused_inplace, ops.attn_res, b))
                us = layer_section.subtract_flush(us, flush_us)
                if name == "table":
                    table_us[l2] = us
                rows.append({"T": T, "K": K, "call": "layer", "l2": l2, "variant": name, "runs": "step", "us": us,
                             "vs_table": table_us[l2] / us, "config": ""})
                print(f"variants T={T} K={K} layer {l2} {name}: {us:.1f} us", flush=True)
    return rows


def dry_run(cells: list[tuple[int, int]], opts: Options, configs: dict | None, only: list[str] | None) -> list[str]:
    """Each cell's entry and alternatives, and the path each resolves to on this machine's device."""
    device = opts.resolved().torch_device
    H = opts.hidden or 7168
    lines = []
    for T, K in cells:
        with replaced_entry(T, K, None) as own:
            lines.append(f"cell T={T} K={K} (entry {table_cell(T, K)}): table = {short(own)} -> "
                         f"{_runs(T, K, H, device, None)}")
        alts = alternatives(T, K, own)
        alts.update({name: _config(knobs) for name, knobs in (configs or {}).items()})
        for name, config in alts.items():
            if only and name not in only:
                continue
            lines.append(f"  {name}: {short(config)} -> {_runs(T, K, H, device, config)}")
    return lines


def main(argv: list[str]) -> dict:
    from .cli import json_arg, l2_arg

    p = argparse.ArgumentParser(prog="python -m k3_ops.bench variants", description=__doc__.split("\n\n")[0],
                                epilog="Example (re-tuning on cold figures): python -m k3_ops.bench variants "
                                       "--cells 256x4,512x1 --l2 cold")
    p.add_argument("--cells", required=True, type=parse_cells, help="comma list of TxK, e.g. 256x4,512x1")
    p.add_argument("--calls", default="plain,fused", help=f"comma list of {', '.join(CALLS)} (default plain,fused)")
    p.add_argument("--l2", type=l2_arg, default=None, metavar="warm|cold|both", help="L2 state (default cold)")
    p.add_argument("--only", default=None, help="comma list of alternative names to time (default: all)")
    p.add_argument("--configs", type=json_arg, default=None,
                   help='extra alternatives, JSON {"name": {"kernel": "token", ...}} or @file.json')
    p.add_argument("--floors", action="store_true", help="also time the floor kernels at each cell")
    p.add_argument("--layer", action="store_true", help="also time the 24-layer step at each cell's T")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--capacity", type=int, default=9)
    p.add_argument("--rep", type=float, default=10.0, help="milliseconds per measurement")
    p.add_argument("--quick", action="store_true", help="fewer replays per measurement")
    p.add_argument("--dry-run", action="store_true", help="list the alternatives, time nothing")
    p.add_argument("--out", default="bench_out", help="directory for variants.json / variants.md")
    args = p.parse_args(argv)
    calls = tuple(c for c in args.calls.split(",") if c)
    bad = [c for c in calls if c not in CALLS]
    if bad:
        p.error(f"--calls must come from {', '.join(CALLS)}, got {bad[0]!r}")
    configs = args.configs
    only = args.only.split(",") if args.only else None
    opts = Options(hidden=args.hidden, capacity=args.capacity, rep_ms=args.rep, quick=args.quick, l2=args.l2)
    if args.dry_run:
        for line in dry_run(args.cells, opts, configs, only):
            print(line)
        return {}
    if opts.resolved().torch_device.type != "cuda":
        p.error("variants times the CUDA launch plans: it needs a CUDA device (--dry-run lists the alternatives "
                "anywhere)")
    result = run(args.cells, opts=opts, calls=calls, only=only, configs=configs, floors=args.floors,
                 layer=args.layer)
    writer.write(result, args.out, formats=("json", "md"))
    return {"variants": result}
