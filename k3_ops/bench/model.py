"""Section ``model``: a Kimi-K3-shaped decoder stack trained a few steps, k3_ops against the unfused formula.

The check a user would run before switching a training job to k3_ops: the same model (Kimi K3's AttnRes schedule,
docs/attn_res.md "Kimi K3 call schedule", with stand-in attention and MLP layers of the real sizes), the same
initial weights, data and optimizer, compiled with ``torch.compile(fullgraph=True)``, once with every mix through
``k3_ops.attn_res`` and once through the plain PyTorch formula (``k3_ops.reference.attn_res_reference``, what a model
without k3_ops computes). Both train ``STEPS`` AdamW steps; the section reports each one's loss curve, the largest
difference between the two curves relative to the first step's loss (the pass rule: at most ``LOSS_RTOL``), the
median step time (forward, backward and optimizer step; device time from CUDA events on a GPU, wall time on a CPU)
and the peak memory one step allocates beyond the weights and optimizer state (GPU).

Stand-ins: attention is its output projection (an H x H linear after the input RMSNorm), the MLP one expert's
SwiGLU (H -> 2 x ``INTERMEDIATE`` -> H). Block size ``BLOCK_SIZE`` layers (Kimi K3 snapshots every 12 of its 93
layers; a few layers need a smaller one for the stack to reach several valid blocks).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from .. import reference
from .common import Options, environment, progress, section_params
from .timing import Timer, synchronize

DEFAULTS = {
    "all": {"hidden": 7168, "capacity": 8, "layouts": ["token"]},
    "gpu": {"tokens": [1024], "layers": 4, "intermediate": 2048, "vocab": 1024},
    # A CPU run is a smoke run of the same code at toy sizes.
    "cpu": {"tokens": [32], "layers": 4, "hidden": 128, "intermediate": 128, "vocab": 256},
    "quick": {"tokens": [16]},
    "quick-cpu": {"hidden": 64},
}
#: Layers per block: the stack snapshots its residual every BLOCK_SIZE layers.
BLOCK_SIZE = 2
#: An expert's intermediate size (Kimi K2/K3 MoE experts).
INTERMEDIATE = 2048
VOCAB = 1024
STEPS = 6
LR = 1e-3
#: The pass rule: at every step the two losses differ by at most this fraction of the first step's loss. bf16 weights
#: and activations (the GPU run) round differently along the two paths; FP32 (the CPU run) far less.
LOSS_RTOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4, torch.float64: 1e-9}


def formula_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
    """The plain PyTorch formula, differentiable by autograd (what the stack computes without k3_ops)."""
    return reference.attn_res_reference(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)


def k3_ops_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
    return torch.ops.kimi_k3.attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)


class AttnResSite(nn.Module):
    """One mix's weights, as Kimi K3's checkpoints name them: an RMSNorm weight and an nn.Linear(H, 1) projection."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden))
        self.proj = nn.Linear(hidden, 1, bias=False)


class Layer(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.attn_res, self.mlp_res = AttnResSite(hidden), AttnResSite(hidden)
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.attn = nn.Linear(hidden, hidden, bias=False)  # stand-in: attention's output projection
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class Stack(nn.Module):
    """Kimi K3's AttnRes schedule over ``layers`` layers, one ``attn_res`` callable for every mix."""

    def __init__(self, hidden: int, layers: int, intermediate: int = INTERMEDIATE, vocab: int = VOCAB,
                 eps: float = 1e-6):
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, intermediate) for _ in range(layers))
        self.final = AttnResSite(hidden)
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, attn_res: Callable) -> torch.Tensor:
        def mix(prefix, blocks, site):
            if not blocks:
                return prefix
            bank = torch.stack(blocks, dim=1)  # [T, K, H]: the valid blocks, capacity K
            return attn_res(prefix, bank, site.norm, site.proj.weight, len(blocks), self.eps)

        blocks, prefix = [], x
        for i, layer in enumerate(self.layers):
            h = mix(prefix, blocks, layer.attn_res)
            a = layer.attn(layer.input_layernorm(h))
            if i % BLOCK_SIZE == 0:
                blocks.append(prefix)  # snapshot: the residual so far becomes a block
                prefix = a
            else:
                prefix = prefix + a
            h = mix(prefix, blocks, layer.mlp_res)
            prefix = prefix + layer.mlp(layer.post_attention_layernorm(h))
        return self.head(self.norm(mix(prefix, blocks, self.final)))


def train_curve(model: Stack, attn_res: Callable, data: list[tuple[torch.Tensor, torch.Tensor]], compile_mode: str,
                device: torch.device) -> tuple[list[float], list[float], float | None]:
    """Train ``model`` one AdamW step per batch of ``data``: (losses, step times in us, peak MiB of a step beyond
    the weights and optimizer state, on CUDA; None elsewhere). ``compile_mode``: "inductor", "aot_eager" or
    "eager"."""
    def loss_fn(x, target):
        logits = model(x, attn_res)
        return nn.functional.cross_entropy(logits.float(), target)

    step_fn = loss_fn if compile_mode == "eager" else torch.compile(loss_fn, fullgraph=True, backend=compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses, times, peak = [], [], None
    for i, (x, target) in enumerate(data):
        synchronize(device)
        if device.type == "cuda" and i == len(data) - 1:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        loss = step_fn(x, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            end.record()
            synchronize(device)
            times.append(1e3 * start.elapsed_time(end))
            if i == len(data) - 1:
                peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        else:
            times.append(1e6 * (time.perf_counter() - t0))
        losses.append(float(loss.detach()))
    return losses, times, peak


def compare(hidden: int, layers: int, tokens: int, dtype: torch.dtype, device: torch.device, steps: int = STEPS,
            compile_mode: str = "inductor", seed: int = 0, intermediate: int = INTERMEDIATE,
            vocab: int = VOCAB, candidate: Callable = k3_ops_attn_res) -> dict:
    """Both stacks from one initialisation on one data stream: {name: (losses, step us, peak MiB)} and the largest
    relative difference between the loss curves. ``candidate``: the mix of the "k3_ops" stack (a test seam)."""
    torch.manual_seed(seed)
    init = Stack(hidden, layers, intermediate, vocab).to(device=device, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    # One batch, seen every step: the stack fits it, so the curves fall and a wrong gradient shows as a gap.
    batch = (torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype),
             torch.randint(0, vocab, (tokens,), generator=g).to(device))
    data = [batch] * steps
    out = {}
    for name, fn in (("k3_ops", candidate), ("formula", formula_attn_res)):
        model = Stack(hidden, layers, intermediate, vocab).to(device=device, dtype=dtype)
        model.load_state_dict(init.state_dict())
        torch._dynamo.reset()
        out[name] = train_curve(model, fn, data, compile_mode, device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    a, b = out["k3_ops"][0], out["formula"][0]
    # Relative to the first loss: the stack memorises its batch, and near a loss of 0 a per-step ratio would
    # measure the rounding of two tiny numbers rather than a difference in training.
    out["max_rel_diff"] = max(abs(x - y) for x, y in zip(a, b)) / max(abs(b[0]), 1e-12)
    return out


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict | None = None) -> dict:
    """The stack trained with k3_ops and with the formula, at each token count of the options."""
    opts = (opts or Options()).resolved()
    device = opts.torch_device
    timer = timer or Timer(device, opts.rep_ms, quick=opts.quick)
    H, tokens = opts.pick(DEFAULTS, "hidden"), opts.pick(DEFAULTS, "tokens")
    sizes = DEFAULTS["gpu" if device.type == "cuda" else "cpu"]
    layers, intermediate, vocab = sizes["layers"], sizes["intermediate"], sizes["vocab"]
    dtype = opts.io_dtype if device.type == "cuda" else torch.float32
    # Inductor on a GPU; on a CPU the same fullgraph trace through AOTAutograd without Inductor's C++ compile,
    # which would take minutes on a small machine for no figure that means anything there.
    mode = "inductor" if device.type == "cuda" else "aot_eager"
    rtol = LOSS_RTOL[dtype]
    rows, notes = [], []
    with progress(len(tokens), "model", opts.progress) as bar:
        for T in tokens:
            bar.step(f"T={T}")
            result = compare(H, layers, T, dtype, device, compile_mode=mode, intermediate=intermediate, vocab=vocab)
            row = {"T": T, "layers": layers, "max_rel_diff": result["max_rel_diff"],
                   "passed": result["max_rel_diff"] <= rtol}
            for name in ("k3_ops", "formula"):
                losses, times, peak = result[name]
                row[f"loss:{name}"] = losses
                # The first steps compile (and autotune): the median of the later ones.
                row[f"step_us:{name}"] = statistics.median(times[2:] if len(times) > 3 else times)
                if peak is not None:
                    row[f"peak_mib:{name}"] = peak
            row["speedup"] = row["step_us:formula"] / row["step_us:k3_ops"]
            rows.append(row)
            if not row["passed"]:
                notes.append(f"loss curves differ by {row['max_rel_diff']:.2e} of the first loss at T={T} "
                             f"(rule: <= {rtol:.0e})")
    columns = [["T", "T", "d"], ["layers", "layers", "d"], ["step_us:k3_ops", "k3_ops step us", ".1f"],
               ["step_us:formula", "formula step us", ".1f"], ["speedup", "formula / k3_ops", ".2f"],
               ["max_rel_diff", "max loss diff / first loss", ".2e"]]
    if device.type == "cuda":
        columns += [["peak_mib:k3_ops", "k3_ops peak MiB", ".0f"], ["peak_mib:formula", "formula peak MiB", ".0f"]]
    else:
        notes.append("CPU: k3_ops's forward is the formula itself there, so the curves compare its backward op "
                     "(attn_res_backward's reference) with autograd of the formula; the step times are no kernel "
                     "figures")
    params = section_params(opts, timer, H, 0, [], timing=(
        "device time per step (CUDA events), median of steps 3.." if device.type == "cuda"
        else "wall time per step, median of steps 3.."), dtype=str(dtype).replace("torch.", ""),
        block_size=BLOCK_SIZE, intermediate=intermediate, vocab=vocab, steps=STEPS, lr=LR, loss_rtol=rtol,
        compile=mode)
    params.pop("capacity")  # the stack's buffer grows with its blocks: no fixed capacity
    return {"section": "model", "title": f"Kimi-K3-shaped stack, {STEPS} AdamW steps, torch.compile(fullgraph=True)",
            "environment": environment(device), "limits": timer.limits(), "params": params,
            "columns": columns, "rows": rows, "notes": notes}
