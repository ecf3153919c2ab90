"""``python -m k3_ops.bench [SECTION ...] [options]`` and its commands ``report``, ``plan`` and ``variants``."""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from ..devices import DEVICE_HELP, device_arg, require
from . import full, fused, host, layer, mix, model, tp, train, writer
from .common import DTYPES, L2_MODES, Ops, Options, k3_ops_ops
from .timing import Timer

SECTIONS = {"mix": mix, "fused": fused, "layer": layer, "host": host, "train": train, "model": model, "full": full,
            "tp": tp}
#: The main job's sections; "full" (fused_attn_res.full's call forms) and "tp" (tensor parallelism, under torchrun)
#: run only when named.
DEFAULT_SECTIONS = ["mix", "fused", "layer", "host", "train", "model"]
COMMANDS = ("report", "plan", "variants")
PROG = "python -m k3_ops.bench"


def _ints(text: str, least: int = 1) -> list[int]:
    """A comma list of integers, each >= ``least`` (argparse names the option in front of the message)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers >= {least}, got {text!r}")
    return values


def _at_least(least: int, kind: type = int):
    """An argparse type: a number of ``kind`` that is >= ``least`` (> 0 for a float ``least`` of 0)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < least or (kind is float and least == 0 and value <= 0):
            rule = "> 0" if kind is float and least == 0 else f">= {least}"
            raise argparse.ArgumentTypeError(f"must be {'a number' if kind is float else 'an integer'} {rule}, "
                                             f"got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _layouts(text: str) -> list[str]:
    layouts = [t for t in text.split(",") if t]
    bad = [t for t in layouts if t not in ("token", "block")] or ([] if layouts else [text])
    if bad:
        raise argparse.ArgumentTypeError(f"must be a comma list of token / block, got {bad[0]!r}")
    return layouts


def json_arg(text: str) -> dict:
    """``--configs`` / ``--bwd-configs``: a JSON object of objects, inline or from ``@file.json``."""
    try:
        value = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text[1:]!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object or @file.json, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError(f'must be a JSON object of objects ({{"name": {{...}}}}), got {text!r}')
    return value


def l2_arg(text: str) -> list[str]:
    """``--l2``: warm, cold or both."""
    if text == "both":
        return list(L2_MODES)
    if text not in L2_MODES:
        raise argparse.ArgumentTypeError(f"must be warm, cold or both, got {text!r}")
    return [text]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Benchmarks of the kimi_k3 ops, on the best device present. Sections: mix (attn_res), "
                    "fused (fused_attn_res and fused_attn_res_ vs unfused), layer (a captured 24-layer decode step), "
                    "host (eager call cost), train (forward + backward), model (a Kimi-K3-shaped stack trained with "
                    "k3_ops and with the formula, torch.compile), full (fused_attn_res.full's call forms vs "
                    "fused_attn_res; only when named), tp (the tensor-parallel serving call vs NCCL's and torch's "
                    "symmetric-memory all-reduce + fused_attn_res_; only when named, under torchrun with one process "
                    "per GPU); no section names all but full and tp. Each writes "
                    "<section>.json, <section>.md (the table) and, for mix and fused, <section>.png under --out. "
                    "Commands: 'report' (docs/benchmarks.md from docs/data/*.json, or saved results as tables), "
                    "'plan' (the launch table as a picture), 'variants' (a launch-table cell's alternatives timed "
                    "beside its entry); '<command> --help' for each.")
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--device", type=device_arg, default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--weight-dtype", default=None, choices=sorted(DTYPES),
                   help="dtype of the norm and projection weights (default: --dtype)")
    p.add_argument("--hidden", type=_at_least(1), default=None, help="H (default 7168; 256 with --quick on a CPU)")
    p.add_argument("--capacity", type=_at_least(1), default=None, help="buffer capacity C (default 9; train: 8)")
    p.add_argument("--tokens", type=_ints, default=None, help="comma list of T for every section run")
    p.add_argument("--blocks", type=partial(_ints, least=0), default=None, help="comma list of K for every section run")
    p.add_argument("--layouts", default=None, type=_layouts,
                   help="comma list of token / block (default: token; mix on a CPU and with --full: both)")
    p.add_argument("--l2", type=l2_arg, default=None, metavar="warm|cold|both",
                   help="mix, fused, layer on a GPU: time with a warm L2 (the same inputs replayed), a cold one "
                        "(input sets together > 3x the L2; the layer step: an L2-sized read between its calls, "
                        "subtracted) or both (default: cold)")
    p.add_argument("--quick", action="store_true", help="a smoke grid and short measurements")
    p.add_argument("--full", action="store_true",
                   help="the full grids (every serving T, block-major too) instead of the lean defaults")
    p.add_argument("--rep", type=_at_least(0, float), default=20.0,
                   help="milliseconds per measurement (graph replay, batch)")
    p.add_argument("--threads", type=_at_least(1), default=None,
                   help="CPU: torch threads while timing (default 1: a fixed count, reported with each table)")
    p.add_argument("--plain", action="store_true", help="mix, fused: add plain-launch columns (cold L2)")
    p.add_argument("--no-refs", action="store_true",
                   help="skip the reference rows (eager formula, torch.compile, unfused sequence, floors)")
    p.add_argument("--max-ref-tokens", type=_at_least(1), default=None, help="skip the reference formulas above this T")
    p.add_argument("--layers", type=_at_least(1), default=layer.LAYERS, help="layer: decoder layers per step")
    p.add_argument("--configs", type=json_arg, default=None,
                   help='mix: extra columns with explicit forward launch configs (CUDA), JSON '
                        '{"name": {"kernel": "rows", ...}} or @file.json')
    p.add_argument("--bwd-configs", type=json_arg, default=None,
                   help='train: extra backward-only columns with explicit BackwardConfig knobs (CUDA), JSON '
                        '{"name": {"programs_per_sm": 4}} or @file.json')
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: when stderr is a terminal)")
    p.add_argument("--out", default="bench_out", help="directory for the JSON, Markdown and PNG files")
    p.add_argument("--formats", default=",".join(writer.FORMATS), type=lambda s: s.split(","),
                   help="comma list of what to write: json, md, png (default: all three)")
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


def options(args: argparse.Namespace) -> Options:
    return Options(device=args.device, dtype=args.dtype, weight_dtype=args.weight_dtype, hidden=args.hidden,
                   capacity=args.capacity, tokens=args.tokens, blocks=args.blocks, layouts=args.layouts,
                   rep_ms=args.rep, quick=args.quick, full=args.full, plain=args.plain, refs=not args.no_refs,
                   max_ref_tokens=args.max_ref_tokens, progress=args.progress, l2=args.l2,
                   extra={"layers": args.layers}).resolved()


def cpu_threads(requested: int | None) -> int:
    """Fix torch's CPU thread count for the timing (``requested``, default 1: on a machine whose cores are busy,
    two OpenMP threads per op wait on each other and a cell's time jumps by orders of magnitude); returns the count
    before, to restore."""
    before = torch.get_num_threads()
    count = 1 if requested is None else requested
    if count < 1:
        raise ValueError(f"--threads must be >= 1, got {count}")
    torch.set_num_threads(count)
    return before


def parse(argv: list[str], prog: str = PROG) -> argparse.Namespace:
    """The section run's arguments, every rule checked before anything runs: a bad value ends the command with
    argparse's usage and one error line, a device this machine lacks with one line saying what is missing (exit
    status 2 both). ``python -m k3_ops`` checks its benchmark options with this before its own checks run."""
    p = parser()
    args = p.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section {unknown[0]!r}: choose from {', '.join(SECTIONS)} (or a command: "
                f"{', '.join(COMMANDS)})")
    bad = [f for f in args.formats if f not in writer.FORMATS]
    if bad:
        p.error(f"--formats must come from {', '.join(writer.FORMATS)}, got {bad[0]!r}")
    for name in args.sections or DEFAULT_SECTIONS:
        # A K above the buffer's capacity is the op's own error, raised mid-run; said here, before any timing.
        capacity = args.capacity or SECTIONS[name].DEFAULTS.get("all", {}).get("capacity")
        if args.blocks and capacity and max(args.blocks) > capacity:
            source = "--capacity" if args.capacity else f"{name}'s default capacity"
            p.error(f"--blocks must be <= the buffer capacity ({source} {capacity}), got {max(args.blocks)}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out must name a directory, got the file {args.out!r}")
    if args.device:
        require(args.device, prog)
    return args


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the sections named in ``argv`` (default: all), write their files; returns {section: result}. The first
    word may instead name a command (``report``, ``plan``, ``variants``), which gets the rest."""
    argv = list(argv or [])
    if argv[:1] == ["report"]:
        from . import report

        report.main(argv[1:])
        return {}
    if argv[:1] == ["plan"]:
        from . import plan

        plan.main(argv[1:])
        return {}
    if argv[:1] == ["variants"]:
        from . import variants as variants_cmd

        return variants_cmd.main(argv[1:])
    args = parse(argv)
    opts = options(args)
    device = opts.torch_device
    threads_before = cpu_threads(args.threads) if device.type == "cpu" else None
    try:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        timer = Timer(device, opts.rep_ms, quick=opts.quick)
        ops = variants(args, device)
        results, written = {}, {}
        for name in args.sections or DEFAULT_SECTIONS:
            section_ops = ops if name in ("mix", "train") else {"k3_ops": ops["k3_ops"]}
            result = SECTIONS[name].run(opts, timer, section_ops)
            if result is None:  # tp: not this rank's to write, or no several GPUs (it said so)
                continue
            results[name] = result
            written[name] = writer.write(result, args.out, formats=args.formats)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if threads_before is not None:
            torch.set_num_threads(threads_before)
    results["_written"] = {n: {k: str(p) for k, p in w.items()} for n, w in written.items()}
    return results
