"""The main job: ``python -m k3_ops``.

On the best device present (CUDA, an Ascend NPU through torch_npu, else CPU) it
1. runs kimi_k3::attn_res on Kimi-K3-shaped inputs (H = 7168, a preallocated buffer with NaN in its unused
   capacity, token-major and block-major) and reports its error against a float64 truth next to the error of
   the plain FP32 formula;
2. runs the op inside ``torch.compile(fullgraph=True, dynamic=True)`` and checks it against eager, with the
   graph-break count;
3. runs the benchmark (``python -m k3_ops.bench``, every section, warm and cold L2 on a GPU; ``--no-bench`` skips
   it, benchmark options go after ``--``), printing each section's table.
"""
from __future__ import annotations

import argparse
import sys

import torch

import k3_ops
from k3_ops import reference
from k3_ops.testing import error_stats


def best_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    npu = getattr(torch, "npu", None)  # present only once torch_npu has been imported by the user's setup
    if npu is not None and npu.is_available():
        return torch.device("npu")
    return torch.device("cpu")


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


def check_numerics(device: torch.device) -> bool:
    print(f"== kimi_k3::attn_res on {device} (error against a float64 truth; 'eager' = the FP32 formula)")
    ok = True
    cases = [(1, 8, 9, "token"), (16, 4, 9, "token"), (77, 8, 9, "block"), (512, 2, 9, "token")]
    for T, K, cap, layout in cases:
        args = _inputs(T, K, cap, 7168, torch.bfloat16, device, layout)
        out = k3_ops.attn_res(*args)
        eager = reference.attn_res_reference(*args)
        cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        truth = reference.attn_res_truth(*cpu_args)
        k, e = error_stats(out, truth), error_stats(eager, truth)
        good = (not out.isnan().any() and k.max_abs <= 1.25 * e.max_abs + 1e-12
                and k.mean_abs <= 1.25 * e.mean_abs + 1e-12)
        ok &= good
        print(f"  T={T:<4} K={K} cap={cap} {layout}-major bf16 H=7168: op max|err|={k.max_abs:.2e} "
              f"mean|err|={k.mean_abs:.2e} | eager max|err|={e.max_abs:.2e} mean|err|={e.mean_abs:.2e} "
              f"{'ok' if good else 'FAIL'}")
    return ok


def check_compile(device: torch.device) -> bool:
    print("== torch.compile(fullgraph=True, dynamic=True) around the op")

    def step(prefix, addend, blocks, norm_w, proj_w):
        return k3_ops.attn_res(prefix + addend, blocks, norm_w, proj_w, 3, 1e-6)

    explain = torch._dynamo.explain(step)(*_compile_args(5, device))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    ok = explain.graph_break_count == 0
    for T in (2, 7, 33):
        a = _compile_args(T, device)
        worst = (compiled(*a).float() - step(*a).float()).abs().max().item()
        ok &= worst <= 1e-2  # Inductor may fuse the add differently; bf16 ulp at |x| ~ 4 is 1.6e-2
        print(f"  T={T:<3} max|compiled - eager| = {worst:.2e}")
    print(f"  graph breaks: {explain.graph_break_count} -> {'ok' if ok else 'FAIL'}")
    return ok


def _compile_args(T: int, device: torch.device):
    prefix, blocks, norm_w, proj_w, _, _ = _inputs(T, 3, 4, 256, torch.bfloat16, device, "token")
    return prefix, torch.ones_like(prefix), blocks, norm_w, proj_w


EPILOG = """\
what it writes: the tables on stdout, and under --out (default bench_out/) <section>.json (the results),
  <section>.md (the tables) and mix.png / fused.png (plots, with the bench extra: pip install -e '.[bench]')
  for the sections mix (attn_res), fused (fused_attn_res and fused_attn_res_), layer (a 24-layer decode step),
  host (eager call cost) and train (forward + backward). 'python -m k3_ops.bench report' makes
  docs/benchmarks.md from such files.
how long: 1-2 minutes on a 2-core CPU (small shapes through the reference formula: a smoke run of the
  benchmark, not a kernel benchmark, timed with 1 thread); about 3 minutes on one H100 (the lean grids, warm
  and cold L2; '-- --full' for the full grids, far longer); add '-- --quick' for a smoke run.
success: the last lines name the files written, then 'ALL CHECKS PASSED' (exit status 0); a failed check
  prints FAIL on its line and ends with 'SOME CHECKS FAILED' (exit status 1).
examples: python -m k3_ops;  python -m k3_ops --no-bench;  python -m k3_ops -- --quick --out /tmp/bench;
  python -m k3_ops -- --out docs/data --formats json,png  (then python -m k3_ops.bench report)
"""


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
    p = argparse.ArgumentParser(prog="python -m k3_ops", description=__doc__.split("\n\n", 1)[1],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu, cuda or npu (default: the best present)")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    args = p.parse_args(argv)
    device = torch.device(args.device) if args.device else best_device()
    print(f"k3_ops {k3_ops.__version__} | torch {torch.__version__} | device {device}")
    ok = check_numerics(device)
    ok &= check_compile(device)
    written = {}
    if not args.no_bench:
        from k3_ops import bench

        print("== benchmark (python -m k3_ops.bench; options after '--')")
        # Both L2 states, so that docs/benchmarks.md shows both; 10 ms per measurement keeps a GPU run within the
        # device's time per command (options after '--' come later and win).
        defaults = ["--device", device.type, "--l2", "both", "--rep", "6"]
        written = bench.main([*defaults, *bench_argv]).get("_written", {})
    for line in summary(ok, written, not args.no_bench):
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
