"""The one writer of the benchmark: a section's result as a text table (stdout), Markdown, JSON and a PNG.

A result is a plain dict: ``section``, ``title``, ``environment`` (device, versions, commit), ``limits`` (copy
bandwidth, graph node: same run), ``params`` (dtype, H, capacity, timing method, ...), ``columns`` (``[key,
header, format]``) and ``rows`` (flat dicts keyed by the column keys). ``plot`` (optional) names what to draw:
``{"series": [name, ...]}`` for rows holding ``T``, ``K``, ``layout``, ``us:<name>`` and ``bw:<name>``.
``python -m k3_ops.bench report FILE.json ...`` renders saved results as Markdown again (docs/benchmarks.md's
tables are made so).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["header", "render", "write", "plot"]


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, (int, float)) and fmt:
        return format(value, fmt)
    return str(value)


def header(result: dict) -> str:
    """One line: what ran where, at which commit, against which same-run limits."""
    env, lim, prm = result["environment"], result.get("limits") or {}, result.get("params") or {}
    parts = [f"{result['section']}: {result.get('title', '')}".rstrip(": "),
             f"{env.get('device')}", f"torch {env.get('torch')}", f"triton {env.get('triton')}",
             f"commit {env.get('commit')}"]
    shape = " ".join(f"{k}={v}" for k, v in prm.items() if k in ("dtype", "hidden", "capacity", "layers"))
    if shape:
        parts.append(shape)
    if prm.get("timing"):
        parts.append(str(prm["timing"]))
    if lim.get("copy_bandwidth_Bps"):
        parts.append(f"copy bandwidth {lim['copy_bandwidth_Bps'] / 1e12:.3f} TB/s (read + write)")
    if lim.get("graph_node_us"):
        parts.append(f"graph node {lim['graph_node_us']:.2f} us")
    return " | ".join(parts)


def render(result: dict, style: str = "text") -> str:
    """The table: aligned text for a terminal, or GitHub Markdown (``style="markdown"``) for the docs."""
    cols = result["columns"]
    cells = [[_fmt(row.get(key), fmt) for key, _, fmt in cols] for row in result["rows"]]
    heads = [head for _, head, _ in cols]
    if style == "markdown":
        align = ["---" if not cols[i][2] else "---:" for i in range(len(cols))]
        lines = [f"_{header(result)}_", "", "| " + " | ".join(heads) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        notes = result.get("notes") or []
        return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(heads)]
    lines = ["# " + header(result), "  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines += [f"# {n}" for n in result.get("notes") or []]
    return "\n".join(lines)


def write(result: dict, out_dir: str | Path, *, echo: bool = True) -> dict[str, Path]:
    """Print the table and write ``<section>.json``, ``<section>.md`` and (where the section plots and
    matplotlib is installed) ``<section>.png`` under ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = result["section"]
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["md"].write_text(render(result, "markdown"))
    if result.get("plot") and result["rows"]:
        png = out / f"{name}.png"
        if plot(result, png):
            paths["png"] = png
    if echo:
        print(render(result))
        print("# wrote " + ", ".join(str(p) for p in paths.values()))
    return paths


def plot(result: dict, path: Path) -> bool:
    """Time per call and fraction of copy bandwidth against T, one line per K (solid token-major, dashed
    block-major), the copy-bandwidth limit drawn in both panels and the graph-node floor in the first."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return False
    rows, series = result["rows"], result["plot"]["series"]
    limits = result.get("limits") or {}
    bw, node = limits.get("copy_bandwidth_Bps"), limits.get("graph_node_us")
    ks = sorted({r["K"] for r in rows})
    cmap = plt.get_cmap("viridis")
    colors = {K: cmap(i / max(len(ks) - 1, 1) * 0.9) for i, K in enumerate(ks)}
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "v", "D"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 5.2))
    keys = [(s, lay) for s in series for lay in ("token", "block")
            if any(r.get("layout", "token") == lay and r.get(f"us:{s}") for r in rows)]
    for ki, (name, layout) in enumerate(keys):
        for K in ks:
            pts = sorted((r["T"], r[f"us:{name}"], r.get(f"bw:{name}")) for r in rows
                         if r["K"] == K and r.get("layout", "token") == layout and r.get(f"us:{name}"))
            if not pts:
                continue
            label = f"K={K}" + (f" {name}" if len(series) > 1 else "") + f" {layout}-major"
            kw = dict(color=colors[K], ls=styles[ki % len(styles)], marker=markers[ki % len(markers)], ms=3.5)
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **kw)
            if bw:
                ax_b.plot([p[0] for p in pts], [p[2] for p in pts], label=label, **kw)
    if bw:
        # The copy-bandwidth limit as a time: bytes the call must move / copy bandwidth (one thin line per K).
        for K in ks:
            pts = sorted({(r["T"], r["bytes"]) for r in rows if r["K"] == K})
            ax_t.plot([p[0] for p in pts], [1e6 * b / bw for _, b in pts], color=colors[K], lw=0.8, ls=(0, (1, 2)))
        ax_t.plot([], [], color="gray", lw=0.8, ls=(0, (1, 2)), label="copy-bandwidth limit (per K)")
        ax_b.axhline(1.0, color="crimson", lw=1.2, label=f"copy bandwidth {bw / 1e12:.2f} TB/s")
        ax_b.set_ylim(0, 1.08)
    if node:
        ax_t.axhline(node, color="gray", lw=1.0, ls="-.", label=f"graph node {node:.2f} us")
    prm = result.get("params") or {}
    ts = sorted({r["T"] for r in rows})
    ticks = ts if len(ts) <= 14 else ts[::2]
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("tokens per call T")
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    measured = [v for r in rows for s in series if (v := r.get(f"us:{s}"))]
    if measured:
        # Keep the copy-bandwidth lines from stretching the axis far below anything measured.
        ax_t.set_ylim(bottom=0.5 * min(min(measured), node or math.inf))
    ax_t.set_ylabel(f"time per call, us ({prm.get('timing', '')})")
    ax_b.set_ylabel("fraction of copy bandwidth (bytes moved / time / copy BW)")
    ax_t.legend(fontsize=7, ncol=2)
    if bw:
        ax_b.legend(fontsize=7, ncol=2)
    else:
        ax_b.text(0.5, 0.5, "no copy bandwidth measured", ha="center", transform=ax_b.transAxes)
    env = result["environment"]
    fig.suptitle(f"{result.get('title', result['section'])}: {env.get('device')}, {prm.get('dtype')} "
                 f"H={prm.get('hidden')} capacity {prm.get('capacity')}, commit {env.get('commit')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
