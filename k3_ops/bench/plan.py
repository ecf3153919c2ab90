"""``python -m k3_ops.bench plan``: the launch table as a picture, on any machine.

For a grid of T x K (bf16, H = 7168 by default) it asks the CUDA launch policy which forward path it picks for the
plain call and ``fused_attn_res`` (one plan: the fused call's mix is the plain op's bit for bit), for two GPUs
described by their facts, no GPU needed: one with the CUDA C++ kernels (an sm_90 build, e.g. an H100: 132 SMs),
and the same GPU without them (a build without the CUDA sources, or an older GPU), where the cluster and streaming
entries run their fallbacks. It writes ``launch_table.md`` (a T x K table per GPU, each cell the path and its
launch shape) and, with matplotlib, ``launch_table.png`` (the grids coloured by path) under ``--out`` (default
docs/). The serving calls ``fused_attn_res_`` and ``fused_attn_res.quant`` take the same plans except where a
cell shows the split path, which they replace by the per-token kernel.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeviceFacts", "H100", "PATHS", "TOKENS", "BLOCKS", "path_of", "table_plans", "markdown", "figure",
           "main"]

#: The forward paths, in the order of the legend, with their colours.
PATHS = {
    "cluster": "#1f77b4",
    "stream": "#9467bd",
    "token: one tile": "#2ca02c",
    "token: row tiles": "#98df8a",
    "token: one row": "#bcbd22",
    "rows": "#ff7f0e",
    "split": "#d62728",
    "tiles": "#7f7f7f",
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384]
BLOCKS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]


@dataclass(frozen=True)
class DeviceFacts:
    """What the launch policy's choice of path may depend on, for a GPU that is not here."""

    name: str
    sms: int
    capability: tuple[int, int]
    cuda_kernels: bool  # a build with the CUDA C++ kernels (csrc_cuda/)

    @property
    def label(self) -> str:
        kernels = "with the CUDA C++ kernels" if self.cuda_kernels else "without the CUDA C++ kernels"
        return f"{self.name}, sm_{self.capability[0]}{self.capability[1]}, {self.sms} SMs, {kernels}"


H100 = DeviceFacts("H100", 132, (9, 0), True)


def path_of(plan) -> tuple[str, str]:
    """(path, launch shape) of a resolved plan."""
    if plan.kernel == "cluster":
        return "cluster", f"{plan.cluster_size} CTAs/token"
    if plan.kernel == "stream":
        return "stream", "2 CTAs/SM"
    if plan.kernel == "token":
        stages = f", {plan.num_stages} st" if plan.num_stages > 1 else ""
        first = ", pf" if plan.prefix_first else ""
        if plan.one_tile:
            return "token: one tile", f"{plan.num_warps} w"
        if plan.rows_per_tile == 1:
            return "token: one row", f"{plan.num_warps} w{stages}{first}"
        return "token: row tiles", f"{plan.rows_per_tile} rows, {plan.num_warps} w{stages}{first}"
    if plan.kernel == "rows":
        return "rows", f"{plan.ctas_per_sm}/SM, {plan.num_warps} w, {plan.num_stages} st"
    if plan.kernel == "split":
        return "split", f"{plan.p} x {plan.chunk} cols"
    return plan.kernel, ""


def _cluster_threads(K: int, H: int, element_size: int, cluster_size: int) -> int:
    # The native kernels' own shape rule (csrc_cuda/attn_res_cluster.cu, cluster_fwd_threads; streaming: 128 threads
    # of H / 1024 vectors, H / 1024 in {1, 2, 4, 7, 8}), for 16-bit rows: threads per CTA, 0 where not supported.
    if element_size != 2 or not 1 <= K <= 8:
        return 0
    if cluster_size == 1:
        return 128 if H % 1024 == 0 and H // 1024 in (1, 2, 4, 7, 8) else 0
    if H % (8 * cluster_size):
        return 0
    threads = -(-(H // (8 * cluster_size)) // 32) * 32
    return threads if threads <= 1024 else 0


def plan_facts(facts: DeviceFacts):
    """The plan step's description (``backends.cuda_plan.DeviceFacts``) of a GPU with ``facts``."""
    from ..backends import cuda_plan

    hopper = facts.capability >= (9, 0)
    return cuda_plan.DeviceFacts(interpreted=False, num_sms=facts.sms, capability=facts.capability, pdl=hopper,
                                 smem_optin=227 * 1024 if hopper else 163 * 1024,
                                 cluster_threads=_cluster_threads if facts.cuda_kernels else None)


def table_plans(facts: DeviceFacts, tokens: list[int] = TOKENS, blocks: list[int] = BLOCKS,
                H: int = 7168) -> dict[tuple[int, int], tuple[str, str]]:
    """{(T, K): (path, launch shape)} of the plain and fused calls' plans on a GPU with ``facts``: the pure plan step
    (``backends.cuda_plan.table_plan``), no GPU needed."""
    from ..backends import cuda_plan

    described = plan_facts(facts)
    return {(T, K): path_of(cuda_plan.table_plan(T, K, H, described)) for T in tokens for K in blocks}


def markdown(grids: dict[DeviceFacts, dict], tokens: list[int], blocks: list[int], H: int) -> str:
    lines = ["# The forward launch table", "",
             "Written by `python -m k3_ops.bench plan` from the CUDA launch policy (`k3_ops/backends/`), bf16, "
             f"H = {H}: the path the plain `attn_res` and `fused_attn_res` take at each T (tokens per call) and K "
             "(valid blocks), and its launch shape (w: warps per program, st: pipeline stages, pf: the prefix "
             "candidate folded before the block rows). The in-place and FP8 serving calls take the same plans, the "
             "per-token kernel where a cell shows split. [launch_table.png](launch_table.png) draws the same grids.",
             ""]
    for facts, grid in grids.items():
        lines += [f"## {facts.label}", "", "| T | " + " | ".join(f"K = {K}" for K in blocks) + " |",
                  "|---:|" + "---|" * len(blocks)]
        for T in tokens:
            lines.append(f"| {T} | " + " | ".join(f"{p} ({shape})" if shape else p
                                                   for p, shape in (grid[(T, K)] for K in blocks)) + " |")
        lines.append("")
    return "\n".join(lines)


def figure(grids: dict[DeviceFacts, dict], tokens: list[int], blocks: list[int], H: int):
    """The grids as coloured T x K maps, one panel per GPU; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError:
        return None
    names = list(PATHS)
    cmap = ListedColormap([PATHS[n] for n in names])
    fig, axes = plt.subplots(1, len(grids), figsize=(6.2 * len(grids), 7.2), squeeze=False)
    for ax, (facts, grid) in zip(axes[0], grids.items()):
        codes = [[names.index(grid[(T, K)][0]) for K in blocks] for T in tokens]
        ax.imshow(codes, cmap=cmap, vmin=0, vmax=len(names) - 1, aspect="auto")
        for i, T in enumerate(tokens):
            for j, K in enumerate(blocks):
                shape = grid[(T, K)][1].replace("/token", "").replace(" cols", "").replace(", ", "\n")
                ax.text(j, i, shape, ha="center", va="center", fontsize=5)
        ax.set_xticks(range(len(blocks)), [str(K) for K in blocks])
        ax.set_yticks(range(len(tokens)), [str(T) for T in tokens])
        ax.set_xlabel("K (valid blocks)")
        ax.set_ylabel("T (tokens per call)")
        ax.set_title(facts.label, fontsize=9)
    fig.legend(handles=[Patch(color=PATHS[n], label=n) for n in names], loc="lower center", ncol=len(names) // 2,
               fontsize=8)
    fig.suptitle(f"k3_ops forward launch table (attn_res, fused_attn_res), bf16, H = {H}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    return fig


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3_ops.bench plan", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", type=Path, default=Path("docs"), help="directory for launch_table.md / .png")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--sms", type=int, default=H100.sms, help="SM count of the GPU drawn (default: an H100's)")
    p.add_argument("--name", default=H100.name, help="the GPU's name in the picture")
    args = p.parse_args(argv)
    facts = DeviceFacts(args.name, args.sms, H100.capability, True)
    grids = {f: table_plans(f, TOKENS, BLOCKS, args.hidden)
             for f in (facts, DeviceFacts(args.name, args.sms, H100.capability, False))}
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "launch_table.md"
    md.write_text(markdown(grids, TOKENS, BLOCKS, args.hidden))
    written = {"md": md}
    fig = figure(grids, TOKENS, BLOCKS, args.hidden)
    if fig is None:
        print("# matplotlib is not installed: no launch_table.png (pip install -e '.[bench]')")
    else:
        import matplotlib.pyplot as plt

        written["png"] = args.out / "launch_table.png"
        fig.savefig(written["png"], dpi=130)
        plt.close(fig)
    print("wrote " + ", ".join(str(v) for v in written.values()))
    return {"grids": grids, "written": written}
