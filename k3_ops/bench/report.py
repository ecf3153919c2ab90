"""``python -m k3_ops.bench report``: docs/benchmarks.md from the results in docs/data/, or saved results as tables.

Without files it reads the main job's ``<section>.json`` (mix, fused, layer, host, train) and the public comparison
(``public_*.json``: figures measured side by side with the public Kimi K3 kernels, named with their source and
date) and the tensor-parallel runs (``tp_tp<N>.json``: the ``tp`` section under torchrun with N ranks) from
``--data`` and writes ``--out``: one header line (device, versions, commit), the method, one table per
section with each cell beside its floor, and the public figures with today's k3_ops cells beside them where
today's device is of the same type. ``--check`` compares instead of writing (a doc edited by hand, or results
changed without the doc, fail it). With files it prints each saved result's table as Markdown (``--plot DIR``:
its PNG too).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from . import writer
from .timing import WIDE_SPREAD

__all__ = ["SECTIONS", "MAX_LINES", "load", "render_doc", "main", "cell", "fmt_us"]

SECTIONS = ("mix", "fused", "layer", "host", "train", "model")
#: The page's length limit: a reference a reader takes in at once.
MAX_LINES = 250
DEFAULT_DATA = Path("docs/data")
DEFAULT_OUT = Path("docs/benchmarks.md")
WIDE = "†"


def fmt_us(us: float | None) -> str:
    """A time in us with the digits that mean something at its size; "-" for none."""
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    if us >= 10000:
        return f"{us:,.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def cell(us: float | None, floor: float | None = None, wide: bool = False) -> str:
    """``us / floor (floor / us)``, or ``us`` alone without a floor; ``WIDE`` marks a wide spread."""
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    text = fmt_us(us) + (WIDE if wide else "")
    if floor:
        text += f" / {fmt_us(floor)} ({floor / us:.2f})"
    return text


def load(data: Path) -> tuple[dict[str, dict], list[dict]]:
    """({section: result} of the sections present, [public comparisons]) from ``data``."""
    results = {}
    for name in SECTIONS:
        path = data / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    public = [json.loads(p.read_text()) | {"_file": p.name} for p in sorted(data.glob("public_*.json"))]
    return results, public


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---:" if i else "---" for i in range(len(head))]
    return ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"] + ["| " + " | ".join(r) + " |"
                                                                           for r in rows]


def _wide(row: dict, name: str) -> bool:
    spread = row.get(f"spread:{name}")
    return spread is not None and spread > WIDE_SPREAD


def _grid(rows: list[dict], name: str, value=None) -> list[str]:
    """T x K table of ``cell(us:name, floor_us)`` (or of ``value(row)``) over ``rows``."""
    ks = sorted({r["K"] for r in rows})
    ts = sorted({r["T"] for r in rows})
    by = {(r["T"], r["K"]): r for r in rows}
    out = []
    for T in ts:
        line = [str(T)]
        for K in ks:
            r = by.get((T, K))
            if r is None:
                line.append("-")
            elif value is not None:
                line.append(value(r))
            else:
                line.append(cell(r.get(f"us:{name}"), r.get("floor_us"), _wide(r, name)))
        out.append(line)
    return _table(["T"] + [f"K = {K}" for K in ks], out)


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _l2_rows(result: dict, l2: str, layout: str = "token") -> list[dict]:
    return [r for r in result["rows"] if r.get("l2", "warm") == l2 and r.get("layout", "token") == layout]


def _device_line(results: dict[str, dict]) -> list[str]:
    first = next(iter(results.values()))
    env = first["environment"]
    device = env.get("device")
    if env.get("sms"):
        device += f" ({env['sms']} SMs)"
    parts = [device, f"torch {env.get('torch')}", f"triton {env.get('triton')}",
             f"CUDA {env['cuda']}" if env.get("cuda") else "no CUDA", f"commit `{env.get('commit')}`"]
    lines = ["_" + " · ".join(parts) + "_"]
    others = [n for n, r in results.items()
              if (r["environment"].get("device"), r["environment"].get("commit")) != (env.get("device"),
                                                                                       env.get("commit"))]
    if others:
        lines.append(f"_(from another run: {', '.join(others)}; see each file's environment)_")
    return lines


def _method(results: dict[str, dict]) -> list[str]:
    first = next(iter(results.values()))
    prm, lim = first.get("params") or {}, first.get("limits") or {}
    cuda = first["environment"].get("device_type") == "cuda"
    lines = ["## Method", ""]
    if cuda:
        l2 = lim.get("l2_bytes")
        lines += [
            f"- {prm.get('dtype')}, H = {prm.get('hidden')}, buffer capacity {prm.get('capacity')} with NaN in the "
            "slots a call must not read; token-major buffers. One process: the main job (`python -m k3_ops -- --out "
            "docs/data --formats json,png`), then `python -m k3_ops.bench report`.",
            "- **Warm L2**: n calls on the same inputs captured in one CUDA graph, the median replay / n.",
            f"- **Cold L2**: one CUDA graph runs calls on a rotation of input sets (each with its own weights), the "
            f"sets together more than 3x the L2 ({l2 / 2**20:.0f} MiB); median replay / calls. The layer step "
            "instead reads an L2-sized window of another buffer before each of its calls (the layers between two "
            "mixes) and subtracts those reads, timed alone." if l2 else "- **Cold L2**: -",
            "- **Floor**: the fastest of the floor kernels (`k3_ops/bench/floor.py`: the call's loads, stores and "
            "reductions without its arithmetic, in three geometries), timed the same way in the same run; a cell "
            "reads `k3_ops / floor (floor ÷ k3_ops)`. **Limit**: graph node + bytes / copy bandwidth "
            f"({writer.bandwidth(lim.get('copy_bandwidth_Bps', 0))}, graph node "
            f"{lim.get('graph_node_us') or 0:.2f} us, same run).",
            "- **Host**: wall time of back-to-back eager calls + one synchronize, beside `torch.add` (the floor of an "
            "eager call). **Training**: " + _train_method(results.get("train")),
        ]
    else:
        lines += [
            f"- **{prm.get('cpu_note', 'CPU run')}** ({prm.get('threads', '?')} thread(s)). Wall time per call, "
            f"median of batches; H = {prm.get('hidden')}, capacity {prm.get('capacity')}, NaN in unused slots. "
            "No CUDA graphs, no L2 states, no floor kernels: the GPU run of the main job replaces this page.",
        ]
    lines.append(f"- {WIDE}: a spread (interquartile range) over 20 % of the median; `spread:<name>` in the JSON.")
    return lines + [""]


def _train_method(train: dict | None) -> str:
    """How the training table was timed, from its own parameters (a run before the host-ahead method says so)."""
    timing = ((train or {}).get("params") or {}).get("timing", "")
    if "host ahead" in timing:
        return ("plain launches with a cold L2 and the host ahead of the GPU (a spin kernel queued before each step, "
                "so the figures are device time), the forward and backward phases of the same steps (no phase above "
                "its step).")
    return ("plain launches with a cold L2, the forward and backward phases of the same steps (no phase above its "
            "step); the host was not held ahead, so at small T a phase includes the host's time between its "
            "kernels.")


def _section_grid(title: str, result: dict, name: str, what: str) -> list[str]:
    lines = [f"## {title}", ""]
    modes = [m for m in ("warm", "cold") if _l2_rows(result, m)]
    for l2 in modes:
        rows = _l2_rows(result, l2)
        floored = any(r.get("floor_us") for r in rows)
        lines += [f"{l2.capitalize()} L2, {what}, us" + (": k3_ops / floor (floor ÷ k3_ops)" if floored else "")
                  + ":", ""] + _grid(rows, name) + [""]
    return lines


def _mix(result: dict) -> list[str]:
    lines = _section_grid("Plain mix (`attn_res`)", result, "k3_ops", "token-major")
    cold = _l2_rows(result, "cold")
    if any(r.get("limit_frac") for r in cold):
        lines += ["Cold L2, the limit (graph node + bytes / copy bandwidth) ÷ k3_ops:", ""]
        lines += _grid(cold, "k3_ops", value=lambda r: f"{r['limit_frac']:.2f}" if r.get("limit_frac") else "-")
        lines.append("")
    warm = _l2_rows(result, "warm")
    ratio = _geomean([r.get("vs_compile") for r in warm])
    if ratio:
        lines += [f"torch.compile of the FP32 formula / k3_ops, warm: geometric mean {ratio:.2f}x over "
                  f"{sum(1 for r in warm if r.get('vs_compile'))} cells.", ""]
    block = [r for r in result["rows"] if r.get("layout") == "block"]
    if block:
        token = {(r.get("l2"), r["T"], r["K"]): r for r in result["rows"] if r.get("layout", "token") == "token"}
        ratios = [token[k]["us:k3_ops"] / r["us:k3_ops"] for r in block
                  if (k := (r.get("l2"), r["T"], r["K"])) in token and r.get("us:k3_ops")]
        mean = _geomean(ratios)
        if mean:
            lines += [f"Block-major buffers (`[C, T, H]` viewed as `[T, C, H]`): token-major / block-major time, "
                      f"geometric mean {mean:.2f} over {len(ratios)} cells (`data/mix.json`).", ""]
    return lines


def _fused(result: dict) -> list[str]:
    rows = result["rows"]
    name = "k3_ops_inplace" if any("us:k3_ops_inplace" in r for r in rows) else "k3_ops"
    what = "`fused_attn_res_` (in place, as vLLM's model calls it)" if name == "k3_ops_inplace" else "fused_attn_res"
    lines = _section_grid("Fused serving call (add, snapshot, mix, RMSNorm)", result, name, what)
    if name == "k3_ops_inplace":
        ratio = _geomean([r["us:k3_ops"] / r["us:k3_ops_inplace"] for r in rows
                          if r.get("us:k3_ops") and r.get("us:k3_ops_inplace")])
        if ratio:
            lines += [f"`fused_attn_res` (a new prefix tensor) / in place: geometric mean {ratio:.2f} over every "
                      "cell.", ""]
    ratio = _geomean([r.get("vs_unfused") for r in rows])
    if ratio:
        lines += [f"The unfused sequence (add, copy, `attn_res`, RMSNorm) / `fused_attn_res`, warm: geometric mean "
                  f"{ratio:.2f}x.", ""]
    return lines


def _layer(result: dict) -> list[str]:
    rows = [r for r in result["rows"] if r.get("layout", "token") == "token"]
    prm = result.get("params") or {}
    names = [n for n in ("k3_ops_inplace", "k3_ops", "unfused") if any(f"us:{n}" in r for r in rows)]
    head = ["T", "L2"] + [{"k3_ops_inplace": "k3_ops in place", "k3_ops": "k3_ops",
                           "unfused": "unfused"}[n] for n in names] + ["limit"]
    out = []
    for r in rows:
        line = [str(r["T"]), r.get("l2", "warm")]
        for i, n in enumerate(names):
            line.append(cell(r.get(f"us:{n}"), r.get("floor_us") if i == 0 else None, _wide(r, n)))
        line.append(fmt_us(r.get("limit_us")))
        out.append(line)
    floored = any(r.get("floor_us") for r in rows)
    return [f"## Layer step ({prm.get('layers', 24)} layers, {rows[0]['calls'] if rows else '-'} calls per step)",
            "", f"us per step ({prm.get('timing', '')})" + (f"; {head[2]} / floor step (floor ÷ k3_ops)" if floored
                                                             else "")
            + "; limit: calls x graph node + bytes / copy bandwidth:", ""] + _table(head, out) + [""]


def _host(result: dict) -> list[str]:
    rows = result["rows"]
    graph = any(r.get("graph_us") for r in rows)
    head = ["call", "T", "K", "wall us", "torch.add / call"] + (["graph us", "wall / graph"] if graph else [])
    out = []
    for r in rows:
        line = [r["call"], str(r["T"]), str(r["K"]), cell(r["wall_us"], None, (r.get("spread") or 0) > WIDE_SPREAD),
                f"{r['floor_frac']:.2f}" if r.get("floor_frac") else "-"]
        if graph:
            line += [fmt_us(r.get("graph_us")), f"{r['ratio']:.2f}" if r.get("ratio") else "-"]
        out.append(line)
    return ["## Host cost of one eager call", ""] + _table(head, out) + [""]


def _train(result: dict) -> list[str]:
    rows = result["rows"]
    refs = [n for n in ("eager", "compile") if any(f"us:{n}" in r for r in rows)]
    mib = any("peak_less_grads:k3_ops" in r for r in rows)
    floor = any("bwd_floor_us" in r for r in rows)
    head = ["T", "K", "k3_ops fwd+bwd", "fwd", "bwd", "bwd of BW"]
    head += ["bwd floor", "floor of BW", "floor / bwd"] if floor else []
    head += [f"{n} fwd+bwd" for n in refs] + (["k3_ops MiB"] if mib else [])
    out = []
    for r in rows:
        line = [str(r["T"]), str(r["K"]), cell(r.get("us:k3_ops"), None, _wide(r, "k3_ops")),
                fmt_us(r.get("fwd_us:k3_ops")), fmt_us(r.get("bwd_us:k3_ops")),
                f"{r['bwd_bw:k3_ops']:.3f}" if r.get("bwd_bw:k3_ops") else "-"]
        if floor:
            line += [fmt_us(r.get("bwd_floor_us")),
                     f"{r['bwd_floor_bw']:.3f}" if r.get("bwd_floor_bw") else "-",
                     f"{r['bwd_vs_floor']:.2f}" if r.get("bwd_vs_floor") else "-"]
        line += [cell(r.get(f"us:{n}"), None, _wide(r, n)) for n in refs]
        if mib:
            line.append(f"{r['peak_less_grads:k3_ops']:.1f}" if r.get("peak_less_grads:k3_ops") else "-")
        out.append(line)
    note = "us; bwd of BW: the backward's bytes / its time / copy bandwidth"
    if floor:
        note += ("; bwd floor: those bytes with one reduction per row read (no weights, no exchange), timed as the "
                 "backward phase of the same steps")
    note += "; MiB: peak beyond the inputs, less the gradients" if mib else ""
    return ["## Training step (forward + backward, gradients of all four inputs)", "", note + ":", ""] \
        + _table(head, out) + [""] + _failed_references(result.get("notes", []))


def _failed_references(notes: list[str]) -> list[str]:
    """One line per reference that failed to run in some cells (its cells read "-"): which, where, the error."""
    import re

    failed: dict[tuple[str, str], list[str]] = {}
    for n in notes:
        m = re.match(r"(\w+) failed at \S+ T=(\d+) K=(\d+): (.*)", n)
        if m:
            failed.setdefault((m.group(1), m.group(4).strip()), []).append(f"{m.group(2)}/{m.group(3)}")
    return [f"-: the {ref} reference failed to run at T/K = {', '.join(cells)} ({error})." for (ref, error), cells
            in failed.items()] + ([""] if failed else [])


def _model(result: dict) -> list[str]:
    prm = result["params"]
    head = ["T", "layers", "k3_ops step", "formula step", "formula / k3_ops", "max loss diff / first loss"]
    mib = any("peak_mib:k3_ops" in r for r in result["rows"])
    head += ["k3_ops MiB", "formula MiB"] if mib else []
    out = []
    for r in result["rows"]:
        line = [str(r["T"]), str(r["layers"]), fmt_us(r.get("step_us:k3_ops")), fmt_us(r.get("step_us:formula")),
                f"{r['speedup']:.2f}", f"{r['max_rel_diff']:.1e}" + ("" if r["passed"] else " (FAILED)")]
        if mib:
            line += [f"{r.get('peak_mib:k3_ops', 0):.0f}", f"{r.get('peak_mib:formula', 0):.0f}"]
        out.append(line)
    curves = "; ".join(f"T = {r['T']}: " + ", ".join(f"{x:.4f}" for x in r["loss:k3_ops"]) for r in result["rows"])
    return ["## Training a Kimi-K3-shaped stack (end to end)", "",
            f"{prm.get('steps')} AdamW steps on one batch, `torch.compile(fullgraph=True)` ({prm.get('compile')}), "
            f"{prm.get('dtype')}, H = {prm.get('hidden')}, block size {prm.get('block_size')}, stand-in attention "
            f"(H x H) and expert MLP ({prm.get('intermediate')}), every mix through k3_ops or through the plain "
            f"formula (autograd); pass rule: at every step the losses differ by at most {prm.get('loss_rtol'):.0e} "
            f"of the first loss. Step: "
            f"forward + backward + optimizer, us ({prm.get('timing')}); MiB: peak of a step beyond weights and "
            f"optimizer state. k3_ops's losses: {curves}.", ""] + _table(head, out) + [""]


def _given(x) -> str:
    """A public figure as it was recorded (no digits added)."""
    return f"{x:g}"


def _find(result: dict | None, **match) -> dict | None:
    if result is None:
        return None
    for r in result["rows"]:
        if all(r.get(k, "warm" if k == "l2" else "token" if k == "layout" else None) == v for k, v in match.items()):
            return r
    return None


def _public(public: dict, results: dict[str, dict]) -> list[str]:
    env = next(iter(results.values()))["environment"] if results else {}
    same = public["device_match"].lower() in str(env.get("device", "")).lower()
    when = public["date"]
    lines = [f"## Against the public Kimi K3 kernels ({public['source']})", "",
             f"Figures from `data/{public['_file']}` ({public['setup']}; torch {public['torch']}, triton "
             f"{public['triton']}); the public columns are as measured on {when}, not re-run. Kernels: "
             + "; ".join(f"{k}: {v}" for k, v in public["kernels"].items()) + ".", ""]
    if same:
        lines += [f"Today's k3_ops cells ({env.get('device')}, commit `{env.get('commit')}`) beside them, from this "
                  "project's own harness (Method, above), not the side-by-side one: where a cell's kernel is the "
                  f"same, the column k3_ops {when} against k3_ops today shows how far the two harnesses differ. "
                  "Today's fused call also writes the snapshot and its cold sets carry their own weights; today's "
                  "training step times each phase on a cold L2. So a today's speed-up compares k3_ops today with "
                  "the public kernel as measured then, not a same-run ratio.", ""]
    else:
        lines += [f"Today's device ({env.get('device')}) is not an {public['device_match']}: no cell of today's run "
                  "is set beside these.", ""]
    today = "k3_ops today" if same else None

    def block(title: str, key: str, head: list[str], make) -> list[str]:
        part = public.get(key)
        if not part:
            return []
        rows = [make(r) for r in part["rows"]]
        extra = [today, "today's speed-up"] if today and key.startswith("mix") else [today] if today else []
        intro = f"**{title}**, us" + (f": {part['summary']}." if part.get("summary") else ":")
        return [intro, ""] + _table(head + extra, rows) + [""]

    mix, fused, layer, host, train = (results.get(n) for n in ("mix", "fused", "layer", "host", "train"))

    def mix_row(l2):
        def make(r):
            line = [str(r["T"]), str(r["K"]), _given(r["k3_ops"]), f"{_given(r['best'])} ({r['which']})",
                    f"{r.get('speedup', r['best'] / r['k3_ops']):.2f}"]
            if l2 == "cold":
                line.append(f"{r['k3_ops_of_limit']:.2f}" if "k3_ops_of_limit" in r else "-")
            if today:
                row = _find(mix, T=r["T"], K=r["K"], l2=l2)
                us = row.get("us:k3_ops") if row else None
                line += [fmt_us(us), f"{r['best'] / us:.2f}" if us else "-"]
            return line
        return make

    lines += block("Plain mix, warm L2", "mix_warm", ["T", "K", f"k3_ops {when}", "best public", "speed-up"],
                   mix_row("warm"))
    lines += block("Plain mix, cold L2", "mix_cold", ["T", "K", f"k3_ops {when}", "best public", "speed-up",
                                                      "limit ÷ k3_ops"], mix_row("cold"))

    def fused_row(r):
        line = [str(r["T"]), str(r["K"]), _given(r["k3_ops"]), _given(r["vllm"]), f"{r['vllm'] / r['k3_ops']:.2f}"]
        if today:
            row = _find(fused, T=r["T"], K=r["K"], l2="warm")
            line.append(fmt_us(row.get("us:k3_ops_inplace")) if row else "-")
        return line

    lines += block("Fused call in place, warm L2", "fused_inplace_warm",
                   ["T", "K", f"k3_ops {when}", "vLLM", "speed-up"], fused_row)

    def layer_row(r):
        line = [str(r["T"]), _given(r["k3_ops"]), _given(r["vllm"]), f"{r['vllm'] / r['k3_ops']:.2f}"]
        if today:
            row = _find(layer, T=r["T"], l2="warm")
            line.append(fmt_us(row.get("us:k3_ops_inplace")) if row else "-")
        return line

    lines += block("Layer step in place, warm L2", "layer_inplace_warm", ["T", f"k3_ops {when}", "vLLM", "speed-up"],
                   layer_row)
    part = public.get("host")
    if part:
        def host_row(r):
            line = [r["call"], _given(r["k3_ops"])]
            if today:
                row = _find(host, call=r["call"], T=part["T"], K=part["K"])
                line.append(fmt_us(row.get("wall_us")) if row else "-")
            return line
        lines += block("Host cost", "host", ["call", f"k3_ops {when}"], host_row)

    def train_row(r):
        line = [str(r["T"]), str(r["K"]), _given(r["k3_ops"]), _given(r["compile"]), _given(r["bibo"])]
        if today:
            row = _find(train, T=r["T"], K=r["K"])
            line.append(fmt_us(row.get("us:k3_ops")) if row else "-")
        return line

    lines += block("Training step", "train", ["T", "K", f"k3_ops {when}", "torch.compile", "BiBo"], train_row)
    return lines


def _tp(paths: list[Path]) -> list[str]:
    """The tensor-parallel section: one table per ``tp_tp<N>.json`` (a ``tp`` section run under torchrun with N
    ranks, copied there), or the command that makes them while there are none."""
    lines = ["## Tensor parallelism (all-reduce of the partial + `fused_attn_res_`)", ""]
    if not paths:
        return lines + ["Not measured yet (no several-GPU run): `torchrun --nproc-per-node N -m k3_ops.bench tp` for "
                        "N = 2, 4, 8 on one host, then copy each run's `tp.json` into the results directory "
                        "as `tp_tp<N>.json`. "
                        "Design and size rule: [tp.md](tp.md).", ""]
    for path in paths:
        lines += writer.render(json.loads(path.read_text()), "markdown").splitlines() + [""]
    return lines


def render_doc(data: Path) -> str:
    """docs/benchmarks.md's text from the results in ``data`` (at most ``MAX_LINES`` lines)."""
    results, public = load(data)
    if not results:
        raise FileNotFoundError(f"no section results ({', '.join(f'{n}.json' for n in SECTIONS)}) in {data}")
    lines = ["# Benchmarks", ""] + _device_line(results) + [""]
    files = ", ".join(f"`{n}.json`" for n in SECTIONS if n in results)
    lines += [f"Generated by `python -m k3_ops.bench report` from `docs/data/` ({files}: the JSON of one run of the "
              "main job); do not edit by hand: `tests/test_report.py` checks that this page is what the command makes.",
              ""]
    lines += _method(results)
    makers = {"mix": _mix, "fused": _fused, "layer": _layer, "host": _host, "train": _train, "model": _model}
    for name, make in makers.items():
        if name in results:
            lines += make(results[name])
            if (data / f"{name}.png").exists():
                lines += [f"![{name}](data/{name}.png)", ""]
    for p in public:
        lines += _public(p, results)
    lines += _tp(sorted(data.glob("tp_tp*.json")))
    text = "\n".join(lines).rstrip("\n") + "\n"
    count = text.count("\n")
    if count > MAX_LINES:
        raise ValueError(f"docs/benchmarks.md would have {count} lines, more than {MAX_LINES}: trim the grids")
    return text


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        prog="python -m k3_ops.bench report",
        description="Without FILE: write docs/benchmarks.md from the main job's JSON in --data (and the public "
                    "comparison public_*.json there). With FILE.json ...: print each saved result as a Markdown "
                    "table.")
    p.add_argument("files", nargs="*", help="<section>.json files written by a run (printed as tables)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of the results (default docs/data)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the page to write (default docs/benchmarks.md)")
    p.add_argument("--check", action="store_true", help="exit 1 if --out differs from what the results make")
    p.add_argument("--plot", default=None, metavar="DIR", help="with FILE: also write <section>.png for each")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not Path(f).is_file()] + ([] if args.files or args.data.is_dir()
                                                                  else [str(args.data)])
    if missing:
        p.error(f"no such {'file' if args.files else 'directory'}: {missing[0]!r}")
    if args.files:
        for path in args.files:
            try:
                result = json.loads(Path(path).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                p.error(f"{path!r} is not a saved result (JSON): {e}")
            print(writer.render(result, "markdown"))
            if args.plot and result.get("plot") and result["rows"]:
                Path(args.plot).mkdir(parents=True, exist_ok=True)
                png = Path(args.plot) / f"{result['section']}.png"
                if writer.plot(result, png):
                    print(f"<!-- wrote {png} -->")
        return
    text = render_doc(args.data)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            sys.exit(f"{args.out} differs from what 'python -m k3_ops.bench report' makes from {args.data}")
        print(f"{args.out} is up to date with {args.data}")
        return
    args.out.write_text(text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines) from {args.data}")
