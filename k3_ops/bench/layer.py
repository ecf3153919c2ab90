"""Section ``layer``: one decode step's serving calls as a model makes them, captured as ONE CUDA graph.

The schedule (24 layers by default, buffer capacity 9): each layer has two fused sites, both with an addend and
the output RMSNorm. Site 1 snapshots the new prefix into slot k on layers 0, 3, 6, ... while k < capacity - 1
(then k += 1, so the next site reads it); site 2 writes nothing. A final plain ``attn_res`` with K = k closes the
step. Each site's output is the next site's addend and its new prefix the next site's prefix (a chain, like a
model: no call can start before its predecessor's output exists). Every site has its own weights.

The step is timed per replay of the whole captured step (graph replay; wall time per step on a CPU) for the fused
op (``fused_attn_res``), the in-place serving call (``<name>_inplace``: ``fused_attn_res_``, the prefix updated in
place, as vLLM's model runs it), the unfused sequence (torch's add, the snapshot copy, ``attn_res``, torch's RMSNorm
per site) and, on a GPU, the same step with every call replaced by the measured floor under it in each geometry
(``floor``, ``floor_stream``, ``floor_row``: ``k3_ops.bench.floor``; the row's floor is the fastest).

Warm L2: the step replayed as it is; what the layers between the sites would evict stays in the L2. Cold L2: the
stand-in for those layers (``Flush``: a sum over an L2-sized window of a larger buffer, a new window each time)
runs before every call of the step; the same reads are timed alone in a graph of their own and subtracted, so a
cold row is the step's own time with an L2 that the layers between its calls have emptied.
"node floor" = calls per step x the same run's graph-node time: what the step would cost if every call were free;
"bandwidth floor" = the bytes the step must move (every call's rows read and written once) at the same run's copy
bandwidth; "limit" = their sum.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .common import (
    EPS,
    Ops,
    Options,
    bytes_moved,
    environment,
    floor_cells,
    k3_ops_ops,
    l2_modes,
    progress,
    section_params,
    site_weights,
    unfused,
)
from .timing import Timer

DEFAULTS = {
    "all": {"hidden": 7168, "capacity": 9, "layouts": ["token"]},
    "gpu": {"tokens": [1, 8, 64, 512]},
    "full-gpu": {"tokens": [1, 8, 64, 256, 512, 1024]},
    "cpu": {"tokens": [1, 8]},
    "quick": {"tokens": [1]},
    "quick-cpu": {"hidden": 256},
}
LAYERS = 24
SNAPSHOT_EVERY = 3


def schedule(layers: int, capacity: int, every: int = SNAPSHOT_EVERY) -> list[tuple[int, int]]:
    """(num_valid_blocks, block_write_idx) of every fused site in order; the final mix reads the last K."""
    sites, k = [], 0
    for layer in range(layers):
        write = k if layer % every == 0 and k < capacity - 1 else -1
        sites.append((k, write))
        k += write >= 0
        sites.append((k, -1))
    return sites


class Flush:
    """The layers between two calls of a cold step: a sum over one ``l2``-byte window of a buffer of ``WINDOWS``
    windows, the next window on each call, so that every read comes from DRAM (the window read before it was read
    two windows of the L2's size ago) and leaves the L2 holding the window, not the step's rows."""

    WINDOWS = 3

    def __init__(self, l2: int, device: torch.device):
        if l2 < 4:
            raise ValueError(f"Flush: l2 must be >= 4 bytes, got {l2}")
        self.windows = torch.ones((self.WINDOWS, l2 // 4), dtype=torch.float32, device=device)
        self.reads = 0

    def __call__(self) -> torch.Tensor:
        window = self.windows[self.reads % self.WINDOWS]
        self.reads += 1
        return window.sum()

    def run(self, reads: int) -> None:
        """``reads`` reads in turn: the flushes of one step, alone."""
        for _ in range(reads):
            self()


def subtract_flush(with_flush_us: float, flush_us: float) -> float:
    """The cold step's own time: the step with a flush before each call, less those flushes timed alone."""
    if flush_us < 0 or with_flush_us < 0:
        raise ValueError(f"subtract_flush: times must be >= 0, got {with_flush_us} and {flush_us}")
    return with_flush_us - flush_us


class Step:
    """The buffers and weights of one step at T tokens, and the step itself for one pair of callables."""

    def __init__(self, T: int, H: int, capacity: int, layers: int, dtype: torch.dtype, w_dtype: torch.dtype,
                 device: torch.device, layout: str):
        g = torch.Generator(device="cpu").manual_seed(T)
        storage_shape = (T, capacity, H) if layout == "token" else (capacity, T, H)
        storage = torch.full(storage_shape, float("nan"), dtype=dtype, device=device)  # nothing valid yet
        self.blocks = storage if layout == "token" else storage.transpose(0, 1)
        self.prefix = (torch.randn(T, H, generator=g) * 1.5).to(device=device, dtype=dtype)
        self.addend = (torch.randn(T, H, generator=g) * 0.5).to(device=device, dtype=dtype)
        self.running = self.prefix.clone()  # the in-place step's running residual
        self.sites = schedule(layers, capacity)
        self.weights = [site_weights(H, w_dtype, device, seed=1000 * T + i) for i in range(len(self.sites) + 1)]
        self.final_k = self.sites[-1][0]

    def calls(self) -> int:
        return len(self.sites) + 1

    def bytes(self) -> int:
        """Bytes the step must move: each fused site reads its prefix, addend and K block rows and writes its new
        prefix, its output and (where it snapshots) the slot; the final mix reads K + 1 rows and writes one."""
        T, _, H = self.blocks.shape
        size = self.blocks.element_size()
        total = sum(bytes_moved(T, H, size, K + 2, 2 + (write >= 0)) for K, write in self.sites)
        return total + bytes_moved(T, H, size, self.final_k + 1, 1)

    def run(self, fused, attn_res, between: Callable[[], object] | None = None) -> torch.Tensor:
        prefix, addend = self.prefix, self.addend
        for (K, write), (nw, pw, onw) in zip(self.sites, self.weights):
            if between is not None:
                between()
            addend, prefix = fused(prefix, addend, self.blocks, nw, pw, K, EPS, write, onw, EPS)
        if between is not None:
            between()
        nw, pw, _ = self.weights[-1]
        return attn_res(prefix, self.blocks, nw, pw, self.final_k, EPS)

    def run_inplace(self, fused_inplace, attn_res, between: Callable[[], object] | None = None) -> torch.Tensor:
        """The step with the in-place serving call: one running residual, updated by every site."""
        addend = self.addend
        for (K, write), (nw, pw, onw) in zip(self.sites, self.weights):
            if between is not None:
                between()
            addend, _ = fused_inplace(self.running, addend, self.blocks, nw, pw, K, EPS, write, onw, EPS)
        if between is not None:
            between()
        nw, pw, _ = self.weights[-1]
        return attn_res(self.running, self.blocks, nw, pw, self.final_k, EPS)


def _steps(ops: dict[str, Ops], refs: bool, is_cuda: bool) -> dict[str, tuple[Callable, Callable, bool]]:
    """name -> (fused call, final mix, in place) of every step this run times."""
    steps = {}
    for n, o in ops.items():
        if o.attn_res is None:
            continue
        if o.fused is not None:
            steps[n] = (o.fused, o.attn_res, False)
        if o.fused_inplace is not None:
            steps[f"{n}_inplace"] = (o.fused_inplace, o.attn_res, True)
    first_mix = next((o.attn_res for o in ops.values() if o.attn_res is not None), None)
    if refs and first_mix is not None:
        steps["unfused"] = (unfused(first_mix), first_mix, False)
    if refs and is_cuda:
        from .floor import fused_floor, fused_floor_row, fused_floor_stream, mix_floor, mix_floor_row, mix_floor_stream

        steps["floor"] = (fused_floor, mix_floor, False)
        steps["floor_stream"] = (fused_floor_stream, mix_floor_stream, False)
        steps["floor_row"] = (fused_floor_row, mix_floor_row, False)
    return steps


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None) -> dict:
    """Time the step for every name in ``ops`` with ``attn_res`` and ``fused`` (and, as ``<name>_inplace``,
    ``fused_inplace``; default: the registered ops) and, with ``opts.refs``, the unfused step built on the first
    name's ``attn_res`` and the floor steps, in every L2 state of ``opts.l2`` (default cold; warm alone on a
    CPU)."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    is_cuda = device.type == "cuda"
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    steps = _steps(ops, opts.refs, is_cuda)
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, layouts = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "layouts")
    modes = l2_modes(opts, device)
    layers = int(opts.extra.get("layers", LAYERS))
    limits = timer.limits()
    node = limits["graph_node_us"]
    flush = Flush(timer.l2_bytes, device) if "cold" in modes else None
    first = next(iter(steps), None)
    rows, notes = [], []
    with torch.inference_mode(), progress(len(layouts) * len(tokens) * len(modes), "layer", opts.progress) as bar:
        for layout in layouts:
            for T in tokens:
                step = Step(T, H, cap, layers, opts.io_dtype, opts.w_dtype, device, layout)
                for l2 in modes:
                    where = f"{layout}-major T={T} {l2} L2"
                    bar.step(where)
                    row = {"layout": layout, "l2": l2, "T": T, "K_final": step.final_k, "calls": step.calls(),
                           "bytes": step.bytes()}
                    between = flush if l2 == "cold" else None
                    if between is not None:
                        row["flush_us"] = timer.graph(partial(flush.run, step.calls()))
                    for name, (fused, mix, in_place) in steps.items():
                        run_step = step.run_inplace if in_place else step.run
                        if not bool(torch.isfinite(run_step(fused, mix)).all()):
                            notes.append(f"{name} step returned non-finite values at {where}")
                        us = timer.primary(lambda r=run_step, f=fused, m=mix, b=between: r(f, m, b))
                        spread = timer.last
                        if between is not None:
                            row[f"with_flush:{name}"] = us
                            us = subtract_flush(us, row["flush_us"])
                        row[f"us:{name}"] = us
                        row[f"site:{name}"] = us / step.calls()
                        if spread is not None:
                            row[f"spread:{name}"] = spread.relative
                            if spread.wide:
                                notes.append(f"wide spread: {name} at {where}: interquartile range "
                                             f"{100 * spread.relative:.0f} % of the median over {spread.samples} "
                                             "samples")
                    if "us:unfused" in row and first != "unfused":
                        row["vs_unfused"] = row["us:unfused"] / row[f"us:{first}"]
                    if node:
                        row["node_floor"] = step.calls() * node
                    row["bw_floor"] = row["bytes"] / limits["copy_bandwidth_Bps"] * 1e6
                    floor_cells(row, first, limits, nodes=step.calls())
                    rows.append(row)
                del step
    names = list(steps)
    columns = [["layout", "layout", ""], ["l2", "L2", ""], ["T", "T", "d"], ["calls", "calls per step", "d"]]
    columns += [[f"us:{n}", f"{n} us/step", ".1f"] for n in names]
    columns += [[f"site:{n}", f"{n} us/call", ".2f"] for n in names if n == first]
    if first:
        columns.append([f"spread:{first}", f"{first} IQR/median", ".2f"])
    if any("flush_us" in r for r in rows):
        columns.append(["flush_us", "flushes alone us/step", ".1f"])
    if any("vs_unfused" in r for r in rows):
        columns.append(["vs_unfused", "unfused / " + names[0], ".2f"])
    if any("floor_frac" in r for r in rows):
        columns.append(["floor_frac", "floor / " + first, ".2f"])
    if node:
        columns.append(["node_floor", "node floor us", ".1f"])
    columns.append(["bw_floor", "bandwidth floor us", ".1f"])
    return {"section": "layer", "title": f"layer schedule ({layers} layers, 2 fused sites each, final mix)",
            "environment": environment(device), "limits": limits,
            "params": section_params(opts, timer, H, cap, modes, layers=layers, snapshot_every=SNAPSHOT_EVERY,
                                     timing=("one CUDA graph per step, replayed" if timer.mode == "graph"
                                             else "wall time per step")),
            "columns": columns, "rows": rows, "notes": notes}
