"""The main job: ``python -m k3_ops``.

On the best device present (CUDA, an Ascend NPU through torch_npu, else CPU) it
1. runs kimi_k3::attn_res on Kimi-K3-shaped inputs (H = 7168, a preallocated buffer with NaN in its unused
   capacity, token-major and block-major) and checks its error against a float64 truth: on a GPU or NPU within
   1.25x of the plain FP32 formula's error; on the CPU, where the op is that formula, a relative RMS error of at
   most half a bf16 ulp;
2. runs the op inside ``torch.compile(fullgraph=True, dynamic=True)`` and checks it against eager (within 1e-2)
   with no graph break;
3. runs the benchmark (``python -m k3_ops.bench``, every section, warm and cold L2 on a GPU; ``--no-bench`` skips
   it, benchmark options go after ``--``), printing each section's table.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

import k3_ops
from k3_ops import reference
from k3_ops.devices import DEVICE_HELP, best_device, device_arg, require
from k3_ops.testing import error_stats

PROG = "python -m k3_ops"


def _inputs(T: int, K: int, capacity: int, H: int, dtype: torch.dtype, device: torch.device, layout: str):
    g = torch.Generator().manual_seed(T * 31 + K)
    blocks = torch.randn(T, capacity, H, generator=g) * torch.linspace(0.5, 2.0, capacity).view(1, capacity, 1)
    blocks[:, K:] = float("nan")  # uninitialised capacity: must never be read
    if layout == "block":
        storage = torch.empty((capacity, T, H), dtype=dtype, device=device)
        storage.copy_(blocks.transpose(0, 1))
        block_residual = storage.transpose(0, 1)
    else:
        block_residual = blocks.to(device, dtype)
    prefix = (torch.randn(T, H, generator=g) * 1.5).to(device, dtype)
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).to(device)
    proj_w = (torch.randn(1, H, generator=g) * 2 / H**0.5).to(device)
    return prefix, block_residual, norm_w, proj_w, K, 1e-6


#: The accuracy cases: (T, K, capacity, layout), bf16 at H = 7168.
CASES = ((1, 8, 9, "token"), (16, 4, 9, "token"), (77, 8, 9, "block"), (512, 2, 9, "token"))
#: Where the op has kernels of its own: its max-abs and mean-abs errors against the float64 truth may be at most
#: this many times those of the plain FP32 formula (the kernels' accuracy contract, k3_ops.testing).
FACTOR = 1.25


def check_numerics(device: torch.device, op: Callable = k3_ops.attn_res, *, cases=CASES, hidden: int = 7168,
                   own_kernels: bool | None = None) -> bool:
    """The accuracy check: ``op`` (default the op itself) against a float64 truth at each of ``cases``; prints what
    it compares, its pass rule and, per case, the figures the rule compares.

    With ``own_kernels`` (default: on every device but the CPU) the rule is the kernels' contract: max-abs and
    mean-abs error at most ``FACTOR`` x the plain FP32 formula's. On the CPU the op *is* that formula (its CPU
    kernel), so that comparison cannot fail; there the rule bounds the error itself: relative RMS error at most half
    an ulp of the I/O dtype (the output's own rounding; FP32 arithmetic adds ~1e-6). Every rule also asks for no NaN
    in the output: the capacity past K holds NaN and must never be read."""
    own = device.type != "cpu" if own_kernels is None else own_kernels
    dtype = torch.bfloat16
    bound = torch.finfo(dtype).eps / 2
    print(f"== accuracy: kimi_k3::attn_res on {device} against a float64 truth (bf16, H = {hidden}, NaN in the "
          "capacity past K)")
    if own:
        print(f"   rule: the op's max|err| and mean|err| <= {FACTOR} x those of the plain FP32 formula (PyTorch on "
              "the same device),")
        print("   both against the same truth; no NaN in the output")
    else:
        print("   on the CPU the op IS the plain FP32 formula (its CPU kernel): comparing the two cannot fail, so "
              "the rule bounds")
        print(f"   its own error: relative RMS error <= half a bf16 ulp = {bound:.2e} (the output's rounding; FP32 "
              "arithmetic adds ~1e-6); no NaN in the output")
    ok = True
    for T, K, cap, layout in cases:
        args = _inputs(T, K, cap, hidden, dtype, device, layout)
        out = op(*args)
        truth = reference.attn_res_truth(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
        k = error_stats(out, truth)
        nan = int(out.isnan().sum())
        where = f"  T={T:<4} K={K} cap={cap} {layout}-major:"
        if own:
            e = error_stats(reference.attn_res_reference(*args), truth)
            # The floor keeps an exact formula (zero error) from asking the op for more than exactness.
            good = k.max_abs <= FACTOR * e.max_abs + 1e-12 and k.mean_abs <= FACTOR * e.mean_abs + 1e-12
            figures = (f"max|err| op {k.max_abs:.2e} vs formula {e.max_abs:.2e} (<= {FACTOR * e.max_abs:.2e}), "
                       f"mean|err| op {k.mean_abs:.2e} vs formula {e.mean_abs:.2e} (<= {FACTOR * e.mean_abs:.2e})")
        else:
            good = k.rel_rms <= bound
            figures = f"rel RMS err {k.rel_rms:.2e} (<= {bound:.2e}), max|err| {k.max_abs:.2e}"
        good &= nan == 0
        ok &= good
        print(f"{where} {figures}, NaN {nan} -> {'ok' if good else 'FAIL'}")
    return ok


#: The compile check's tolerance: Inductor may fuse the add before the op differently; a bf16 ulp at |x| ~ 4 is
#: 1.6e-2.
COMPILE_TOL = 1e-2


def check_compile(device: torch.device) -> bool:
    """The op inside ``torch.compile(fullgraph=True, dynamic=True)`` against eager, at three token counts of one
    compiled graph; prints its rule and, per T, the difference."""
    print("== torch.compile(fullgraph=True, dynamic=True) of add + kimi_k3::attn_res against eager")
    print(f"   rule: max|compiled - eager| <= {COMPILE_TOL:.0e} at each T (Inductor may fuse the add differently; "
          "a bf16 ulp")
    print("   at |x| ~ 4 is 1.6e-02), and 0 graph breaks")

    def step(prefix, addend, blocks, norm_w, proj_w):
        return k3_ops.attn_res(prefix + addend, blocks, norm_w, proj_w, 3, 1e-6)

    explain = torch._dynamo.explain(step)(*_compile_args(5, device))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    ok = explain.graph_break_count == 0
    for T in (2, 7, 33):
        a = _compile_args(T, device)
        worst = (compiled(*a).float() - step(*a).float()).abs().max().item()
        ok &= worst <= COMPILE_TOL
        print(f"  T={T:<3} max|compiled - eager| = {worst:.2e} -> {'ok' if worst <= COMPILE_TOL else 'FAIL'}")
    print(f"  graph breaks: {explain.graph_break_count} -> {'ok' if explain.graph_break_count == 0 else 'FAIL'}")
    return ok


def _compile_args(T: int, device: torch.device):
    prefix, blocks, norm_w, proj_w, _, _ = _inputs(T, 3, 4, 256, torch.bfloat16, device, "token")
    return prefix, torch.ones_like(prefix), blocks, norm_w, proj_w


EPILOG = """\
benchmark options: everything after '--' goes to the benchmark (python -m k3_ops.bench --help lists them),
  e.g. --quick, --full, --out DIR, --formats; '--device' and '--l2 both --rep 6' are passed before them.
what it writes: the tables on stdout, and under the benchmark's --out (default bench_out/) <section>.json (the
  results), <section>.md (the tables) and mix.png / fused.png (plots, with the bench extra: pip install -e
  '.[bench]') for the sections mix (attn_res), fused (fused_attn_res and fused_attn_res_), layer (a 24-layer
  decode step), host (eager call cost), train (forward + backward) and model (a Kimi-K3-shaped stack trained
  with k3_ops and with the formula, also a check: the loss curves must agree). 'python -m k3_ops.bench report'
  makes docs/benchmarks.md from such files.
how long: about 30 s on a 2-core x86-64 CPU (29 s measured, first run with an empty Inductor cache; 18 s once it
  is warm; small shapes through the reference formula: a smoke run of the benchmark, not a kernel benchmark,
  timed with 1 thread); about 5 minutes on one H100 (183 s at 4a04013, the lean grids, warm and cold L2, before
  the training grid grew to 16 cells and the model section came: 25 s for 4 of the cells and 40 s in one H100 run
  of theirs; '-- --full' for the full grids, far longer); '-- --quick' for a smoke run.
success: each check prints what it compares and its rule, then one line per case ending 'ok' or 'FAIL'; the last
  lines name the files written, then 'ALL CHECKS PASSED' (exit status 0) or 'SOME CHECKS FAILED' (exit status 1).
  A device this machine lacks ends the job with one line saying what is missing, a bad option with the usage
  and one line (exit status 2 both), before anything runs.
examples: python -m k3_ops;  python -m k3_ops --no-bench;  python -m k3_ops -- --quick --out /tmp/bench;
  python -m k3_ops -- --out docs/data --formats json,png  (then python -m k3_ops.bench report)
"""


def check_training(model: dict | None) -> bool:
    """The benchmark's model section as a check: the stack's loss curve with k3_ops against the formula's."""
    if model is None:
        return True
    rule = model["params"]["loss_rtol"]
    print(f"check: training a Kimi-K3-shaped stack ({model['params']['steps']} AdamW steps, torch.compile "
          f"fullgraph): k3_ops's loss curve against the plain formula's; rule: at every step within {rule:.0e} of the "
          f"first loss")
    ok = True
    for r in model["rows"]:
        print(f"  T={r['T']} layers={r['layers']}: max difference / first loss {r['max_rel_diff']:.2e} "
              f"{'ok' if r['passed'] else 'FAIL'}")
        ok &= bool(r["passed"])
    return ok


def summary(ok: bool, written: dict[str, dict[str, str]], ran_bench: bool) -> list[str]:
    """The job's last lines: the files the benchmark wrote (JSON, Markdown, plots; a plot line says why there is
    none), then the verdict."""
    lines = []
    if ran_bench:
        for kind, what in (("json", "results (JSON)"), ("md", "tables (Markdown)"), ("png", "plots (PNG)")):
            paths = [w[kind] for w in written.values() if kind in w]
            if paths:
                lines.append(f"benchmark {what}: {', '.join(paths)}")
            elif kind == "png":
                lines.append("benchmark plots (PNG): none (matplotlib is not installed: pip install -e '.[bench]')")
    lines.append("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_argv: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_argv = argv[:i], argv[i + 1:]
    usage = f"{PROG} [-h] [--device DEVICE] [--no-bench] [-- BENCHMARK_OPTION ...]"
    p = argparse.ArgumentParser(prog=PROG, usage=usage, description=__doc__.split("\n\n", 1)[1], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, default=None, help=DEVICE_HELP)
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    args, unknown = p.parse_known_args(argv)
    if unknown:
        hint = (f": benchmark options go after '--' ({PROG} -- {' '.join(unknown)})" if unknown[0].startswith("--")
                else "")
        p.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if args.no_bench and bench_argv:
        p.error(f"the options after '--' ({' '.join(bench_argv)}) are the benchmark's, which --no-bench skips")
    if args.device:
        require(args.device, PROG)
    device = torch.device(args.device) if args.device else best_device()
    bench_args = []
    if not args.no_bench:
        from k3_ops.bench import cli as bench_cli

        # Both L2 states, so that docs/benchmarks.md shows both; 6 ms per measurement keeps a GPU run within the
        # device's time per command (options after '--' come later and win). Checked now, before the checks run.
        bench_args = ["--device", device.type, "--l2", "both", "--rep", "6", *bench_argv]
        bench_cli.parse(bench_args)
    print(f"k3_ops {k3_ops.__version__} | torch {torch.__version__} | device {device}")
    ok = check_numerics(device)
    ok &= check_compile(device)
    written = {}
    if not args.no_bench:
        from k3_ops import bench

        print("== benchmark (python -m k3_ops.bench; options after '--')")
        results = bench.main(bench_args)
        written = results.get("_written", {})
        ok &= check_training(results.get("model"))
    for line in summary(ok, written, not args.no_bench):
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
