"""``python -m k3_ops.bench [SECTION ...] [options]``; ``python -m k3_ops.bench report FILE.json ...``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from . import full, fused, host, layer, mix, train, writer
from .common import DTYPES, Ops, Options, k3_ops_ops
from .timing import Timer

SECTIONS = {"mix": mix, "fused": fused, "layer": layer, "host": host, "train": train, "full": full}
#: The main job's sections; "full" (fused_attn_res.full's call forms) runs only when named.
DEFAULT_SECTIONS = ["mix", "fused", "layer", "host", "train"]


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _json_arg(text: str) -> dict:
    return json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m k3_ops.bench",
        description="Benchmarks of the kimi_k3 ops, on the best device present. Sections: mix (attn_res), "
                    "fused (fused_attn_res vs unfused), layer (a captured 24-layer decode step), host (eager "
                    "call cost), train (forward + backward), full (fused_attn_res.full's call forms vs "
                    "fused_attn_res; only when named); no section names all but full. Each writes "
                    "<section>.json, <section>.md (the table) and, for mix and fused, <section>.png under --out. "
                    "'python -m k3_ops.bench report FILE.json ...' prints saved results as Markdown tables.")
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--weight-dtype", default=None, choices=sorted(DTYPES),
                   help="dtype of the norm and projection weights (default: --dtype)")
    p.add_argument("--hidden", type=int, default=None, help="H (default 7168; 256 with --quick on a CPU)")
    p.add_argument("--capacity", type=int, default=None, help="buffer capacity C (default 9; train: 8)")
    p.add_argument("--tokens", type=_ints, default=None, help="comma list of T for every section run")
    p.add_argument("--blocks", type=_ints, default=None, help="comma list of K for every section run")
    p.add_argument("--layouts", default=None, type=lambda s: s.split(","),
                   help="comma list of token / block (default: mix both, the other sections token)")
    p.add_argument("--quick", action="store_true", help="a smoke grid and short measurements")
    p.add_argument("--rep", type=float, default=20.0, help="milliseconds per measurement (graph replay, batch)")
    p.add_argument("--plain", action="store_true", help="mix, fused: add plain-launch columns (cold L2)")
    p.add_argument("--no-refs", action="store_true",
                   help="skip the reference rows (eager formula, torch.compile, unfused sequence)")
    p.add_argument("--max-ref-tokens", type=int, default=None, help="skip the reference formulas above this T")
    p.add_argument("--layers", type=int, default=layer.LAYERS, help="layer: decoder layers per step")
    p.add_argument("--configs", type=_json_arg, default=None,
                   help='mix: extra columns with explicit forward launch configs (CUDA), JSON '
                        '{"name": {"kernel": "rows", ...}} or @file.json')
    p.add_argument("--bwd-configs", type=_json_arg, default=None,
                   help='train: extra backward-only columns with explicit BackwardConfig knobs (CUDA), JSON '
                        '{"name": {"programs_per_sm": 4}} or @file.json')
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: when stderr is a terminal)")
    p.add_argument("--out", default="bench_out", help="directory for the JSON, Markdown and PNG files")
    return p


def variants(args: argparse.Namespace, device: torch.device) -> dict[str, Ops]:
    """The registered ops, plus one entry per --configs / --bwd-configs launch configuration (CUDA only)."""
    ops = {"k3_ops": k3_ops_ops()}
    if device.type != "cuda":
        return ops
    if args.configs or args.bwd_configs:
        from ..backends import cuda as cuda_backend
    for name, knobs in (args.configs or {}).items():
        cfg = cuda_backend.LaunchConfig(**knobs)
        ops[f"k3[{name}]"] = Ops(attn_res=lambda *a, c=cfg: cuda_backend.attn_res_forward(*a, config=c))
    for name, knobs in (args.bwd_configs or {}).items():
        cfg = cuda_backend.BackwardConfig(**knobs)
        ops[f"bwd[{name}]"] = Ops(backward=lambda *a, c=cfg: cuda_backend.attn_res_backward(*a, config=c))
    return ops


def report(argv: list[str]) -> None:
    """Print saved results as Markdown tables (how docs/benchmarks.md's tables are made); ``--plot DIR`` also
    draws their PNGs there (for results measured where matplotlib was not installed)."""
    p = argparse.ArgumentParser(prog="python -m k3_ops.bench report")
    p.add_argument("files", nargs="+", help="<section>.json files written by a run")
    p.add_argument("--plot", default=None, metavar="DIR", help="also write <section>.png for each into DIR")
    args = p.parse_args(argv)
    for path in args.files:
        result = json.loads(Path(path).read_text())
        print(writer.render(result, "markdown"))
        if args.plot and result.get("plot") and result["rows"]:
            Path(args.plot).mkdir(parents=True, exist_ok=True)
            png = Path(args.plot) / f"{result['section']}.png"
            if writer.plot(result, png):
                print(f"<!-- wrote {png} -->")


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the sections named in ``argv`` (default: all), write their files; returns {section: result}."""
    argv = list(argv or [])
    if argv[:1] == ["report"]:
        report(argv[1:])
        return {}
    p = parser()
    args = p.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section {unknown[0]!r}: choose from {', '.join(SECTIONS)}")
    opts = Options(device=args.device, dtype=args.dtype, weight_dtype=args.weight_dtype, hidden=args.hidden,
                   capacity=args.capacity, tokens=args.tokens, blocks=args.blocks, layouts=args.layouts,
                   rep_ms=args.rep, quick=args.quick, plain=args.plain, refs=not args.no_refs,
                   max_ref_tokens=args.max_ref_tokens, progress=args.progress,
                   extra={"layers": args.layers}).resolved()
    device = opts.torch_device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    timer = Timer(device, opts.rep_ms, quick=opts.quick)
    ops = variants(args, device)
    results, written = {}, {}
    for name in args.sections or DEFAULT_SECTIONS:
        section_ops = ops if name in ("mix", "train") else {"k3_ops": ops["k3_ops"]}
        results[name] = SECTIONS[name].run(opts, timer, section_ops)
        written[name] = writer.write(results[name], args.out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["_written"] = {n: {k: str(p) for k, p in w.items()} for n, w in written.items()}
    return results
