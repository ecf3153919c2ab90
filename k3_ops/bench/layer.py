"""Section ``layer``: one decode step's serving calls as a model makes them, captured as ONE CUDA graph.

The schedule (24 layers by default, buffer capacity 9): each layer has two fused sites, both with an addend and
the output RMSNorm. Site 1 snapshots the new prefix into slot k on layers 0, 3, 6, ... while k < capacity - 1
(then k += 1, so the next site reads it); site 2 writes nothing. A final plain ``attn_res`` with K = k closes the
step. Each site's output is the next site's addend and its new prefix the next site's prefix (a chain, like a
model: no call can start before its predecessor's output exists). Every site has its own weights.

The step is timed per replay of the whole captured step (graph replay; wall time per step on a CPU), for the
fused op and for the unfused sequence (torch's add, the snapshot copy, ``attn_res``, torch's RMSNorm per site).
"floor" = calls per step x the same run's graph-node time: what the step would cost if every call were free;
"bandwidth floor" = the bytes the step must move (every call's rows read and written once) at the same run's copy
bandwidth: what it would cost if every byte came from DRAM at that rate (less can: L2 may keep rows between calls).
On a GPU the rows ``floor_kernel`` and ``floor_stream`` run the same step, one graph, with every call replaced by
the measured floor under it (``k3_ops.bench.floor``, its tile and stream geometries): the chain's loads, stores
and reductions with nothing of the op's arithmetic, the step's measured floor.
"""
from __future__ import annotations

import torch

from .common import EPS, Ops, Options, bytes_moved, environment, k3_ops_ops, progress, site_weights, unfused
from .timing import Timer

DEFAULTS = {
    "all": {"hidden": 7168, "capacity": 9, "layouts": ["token"]},
    "gpu": {"tokens": [1, 8, 64, 512]},
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

    def run(self, fused, attn_res) -> torch.Tensor:
        prefix, addend = self.prefix, self.addend
        for (K, write), (nw, pw, onw) in zip(self.sites, self.weights):
            addend, prefix = fused(prefix, addend, self.blocks, nw, pw, K, EPS, write, onw, EPS)
        nw, pw, _ = self.weights[-1]
        return attn_res(prefix, self.blocks, nw, pw, self.final_k, EPS)


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None) -> dict:
    """Time the step for every name in ``ops`` with both ``fused`` and ``attn_res`` (default: the registered
    ops) and, with ``opts.refs``, the unfused step built on the first name's ``attn_res``."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    steps = {n: (o.fused, o.attn_res) for n, o in ops.items() if o.fused is not None and o.attn_res is not None}
    first_mix = next((o.attn_res for o in ops.values() if o.attn_res is not None), None)
    if opts.refs and first_mix is not None:
        steps["unfused"] = (unfused(first_mix), first_mix)
    if opts.refs and device.type == "cuda":
        from .floor import fused_floor, fused_floor_stream, mix_floor, mix_floor_stream

        steps["floor_kernel"] = (fused_floor, mix_floor)
        steps["floor_stream"] = (fused_floor_stream, mix_floor_stream)
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, layouts = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "layouts")
    layers = int(opts.extra.get("layers", LAYERS))
    limits = timer.limits()
    node = limits["graph_node_us"]
    rows, notes = [], []
    with torch.inference_mode(), progress(len(layouts) * len(tokens), "layer", opts.progress) as bar:
        for layout in layouts:
            for T in tokens:
                bar.step(f"{layout}-major T={T}")
                step = Step(T, H, cap, layers, opts.io_dtype, opts.w_dtype, device, layout)
                row = {"layout": layout, "T": T, "K_final": step.final_k, "calls": step.calls()}
                for name, (fused, mix) in steps.items():
                    if not bool(torch.isfinite(step.run(fused, mix)).all()):
                        notes.append(f"{name} step returned non-finite values at {layout}-major T={T}")
                    row[f"us:{name}"] = timer.primary(lambda f=fused, m=mix, s=step: s.run(f, m))
                    row[f"site:{name}"] = row[f"us:{name}"] / step.calls()
                first = next(iter(steps))
                if "us:unfused" in row and first != "unfused":
                    row["vs_unfused"] = row["us:unfused"] / row[f"us:{first}"]
                if node:
                    row["floor"] = step.calls() * node
                row["bytes"] = step.bytes()
                row["bw_floor"] = row["bytes"] / limits["copy_bandwidth_Bps"] * 1e6
                rows.append(row)
                del step
    names = list(steps)
    columns = [["layout", "layout", ""], ["T", "T", "d"], ["calls", "calls per step", "d"]]
    columns += [[f"us:{n}", f"{n} us/step", ".1f"] for n in names]
    columns += [[f"site:{n}", f"{n} us/call", ".2f"] for n in names]
    if any("vs_unfused" in r for r in rows):
        columns.append(["vs_unfused", "unfused / " + names[0], ".2f"])
    if node:
        columns.append(["floor", "graph-node floor us", ".1f"])
    columns.append(["bw_floor", "bandwidth floor us", ".1f"])
    timing = "one CUDA graph per step, replayed" if timer.mode == "graph" else "wall time per step"
    return {"section": "layer", "title": f"layer schedule ({layers} layers, 2 fused sites each, final mix)",
            "environment": environment(device), "limits": limits,
            "params": {"dtype": opts.dtype, "weight_dtype": opts.weight_dtype or opts.dtype, "hidden": H,
                       "capacity": cap, "layers": layers, "snapshot_every": SNAPSHOT_EVERY, "timing": timing},
            "columns": columns, "rows": rows, "notes": notes}
