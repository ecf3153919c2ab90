"""Train a small Kimi-K3-shaped stack with FSDP2 and sequence / tensor parallelism, and compare its loss curve with
the same model trained in one process.

    torchrun --nproc-per-node 4 examples/train_dtensor.py      # a dp x tp = 2 x 2 mesh

NCCL on CUDA GPUs where present, else gloo on the CPU; the script is the same. The model: AttnRes blocks
(k3_ops.nn.AttnRes, two mixes per layer as in Kimi K3, a block snapshot every BLOCK_SIZE layers) around stand-in
attention and MLP layers (per-token two-layer perceptrons). The parallel plan:

- tp (tensor / sequence parallel): activations are DTensors token-sharded over tp (Shard(0)); the AttnRes modules'
  weights are replicated over tp (distribute_module; the op runs on each rank's tokens with no communication, its
  weight gradients come back Partial and DTensor sums them); the stand-in layers are parallelize_module'd Megatron
  style, ColwiseParallel (all-gather of the tokens) then RowwiseParallel (reduce-scatter back to tokens);
- dp (FSDP2, fully_shard): each dp rank trains on its own tokens, parameters sharded over dp.

The bank of block snapshots is stacked block-major ([C, T, H], Shard(1)) and passed as .transpose(0, 1): the
token-sharded [T, C, H] view the op takes.

Loss curve tolerance: LOSS_RTOL (relative, per step). The distributed run adds the same numbers in another order
(weight gradients summed over ranks, FSDP's reduce-scatter), in FP32; AdamW then amplifies nothing beyond that.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import k3_ops  # noqa: F401  (registers the kimi_k3 ops and their DTensor rules)
from k3_ops.nn import AttnRes

H, FFN, LAYERS, BLOCK_SIZE, TOKENS_PER_DP, STEPS, LR = 32, 64, 4, 2, 10, 5, 1e-2
LOSS_RTOL = 1e-4


class StandIn(nn.Module):
    """A per-token perceptron standing in for attention or the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, FFN)
        self.down = nn.Linear(FFN, H)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class Layer(nn.Module):
    """One Kimi K3 decoder layer's residual schedule (docs/attn_res.md, "Kimi K3 call schedule")."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_res, self.mlp_res = AttnRes(H), AttnRes(H)
        self.attn, self.mlp = StandIn(), StandIn()

    def forward(self, prefix, blocks: list):
        bank = torch.stack(blocks).transpose(0, 1)  # block-major [C, T, H] as the op's [T, C, H] view
        h = self.attn_res(prefix, bank, len(blocks))
        prefix = prefix + self.attn(h)
        h = self.mlp_res(prefix, bank, len(blocks))
        return prefix + self.mlp(h)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every process and in the one-process model
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.out_res = AttnRes(H)
        for module in self.modules():
            if isinstance(module, AttnRes):  # nonzero scores (an unloaded AttnRes starts at zero)
                nn.init.normal_(module.proj.weight, std=2.0 / H**0.5)

    def forward(self, x):
        blocks, prefix = [x], x
        for i, layer in enumerate(self.layers):
            if i and i % BLOCK_SIZE == 0:
                blocks = [*blocks, prefix]  # a block snapshot
            prefix = layer(prefix, blocks)
        return self.out_res(prefix, torch.stack(blocks).transpose(0, 1), len(blocks))


def data(dp_size: int, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: inputs and targets, [dp_size * TOKENS_PER_DP, H] each."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(dp_size * TOKENS_PER_DP, H, generator=g)
    return x.to(device), torch.sin(2 * x).roll(1, dims=1).to(device)


def train_single(dp_size: int, device) -> list[float]:
    model = Stack().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = data(dp_size, step, device)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_parallel(device_type: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    tp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    model = Stack().to(device_type)
    # The AttnRes modules: weights replicated over tp (what SequenceParallel does for a norm; distribute_module
    # because SequenceParallel replicates only a module's own parameters, and AttnRes keeps them in submodules).
    for module in model.modules():
        if isinstance(module, AttnRes):
            distribute_module(module, tp_mesh)
    plan = {}
    for i in range(LAYERS):
        for part in ("attn", "mlp"):
            plan[f"layers.{i}.{part}.up"] = ColwiseParallel(input_layouts=Shard(0))
            plan[f"layers.{i}.{part}.down"] = RowwiseParallel(output_layouts=Shard(0), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dp_rank = dp_mesh.get_local_rank()
    losses = []
    for step in range(STEPS):
        x, y = data(dp_mesh.size(), step, device_type)
        mine = slice(dp_rank * TOKENS_PER_DP, (dp_rank + 1) * TOKENS_PER_DP)
        out = model(distribute_tensor(x[mine], tp_mesh, [Shard(0)]))
        # This dp rank's mean (FSDP averages the gradients over dp): the sum of this rank's tokens' squared
        # errors over the dp rank's element count; to_local's backward hands each rank its tokens' gradient.
        local_y = distribute_tensor(y[mine], tp_mesh, [Shard(0)]).to_local()
        loss = (out.to_local() - local_y).pow(2).sum() / (TOKENS_PER_DP * H)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # over every rank: sum of the dp means
        losses.append(total.item() / dp_mesh.size())
    return losses


def run() -> dict:
    """Both trainings in this process group; returns the two curves and whether they agree (every rank)."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    parallel = train_parallel(device_type)
    tp = 2 if dist.get_world_size() % 2 == 0 else 1
    single = train_single(dist.get_world_size() // tp, device_type)
    worst = max(abs(a - b) / abs(b) for a, b in zip(parallel, single))
    return {"parallel": parallel, "single": single, "worst_rel_diff": worst, "rtol": LOSS_RTOL,
            "ok": worst <= LOSS_RTOL and parallel[-1] < parallel[0]}


def init(rank: int | None = None, world_size: int | None = None, store_path: str | None = None) -> None:
    """NCCL + CUDA where GPUs are present, gloo + CPU otherwise; torchrun's environment, or a FileStore."""
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if store_path is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size)


def worker(rank: int, world_size: int, store_path: str, out_path: str) -> None:
    """Entry point for torch.multiprocessing (tests/test_distributed.py): writes rank 0's result as JSON."""
    import json

    torch.set_num_threads(1)
    init(rank, world_size, store_path)
    try:
        result = run()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def main() -> int:
    init()
    result = run()
    if dist.get_rank() == 0:
        for step, (a, b) in enumerate(zip(result["parallel"], result["single"])):
            print(f"step {step}: loss {a:.6f} (FSDP2 + TP/SP)  {b:.6f} (one process)")
        print(f"worst relative difference {result['worst_rel_diff']:.2e} (tolerance {LOSS_RTOL:.0e}): "
              f"{'OK' if result['ok'] else 'FAILED'}")
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
