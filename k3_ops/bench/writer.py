"""The one writer of the benchmark: a section's result as a text table (stdout), Markdown, JSON and a PNG.

A result is a plain dict: ``section``, ``title``, ``environment`` (device, versions, commit), ``limits`` (copy
bandwidth, graph node: same run), ``params`` (dtype, H, capacity, timing method, ...), ``columns`` (``[key,
header, format]``) and ``rows`` (flat dicts keyed by the column keys). ``plot`` (optional) names what to draw:
``{"series": [name, ...], "refs": [name, ...], "floor": bool}`` for rows holding ``T``, ``K``, ``layout``, ``l2``,
``bytes``, ``us:<name>`` and ``floor_us``.
``python -m k3_ops.bench report FILE.json ...`` renders saved results as Markdown again (docs/benchmarks.md's
tables are made so).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["FORMATS", "bandwidth", "header", "render", "write", "plot", "figure"]


def bandwidth(bytes_per_s: float) -> str:
    """A bandwidth as the tables, the plots and docs/benchmarks.md all print it: three significant digits, in TB/s
    from 1 TB/s up (a GPU's "3.04 TB/s"), else in GB/s (a CPU's "22.4 GB/s", not "0.02 TB/s")."""
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.3g} TB/s"
    return f"{bytes_per_s / 1e9:.3g} GB/s"


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
    if prm.get("l2"):
        parts.append("L2 " + " and ".join(prm["l2"]))
    if prm.get("threads"):
        parts.append(f"{prm['threads']} CPU thread{'s' if prm['threads'] > 1 else ''} (torch.set_num_threads)")
    if lim.get("copy_bandwidth_Bps"):
        parts.append(f"copy bandwidth {bandwidth(lim['copy_bandwidth_Bps'])} (read + write)")
    if lim.get("graph_node_us"):
        parts.append(f"graph node {lim['graph_node_us']:.2f} us")
    if lim.get("l2_bytes"):
        parts.append(f"L2 {lim['l2_bytes'] / 2**20:.0f} MiB")
    return " | ".join(parts)


def _notes(result: dict) -> list[str]:
    prm = result.get("params") or {}
    return ([prm["cpu_note"]] if prm.get("cpu_note") else []) + list(result.get("notes") or [])


def render(result: dict, style: str = "text") -> str:
    """The table: aligned text for a terminal, or GitHub Markdown (``style="markdown"``) for the docs."""
    cols = result["columns"]
    cells = [[_fmt(row.get(key), fmt) for key, _, fmt in cols] for row in result["rows"]]
    heads = [head for _, head, _ in cols]
    notes = _notes(result)
    if style == "markdown":
        align = ["---" if not cols[i][2] else "---:" for i in range(len(cols))]
        lines = [f"_{header(result)}_", "", "| " + " | ".join(heads) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(heads)]
    lines = ["# " + header(result), "  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines += [f"# {n}" for n in notes]
    return "\n".join(lines)


FORMATS = ("json", "md", "png")


def write(result: dict, out_dir: str | Path, *, echo: bool = True,
          formats: tuple[str, ...] | list[str] = FORMATS) -> dict[str, Path]:
    """Print the table and write, of ``formats``, ``<section>.json``, ``<section>.md`` and (where the section plots
    and matplotlib is installed) ``<section>.png`` under ``out_dir``; returns the paths written."""
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"formats must come from {FORMATS}, got {bad[0]!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = result["section"]
    paths = {}
    if "json" in formats:
        paths["json"] = out / f"{name}.json"
        paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    if "md" in formats:
        paths["md"] = out / f"{name}.md"
        paths["md"].write_text(render(result, "markdown"))
    if "png" in formats and result.get("plot") and result["rows"]:
        png = out / f"{name}.png"
        if plot(result, png):
            paths["png"] = png
    if echo:
        print(render(result))
        print("# wrote " + ", ".join(str(p) for p in paths.values()))
    return paths


def plot(result: dict, path: Path) -> bool:
    """Draw ``figure(result)`` into ``path`` (PNG); False, with a line saying why, without matplotlib."""
    fig = figure(result)
    if fig is None:
        print("# matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return False
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return True


_STYLES = {"warm": "-", "cold": "--"}


def figure(result: dict):
    """Time per call against T, one panel per K: every series the table holds (the op's forms, the reference
    formulas, the fastest floor), solid for a warm L2 and dashed for a cold one, the limit (graph node + bytes the
    call must move / the run's copy bandwidth) and the graph-node time; the y range spans every line drawn.
    Token-major rows (block-major ones as their own series). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, spec = result["rows"], result.get("plot") or {}
    series = list(spec.get("series", [])) + list(spec.get("refs", []))
    limits = result.get("limits") or {}
    bw, node = limits.get("copy_bandwidth_Bps"), limits.get("graph_node_us")
    ks = sorted({r["K"] for r in rows})
    modes = [m for m in ("warm", "cold") if any(r.get("l2", "warm") == m for r in rows)]
    layouts = [lay for lay in ("token", "block") if any(r.get("layout", "token") == lay for r in rows)]
    lines = [(name, "token") for name in series] + [(name, "block") for name in spec.get("series", [])[:1]
                                                     if "block" in layouts]
    if spec.get("floor"):
        lines.append(("floor", "token"))
    cmap = plt.get_cmap("tab10")
    colors = {key: cmap(i % 10) for i, key in enumerate(lines)}
    ncols = min(4, len(ks)) or 1
    nrows = -(-len(ks) // ncols) or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1, 3.8 * nrows + 0.8), squeeze=False)
    prm = result.get("params") or {}
    for ax, K in zip(axes.flat, ks):
        drawn = []
        for key in lines:
            name, layout = key
            value = "floor_us" if name == "floor" else f"us:{name}"
            for l2 in modes:
                pts = sorted((r["T"], r[value]) for r in rows if r["K"] == K and r.get(value)
                             and r.get("layout", "token") == layout and r.get("l2", "warm") == l2)
                if not pts:
                    continue
                label = ("floor (fastest geometry)" if name == "floor" else name) + \
                    (" block-major" if layout == "block" else "") + (f", {l2} L2" if len(modes) > 1 else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[key], ls=_STYLES[l2], marker="o",
                        ms=3, lw=1.3, label=label)
                drawn += [p[1] for p in pts]
        if bw:
            # The limit the tables use: a captured call's graph node (where there are graphs) + its bytes at the
            # run's copy bandwidth.
            pts = sorted({(r["T"], r["bytes"]) for r in rows if r["K"] == K and "bytes" in r})
            if pts:
                ys = [(node or 0.0) + 1e6 * b / bw for _, b in pts]
                ax.plot([p[0] for p in pts], ys, color="crimson", lw=0.9, ls=":",
                        label=("graph node + " if node else "") + f"bytes / copy bandwidth ({bandwidth(bw)})")
                drawn += ys
        if node:
            ax.axhline(node, color="gray", lw=0.9, ls="-.", label=f"graph node {node:.2f} us")
            drawn.append(node)
        ts = sorted({r["T"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts], fontsize=7)
        ax.minorticks_off()
        ax.set_yscale("log")
        positive = [y for y in drawn if y and y > 0]
        if positive:
            ax.set_ylim(min(positive) / 1.3, max(positive) * 1.3)
        ax.set_title(f"K = {K}", fontsize=9)
        ax.set_xlabel("tokens per call T", fontsize=8)
        ax.set_ylabel("us per call", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(ks):]:
        ax.set_visible(False)
    env = result["environment"]
    cpu = ("\nCPU: every op is the reference formula (a smoke run, not a kernel benchmark)"
           if prm.get("cpu_note") else "")
    fig.suptitle(f"{result.get('title', result['section'])}: {env.get('device')}, {prm.get('dtype')} "
                 f"H={prm.get('hidden')} capacity {prm.get('capacity')}, {prm.get('timing', '')}, commit "
                 f"{env.get('commit')}{cpu}", fontsize=9)
    fig.tight_layout()
    return fig
