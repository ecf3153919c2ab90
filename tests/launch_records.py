"""What the launch policies choose and launch, as data (tests/test_launch_plan.py compares it with
tests/data/launch_plans.json).

Two records, both from code:

- **plans**: the CUDA table's plan (and the serving calls' plan) over a grid of T x K x H on described devices, plans
  for explicit ``LaunchConfig`` s, the CUDA backward plans over T x K x H x element size x ``BackwardConfig``, the
  plans ``warmup`` compiles, and the NPU forward / backward plans. Readable: every distinct plan once, each grid
  cell its index.
- **launches**: one digest per call of a list of calls (every op of both policies, the table's and explicit
  configs, several layouts and flags, ``warmup``): the digest of everything the call hands to Triton and to the CUDA
  C++ kernels (kernel, grid, every argument with tensors named by role, every keyword) and to the C++ launch
  recorder (native launches, scratch buffers, unrecordable work). The kernels are intercepted, nothing runs, so
  large T cost only address space.

Devices are described, not present (``Facts``): the interpreter's, and GPUs given by SM count, compute capability,
PDL, shared-memory opt-in and whether k3_ops._C has the CUDA kernels, whose shape rules ``fake_cluster_threads`` /
``fake_single_read_smem`` stand in for. An ``Api`` adapts the policies to these descriptions; ``current_api`` is the
package's own. ``python tests/launch_records.py --write`` rewrites the JSON from the current code (after an
intended change of the table or the launches).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).parent / "data" / "launch_plans.json"


# --------------------------------------------------------------------------------------------------------------
# Described devices.
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Facts:
    """A device as the launch policy sees it. interpreted: the Triton interpreter (CPU tensors); pdl_env: the value
    of K3_OPS_PDL (PDL where it is not "0" on sm_90+, the installed Triton taken to have ``launch_pdl``); native:
    k3_ops._C has the CUDA C++ kernels."""

    name: str
    interpreted: bool
    num_sms: int
    capability: tuple[int, int] = (0, 0)
    pdl_env: str = "1"
    smem_optin: int = 0
    native: bool = False

    @property
    def pdl(self) -> bool:
        return not self.interpreted and self.pdl_env != "0" and self.capability >= (9, 0)


FACTS = {f.name: f for f in (
    Facts("interpreter", True, 132),
    Facts("h100", False, 132, (9, 0), "1", 232448, True),
    Facts("h100-nopdl", False, 132, (9, 0), "0", 232448, True),
    Facts("h100-nobuild", False, 132, (9, 0), "1", 232448, False),
    Facts("h100-pcie", False, 114, (9, 0), "1", 232448, True),
    Facts("a100", False, 108, (8, 0), "1", 166912, True),
    Facts("v100", False, 80, (7, 0), "1", 98304, True),
)}


def fake_cluster_threads(K: int, H: int, element_size: int, cluster_size: int) -> int:
    """Stand-in for k3_ops._C.attn_res_cluster_threads (0: the shape is not supported)."""
    if element_size != 2 or not 1 <= K <= 8:
        return 0
    if cluster_size == 1:  # the streaming kernel: 128 threads, H / 8 / 128 vectors each
        return 128 if H % 1024 == 0 and H // 1024 in (1, 2, 4, 7, 8) else 0
    if H % (8 * cluster_size):
        return 0
    threads = -(-(H // (8 * cluster_size)) // 32) * 32
    return threads if threads <= 1024 else 0


def fake_single_read_smem(K: int, H: int, element_size: int, vectors_per_thread: int) -> int:
    """Stand-in for k3_ops._C.attn_res_bwd_single_read_smem_bytes (0: the shape is not supported)."""
    if element_size != 2 or not 1 <= K <= 8 or H % 8 or H > 8192:
        return 0
    nvec = H // 8
    if vectors_per_thread == 3:  # the ring layout: H <= 7168, its least (one slot per row of a token)
        return (K + 2) * nvec * 16 + 3072 if H <= 7168 else 0
    return (K + 2) * nvec * 16 + 8 * nvec * 8 + (1024 if vectors_per_thread == 0 else 2048)


# --------------------------------------------------------------------------------------------------------------
# Canonical forms.
# --------------------------------------------------------------------------------------------------------------
def plan_dict(plan) -> Any:
    """A plan (a frozen dataclass, possibly nested) as plain JSON data; fields that are 0, False, None or empty are
    left out (a field added with such a value leaves every record as it was)."""
    if plan is None:
        return None
    if dataclasses.is_dataclass(plan):
        fields = {f.name: plan_dict(getattr(plan, f.name)) for f in dataclasses.fields(plan)}
        return {k: v for k, v in fields.items() if v not in (0, False, None, [], "")}
    if isinstance(plan, (tuple, list)):
        return [plan_dict(x) for x in plan]
    if isinstance(plan, torch.dtype):
        return str(plan)
    return plan


class _Index:
    """Distinct values, each once; cells hold their position."""

    def __init__(self):
        self.values: list = []
        self._pos: dict[str, int] = {}

    def __call__(self, value) -> int:
        key = json.dumps(value, sort_keys=True)
        if key not in self._pos:
            self._pos[key] = len(self.values)
            self.values.append(value)
        return self._pos[key]


# --------------------------------------------------------------------------------------------------------------
# The plan grids.
# --------------------------------------------------------------------------------------------------------------
TOKENS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128, 129, 256, 257, 512, 513, 1024, 2048, 2049, 4096,
          4097, 8192, 65536)
BLOCKS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 33, 65)
HIDDEN = (64, 7168, 16384)
PLAN_FACTS = ("interpreter", "h100", "h100-nopdl", "h100-nobuild", "a100")

#: Explicit LaunchConfigs (keyword arguments), resolved for a few (K, H).
CONFIGS = {
    "rows": dict(kernel="rows"),
    "rows-pf0-s2-w8": dict(kernel="rows", prefetch=0, num_stages=2, num_warps=8, ctas_per_sm=1),
    "rows-pf2-nreg": dict(kernel="rows", prefetch=2, maxnreg=128),
    "rows-pdl-off": dict(kernel="rows", pdl=False),
    "rows-pdl-on": dict(kernel="rows", pdl=True),
    "token": dict(kernel="token"),
    "token-onetile": dict(kernel="token", rows_per_tile=0, num_warps=8, num_stages=3),
    "token-onetile-gram": dict(kernel="token", rows_per_tile=0, num_warps=8, norm_gram=True, gram_tau=0.5),
    "token-onetile-after": dict(kernel="token", rows_per_tile=0, num_warps=8, onw_ahead=False),
    "token-2row-w8": dict(kernel="token", rows_per_tile=2, num_warps=8, num_stages=1),
    "token-1row-pf": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=4, prefix_first=True),
    "token-8row-gram": dict(kernel="token", rows_per_tile=8, num_warps=16, num_stages=2),
    "token-4row-gram-ahead": dict(kernel="token", rows_per_tile=4, norm_gram=True, onw_ahead=True, pdl=True),
    "split": dict(kernel="split"),
    "split-64": dict(kernel="split", chunk=64, num_warps=2),
    "tiles": dict(kernel="tiles"),
    "tiles-128-tpp4": dict(kernel="tiles", tile_h=128, tokens_per_prog=4, maxnreg=96),
    "cluster8": dict(kernel="cluster"),
    "cluster2-gram": dict(kernel="cluster", cluster_size=2, norm_gram=True, min_k=3),
    "cluster4-rowsfb": dict(kernel="cluster", cluster_size=4, fallback=dict(kernel="rows")),
    "stream": dict(kernel="stream"),
    "stream-pdl-off": dict(kernel="stream", pdl=False, min_k=2),
}
CONFIG_SHAPES = ((1, 64), (2, 7168), (4, 7168), (8, 7168), (8, 8200), (15, 7168), (16, 7168), (20, 16384))

BACKWARD_TOKENS = (1, 2048, 16384)
BACKWARD_BLOCKS = (1, 3, 4, 5, 8, 9, 15)
BACKWARD_HIDDEN = (7168, 8200)
BACKWARD_FACTS = ("interpreter", "h100", "h100-nobuild", "a100", "v100")
BACKWARD_CONFIGS = {
    "default": None,
    "single_read": dict(kernel="single_read"),
    "single_read-vpt0": dict(kernel="single_read", vectors_per_thread=0),
    "single_read-vpt1": dict(kernel="single_read", vectors_per_thread=1),
    "stats_apply": dict(kernel="stats_apply", apply_block=512, apply_warps=2, stats_programs_per_sm=4),
    "rows": dict(kernel="rows", programs_per_sm=2, num_warps=4),
    "tiles": dict(kernel="tiles", tile_elems=1024, num_stages=2, maxnreg=128),
    "fp32": dict(acc64=False, maxnreg=200),
}

NPU_HIDDEN = (16, 40, 96, 1000, 2500, 4096, 7168, 8192, 8200, 16384)
NPU_BLOCKS = (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 64)
NPU_BACKWARD_HIDDEN = (40, 1000, 7168, 16384)
NPU_BACKWARD_BLOCKS = (1, 3, 4, 8, 15, 31)
NPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def plan_records(api: Api) -> dict:
    """Every plan of the grids above, as {"plans": [distinct plans], section: cells -> index}."""
    index = _Index()
    out: dict[str, Any] = {}
    for kind in ("table", "serving"):
        section = out[kind] = {}
        for fname in PLAN_FACTS:
            facts = FACTS[fname]
            for H in HIDDEN:
                for T in TOKENS:
                    fn = api.table_plan if kind == "table" else api.serving_plan
                    section[f"{fname}/H{H}/T{T}"] = [index(plan_dict(fn(T, K, H, facts))) for K in BLOCKS]
    section = out["configs"] = {}
    for fname in ("interpreter", "h100", "h100-nopdl", "a100"):
        for name, kw in CONFIGS.items():
            section[f"{fname}/{name}"] = [index(plan_dict(api.config_plan(K, H, FACTS[fname], kw)))
                                          for K, H in CONFIG_SHAPES]
    section = out["backward"] = {}
    for fname in BACKWARD_FACTS:
        for cname, kw in BACKWARD_CONFIGS.items():
            for size in (2, 4):
                for H in BACKWARD_HIDDEN:
                    for T in BACKWARD_TOKENS:
                        section[f"{fname}/{cname}/e{size}/H{H}/T{T}"] = [
                            index(plan_dict(api.backward_plan(T, K, H, FACTS[fname], kw, size)))
                            for K in BACKWARD_BLOCKS]
    section = out["warmup"] = {}
    for fname in PLAN_FACTS:
        for H, max_k, max_t in ((7168, 8, 65536), (7168, 16, 1024), (4096, 4, 8)):
            plans = api.warmup_plans(H, max_k, max_t, FACTS[fname])
            section[f"{fname}/H{H}-K{max_k}-T{max_t}"] = [[index(plan_dict(p)), list(tk)] for p, tk in plans.items()]
    section = out["npu_forward"] = {}
    for forced in (None, "single_read", "two_pass"):
        for dtype in NPU_DTYPES:
            for fused in (False, True):
                for H in NPU_HIDDEN:
                    section[f"{forced}/{dtype}/{'fused' if fused else 'plain'}/H{H}"] = [
                        index(plan_dict(api.npu_forward_plan(H, K, dtype, fused, forced))) for K in NPU_BLOCKS]
    section = out["npu_backward"] = {}
    for cores in (3, 48):
        for ascend in (False, True):
            for dtype in NPU_DTYPES:
                for H in NPU_BACKWARD_HIDDEN:
                    section[f"c{cores}/{'ascend' if ascend else 'triton'}/{dtype}/H{H}"] = [
                        index(plan_dict(api.npu_backward_plan(H, K, dtype, cores, ascend)))
                        for K in NPU_BACKWARD_BLOCKS]
    out["plans"] = index.values
    return out


# --------------------------------------------------------------------------------------------------------------
# Launch records.
# --------------------------------------------------------------------------------------------------------------
#: Every Triton kernel a launch policy launches, by module of k3_ops.kernels.
KERNELS = {
    "attn_res_fwd": ("attn_res_rows_kernel", "attn_res_split_kernel", "attn_res_npu_kernel",
                     "attn_res_add_snapshot_kernel"),
    "attn_res_decode": ("attn_res_token_kernel",),
    "attn_res_npu": ("attn_res_npu_single_read_kernel",),
    "attn_res_bwd": ("attn_res_bwd_kernel", "attn_res_bwd_rows_kernel", "attn_res_bwd_dw_reduce_kernel",
                     "attn_res_bwd_stats_kernel", "attn_res_bwd_scalars_kernel", "attn_res_bwd_apply_kernel"),
}


@contextlib.contextmanager
def patched(*changes: tuple[object, str, object]) -> Iterator[None]:
    """Set ``obj.name = value`` for each (obj, name, value) for the duration; restore (or delete) after."""
    missing = object()
    saved = [(obj, name, getattr(obj, name, missing)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def environ(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class _Kernel:
    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.events.append(("launch", self.name, tuple(grid), args, kwargs))

        return launch


@contextlib.contextmanager
def intercepted(events: list) -> Iterator[None]:
    """Kernels, native launches and the recorder's hooks write ``events`` instead of running."""
    import importlib

    import k3_ops
    from k3_ops.backends import _launch

    changes = []
    for module, names in KERNELS.items():
        mod = importlib.import_module(f"k3_ops.kernels.{module}")
        changes += [(mod, name, _Kernel(name, events)) for name in names]

    def scratch(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        events.append(("scratch", t))
        return t

    changes += [
        (_launch, "scratch", scratch),
        (_launch, "unrecordable", lambda: events.append(("unrecordable",))),
        (_launch, "launch_native", lambda name, tensors, ints, floats: events.append(
            ("launch_native", name, tensors, ints, floats))),
        (k3_ops._C, "attn_res_cluster_forward", lambda *a: events.append(("cluster_forward", a))),
        (k3_ops._C, "attn_res_bwd_single_read", lambda *a: events.append(("single_read", a))),
    ]
    with patched(*changes):
        yield


def _flatten(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _flatten(r)]
    return []


def _canonical_events(events: list, inputs: dict[str, torch.Tensor], result) -> list:
    roles: dict[int, str] = {}

    def name(t: torch.Tensor, role: str) -> None:
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in roles:
            roles[t.data_ptr()] = role

    for key, t in inputs.items():
        name(t, key)
    for i, t in enumerate(_flatten(result)):
        name(t, f"result{i}")
    scratch = [e[1] for e in events if e[0] == "scratch"]
    for i, t in enumerate(scratch):
        name(t, f"scratch{i}")

    def value(v):
        if isinstance(v, torch.Tensor):
            role = roles.get(v.data_ptr(), "new") if v.numel() else "empty"
            return ["tensor", role, str(v.dtype), list(v.shape), list(v.stride())]
        if isinstance(v, (tuple, list)):
            return [value(x) for x in v]
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, float):
            return ["float", repr(v)]
        if v is None or isinstance(v, (bool, int, str)):
            return v
        return repr(v)

    out = []
    for e in events:
        if e[0] == "launch":
            _, kernel, grid, args, kwargs = e
            out.append(["launch", kernel, list(grid), value(list(args)),
                        sorted([k, value(v)] for k, v in kwargs.items())])
        elif e[0] == "scratch":
            out.append(["scratch", str(e[1].dtype), list(e[1].shape)])
        else:
            out.append([e[0], *value(list(e[1:]))])
    out.append(["result", value(_flatten(result))])
    return out


def digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:8]


# --- The calls ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a launch policy's entry point on tensors of a described layout (values never matter)."""

    policy: str  # "cuda" or "npu"
    facts: str  # FACTS name (cuda); "c<cores>[-ascend][-<forced kernel>]" (npu)
    op: str  # attn_res_forward, fused_attn_res, fused_attn_res_quant, fused_attn_res_, fused_attn_res_full,
    # attn_res_backward
    T: int
    K: int
    H: int = 7168
    cap: int = 0  # 0: K + 2
    dtype: str = "bfloat16"
    layout: str = "tokenmajor"  # tokenmajor, blockmajor, hstrided (every [T, H] / [T, C, H] input), offset, odd
    addend: bool = False
    write: bool = False
    norm: bool = False
    round_mix: bool = True
    out_dtype: str | None = None
    weights: str = "fp32"  # fp32, bf16, fp64, proj2d
    config: str | None = None  # a CONFIGS name (cuda forward) or a BACKWARD_CONFIGS name (cuda backward)
    mask: str = "1111"
    return_mix: bool = False  # fused_attn_res_full's options
    sum_out: str = "none"  # none, dense ([T, H]), rows (token stride 2 H)
    mix: bool = True

    @property
    def id(self) -> str:
        parts = [self.policy, self.facts, self.op, f"T{self.T}-K{self.K}-cap{self.cap or self.K + 2}-H{self.H}",
                 self.dtype, self.layout, self.weights]
        flags = [n for n in ("addend", "write", "norm") if getattr(self, n)]
        if not self.round_mix:
            flags.append("fp32mix")
        if self.out_dtype:
            flags.append(self.out_dtype)
        if self.config:
            flags.append(f"cfg={self.config}")
        if self.op == "attn_res_backward":
            flags.append(f"mask={self.mask}")
        if self.return_mix:
            flags.append("retmix")
        if self.sum_out != "none":
            flags.append(f"sumout={self.sum_out}")
        if not self.mix:
            flags.append("nomix")
        return "/".join(parts + flags)


def _rows(T: int, H: int, dtype, layout: str) -> torch.Tensor:
    if layout == "hstrided":
        return torch.empty((T, H, 2), dtype=dtype)[..., 0]
    if layout == "offset":
        return torch.empty((T * H + 1,), dtype=dtype)[1:].view(T, H)
    return torch.empty((T, H), dtype=dtype)


def _buffer(T: int, C: int, H: int, dtype, layout: str) -> torch.Tensor:
    if layout == "blockmajor":
        return torch.empty((C, T, H), dtype=dtype).transpose(0, 1)
    if layout == "hstrided":
        return torch.empty((T, C, H, 2), dtype=dtype)[..., 0]
    return torch.empty((T, C, H), dtype=dtype)


def call_inputs(call: Call) -> dict[str, Any]:
    dtype = getattr(torch, call.dtype)
    T, K, H = call.T, call.K, call.H
    C = call.cap or K + 2
    layout = call.layout
    buffer_layout = "tokenmajor" if layout == "offset" else layout
    inputs: dict[str, Any] = dict(prefix_sum=_rows(T, H, dtype, layout), block_residual=_buffer(T, C, H, dtype,
                                                                                                buffer_layout))
    wdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64, "proj2d": torch.float32}
    inputs["norm_weight"] = torch.ones(H, dtype=wdtype[call.weights])
    inputs["proj_weight"] = torch.ones((1, H) if call.weights == "proj2d" else (H,), dtype=wdtype[call.weights])
    if call.op == "attn_res_backward":
        inputs["grad_out"] = _rows(T, H, dtype, layout)
    if call.addend:
        inputs["addend"] = _rows(T, H, dtype, layout)
    if call.norm:
        inputs["out_norm_weight"] = torch.ones(H, dtype=dtype)
    if call.sum_out != "none":
        inputs["sum_out"] = torch.empty((T, 2 * H) if call.sum_out == "rows" else (T, H), dtype=dtype)[:, :H]
    return inputs


def run_call(call: Call, api: Api) -> list:
    inputs = call_inputs(call)
    events: list = []
    with contextlib.ExitStack() as stack:
        policy = stack.enter_context(api.cuda(FACTS[call.facts]) if call.policy == "cuda" else api.npu(call.facts))
        stack.enter_context(intercepted(events))
        plain = (inputs["prefix_sum"], inputs["block_residual"], inputs["norm_weight"], inputs["proj_weight"], call.K,
                 1e-6)
        if call.op == "attn_res_forward":
            kw = {} if call.config is None else dict(config=api.launch_config(CONFIGS[call.config]))
            result = policy.attn_res_forward(*plain, **kw)
        elif call.op == "attn_res_backward":
            kw = {}
            if call.config is not None and BACKWARD_CONFIGS[call.config] is not None:
                kw = dict(config=api.backward_config(BACKWARD_CONFIGS[call.config]))
            result = policy.attn_res_backward(inputs["grad_out"], *plain, [m == "1" for m in call.mask], **kw)
        else:
            fused = (inputs["prefix_sum"], inputs.get("addend"), *plain[1:], call.K if call.write else -1,
                     inputs.get("out_norm_weight"), 1e-5 if call.norm else None)
            kw = dict(round_mix=call.round_mix)
            if call.op == "fused_attn_res_full":
                kw.update(return_mix=call.return_mix, mix=call.mix, sum_out=inputs.get("sum_out"))
            if call.out_dtype or call.op == "fused_attn_res_quant":
                kw["out_dtype"] = getattr(torch, call.out_dtype) if call.out_dtype else None
            result = getattr(policy, call.op)(*fused, **kw)
    return _canonical_events(events, inputs, result)


def calls() -> list[Call]:
    """The calls whose launches are recorded."""
    out: list[Call] = []
    gpus = ("interpreter", "h100", "h100-nopdl", "h100-nobuild", "h100-pcie", "a100")
    table_tokens = (1, 3, 8, 20, 64, 100, 200, 300, 700, 1500, 3000, 5000)
    for facts in gpus:
        for T in table_tokens:
            for K in (1, 2, 3, 4, 6, 8, 12, 20):
                out.append(Call("cuda", facts, "attn_res_forward", T, K))
    for facts in ("interpreter", "h100"):
        for T in (1, 8, 64, 300):
            for K in (2, 4, 8):
                for layout in ("blockmajor", "hstrided", "offset"):
                    out.append(Call("cuda", facts, "attn_res_forward", T, K, layout=layout))
                out.append(Call("cuda", facts, "attn_res_forward", T, K, H=7170))
                out.append(Call("cuda", facts, "attn_res_forward", T, K, dtype="float32"))
                out.append(Call("cuda", facts, "attn_res_forward", T, K, dtype="float16", weights="bf16"))
                out.append(Call("cuda", facts, "attn_res_forward", T, K, weights="fp64"))
                out.append(Call("cuda", facts, "attn_res_forward", T, K, weights="proj2d", cap=9))
        for T in (0, 4):
            out.append(Call("cuda", facts, "attn_res_forward", T, 4))
        out.append(Call("cuda", facts, "attn_res_forward", 4, 0))
        out.append(Call("cuda", facts, "attn_res_forward", 4, 2, H=64, dtype="float64"))
        for config in CONFIGS:
            for T, K, H in ((1, 2, 7168), (5, 8, 7168), (300, 20, 7168), (5, 3, 40)):
                out.append(Call("cuda", facts, "attn_res_forward", T, K, H=H, config=config))
    fused_flags = ((True, True, True, True), (False, False, False, True), (True, False, True, False),
                   (False, True, True, True), (True, True, False, True), (False, False, True, False))
    for facts in ("interpreter", "h100", "a100"):
        for T in (1, 4, 8, 64, 300, 3000):
            for K in (1, 2, 4, 6, 8):
                for addend, write, norm, round_mix in fused_flags:
                    out.append(Call("cuda", facts, "fused_attn_res", T, K, addend=addend, write=write, norm=norm,
                                    round_mix=round_mix))
                for addend, out_dtype, round_mix in ((True, None, False), (False, None, False),
                                                     (True, "float8_e4m3fn", True), (False, "float8_e4m3fnuz", False)):
                    out.append(Call("cuda", facts, "fused_attn_res_", T, K, addend=addend, write=True, norm=True,
                                    round_mix=round_mix, out_dtype=out_dtype))
                out.append(Call("cuda", facts, "fused_attn_res_quant", T, K, addend=True, write=True, norm=True,
                                out_dtype="float8_e4m3fn"))
                out.append(Call("cuda", facts, "fused_attn_res_quant", T, K, norm=True, round_mix=False,
                                out_dtype="float8_e4m3fnuz"))
        for T, K in ((2, 8), (64, 4)):
            for layout in ("blockmajor", "hstrided", "offset"):
                out.append(Call("cuda", facts, "fused_attn_res", T, K, layout=layout, addend=True, write=True,
                                norm=True))
                out.append(Call("cuda", facts, "fused_attn_res_", T, K, layout=layout, addend=True, write=True,
                                norm=True, round_mix=False))
            out.append(Call("cuda", facts, "fused_attn_res", T, K, dtype="float32", addend=True, norm=True))
        out.append(Call("cuda", facts, "fused_attn_res", 0, 4, addend=True, norm=True))
        out.append(Call("cuda", facts, "fused_attn_res_", 3, 2, H=64, dtype="float64", addend=True, norm=True))
    for facts in ("interpreter", "h100", "h100-nobuild", "a100", "v100"):
        for T in (1, 64, 2048, 4096):
            for K in (1, 4, 8, 9):
                for mask in ("1111", "1000", "0011", "0001", "0000"):
                    out.append(Call("cuda", facts, "attn_res_backward", T, K, mask=mask))
        for config in BACKWARD_CONFIGS:
            for T, K, H in ((3, 8, 7168), (4096, 2, 7168), (64, 4, 9000), (5, 3, 40)):
                out.append(Call("cuda", facts, "attn_res_backward", T, K, H=H, config=config))
        for layout in ("blockmajor", "hstrided", "offset"):
            out.append(Call("cuda", facts, "attn_res_backward", 8, 4, layout=layout))
        out.append(Call("cuda", facts, "attn_res_backward", 8, 4, dtype="float32"))
        out.append(Call("cuda", facts, "attn_res_backward", 8, 0))
    for cores in ("c3", "c48", "c3-ascend", "c3-two_pass", "c48-ascend-single_read"):
        for dtype in ("bfloat16", "float32"):
            for T, K, H in ((1, 1, 96), (5, 4, 96), (100, 8, 7168), (7, 0, 64), (3, 15, 40)):
                out.append(Call("npu", cores, "attn_res_forward", T, K, H=H, dtype=dtype))
                for addend, write, norm, round_mix in fused_flags:
                    out.append(Call("npu", cores, "fused_attn_res", T, K, H=H, dtype=dtype, addend=addend,
                                    write=write, norm=norm, round_mix=round_mix))
                out.append(Call("npu", cores, "fused_attn_res_", T, K, H=H, dtype=dtype, addend=True, write=True,
                                norm=True, round_mix=False))
                out.append(Call("npu", cores, "fused_attn_res_", T, K, H=H, dtype=dtype, norm=True,
                                out_dtype="float8_e4m3fn"))
                out.append(Call("npu", cores, "fused_attn_res_quant", T, K, H=H, dtype=dtype, addend=True,
                                norm=True, out_dtype="float8_e4m3fnuz"))
                for mask in ("1111", "0100", "0010"):
                    out.append(Call("npu", cores, "attn_res_backward", T, K, H=H, dtype=dtype, mask=mask))
        out.append(Call("npu", cores, "attn_res_forward", 4, 3, H=96, layout="blockmajor"))
        out.append(Call("npu", cores, "fused_attn_res", 4, 3, H=96, layout="hstrided", addend=True, norm=True))
    return out


def full_calls() -> list[Call]:
    """The calls of fused_attn_res.full (and the in-place call without an addend on a hidden-strided prefix, which
    is copied to unit stride as fused_attn_res's), recorded after the warmups."""
    out: list[Call] = []
    # (addend, write, norm, round_mix, return_mix, sum_out, mix): vLLM-Ascend's forms and the native kernels' limits.
    forms = ((True, True, True, True, True, "none", True), (False, True, True, True, True, "none", True),
             (False, False, True, True, False, "none", True), (True, False, True, False, False, "rows", True),
             (True, True, True, True, False, "dense", True), (True, False, False, True, False, "rows", True),
             (True, True, False, True, False, "none", False), (False, True, False, True, False, "none", False),
             (True, False, False, True, False, "rows", False), (False, False, False, True, False, "none", False))
    for facts in ("interpreter", "h100", "a100"):
        for T in (1, 4, 64, 3000):
            for K in (2, 6, 8):
                for addend, write, norm, round_mix, ret, sum_out, mix in forms:
                    out.append(Call("cuda", facts, "fused_attn_res_full", T, K, addend=addend, write=write,
                                    norm=norm, round_mix=round_mix, return_mix=ret, sum_out=sum_out, mix=mix))
        for T, K in ((2, 8), (64, 4)):
            for layout in ("blockmajor", "hstrided", "offset"):
                for addend, ret in ((True, True), (False, False)):
                    out.append(Call("cuda", facts, "fused_attn_res_full", T, K, layout=layout, addend=addend,
                                    write=True, norm=True, return_mix=ret))
            out.append(Call("cuda", facts, "fused_attn_res_", T, K, layout="hstrided", write=True, norm=True))
        out.append(Call("cuda", facts, "fused_attn_res_full", 0, 4, addend=True, norm=True, return_mix=True))
        out.append(Call("cuda", facts, "fused_attn_res_full", 3, 2, H=64, dtype="float64", norm=True,
                        return_mix=True))
    for cores in ("c3", "c3-ascend", "c3-two_pass"):
        for dtype in ("bfloat16", "float32"):
            for T, K, H in ((1, 1, 96), (5, 4, 96), (100, 8, 7168)):
                for addend, write, norm, round_mix, ret, sum_out, mix in forms:
                    out.append(Call("npu", cores, "fused_attn_res_full", T, K, H=H, dtype=dtype, addend=addend,
                                    write=write, norm=norm, round_mix=round_mix, return_mix=ret, sum_out=sum_out,
                                    mix=mix))
        out.append(Call("npu", cores, "fused_attn_res_full", 4, 3, H=96, layout="hstrided", norm=True,
                        return_mix=True))
    return out


#: warmup calls: (policy, facts, hidden_size, dtype, max_num_valid_blocks, max_num_tokens, keyword arguments).
WARMUPS = (
    ("cuda", "interpreter", 96, "bfloat16", 8, 1024, dict(serving=True)),
    ("cuda", "h100", 7168, "bfloat16", 8, 1024, dict(serving=True)),
    ("cuda", "h100", 7168, "float32", 4, 64, dict(fused=False)),
    ("cuda", "a100", 7168, "float16", 8, 512, dict(serving=True, weight_dtype=torch.bfloat16)),
    ("cuda", "h100", 7168, "float64", 8, 1024, {}),
    ("npu", "c3", 96, "bfloat16", 8, 1024, {}),
    ("npu", "c48", 8192, "float32", 8, 1024, {}),
)
#: fused_attn_res.full's warmups, recorded after the calls of ``full_calls``.
FULL_WARMUPS = (
    ("cuda", "h100", 7168, "bfloat16", 8, 1024, dict(fused=False, full=True, weight_dtype=torch.bfloat16)),
    ("cuda", "interpreter", 96, "bfloat16", 4, 1024, dict(fused=False, full=True)),
    ("npu", "c3", 96, "bfloat16", 8, 1024, dict(full=True)),
)


def run_warmup(spec: tuple, api: Api) -> list:
    policy_name, facts, H, dtype, max_k, max_t, kw = spec
    events: list = []
    with contextlib.ExitStack() as stack:
        policy = stack.enter_context(api.cuda(FACTS[facts]) if policy_name == "cuda" else api.npu(facts))
        stack.enter_context(intercepted(events))
        n = policy.warmup(H, getattr(torch, dtype), torch.device("cpu"), max_num_valid_blocks=max_k,
                          max_num_tokens=max_t, **kw)
    return [n, _canonical_events(events, {}, None)]


def warmup_id(spec: tuple) -> str:
    policy_name, facts, H, dtype, max_k, max_t, kw = spec
    return f"{policy_name}/{facts}/H{H}-{dtype}-K{max_k}-T{max_t}/" + ",".join(f"{k}={v}" for k, v in kw.items())


def launch_ids() -> list[str]:
    return ([call.id for call in calls()] + [warmup_id(spec) for spec in WARMUPS]
            + [call.id for call in full_calls()] + [warmup_id(spec) for spec in FULL_WARMUPS])


def launch_records(api: Api) -> list[str]:
    """The digest of every call's and warmup's launches, in ``launch_ids()`` order."""
    return ([digest(run_call(call, api)) for call in calls()] + [digest(run_warmup(spec, api)) for spec in WARMUPS]
            + [digest(run_call(call, api)) for call in full_calls()]
            + [digest(run_warmup(spec, api)) for spec in FULL_WARMUPS])


# --------------------------------------------------------------------------------------------------------------
# The package's API.
# --------------------------------------------------------------------------------------------------------------
class Api:
    """How the records reach a launch policy; see ``current_api``."""

    table_plan: Callable
    serving_plan: Callable
    config_plan: Callable
    backward_plan: Callable
    warmup_plans: Callable
    npu_forward_plan: Callable
    npu_backward_plan: Callable
    launch_config: Callable
    backward_config: Callable
    cuda: Callable
    npu: Callable


def _npu_spec(spec: str) -> tuple[int, bool, str | None]:
    parts = spec.split("-")
    cores = int(parts[0][1:])
    ascend = "ascend" in parts
    forced = next((p for p in parts[1:] if p != "ascend"), None)
    return cores, ascend, forced


def device_facts(f: Facts):
    """``f`` as the plan step's ``DeviceFacts``."""
    from k3_ops.backends.cuda_plan import DeviceFacts

    native = f.native and not f.interpreted
    return DeviceFacts(interpreted=f.interpreted, num_sms=f.num_sms, capability=f.capability, pdl=f.pdl,
                       smem_optin=f.smem_optin, cluster_threads=fake_cluster_threads if native else None,
                       single_read_smem=fake_single_read_smem if native else None)


def _launch_config(kw: dict):
    from k3_ops.backends.cuda_table import LaunchConfig

    kw = dict(kw)
    if isinstance(kw.get("fallback"), dict):
        kw["fallback"] = LaunchConfig(**kw["fallback"])
    return LaunchConfig(**kw)


def _backward_config(kw: dict):
    from k3_ops.backends.cuda_plan import BackwardConfig

    return BackwardConfig(**kw)


@contextlib.contextmanager
def _on_cuda(f: Facts) -> Iterator[Any]:
    """The CUDA policy as if its tensors' device were ``f`` (plans resolved afresh, launches on CPU tensors)."""
    from k3_ops.backends import cuda

    facts = device_facts(f)
    cuda.clear_plan_cache()
    try:
        with patched((cuda, "device_facts", lambda device: facts),
                     (cuda, "use_interpreter", lambda t: f.interpreted)):
            yield cuda
    finally:
        cuda.clear_plan_cache()


@contextlib.contextmanager
def _on_npu(spec: str) -> Iterator[Any]:
    """The NPU policy with ``spec`` 's vector cores, triton-ascend or not, and forced forward kernel."""
    from k3_ops.backends import npu

    cores, ascend, forced = _npu_spec(spec)
    changes = [(npu, "is_triton_ascend", lambda: True), (npu, "use_interpreter", lambda: False)] if ascend else []
    with patched(*changes), npu.substitute(num_vector_cores=lambda device: cores, forward_kernel=forced):
        yield npu


def current_api() -> Api:
    """The package's plan step (pure: no triton for the plan records) and policies."""
    from k3_ops.backends import TRITON_COMPILE_OPTIONS, cuda_plan, npu_plan

    api = Api()
    api.table_plan = lambda T, K, H, f: cuda_plan.table_plan(T, K, H, device_facts(f))
    api.serving_plan = lambda T, K, H, f: cuda_plan.serving_plan(cuda_plan.table_plan(T, K, H, device_facts(f)),
                                                                 K, H, device_facts(f))
    api.config_plan = lambda K, H, f, kw: cuda_plan.resolve(K, H, device_facts(f), _launch_config(kw))
    api.backward_plan = lambda T, K, H, f, kw, size: cuda_plan.backward_plan(
        T, K, H, device_facts(f), None if kw is None else _backward_config(kw), size)
    api.warmup_plans = lambda H, max_k, max_t, f: cuda_plan.table_plans(H, max_k, max_t, device_facts(f))
    api.npu_forward_plan = npu_plan.forward_plan
    api.npu_backward_plan = lambda H, K, dtype, cores, ascend: npu_plan.backward_plan(
        H, K, dtype.itemsize, cores, {"multibuffer": True} if ascend else {},
        {} if ascend else dict(TRITON_COMPILE_OPTIONS))
    api.launch_config, api.backward_config = _launch_config, _backward_config
    api.cuda, api.npu = _on_cuda, _on_npu
    return api


def dumps(data: dict) -> str:
    """The records as JSON, one grid row, plan or launch digest group per line (diffs show what changed)."""
    def compact(v) -> str:
        return json.dumps(v, sort_keys=True, separators=(",", ":"))

    lines = ["{"]
    for i, (section, value) in enumerate(data.items()):
        lines.append(f"{compact(section)}:{{")
        items = list(value.items())
        for j, (key, rows) in enumerate(items):
            if isinstance(rows, list) and key in ("plans", "launches"):
                body = ",\n".join(compact(r) for r in rows) if key == "plans" else ",\n".join(
                    compact(rows[k:k + 16]).strip("[]") for k in range(0, len(rows), 16))
                lines.append(f"{compact(key)}:[\n{body}]" + ("," if j < len(items) - 1 else ""))
            elif isinstance(rows, dict):
                inner = ",\n".join(f"{compact(k)}:{compact(v)}" for k, v in rows.items())
                lines.append(f"{compact(key)}:{{\n{inner}}}" + ("," if j < len(items) - 1 else ""))
            else:
                lines.append(f"{compact(key)}:{compact(rows)}" + ("," if j < len(items) - 1 else ""))
        lines.append("}" + ("," if i < len(data) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def record(api: Api) -> dict:
    return {"plans": plan_records(api), "launches": {"launches": launch_records(api)}}


def main(argv: list[str]) -> None:
    if argv != ["--write"]:
        sys.exit("usage: python tests/launch_records.py --write  (rewrites tests/data/launch_plans.json)")
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(dumps(record(current_api())))


if __name__ == "__main__":
    main(sys.argv[1:])
