"""Section ``train``: forward + backward of one ``attn_res`` call at training shapes.

Per (layout, T, K), for each implementation: one step (the forward, then ``torch.autograd.grad`` of all four inputs
with a fixed incoming gradient) timed with ``Timer.phases``: every sample times the forward and the backward of
one step (plain launches, each step alone with a cold L2 and the host ahead of the GPU, device time, on a GPU;
wall time of batches of steps on a CPU), so the step's figure is the median of whole steps and the forward and
backward figures the medians of their phases, and no phase is reported slower than the step it is part of. On a GPU
also the peak memory the step allocates beyond what existed before it, and that peak less the gradients it returns
(which every implementation must allocate): O(T * H) for k3_ops (grad_out copies, workspace), O(T * K * H) for the
eager graph's saved FP32 intermediates. Implementations: ``ops[name].attn_res`` with its registered autograd, and
the references: autograd of the FP32 formula (``eager``) and of ``torch.compile`` of it (``compile``, GPU only).
The backward's fraction of copy bandwidth counts the bytes it must move: K + 1 candidate rows and grad_out read,
C + 1 gradient rows written (grad_block_residual at full capacity, grad_prefix_sum), per token. On a GPU the
backward's floor (``floor.backward_floor``: those bytes with one reduction per row read, no weights, no exchange)
is timed as the backward phase of the same steps (after the same forward, with a cold L2 and the host ahead), so
"bwd floor / bwd" compares like with like. Backward variants (``Ops`` with a ``backward`` and no ``attn_res``, e.g.
``--bwd-configs``) are timed as the backward op alone (plain launches, the host ahead), beside the registered
backward op timed the same way.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .common import Ops, Options, Problem, environment, k3_ops_ops, progress, section_params
from .mix import reference_impls
from .timing import Timer, synchronize

DEFAULTS = {
    "all": {"hidden": 7168, "capacity": 8, "layouts": ["token"]},
    "gpu": {"tokens": [1024, 2048, 4096, 16384], "blocks": [1, 2, 4, 8]},
    "full-gpu": {"tokens": [1024, 2048, 4096, 16384], "blocks": [1, 2, 4, 8]},
    "cpu": {"tokens": [16, 64], "blocks": [1, 8]},
    "quick": {"tokens": [16], "blocks": [4]},
    "quick-cpu": {"hidden": 256},
}


def backward_bytes(T: int, K: int, C: int, H: int, itemsize: int) -> int:
    return T * H * itemsize * ((K + 1) + 1 + (C + 1))


def step_phases(attn_res: Callable, call_args: tuple, grad_out: torch.Tensor) -> tuple[Callable, Callable]:
    """One training step as its two phases: ``forward() -> out`` and ``backward(out) -> gradients`` of all four
    tensor inputs (fresh leaves; a block-major view stays a view)."""
    prefix, blocks, nw, pw, K, eps = call_args
    leaves = tuple(t.detach().requires_grad_(True) for t in (prefix, blocks, nw, pw))

    def forward():
        with torch.enable_grad():
            return attn_res(*leaves, K, eps)

    def backward(out):
        return torch.autograd.grad(out, leaves, grad_out)

    return forward, backward


def step_fn(attn_res: Callable, call_args: tuple, grad_out: torch.Tensor) -> Callable[[], tuple]:
    """One training step: forward, then the gradients of all four tensor inputs."""
    forward, backward = step_phases(attn_res, call_args, grad_out)
    return lambda: backward(forward())


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


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict[str, Ops] | None = None,
        refs: dict | None = None) -> dict:
    """Time the step of ``ops[name].attn_res`` and the backward alone of ``ops[name].backward`` for every name
    (default: the registered ops) plus the ``refs`` formulas' steps (default: ``mix.reference_impls``)."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    is_cuda = device.type == "cuda"
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    ops = {"k3_ops": k3_ops_ops()} if ops is None else ops
    refs = (reference_impls(device) if opts.refs else {}) if refs is None else refs
    forwards = {n: o.attn_res for n, o in ops.items() if o.attn_res is not None}
    forwards.update({n: f for n, f in refs.items() if n not in forwards})
    variants = any(o.backward is not None and o.attn_res is None for o in ops.values())
    backwards = {n: o.backward for n, o in ops.items() if o.backward is not None} if variants else {}
    H, cap = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "capacity")
    tokens, ks = opts.pick(DEFAULTS, "tokens"), opts.pick(DEFAULTS, "blocks")
    layouts = opts.pick(DEFAULTS, "layouts")
    dtype = opts.io_dtype
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    rows, notes = [], []
    if is_cuda and "compile" in refs:
        # The mix section compiled the same formula at many shapes (its shapes are dynamic by now); the training
        # steps start from static shapes.
        torch._dynamo.reset()
    with progress(len(layouts) * len(ks) * len(tokens), "train", opts.progress) as bar:
        for layout in layouts:
            problem = Problem(max(tokens), cap, H, dtype, device, layout, opts.w_dtype)
            g = torch.Generator(device="cpu").manual_seed(1)
            grad_out_all = torch.randn(max(tokens), H, generator=g).to(device=device, dtype=dtype)
            for K in ks:
                problem.poison(K)
                for T in tokens:
                    bar.step(f"{layout}-major T={T} K={K}")
                    call_args = problem.attn_res_args(T, K)
                    gy = grad_out_all[:T]
                    row = {"layout": layout, "T": T, "K": K, "bytes": backward_bytes(T, K, cap, H, dtype.itemsize)}
                    for name, fwd in forwards.items():
                        if name in refs and opts.max_ref_tokens and T > opts.max_ref_tokens:
                            continue
                        forward, backward = step_phases(fwd, call_args, gy)
                        try:
                            if is_cuda:
                                row[f"peak:{name}"], row[f"peak_less_grads:{name}"] = peak_extra(
                                    lambda f=forward, b=backward: b(f()), device)
                            whole, row[f"fwd_us:{name}"], row[f"bwd_us:{name}"] = timer.phases(forward, backward)
                            row[f"us:{name}"] = whole
                            row[f"bwd_bw:{name}"] = row["bytes"] / (row[f"bwd_us:{name}"] * 1e-6) / bw
                            row[f"spread:{name}"] = timer.last.relative
                            if timer.last.wide:
                                notes.append(f"wide spread: {name} at {layout}-major T={T} K={K}: interquartile "
                                             f"range {100 * timer.last.relative:.0f} % of the median")
                        except torch.OutOfMemoryError:
                            row[f"us:{name}"] = float("nan")  # the unfused graph does not fit: that is the point
                        except Exception as e:  # noqa: BLE001 - a reference's failure is noted, not the run's end
                            if name not in refs:
                                raise
                            row[f"us:{name}"] = float("nan")
                            first_line = (str(e).strip().splitlines() or [""])[0][:160]
                            notes.append(f"{name} failed at {layout}-major T={T} K={K}: {type(e).__name__}"
                                         + (f": {first_line}" if first_line else ""))
                        del forward, backward
                        if is_cuda:
                            torch.cuda.empty_cache()
                    if is_cuda and forwards:
                        from .floor import backward_floor

                        first_forward, _ = step_phases(next(iter(forwards.values())), call_args, gy)
                        _, _, row["bwd_floor_us"] = timer.phases(
                            first_forward, lambda out, a=call_args, g=gy: backward_floor(g, *a))
                        row["bwd_floor_bw"] = row["bytes"] / (row["bwd_floor_us"] * 1e-6) / bw
                        first = next(iter(forwards))
                        if row.get(f"bwd_us:{first}"):
                            row["bwd_vs_floor"] = row["bwd_floor_us"] / row[f"bwd_us:{first}"]
                    for name, bwd in backwards.items():
                        row[f"bwd_op_us:{name}"] = timer.launch(partial(bwd, gy, *call_args, [True, True, True, True]),
                                                                host_ahead=True)
                    first = next(iter(ops), None)
                    if first and row.get("us:compile") and row.get(f"us:{first}"):
                        row["vs_compile"] = row["us:compile"] / row[f"us:{first}"]
                    rows.append(row)
                problem.restore(K)
            del problem, grad_out_all
            synchronize(device)
            if is_cuda:
                torch.cuda.empty_cache()
    names = [n for n in forwards if any(f"us:{n}" in r for r in rows)]
    columns = [["layout", "layout", ""], ["T", "T", "d"], ["K", "K", "d"]]
    columns += [[f"us:{n}", f"{n} fwd+bwd us", ".1f"] for n in names]
    columns += [[f"fwd_us:{n}", f"{n} fwd us", ".1f"] for n in names[:1]]
    columns += [[f"bwd_us:{n}", f"{n} bwd us", ".1f"] for n in names]
    if names:
        columns += [[f"spread:{names[0]}", f"{names[0]} IQR/median", ".2f"],
                    [f"bwd_bw:{names[0]}", f"{names[0]} bwd of BW", ".3f"]]
    if any("bwd_floor_us" in r for r in rows):
        columns += [["bwd_floor_us", "bwd floor us", ".1f"], ["bwd_floor_bw", "floor of BW", ".3f"],
                    ["bwd_vs_floor", "bwd floor / bwd", ".2f"]]
    if is_cuda:
        columns += [[f"peak_less_grads:{n}", f"{n} MiB", ".1f"] for n in names]
    columns += [[f"bwd_op_us:{n}", f"{n} bwd op alone us", ".1f"] for n in backwards]
    if any("vs_compile" in r for r in rows):
        columns.append(["vs_compile", "compile / " + next(iter(ops)), ".2f"])
    if device.type == "cpu" and rows:
        notes.insert(0, "CPU: k3_ops fwd+bwd is the formula's forward, then the backward op, which recomputes the "
                        "forward from the four saved inputs (as the GPU kernels do, to keep O(T * H) memory); eager "
                        "autograd keeps the forward's FP32 intermediates instead, so k3_ops may be the slower here")
    if is_cuda:
        notes.insert(0, "MiB: peak memory of one forward + backward step beyond what existed before it, less the "
                        "gradients it returns")
    timing = ("plain launches, cold L2, host ahead (a spin kernel before each step), median; forward and backward "
              "phases of the same steps" if is_cuda
              else "wall time per step, median of batches; forward and backward phases of the same steps")
    return {"section": "train", "title": "attn_res forward + backward", "environment": environment(device),
            "limits": limits,
            "params": section_params(opts, timer, H, cap, [], timing=timing, nan_in_unused_slots=True),
            "columns": columns, "rows": rows, "notes": notes}
