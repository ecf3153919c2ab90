"""Pinned contracts: the schema strings and the FX graph that torch.compile produces around the op.

Update intentionally with EXPECTTEST_ACCEPT=1 and review the diff: a change here changes every caller.
"""
from __future__ import annotations

import re

import expecttest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs, normalize_gm

import k3_ops

from conftest import Sample


def canonical_symbols(code: str) -> str:
    """Rename size symbols in order of first appearance (s0, s1, ...): their numbers are hashes of source
    locations and differ between torch releases, while the graph's structure is what is pinned."""
    names: dict[str, str] = {}
    return re.sub(r"\bs\d+\b", lambda m: names.setdefault(m.group(0), f"s{len(names)}"), code)


class TestPinned(expecttest.TestCase):
    def test_schemas(self):
        ops = torch.ops.kimi_k3
        self.assertExpectedInline(
            str(ops.attn_res.default._schema),
            """kimi_k3::attn_res(Tensor prefix_sum, Tensor block_residual, Tensor norm_weight, Tensor proj_weight, int num_valid_blocks, float eps) -> Tensor""",  # noqa: E501
        )
        self.assertExpectedInline(
            str(ops.attn_res_backward.default._schema),
            """kimi_k3::attn_res_backward(Tensor grad_out, Tensor prefix_sum, Tensor block_residual, Tensor norm_weight, Tensor proj_weight, int num_valid_blocks, float eps, bool[4] output_mask) -> (Tensor grad_prefix_sum, Tensor grad_block_residual, Tensor grad_norm_weight, Tensor grad_proj_weight)""",  # noqa: E501
        )
        self.assertExpectedInline(
            str(ops.fused_attn_res.default._schema),
            """kimi_k3::fused_attn_res(Tensor prefix_sum, Tensor? addend, Tensor(a!) block_residual, Tensor norm_weight, Tensor proj_weight, int num_valid_blocks, float eps, int block_write_idx=-1, Tensor? out_norm_weight=None, float? out_norm_eps=None, *, bool round_mix=True) -> (Tensor, Tensor)""",  # noqa: E501
        )
        self.assertExpectedInline(
            str(ops.fused_attn_res.quant._schema),
            """kimi_k3::fused_attn_res.quant(Tensor prefix_sum, Tensor? addend, Tensor(a!) block_residual, Tensor norm_weight, Tensor proj_weight, int num_valid_blocks, float eps, int block_write_idx=-1, Tensor? out_norm_weight=None, float? out_norm_eps=None, *, ScalarType out_dtype, bool round_mix=True) -> (Tensor out, Tensor new_prefix, Tensor scale)""",  # noqa: E501
        )
        self.assertExpectedInline(
            str(ops.fused_attn_res_.default._schema),
            """kimi_k3::fused_attn_res_(Tensor(a!) prefix_sum, Tensor? addend, Tensor(b!) block_residual, Tensor norm_weight, Tensor proj_weight, int num_valid_blocks, float eps, int block_write_idx=-1, Tensor? out_norm_weight=None, float? out_norm_eps=None, *, ScalarType? out_dtype=None, bool round_mix=True) -> (Tensor out, Tensor scale)""",  # noqa: E501
        )
        self.assertExpectedInline(
            str(ops.tp_all_reduce.default._schema),
            """kimi_k3::tp_all_reduce(Tensor partial, str group_name) -> Tensor""",
        )
        # The Meta kernels are C++ registrations on the same library, not Python fakes.
        for name in ("attn_res", "attn_res_backward", "fused_attn_res", "fused_attn_res.quant", "fused_attn_res_",
                     "tp_all_reduce"):
            self.assertTrue(torch._C._dispatch_has_kernel_for_dispatch_key(f"kimi_k3::{name}", "Meta"), name)

    def test_fx_graph_has_one_op_node_with_symbolic_tokens(self):
        def f(prefix_sum, block_residual, norm_weight, proj_weight):
            return k3_ops.attn_res(prefix_sum, block_residual, norm_weight, proj_weight, 2, 1e-6)

        args = Sample(T=5, K=2, cap=4, H=32, dtype=torch.bfloat16).make()
        backend = AotEagerAndRecordGraphs()
        compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
        compiled(args["prefix_sum"], args["block_residual"], args["norm_weight"], args["proj_weight"])
        self.assertEqual(len(backend.fw_graphs), 1)
        gm = backend.fw_graphs[0]
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        self.assertEqual([str(n.target) for n in calls], ["kimi_k3.attn_res.default"])
        self.assertExpectedInline(
            canonical_symbols(normalize_gm(gm.print_readable(print_output=False))),
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s0)", arg1_1: "Sym(s1)", arg2_1: "bf16[s0, s1]", arg3_1: "Sym(s2)", arg4_1: "bf16[s0, s2, s1]", arg5_1: "f32[s1]", arg6_1: "f32[1, s1]"):
        attn_res: "bf16[s0, s1]" = torch.ops.kimi_k3.attn_res.default(arg2_1, arg4_1, arg5_1, arg6_1, 2, 1e-06);  arg2_1 = arg4_1 = arg5_1 = arg6_1 = None
        return (attn_res,)
""",
        )
