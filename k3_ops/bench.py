"""Benchmark of kimi_k3::attn_res: ``python -m k3_ops.bench`` (also run by ``python -m k3_ops``).

Everything is measured in one process, on one device, in one run, so the ratios are honest:

* the device-to-device copy bandwidth (bytes read + written per second) — the ceiling for this op, which only
  streams memory: it reads K + 1 candidate rows and writes one row per token;
* the cost of a trivial CUDA-graph node — the floor for a decode-size call;
* k3_ops, the eager FP32 formula (``k3_ops.reference.attn_res_reference``) and ``torch.compile`` of that same
  formula, each timed under CUDA-graph replay (``triton.testing.do_bench_cudagraph``: launch overhead
  amortised, as in a captured decode step) and with plain launches (``triton.testing.do_bench``, which also
  flushes L2 between calls).

"of BW" = bytes the op must move / time / copy bandwidth. Unused buffer slots hold NaN, as in serving.
On a machine without a GPU the benchmark still runs (reference timings on the CPU, wall-clock), so the README's
main job works everywhere. Results go to JSON (and a PNG plot when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
BLOCK_MAJOR_TOKENS = (1, 8, 64, 512, 4096, 65536)
CPU_TOKENS = (1, 8, 64, 512)


@dataclass
class Row:
    layout: str
    T: int
    K: int
    bytes_moved: int
    us: dict[str, float] = field(default_factory=dict)  # impl -> microseconds per call


def _progress(i: int, n: int, label: str) -> None:
    """A dependency-free progress bar on stderr (one line, redrawn)."""
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<40}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _commit() -> str:
    env = os.environ.get("K3_OPS_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "commit": _commit(),
            "device_type": device.type}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info.update(device=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


# ------------------------------------------------------------------------------------------------------ inputs
class Inputs:
    """One preallocated problem at the largest T; every (T, K) takes views of it, as a serving engine would."""

    def __init__(self, max_tokens: int, capacity: int, H: int, dtype: torch.dtype, device: torch.device,
                 layout: str):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.H, self.capacity, self.layout = H, capacity, layout
        shape = (max_tokens, capacity, H) if layout == "token" else (capacity, max_tokens, H)
        self.storage = torch.empty(shape, dtype=dtype, device=device)
        # Random values drawn on the device: generating 8 GB on the CPU would dominate the run.
        self.storage.normal_(0.0, 1.0)
        self.prefix = torch.empty((max_tokens, H), dtype=dtype, device=device).normal_(0.0, 1.5)
        self.norm_weight = (1.0 + 0.1 * torch.randn(H, generator=g)).to(device)
        self.proj_weight = (torch.randn(1, H, generator=g) * 2.0 / H ** 0.5).to(device)

    def _blocks(self, T: int) -> torch.Tensor:
        """[T, C, H] view of the buffer (block-major storage is passed as a transpose view, never copied)."""
        return self.storage[:T] if self.layout == "token" else self.storage[:, :T].transpose(0, 1)

    def poison(self, K: int) -> None:
        """NaN in slots >= K, as uninitialised capacity would hold: a kernel that reads it shows NaN."""
        self._blocks(self.storage.shape[0 if self.layout == "token" else 1])[:, K:].fill_(float("nan"))

    def restore(self, K: int) -> None:
        """Refill slots >= K with numbers, so that a larger K reads real data."""
        self._blocks(self.storage.shape[0 if self.layout == "token" else 1])[:, K:].normal_(0.0, 1.0)

    def args(self, T: int, K: int) -> tuple:
        return (self.prefix[:T], self._blocks(T), self.norm_weight, self.proj_weight, K, 1e-6)


def bytes_moved(T: int, K: int, H: int, itemsize: int) -> int:
    return (K + 2) * T * H * itemsize  # K + 1 rows read, one written


# ------------------------------------------------------------------------------------------------------ timing
def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    import triton.testing

    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * n * 2 / (ms * 1e-3)


def trivial_node_us(device: torch.device) -> float:
    """Per-call time of a one-element add under CUDA-graph replay: the floor of any graph node."""
    import triton.testing

    x = torch.zeros(1, device=device)
    return 1e3 * triton.testing.do_bench_cudagraph(lambda: x.add_(1.0), rep=50, return_mode="median")


def _time_cuda(fn: Callable[[], object], graph: bool, rep: int) -> float:
    import triton.testing

    fn()
    fn()  # compile / autotune / allocate outside any capture
    torch.cuda.synchronize()
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def _time_cpu(fn: Callable[[], object], min_seconds: float = 0.2) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and n >= 3:
            return 1e6 * elapsed / n


# ------------------------------------------------------------------------------------------------------- impls
def implementations(device: torch.device, which: list[str], configs: dict[str, object]) -> dict[str, Callable]:
    impls: dict[str, Callable] = {}
    if "k3_ops" in which:
        impls["k3_ops"] = torch.ops.kimi_k3.attn_res.default
    if "eager" in which:
        impls["eager"] = reference.attn_res_reference
    if "compile" in which:
        impls["compile"] = torch.compile(reference.attn_res_reference)
    if configs and device.type == "cuda":
        from .backends import cuda as cuda_backend

        for name, cfg in configs.items():
            impls[f"k3[{name}]"] = (lambda c: lambda *a: cuda_backend.attn_res_forward(*a, config=c))(cfg)
    return impls


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    is_cuda = device.type == "cuda"
    configs = {}
    if args.configs:
        from .backends.cuda import LaunchConfig

        text = Path(args.configs[1:]).read_text() if args.configs.startswith("@") else args.configs
        configs = {name: LaunchConfig(**kw) for name, kw in json.loads(text).items()}
    impls = implementations(device, args.impls.split(","), configs)
    env = environment(device)
    result: dict = {"environment": env, "dtype": args.dtype, "hidden": args.hidden, "capacity": args.capacity,
                    "rows": []}
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        result["copy_bandwidth_Bps"] = bw = copy_bandwidth(device)
        result["trivial_graph_node_us"] = floor_us = trivial_node_us(device)
        print(f"# {env['device']}: torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
        print(f"# copy bandwidth {bw / 1e12:.2f} TB/s (read + write), trivial graph node {floor_us:.2f} us")
    else:
        bw = None
        print(f"# CPU ({env['device']}, {env['threads']} threads): torch {env['torch']}; reference timings only "
              "(wall-clock), no GPU present")
    sets = [("token", [int(t) for t in args.tokens.split(",")])]
    if args.block_tokens:
        sets.append(("block", [int(t) for t in args.block_tokens.split(",")]))
    ks = [int(k) for k in args.blocks.split(",")]
    modes = ["graph", "plain"] if is_cuda and not args.graph_only else (["graph"] if is_cuda else ["wall"])
    total = sum(len(ts) for _, ts in sets) * len(ks)
    step = 0
    for layout, tokens in sets:
        inputs = Inputs(max(tokens), args.capacity, args.hidden, dtype, device, layout)
        for K in ks:
            inputs.poison(K)
            for T in tokens:
                step += 1
                _progress(step, total, f"{layout}-major T={T} K={K}")
                call_args = inputs.args(T, K)
                row = Row(layout, T, K, bytes_moved(T, K, args.hidden, dtype.itemsize))
                for name, fn in impls.items():
                    if name == "eager" and T > args.max_eager_tokens:
                        continue
                    for mode in modes:
                        if mode == "wall":
                            row.us[name] = _time_cpu(lambda: fn(*call_args))
                        else:
                            key = name if mode == "graph" else f"{name}/plain"
                            row.us[key] = _time_cuda(lambda: fn(*call_args), mode == "graph", args.rep)
                result["rows"].append(asdict(row))
                if args.out:  # keep what is measured so far, should the run be cut short
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    (Path(args.out) / "results.json").write_text(json.dumps(result, indent=1))
            inputs.restore(K)
        del inputs
        if is_cuda:
            torch.cuda.empty_cache()
    print_table(result, bw)
    return result


def print_table(result: dict, bw: float | None) -> None:
    rows = result["rows"]
    names = list(dict.fromkeys(k for r in rows for k in r["us"]))
    head = f"{'layout':<6} {'T':>6} {'K':>2} " + " ".join(f"{n + ' us':>14}" for n in names)
    if bw:
        head += f" {'k3 GB/s':>8} {'k3 ofBW':>7} {'vs comp':>7}"
    print(head)
    for r in rows:
        line = f"{r['layout']:<6} {r['T']:>6} {r['K']:>2} " + " ".join(
            f"{r['us'][n]:>14.2f}" if n in r["us"] else f"{'-':>14}" for n in names)
        if bw and "k3_ops" in r["us"]:
            rate = r["bytes_moved"] / (r["us"]["k3_ops"] * 1e-6)
            speedup = r["us"].get("compile", float("nan")) / r["us"]["k3_ops"]
            line += f" {rate / 1e9:>8.0f} {rate / bw:>7.3f} {speedup:>6.1f}x"
        print(line)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot (pip install matplotlib)")
        return False
    bw = result.get("copy_bandwidth_Bps")
    if not bw:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for layout, style in (("token", "-"), ("block", "--")):
        for K in sorted({r["K"] for r in result["rows"]}):
            pts = [(r["T"], r["bytes_moved"] / (r["us"]["k3_ops"] * 1e-6) / bw) for r in result["rows"]
                   if r["layout"] == layout and r["K"] == K and "k3_ops" in r["us"]]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"K={K} {layout}-major")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("fraction of copy bandwidth")
    ax.axhline(0.85, color="gray", lw=0.8, ls=":")
    env = result["environment"]
    ax.set_title(f"kimi_k3::attn_res, H={result['hidden']} {result['dtype']}, {env.get('device')}, "
                 f"CUDA-graph replay")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# wrote {path}")
    return True


def add_shape_args(p: argparse.ArgumentParser, capacity: int) -> None:
    """Options every k3_ops benchmark shares: device, dtype, shapes, implementations, eager cut-off."""
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--capacity", type=int, default=capacity)
    p.add_argument("--blocks", default=None, help="comma list of K")
    p.add_argument("--impls", default="k3_ops,eager,compile")
    p.add_argument("--max-eager-tokens", type=int, default=1 << 62, help="skip the eager column above this T")


def resolve_device_defaults(args: argparse.Namespace, cpu_tokens, gpu_tokens, cpu_blocks: str,
                            gpu_blocks: str) -> bool:
    """Fill device-dependent defaults in place (the CPU gets small shapes and no torch.compile column, which
    would only time Inductor's CPU code); returns whether the run is on the CPU."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    if args.tokens is None:
        args.tokens = ",".join(map(str, cpu_tokens if cpu else gpu_tokens))
    if args.blocks is None:
        args.blocks = cpu_blocks if cpu else gpu_blocks
    if cpu:
        args.impls = ",".join(i for i in args.impls.split(",") if i in ("k3_ops", "eager"))
    return cpu


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3_ops.bench", description=__doc__.split("\n\n")[0])
    add_shape_args(p, capacity=9)
    p.add_argument("--tokens", default=None, help="comma list of T for the token-major set")
    p.add_argument("--block-tokens", default=None, help="comma list of T for the block-major set ('' for none)")
    p.add_argument("--configs", default=None,
                   help='extra k3_ops columns with explicit launch configs, JSON {"name": {"kernel": "rows", ...}} '
                        'or @file.json')
    p.add_argument("--rep", type=int, default=25, help="milliseconds of timed repetitions per measurement")
    p.add_argument("--graph-only", action="store_true", help="skip the plain-launch columns")
    p.add_argument("--out", default="bench_out", help="directory for results.json and plot.png")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    cpu = resolve_device_defaults(args, CPU_TOKENS, FULL_TOKENS, cpu_blocks="1,4,8", gpu_blocks="1,2,4,8")
    if args.block_tokens is None:
        args.block_tokens = "" if cpu else ",".join(map(str, BLOCK_MAJOR_TOKENS))
    import k3_ops  # noqa: F401  (the op library)

    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"# wrote {out / 'results.json'}")
    plot(result, out / "plot.png")
    return result


if __name__ == "__main__":
    main()
