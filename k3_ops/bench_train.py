"""Training benchmark of kimi_k3::attn_res: ``python -m k3_ops.bench_train``.

Forward + backward of one call, at training shapes, on the current device, in one process:

* ``k3_ops``: the op with its registered autograd (fused Triton forward and backward kernels);
* ``eager``: autograd of the FP32 formula ``k3_ops.reference.attn_res_reference`` (what an unfused model runs);
* ``compile``: autograd of ``torch.compile`` of that same formula.

Per (layout, T, K): the time of one forward + backward step (``torch.autograd.grad`` of all four inputs with a
fixed incoming gradient; plain launches, L2 flushed between calls by ``triton.testing.do_bench``), the peak
memory it allocates beyond what existed before the step, and the same peak less the gradients it returns
(which every implementation must allocate): the part that grows as O(T * H) for k3_ops (grad_out copies,
workspace) and as O(T * K * H) for the eager graph's saved FP32 intermediates. For k3_ops the backward op is
also timed alone, against the bytes it must move: K + 1 candidate rows and grad_out read, C + 1 gradient rows
written (grad_block_residual at full capacity, grad_prefix_sum), per token; "of BW" divides that rate by the
measured device copy bandwidth (bytes read + written per second). ``--bwd-configs`` adds backward-only columns
with explicit ``backends.cuda.BackwardConfig`` knobs, for tuning.

On a machine without a GPU the benchmark prints reference timings only (eager and k3_ops, which is the same
formula on the CPU; wall-clock), so it runs everywhere. Results go to the JSON file named by ``--out``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import reference
from .bench import (DTYPES, Inputs, _progress, _time_cpu, add_shape_args, copy_bandwidth, environment,
                    resolve_device_defaults)

GPU_TOKENS = (1024, 4096, 16384)
CPU_TOKENS = (16, 64)
NAMES = ("prefix_sum", "block_residual", "norm_weight", "proj_weight")


@dataclass
class Row:
    layout: str
    T: int
    K: int
    bwd_bytes: int  # bytes the backward must move (see the module docstring)
    us: dict[str, float] = field(default_factory=dict)  # impl -> microseconds per forward + backward step
    peak_mib: dict[str, float] = field(default_factory=dict)  # impl -> peak extra MiB of one step
    peak_less_grads_mib: dict[str, float] = field(default_factory=dict)  # the same, less the returned grads
    bwd_us: dict[str, float] = field(default_factory=dict)  # k3_ops backward op alone (and tuning columns)


def backward_bytes(T: int, K: int, C: int, H: int, itemsize: int) -> int:
    return T * H * itemsize * ((K + 1) + 1 + (C + 1))


def _leaves(call_args: tuple) -> tuple:
    """The four tensor inputs as fresh leaves that require grad (a block-major view stays a view)."""
    prefix, blocks, nw, pw, K, eps = call_args
    leaves = tuple(t.detach().requires_grad_(True) for t in (prefix, blocks, nw, pw))
    return leaves, K, eps


def step_fn(impl: Callable, call_args: tuple, grad_out: torch.Tensor) -> Callable[[], tuple]:
    leaves, K, eps = _leaves(call_args)

    def step():
        out = impl(*leaves, K, eps)
        return torch.autograd.grad(out, leaves, grad_out)

    return step


def peak_extra(step: Callable[[], tuple], device: torch.device) -> tuple[float, float]:
    """(peak MiB allocated by one step beyond the memory before it, the same less the gradients returned)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    del grads
    return peak / 2**20, (peak - grad_bytes) / 2**20


def _time_gpu(fn: Callable[[], object], rep: int) -> float:
    import triton.testing

    fn()
    fn()  # compile / allocate first
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def implementations(which: list[str]) -> dict[str, Callable]:
    impls: dict[str, Callable] = {}
    if "k3_ops" in which:
        impls["k3_ops"] = torch.ops.kimi_k3.attn_res.default
    if "eager" in which:
        impls["eager"] = reference.attn_res_reference
    if "compile" in which:
        impls["compile"] = torch.compile(reference.attn_res_reference)
    return impls


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    is_cuda = device.type == "cuda"
    impls = implementations(args.impls.split(","))
    bwd_configs = {}
    if args.bwd_configs and is_cuda:
        from .backends.cuda import BackwardConfig

        text = Path(args.bwd_configs[1:]).read_text() if args.bwd_configs.startswith("@") else args.bwd_configs
        bwd_configs = {name: BackwardConfig(**kw) for name, kw in json.loads(text).items()}
    env = environment(device)
    result: dict = {"environment": env, "dtype": args.dtype, "hidden": args.hidden, "capacity": args.capacity,
                    "rows": []}
    if is_cuda:
        result["copy_bandwidth_Bps"] = bw = copy_bandwidth(device)
        print(f"# {env['device']}: torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
        print(f"# copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    else:
        bw = None
        print(f"# CPU ({env['device']}, {env['threads']} threads): torch {env['torch']}; reference timings only "
              "(wall-clock), no GPU present")
    tokens = [int(t) for t in args.tokens.split(",")]
    ks = [int(k) for k in args.blocks.split(",")]
    layouts = args.layouts.split(",")
    total, step_i = len(layouts) * len(ks) * len(tokens), 0
    for layout in layouts:
        inputs = Inputs(max(tokens), args.capacity, args.hidden, dtype, device, layout)
        g = torch.Generator(device="cpu").manual_seed(1)
        grad_out_all = torch.randn(max(tokens), args.hidden, generator=g).to(device=device, dtype=dtype)
        for K in ks:
            inputs.poison(K)
            for T in tokens:
                step_i += 1
                _progress(step_i, total, f"{layout}-major T={T} K={K}")
                call_args = inputs.args(T, K)
                gy = grad_out_all[:T]
                row = Row(layout, T, K, backward_bytes(T, K, args.capacity, args.hidden, dtype.itemsize))
                for name, impl in impls.items():
                    if name != "k3_ops" and T > args.max_eager_tokens:
                        continue
                    step = step_fn(impl, call_args, gy)
                    try:
                        if is_cuda:
                            row.peak_mib[name], row.peak_less_grads_mib[name] = peak_extra(step, device)
                            row.us[name] = _time_gpu(step, args.rep)
                        else:
                            row.us[name] = _time_cpu(step)
                    except torch.OutOfMemoryError:
                        row.us[name] = float("nan")  # the unfused graph does not fit: that is the point
                        row.peak_mib[name] = row.peak_less_grads_mib[name] = float("nan")
                    del step
                    if is_cuda:
                        torch.cuda.empty_cache()
                if is_cuda and "k3_ops" in impls:
                    bwd = torch.ops.kimi_k3.attn_res_backward.default
                    row.bwd_us["k3_ops"] = _time_gpu(lambda: bwd(gy, *call_args, [True, True, True]), args.rep)
                    if bwd_configs:
                        from .backends import cuda as cuda_backend

                        for cname, cfg in bwd_configs.items():
                            row.bwd_us[cname] = _time_gpu(
                                lambda c=cfg: cuda_backend.attn_res_backward(gy, *call_args, [True, True, True],
                                                                             config=c), args.rep)
                result["rows"].append(asdict(row))
            inputs.restore(K)
        del inputs, grad_out_all
        if is_cuda:
            torch.cuda.empty_cache()
    print_table(result, bw)
    return result


def print_table(result: dict, bw: float | None) -> None:
    rows = result["rows"]
    names = list(dict.fromkeys(k for r in rows for k in r["us"]))
    head = f"{'layout':<6} {'T':>6} {'K':>2} " + " ".join(f"{n + ' us':>13}" for n in names)
    if bw:
        head += " " + " ".join(f"{n + ' MiB':>12}" for n in names)
        head += f" {'k3 bwd us':>10} {'bwd ofBW':>8} {'vs comp':>7}"
    print(head)
    for r in rows:
        line = f"{r['layout']:<6} {r['T']:>6} {r['K']:>2} " + " ".join(
            f"{r['us'][n]:>13.1f}" if n in r["us"] else f"{'-':>13}" for n in names)
        if bw:
            line += " " + " ".join(f"{r['peak_less_grads_mib'][n]:>12.1f}" if n in r["peak_less_grads_mib"]
                                   else f"{'-':>12}" for n in names)
            b = r["bwd_us"].get("k3_ops")
            if b:
                speedup = r["us"].get("compile", float("nan")) / r["us"]["k3_ops"]
                line += f" {b:>10.1f} {r['bwd_bytes'] / (b * 1e-6) / bw:>8.3f} {speedup:>6.1f}x"
        print(line)
    configs = list(dict.fromkeys(k for r in rows for k in r["bwd_us"] if k != "k3_ops"))
    if bw and configs:
        # --bwd-configs: the backward alone per launch configuration (us, fraction of copy bandwidth).
        print(f"{'layout':<6} {'T':>6} {'K':>2} " + " ".join(f"{c + ' bwd us (ofBW)':>24}" for c in configs))
        for r in rows:
            print(f"{r['layout']:<6} {r['T']:>6} {r['K']:>2} " + " ".join(
                f"{r['bwd_us'][c]:>14.1f} ({r['bwd_bytes'] / (r['bwd_us'][c] * 1e-6) / bw:.3f})"
                if c in r["bwd_us"] else f"{'-':>24}" for c in configs))
    if bw:
        print("# MiB: peak memory of one forward + backward step beyond what existed before it, less the "
              "gradients it returns")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3_ops.bench_train", description=__doc__.split("\n\n")[0])
    add_shape_args(p, capacity=8)
    p.add_argument("--tokens", default=None, help="comma list of T")
    p.add_argument("--layouts", default="token", help="comma list of token / block")
    p.add_argument("--bwd-configs", default=None,
                   help='extra backward-only columns, JSON: {"name": {"programs_per_sm": 4, "tile_elems": 4096}} '
                        'or @file.json')
    p.add_argument("--rep", type=int, default=50, help="milliseconds of timed repetitions per measurement")
    p.add_argument("--out", default="bench_out/train.json", help="JSON file for the results")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    resolve_device_defaults(args, CPU_TOKENS, GPU_TOKENS, cpu_blocks="1,8", gpu_blocks="1,4,8")
    import k3_ops  # noqa: F401  (the op library and its autograd)

    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"# wrote {out}")
    return result


if __name__ == "__main__":
    main()
