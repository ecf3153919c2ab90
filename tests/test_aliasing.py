"""The aliasing rules of the serving ops: every argument an op writes (the snapshot slot block_residual[:, w],
prefix_sum in place, sum_out) against every argument it reads, with full, partial and no overlap, token- and
block-major, every overload, eagerly (the kernels' checks) and at trace time (FakeTensorMode -> the C++ Meta kernel).

Every tensor of a call is a view of one arena, so any two can be made to overlap. A rejected call must name both
arguments and leave the arena untouched (the checks run before anything is written); an accepted one (no overlap:
apart in the arena, or side by side at one token stride) must give the same bits as the same call on separate
tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import k3_ops  # noqa: F401

from conftest import bits_equal

T, C, H, EPS = 3, 4, 16, 1e-6
GAP = 1024  # elements between the default places of the arena's tensors: far apart unless a case moves one
FP8 = torch.float8_e4m3fn

# Which arguments each overload writes; what every overload reads.
WRITES = {
    "default": ("snapshot",),
    "quant": ("snapshot",),
    "full": ("snapshot", "sum_out"),
    "inplace": ("snapshot", "prefix_sum"),
}
READS = ("prefix_sum", "addend", "valid_blocks", "norm_weight", "proj_weight", "out_norm_weight")
NAMES = {"snapshot": "block_residual[:, block_write_idx={w}]",
         "valid_blocks": "block_residual[:, :num_valid_blocks={K}]"}


@dataclass
class Place:
    """A strided view of the arena: element offset, sizes, strides."""

    offset: int
    sizes: tuple
    strides: tuple

    def shifted(self, by: int) -> Place:
        return Place(self.offset + by, self.sizes, self.strides)


@dataclass
class Layout:
    """Where each argument of one call lies in the arena. The buffer is the first C slots of a C + 1 slot allocation,
    so slot C is a spare beside it (the allowed home of sum_out or a prefix)."""

    major: str
    K: int
    w: int
    slot_stride_scale: float = 1.0  # < 1: the buffer's slots overlap each other (a bad buffer for the snapshot)

    def __post_init__(self):
        self.places = {
            "prefix_sum": Place(1 * GAP, (T, H), (H, 1)),
            "addend": Place(2 * GAP, (T, H), (H, 1)),
            "sum_out": Place(3 * GAP, (T, H), (H, 1)),
            "norm_weight": Place(4 * GAP, (H,), (1,)),
            "proj_weight": Place(5 * GAP, (H,), (1,)),
            "out_norm_weight": Place(6 * GAP, (H,), (1,)),
        }

    @property
    def token_stride(self) -> int:
        return (C + 1) * H if self.major == "token" else H

    @property
    def slot_stride(self) -> int:
        return int((H if self.major == "token" else T * H) * self.slot_stride_scale)

    def bank(self) -> Place:
        return Place(0, (T, C, H), (self.token_stride, self.slot_stride, 1))

    def slot(self, i: int) -> Place:
        return Place(i * (H if self.major == "token" else T * H), (T, H), (self.token_stride, 1))


def arena_views(arena: torch.Tensor, layout: Layout, overload: str) -> dict:
    v = {name: arena.as_strided(p.sizes, p.strides, p.offset) for name, p in layout.places.items()}
    b = layout.bank()
    v["block_residual"] = arena.as_strided(b.sizes, b.strides, b.offset)
    if overload != "full":
        v.pop("sum_out")
    return v


def fill(arena: torch.Tensor, layout: Layout) -> None:
    g = torch.Generator().manual_seed(0)
    arena.copy_(torch.randn(arena.numel(), generator=g).to(arena.dtype))
    for name in ("norm_weight", "out_norm_weight"):
        p = layout.places[name]
        arena[p.offset:p.offset + H] = (1.0 + 0.1 * torch.randn(H, generator=g)).to(arena.dtype)


def call(overload: str, v: dict, layout: Layout):
    args = (v["prefix_sum"], v["addend"], v["block_residual"], v["norm_weight"], v["proj_weight"], layout.K, EPS,
            layout.w, v["out_norm_weight"], 1e-5)
    if overload == "default":
        return torch.ops.kimi_k3.fused_attn_res.default(*args)
    if overload == "quant":
        return torch.ops.kimi_k3.fused_attn_res.quant(*args, out_dtype=FP8)
    if overload == "full":
        return torch.ops.kimi_k3.fused_attn_res.full(*args, return_mix=True, sum_out=v["sum_out"])
    return torch.ops.kimi_k3.fused_attn_res_.default(*args)


def arrange(layout: Layout, written: str, read: str, mode: str) -> None:
    """Move one argument so that the written one and the read one overlap fully, partly, or lie side by side at one
    token stride ("beside"); "apart" keeps the default places (one storage, far apart)."""
    if mode == "apart":
        return
    if read == "valid_blocks":
        if written == "snapshot":  # the buffer's own slots overlap: the snapshot slot lands on a valid one
            layout.w = layout.K
            layout.slot_stride_scale = {"full": 0.0, "partial": 0.5, "beside": 1.0}[mode]
            return
        # prefix_sum or sum_out onto the buffer's valid slot 0, half a row into it, or into the spare slot C
        place = {"full": layout.slot(0), "partial": layout.slot(0).shifted(H // 2), "beside": layout.slot(C)}[mode]
        layout.places[written] = place
        return
    target = layout.slot(layout.w) if written == "snapshot" else layout.places[written]
    if written == "sum_out" and read == "block_residual":
        layout.places["sum_out"] = {"full": layout.slot(layout.w), "partial": layout.slot(0).shifted(H // 2),
                                    "beside": layout.slot(C)}[mode]
        return
    if mode == "beside":  # the spare slot, beside the snapshot slot at one token stride
        layout.places[read] = layout.slot(C)
        return
    shift = 0 if mode == "full" else H // 2
    if read in ("prefix_sum", "addend"):
        layout.places[read] = target.shifted(shift)
    else:  # a weight over the written tensor's first row, or across its end
        layout.places[read] = Place(target.offset + shift, (H,), (1,))


def cases():
    for overload, writes in WRITES.items():
        for written in writes:
            reads = READS if written != "sum_out" else (*READS, "block_residual")
            for read in reads:
                if written == "sum_out" and read == "valid_blocks":
                    continue  # sum_out is checked against the whole buffer (read == "block_residual")
                if written == "prefix_sum" and read == "prefix_sum":
                    continue
                modes = ["full", "partial", "apart"]
                if written == "snapshot" and read in ("prefix_sum", "addend", "valid_blocks"):
                    modes.append("beside")
                if written in ("prefix_sum", "sum_out") and read in ("valid_blocks", "block_residual"):
                    modes.append("beside")
                if written == "prefix_sum" and read == "addend":
                    modes.remove("full")  # addend is prefix_sum: the allowed alias (its own test, below)
                for major in ("token", "block"):
                    for mode in modes:
                        yield pytest.param(overload, written, read, mode, major,
                                           id=f"{overload}-{written}-vs-{read}-{mode}-{major}major")


def _names(layout: Layout, written: str, read: str) -> tuple[str, str]:
    fmt = {"w": layout.w, "K": layout.K}
    return (NAMES.get(written, written).format(**fmt), NAMES.get(read, read).format(**fmt))


def _separate(v: dict) -> dict:
    """The same values in tensors of their own (the call every accepted alias layout must equal)."""
    return {k: t.clone() for k, t in v.items()}


@pytest.mark.parametrize("overload,written,read,mode,major", list(cases()))
def test_written_vs_read(overload, written, read, mode, major, device):
    layout = Layout(major, K=1, w=2)
    arrange(layout, written, read, mode)
    arena = torch.empty(8 * GAP, dtype=torch.bfloat16)
    fill(arena, layout)
    arena = arena.to(device)
    v = arena_views(arena, layout, overload)
    before = arena.clone()
    if mode in ("full", "partial"):
        w_name, r_name = _names(layout, written, read)
        with pytest.raises(ValueError, match="must not share memory") as info:
            call(overload, v, layout)
        msg = str(info.value)
        # The message names both arguments (the rule reports the written one first, or for prefix_sum in place
        # against the snapshot slot, the slot first).
        assert w_name in msg and r_name in msg, msg
        assert bits_equal(arena, before), "a rejected call wrote into the caller's memory"
        # Trace time: the Meta kernel raises the same message.
        with FakeTensorMode() as mode_:
            fake = mode_.from_tensor(arena)
            with pytest.raises(ValueError) as traced:
                call(overload, arena_views(fake, layout, overload), layout)
        assert str(traced.value) == msg
    else:
        ref = _separate(v)
        got = call(overload, v, layout)
        want = call(overload, ref, layout)
        for a, b in zip(got, want):
            assert bits_equal(a, b)
        for name in ("prefix_sum", "block_residual", "sum_out"):
            if name in v:
                assert bits_equal(v[name], ref[name]), name


def test_addend_is_prefix_sum_in_place(device):
    """The one alias a contract allows: fused_attn_res_(p, p, ...) is p += p, then the mix."""
    layout = Layout("token", K=1, w=2)
    layout.places["addend"] = layout.places["prefix_sum"]
    arena = torch.empty(8 * GAP, dtype=torch.bfloat16)
    fill(arena, layout)
    arena = arena.to(device)
    v = arena_views(arena, layout, "inplace")
    assert v["addend"].data_ptr() == v["prefix_sum"].data_ptr()
    twice = (v["prefix_sum"].float() * 2).to(torch.bfloat16)
    call("inplace", v, layout)
    assert bits_equal(v["prefix_sum"], twice)


def test_written_internal_overlap(device):
    """A written tensor that maps two elements to one location: a buffer whose token dim is broadcast (the snapshot
    slot), a prefix_sum written in place whose rows overlap each other."""
    args = dict(norm_weight=torch.ones(H, device=device), proj_weight=torch.ones(H, device=device))
    bank = torch.zeros(1, C, H, dtype=torch.bfloat16, device=device).expand(T, C, H)
    prefix = torch.zeros(T, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"^block_residual\[:, block_write_idx=2\] is written \(the snapshot of the "
                                         r"new prefix\) and must not map two elements to one memory location, got "
                                         r"sizes \[3, 1, 16\] and strides \[0, 16, 1\]$"):
        torch.ops.kimi_k3.fused_attn_res(prefix, None, bank, args["norm_weight"], args["proj_weight"], 1, EPS, 2)
    flat = torch.zeros(2 * H, dtype=torch.bfloat16, device=device)
    rows = flat.as_strided((T, H), (H // 2, 1))  # rows overlapping by half
    bank = torch.zeros(T, C, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"^prefix_sum is written \(round\(prefix_sum \+ addend\) is stored into it in "
                                         r"place\) and must not map two elements"):
        torch.ops.kimi_k3.fused_attn_res_(rows, torch.zeros(T, H, dtype=torch.bfloat16, device=device), bank,
                                          args["norm_weight"], args["proj_weight"], 1, EPS)
    assert not flat.any() and not bank.any()


def test_alias_checked_under_compile():
    """torch.compile: the Meta kernel rejects an overlapping in-place call while tracing, with the eager message."""
    bank = torch.randn(T, C, H, dtype=torch.bfloat16)
    bank[:, 1:] = float("nan")
    addend = torch.randn(T, H, dtype=torch.bfloat16)
    w = torch.ones(H)

    def step(bank, addend):
        out, _ = torch.ops.kimi_k3.fused_attn_res_(bank[:, 0], addend, bank, w, w, 1, EPS)
        return out

    with pytest.raises(ValueError, match="must not share memory") as eager:
        step(bank, addend)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(step, fullgraph=True, backend="aot_eager")(bank, addend)
    assert str(eager.value) in str(compiled.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_alias_checked_during_graph_capture():
    """CUDA-graph capture: an overlapping call raises before it launches anything, also after the same shapes and
    strides were recorded without the overlap (the C++ replay keys tensors that share a storage)."""
    bank = torch.randn(T, C, H, dtype=torch.bfloat16, device="cuda")
    other = torch.randn(T, C, H, dtype=torch.bfloat16, device="cuda")
    addend = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(H, device="cuda")
    for _ in range(3):  # recorded and replayed: prefix_sum a slot of another buffer
        torch.ops.kimi_k3.fused_attn_res_(other[:, 1], addend, bank, w, w, 2, EPS)
    torch.cuda.synchronize()
    before = bank.clone()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=r"^prefix_sum \(written in place\) must not share memory with "
                                         r"block_residual\[:, :num_valid_blocks=2\]"):
        with torch.cuda.graph(graph):
            torch.ops.kimi_k3.fused_attn_res_(bank[:, 1], addend, bank, w, w, 2, EPS)
    torch.cuda.synchronize()
    assert bits_equal(bank, before)
