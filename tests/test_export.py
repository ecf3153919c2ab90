"""torch.export of modules that use the kimi_k3 ops, with a dynamic token dimension (torch.export.Dim).

The exported program must contain the ops as calls (custom ops are never decomposed, also not by
run_decompositions), run for token counts other than the example's, equal eager, and survive a
save / load round trip. The fused op mutates the bank: in the functional IR it appears inside
auto_functionalized, and the bank's storage is a mutated buffer in the graph signature.
"""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.export import Dim

import k3_ops  # noqa: F401  (loads the kimi_k3 library)
from k3_ops.nn import AttnRes

from conftest import Sample
from test_model_graph import ToyK3Model, make_input

ATTN_RES = torch.ops.kimi_k3.attn_res.default
FUSED = torch.ops.kimi_k3.fused_attn_res.default


def called_ops(ep: torch.export.ExportedProgram) -> list:
    """Every op the graph calls, looking inside auto_functionalized(op, ...) wrappers."""
    ops = []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator) and node.args and isinstance(
                node.args[0], torch._ops.OpOverload):
            target = node.args[0]
        ops.append(target)
    return ops


class MixOnce(nn.Module):
    """The smallest user of the op: one AttnRes over a [T, C, H] buffer passed in (token- or block-major)."""

    def __init__(self, hidden_size: int, num_valid_blocks: int) -> None:
        super().__init__()
        self.mix = AttnRes(hidden_size)
        self.num_valid_blocks = num_valid_blocks
        with torch.no_grad():
            self.mix.proj.weight.normal_(generator=torch.Generator().manual_seed(0))

    def forward(self, prefix_sum: torch.Tensor, block_residual: torch.Tensor) -> torch.Tensor:
        return self.mix(prefix_sum, block_residual, self.num_valid_blocks)


def roundtrip(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    f = io.BytesIO()
    torch.export.save(ep, f)
    f.seek(0)
    return torch.export.load(f)


@pytest.mark.parametrize("layout", ["tokenmajor", "blockmajor"])
def test_export_attn_res_module_dynamic_tokens(layout: str):
    base = Sample(T=7, K=3, cap=5, H=32, dtype=torch.float32, layout=layout)
    model = MixOnce(base.H, base.K)
    example = base.make("cpu")
    T = Dim("T", min=1, max=4096)
    ep = torch.export.export(model, (example["prefix_sum"], example["block_residual"]),
                             dynamic_shapes=({0: T}, {0: T}))
    assert ATTN_RES in called_ops(ep)
    assert ATTN_RES in called_ops(ep.run_decompositions()), "run_decompositions must keep the op"
    for runner in (ep.module(), roundtrip(ep).module()):
        for t in (1, 7, 17, 512):
            args = base.with_(T=t).make("cpu", seed=t)
            with torch.no_grad():
                want = model(args["prefix_sum"], args["block_residual"])
            assert torch.equal(runner(args["prefix_sum"], args["block_residual"]), want), f"T={t}"


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_export_toy_stack_with_bank_mutation(fused: bool):
    model = ToyK3Model(num_layers=4, fused=fused, max_num_tokens=64)
    eager = ToyK3Model(num_layers=4, fused=fused, max_num_tokens=64)
    T = Dim("T", min=1, max=64)
    with torch.no_grad():
        ep = torch.export.export(model, (make_input(7),), dynamic_shapes=({0: T},))
    op = FUSED if fused else ATTN_RES
    # Unfused, layer 0's pre-attention mix is skipped (no blocks yet); fused, every mix is one call.
    functional = ep.run_decompositions()
    for program in (ep, functional):
        assert called_ops(program).count(op) == 2 * 4 + (1 if fused else 0)
    # In the functional IR the snapshot writes become an output that is written back to the buffer.
    assert "bank.storage" in functional.graph_signature.buffers_to_mutate.values()
    # The export IR runs eager's kernels: bit for bit. run_decompositions turns linear into permute + mm,
    # whose FP32 rounding may differ by an ulp: default FP32 tolerances there.
    for program, exact in ((ep, True), (functional, False)):
        runner = program.module()
        for t in (1, 7, 17, 64):
            x = make_input(t)
            with torch.no_grad():
                want = eager(x)
                got = runner(x)
            # The exported module writes its own copy of the bank, as the eager model writes its bank.
            got_bank = dict(runner.named_buffers())["bank.storage"].view(eager.bank.shape)[:t]
            want_bank = eager.bank.buffer[:t]
            if exact:
                assert torch.equal(got, want), f"T={t}"
                assert torch.equal(got_bank.view(torch.int32), want_bank.view(torch.int32)), f"T={t}"
            else:
                torch.testing.assert_close(got, want, msg=lambda m, t=t: f"T={t}: {m}")
                torch.testing.assert_close(got_bank, want_bank, equal_nan=True, msg=lambda m, t=t: f"T={t}: {m}")
