"""The toy Kimi-K3-style stack (tests/toy_k3.py) run unfused and fused: outputs and buffers match.

Three levels, from the contract (docs/fused_attn_res.md) outwards:
1. every fused call of the schedule meets the contract where it stands (growing K, snapshots, norms):
   new_prefix and the snapshot bit for bit, all other buffer bytes untouched, out within one ulp of
   torch's RMSNorm of attn_res(new_prefix);
2. end to end, fused vs the unfused pipeline with torch's RMSNorm: within the drift that one-ulp norm
   differences can accumulate over the layers, and the never-filled capacity slot still NaN-poisoned;
3. on the CPU, whose kernel is the reference composition, fused == unfused bit for bit end to end, with the
   unfused norm being that same reference RMSNorm (so the schedule translation itself is exact).
"""
from __future__ import annotations

import pytest
import torch

import k3_ops
from k3_ops.testing import assert_close

from test_fused import NORM_RTOL, bits
from toy_k3 import ToyK3, ToyK3Config, Trace

CONFIGS = [
    ToyK3Config(),  # bf16, token-major
    ToyK3Config(layout="blockmajor"),
    ToyK3Config(dtype=torch.float16, layout="blockmajor"),
    ToyK3Config(dtype=torch.float32, num_layers=5, block_size=2, capacity=3),  # full capacity at the end
]
TOKENS = [1, 5]


def config_id(c: ToyK3Config) -> str:
    return f"L{c.num_layers}-B{c.block_size}-cap{c.capacity}-H{c.hidden}-{str(c.dtype).split('.')[-1]}-{c.layout}"


def params():
    return [pytest.param(c, T, id=f"{config_id(c)}-T{T}") for c in CONFIGS for T in TOKENS]


# End-to-end drift: a one-ulp difference in a norm output (allowed by the contract) moves a sublayer's output
# and then the residual stream by about one ulp of values up to ~4, a few times over the layers. Measured on
# the CPU by swapping the unfused norm for an FP64 one: <= 2 ulps (fp16 2.4e-3, fp32 3.3e-6); these bounds
# allow about 2x-4x that.
END_TO_END_TOL = {torch.bfloat16: (2**-4, 2**-6), torch.float16: (2**-7, 2**-9), torch.float32: (1e-5, 1e-5)}


def run(model: ToyK3, T: int, pipeline: str, **kw) -> tuple[Trace, torch.Tensor, torch.Tensor]:
    """Run one pipeline ("fused" / "unfused") on fresh embeddings and a fresh NaN-poisoned buffer."""
    x = model.embeddings(T)
    x_before = x.clone()
    buf = model.new_buffer(T)
    trace = model.forward_fused(x, buf, **kw) if pipeline == "fused" else model.forward_unfused(x, buf, **kw)
    assert torch.equal(bits(x), bits(x_before)), "the embeddings (the first prefix_sum) were written"
    return trace, buf, x


@pytest.mark.parametrize("config,T", params())
def test_every_fused_call_meets_the_contract(config: ToyK3Config, T: int, device: str):
    model = ToyK3(config, device)
    calls = []

    def checked(prefix_sum, addend, buf, norm_weight, proj_weight, K, eps, *, block_write_idx=-1,
                out_norm_weight=None, out_norm_eps=None):
        where = f"call {len(calls)} (K={K}, block_write_idx={block_write_idx})"
        buf_before, prefix_before = buf.clone(), prefix_sum.clone()
        addend_before = addend.clone() if addend is not None else None
        out, new_prefix = k3_ops.fused_attn_res(prefix_sum, addend, buf, norm_weight, proj_weight, K, eps,
                                                block_write_idx=block_write_idx, out_norm_weight=out_norm_weight,
                                                out_norm_eps=out_norm_eps)
        expected_prefix = prefix_sum + addend if addend is not None else prefix_sum
        assert torch.equal(bits(new_prefix), bits(expected_prefix)), f"{where}: new_prefix != prefix_sum + addend"
        others = [i for i in range(config.capacity) if i != block_write_idx]
        assert torch.equal(bits(buf[:, others]), bits(buf_before[:, others])), f"{where}: other slots changed"
        if block_write_idx >= 0:
            assert torch.equal(bits(buf[:, block_write_idx]), bits(new_prefix)), f"{where}: snapshot != new_prefix"
        assert torch.equal(bits(prefix_sum), bits(prefix_before)), f"{where}: prefix_sum was written"
        if addend is not None:
            assert torch.equal(bits(addend), bits(addend_before)), f"{where}: addend was written"
        mix = k3_ops.attn_res(new_prefix, buf, norm_weight, proj_weight, K, eps)
        rtol = NORM_RTOL[config.dtype]
        assert_close(out, model.rms_norm(mix, out_norm_weight), atol=rtol, rtol=rtol, what=f"{where}: out")
        calls.append(block_write_idx)
        return out, new_prefix

    trace, buf, _ = run(model, T, "fused", fused=checked)
    # Two mixes per layer and the final one; one snapshot per block, into consecutive slots.
    assert len(calls) == 2 * config.num_layers + 1
    assert [i for i in calls if i >= 0] == list(range(config.num_snapshots))
    assert not any(t.isnan().any() for _, t in trace), "NaN poison leaked into a sublayer input"


def _poison_intact(buf: torch.Tensor, config: ToyK3Config) -> bool:
    unused = buf[:, config.num_snapshots:]
    return bool(unused.isnan().all()) and torch.equal(bits(unused), bits(torch.full_like(unused, float("nan"))))


@pytest.mark.parametrize("config,T", params())
def test_fused_stack_matches_unfused(config: ToyK3Config, T: int, device: str):
    model = ToyK3(config, device)
    unfused, buf_u, _ = run(model, T, "unfused")
    fused, buf_f, _ = run(model, T, "fused")
    atol, rtol = END_TO_END_TOL[config.dtype]
    assert [name for name, _ in fused] == [name for name, _ in unfused]
    for (name, f), (_, u) in zip(fused, unfused):
        assert_close(f, u, atol=atol, rtol=rtol, what=f"{config_id(config)} T={T}: {name}")
    n = config.num_snapshots
    assert_close(buf_f[:, :n], buf_u[:, :n], atol=atol, rtol=rtol, what="snapshots")
    assert _poison_intact(buf_f, config) and _poison_intact(buf_u, config), "never-filled capacity was written"


@pytest.mark.parametrize("config,T", params())
def test_fused_stack_is_bit_exact_on_cpu(config: ToyK3Config, T: int):
    # The CPU kernel is the reference composition, so with the reference RMSNorm on the unfused side every
    # sublayer input, the output and every buffer byte agree bit for bit: the fused schedule (deferred adds,
    # snapshot inside the pre-attention call, prefix restarting from the attention output) is the unfused one.
    model = ToyK3(config, "cpu")
    unfused, buf_u, _ = run(model, T, "unfused", norm=lambda x, w: k3_ops.reference.rms_norm_reference(
        x, w, config.norm_eps))
    fused, buf_f, _ = run(model, T, "fused")
    for (name, f), (_, u) in zip(fused, unfused):
        assert torch.equal(bits(f), bits(u)), f"{config_id(config)} T={T}: {name} differs"
    assert torch.equal(bits(buf_f), bits(buf_u)), "buffers differ"
