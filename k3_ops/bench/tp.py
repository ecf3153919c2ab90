"""Section ``tp``: the tensor-parallel serving call, the all-reduce of the per-rank partial and fused_attn_res_, side
by side on every rank of a torchrun launch (one process per GPU)::

    torchrun --nproc-per-node 8 -m k3_ops.bench tp        # also 2 and 4

Rows per T (1, 8, 64, 512 by default; H = 7168, bf16, K = 4 valid blocks, the snapshot into slot K, the output
RMSNorm), each a CUDA-graph replay of 16 calls on every rank, the slowest rank's median
(``timing.collective_graph_us``):

- ``k3_ops``: ``k3_ops.fused_attn_res_(..., tp_group=group)`` as it runs, the size rule choosing the path;
- ``k3_ops_oneshot``: the same with the one-shot symmetric-memory kernel forced (``k3_ops.tp.forced_plan``);
- ``nccl``: NCCL's all-reduce of a copy of the partial, then ``fused_attn_res_`` (the unfused pipeline; also what
  the forced fallback runs);
- ``symm_mem``: the partial copied into a symmetric buffer, torch's ``symm_mem.one_shot_all_reduce``, then
  ``fused_attn_res_``.

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set (unless already set) before the process group
starts: no path uses NVLink multicast. One process or no GPU: the section says what it needs in one line and writes
nothing; ranks other than 0 write nothing either.
"""
from __future__ import annotations

import os

import torch

from .common import Options, environment, site_weights
from .timing import Timer, collective_graph_us

DEFAULTS = {"tokens": [1, 8, 64, 512], "hidden": 7168, "capacity": 9, "blocks": 4}
NAMES = ("k3_ops", "k3_ops_oneshot", "nccl", "symm_mem")


def _group():
    """The torchrun world as a process group on this rank's GPU, or a one-line reason why there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        return None, ("tp: needs several GPUs, one process each: torchrun --nproc-per-node N -m k3_ops.bench tp "
                      "(N = 2, 4 or 8); skipped")
    if not torch.cuda.is_available() or torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        return None, f"tp: needs {world} GPUs on this host (one per rank), found {torch.cuda.device_count()}; skipped"
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    return (dist.group.WORLD, device), None


def _impls(group, device, T: int, H: int, dtype: torch.dtype, K: int, cap: int) -> dict:
    """The four calls of a row, each on its own prefix and buffer (every call writes both)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    import k3_ops
    from k3_ops import tp

    rank = group.rank()
    g = torch.Generator().manual_seed(1000 + rank)
    partial = torch.randn(T, H, generator=g).to(dtype).to(device)
    prefix = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    blocks = torch.randn(T, cap, H, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    norm_w, proj_w, out_norm_w = site_weights(H, torch.float32, device, 3)[:3]
    symm = symm_mem.empty(T, H, dtype=dtype, device=device)
    symm_mem.rendezvous(symm, group.group_name)
    name = group.group_name

    def call(prefix_t, buf, addend, tp_group=None):
        return k3_ops.fused_attn_res_(prefix_t, addend, buf, norm_w, proj_w, K, 1e-6, block_write_idx=K,
                                      out_norm_weight=out_norm_w, tp_group=tp_group)

    own = {n: (prefix.clone(), blocks.clone()) for n in NAMES}

    def ours():
        return call(*own["k3_ops"], partial, group)

    def oneshot():
        with tp.forced_plan("fused"):
            return call(*own["k3_ops_oneshot"], partial, group)

    def nccl():
        summed = partial.clone()
        dist.all_reduce(summed, group=group)
        return call(*own["nccl"], summed)

    def torch_one_shot():
        symm.copy_(partial)
        return call(*own["symm_mem"], torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", name))

    with tp.forced_plan("fused"):
        tp.warmup(group, H, dtype, device, max_num_tokens=T)
    k3_ops.warmup(H, dtype, device, max_num_valid_blocks=K, max_num_tokens=T, serving=True)
    return {"k3_ops": ours, "k3_ops_oneshot": oneshot, "nccl": nccl, "symm_mem": torch_one_shot}


def run(opts: Options | None = None, timer: Timer | None = None, ops: dict | None = None) -> dict | None:
    """Time the four calls at every T on every rank; rank 0 returns the result, other ranks and a launch without
    several GPUs return None (nothing to write)."""
    opts = (opts or Options()).resolved()
    got, reason = _group()
    if got is None:
        print(reason)
        return None
    group, device = got
    from k3_ops import tp

    H, cap, K = DEFAULTS["hidden"], DEFAULTS["capacity"], DEFAULTS["blocks"]
    dtype = opts.io_dtype
    tokens = opts.tokens or DEFAULTS["tokens"]
    world = group.size()
    rows = []
    with torch.inference_mode():
        for T in tokens:
            row = {"TP": world, "T": T, "path": tp.tp_plan(T, H, world, dtype, device),
                   "bytes": T * H * dtype.itemsize}
            for name, fn in _impls(group, device, T, H, dtype, K, cap).items():
                row[f"us:{name}"] = collective_graph_us(fn, group, device)
            row["vs_nccl"] = row["us:nccl"] / row["us:k3_ops"]
            rows.append(row)
            torch.cuda.empty_cache()
    if group.rank() != 0:
        return None
    columns = [["TP", "TP", "d"], ["T", "T", "d"], ["bytes", "partial bytes", "d"], ["path", "size rule", ""]]
    columns += [[f"us:{n}", f"{n} (us)", ".1f"] for n in NAMES] + [["vs_nccl", "nccl / k3_ops", ".2f"]]
    return {"section": "tp", "title": "all-reduce of the partial + fused_attn_res_ (tensor parallelism)",
            "environment": {**environment(device), "world_size": world}, "limits": {},
            "params": {"dtype": str(dtype).replace("torch.", ""), "hidden": H, "capacity": cap, "K": K,
                       "timing": f"CUDA-graph replay of 16 calls per rank, slowest rank's median, {world} ranks"},
            "columns": columns, "rows": rows,
            "notes": ["k3_ops: the size rule's path; k3_ops_oneshot: the one-shot kernel forced; nccl: NCCL "
                      "all-reduce of a copy + fused_attn_res_; symm_mem: copy into a symmetric buffer + torch's "
                      "one_shot_all_reduce + fused_attn_res_. No NVLink multicast anywhere."]}
