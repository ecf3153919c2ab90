"""k3_ops.nn: AttnRes (checkpoint-named parameters, plain and fused entry points), ResidualBank (one
preallocated buffer, views never copies, block counting) and RMSNorm.

The modules are thin wiring around the ops, so the oracle here is the op itself called with the tensors the
module should pass: any mix-up of weights, eps, K or the snapshot slot shows as a bit difference. Unused
bank capacity is NaN-poisoned throughout.
"""
from __future__ import annotations

import pytest
import torch

import k3_ops
import k3_ops.reference
from k3_ops.nn import AttnRes, ResidualBank, RMSNorm
from k3_ops.reference import rms_norm_reference

from conftest import SAMPLES, Sample, sample_params

NAN = float("nan")


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view, so that equality is bitwise and NaN == NaN."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def module_for(sample: Sample, args: dict, device: str) -> AttnRes:
    """An AttnRes holding the sample's weights, loaded by their checkpoint names."""
    m = AttnRes(sample.H, eps=sample.eps, device=device, dtype=torch.float32)
    m.load_state_dict({"norm.weight": args["norm_weight"], "proj.weight": args["proj_weight"].reshape(1, sample.H)})
    return m


def bank_for(sample: Sample, args: dict, device: str, spare_tokens: int = 5) -> ResidualBank:
    """A NaN-poisoned bank of the sample's layout holding the sample's K valid blocks (via append)."""
    bank = ResidualBank(sample.T + spare_tokens, sample.cap, sample.H, layout=sample.layout, dtype=sample.dtype,
                        device=device)
    bank.storage.fill_(NAN)
    for i in range(sample.K):
        bank.append(args["block_residual"][:, i])
    return bank


def test_parameters_are_named_and_shaped_like_the_checkpoint():
    m = AttnRes(48, eps=1e-5)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {"norm.weight": (48,), "proj.weight": (1, 48)}
    assert m.norm.variance_epsilon == 1e-5 and m.eps == 1e-5
    assert isinstance(m.proj, torch.nn.Linear) and m.proj.bias is None
    g = torch.Generator().manual_seed(0)
    ckpt = {"norm.weight": torch.randn(48, generator=g), "proj.weight": torch.randn(1, 48, generator=g)}
    m.load_state_dict(ckpt, strict=True)
    assert torch.equal(m.norm.weight, ckpt["norm.weight"]) and torch.equal(m.proj.weight, ckpt["proj.weight"])


def test_unloaded_module_averages_the_candidates():
    """proj.weight starts at zero: every score is 0, so the mix is the plain mean of the K + 1 candidates."""
    m = AttnRes(16)
    g = torch.Generator().manual_seed(0)
    prefix, blocks = torch.randn(3, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    with torch.no_grad():
        out = m(prefix, blocks, 2)
    torch.testing.assert_close(out, (blocks.sum(1) + prefix) / 3)


def test_parameters_train_through_the_op():
    """Gradients reach norm.weight and proj.weight (by the op's autograd) and equal autograd of the formula."""
    sample = Sample(T=5, K=2, cap=3, H=16, dtype=torch.float64, layout="blockmajor")
    args = sample.make("cpu")
    m = module_for(sample, args, "cpu").double()
    m(args["prefix_sum"], args["block_residual"], sample.K).square().sum().backward()
    nw = args["norm_weight"].double().requires_grad_(True)
    pw = args["proj_weight"].double().reshape(1, sample.H).requires_grad_(True)
    k3_ops.reference.attn_res_reference(args["prefix_sum"], args["block_residual"], nw, pw, sample.K,
                                        sample.eps).square().sum().backward()
    torch.testing.assert_close(m.norm.weight.grad, nw.grad)
    torch.testing.assert_close(m.proj.weight.grad, pw.grad)


@pytest.mark.parametrize("sample", sample_params())
@torch.no_grad()
def test_forward_calls_the_op_with_the_module_weights(sample: Sample, device: str):
    args = sample.make(device)
    m = module_for(sample, args, device)
    want = k3_ops.attn_res(args["prefix_sum"], args["block_residual"], m.norm.weight, m.proj.weight, sample.K,
                           sample.eps)
    got = m(args["prefix_sum"], args["block_residual"], sample.K)
    assert torch.equal(bits(got), bits(want))
    # The same blocks in a bank of the same layout: the bank's view and count are what the op receives.
    bank = bank_for(sample, args, device)
    assert bank.num_valid_blocks == sample.K
    assert torch.equal(bits(m(args["prefix_sum"], bank)), bits(want))


FUSED_SAMPLES = [s for s in SAMPLES if s.K < s.cap]  # a full bank takes no snapshot


@pytest.mark.parametrize("with_norm", [False, True], ids=["nonorm", "outnorm"])
@pytest.mark.parametrize("sample", sample_params(FUSED_SAMPLES))
@torch.no_grad()
def test_fused_with_bank_snapshots_into_the_next_slot_and_counts_it(sample: Sample, with_norm: bool, device: str):
    args = sample.make(device)
    m = module_for(sample, args, device)
    norm = RMSNorm(sample.H, eps=1e-5, device=device) if with_norm else None
    if norm is not None:
        norm.weight.copy_(torch.linspace(0.5, 1.5, sample.H))
    addend = torch.randn(sample.T, sample.H, generator=torch.Generator().manual_seed(3)).to(device, sample.dtype)
    bank = bank_for(sample, args, device)
    expected_buffer = bank.storage.clone()
    out, new_prefix = m.fused(args["prefix_sum"], bank, addend=addend, snapshot=True, out_norm=norm)

    # The op, called by hand on a copy of the buffer, with what the module must pass.
    blocks = expected_buffer.view(bank.shape)
    blocks = blocks[: sample.T] if sample.layout == "tokenmajor" else blocks[:, : sample.T].transpose(0, 1)
    want_out, want_prefix = k3_ops.fused_attn_res(
        args["prefix_sum"], addend, blocks, m.norm.weight, m.proj.weight, sample.K, sample.eps,
        block_write_idx=sample.K, out_norm_weight=None if norm is None else norm.weight,
        out_norm_eps=None if norm is None else 1e-5)
    assert torch.equal(bits(out), bits(want_out)) and torch.equal(bits(new_prefix), bits(want_prefix))
    assert torch.equal(bits(bank.storage), bits(expected_buffer)), "bank bytes differ from the op's own write"
    assert bank.num_valid_blocks == sample.K + 1
    assert torch.equal(bits(bank.view(sample.T)[:, sample.K]), bits(new_prefix))


@pytest.mark.parametrize("layout", ["tokenmajor", "blockmajor"])
@torch.no_grad()
def test_fused_equals_unfused_module_pipeline(layout: str):
    """CPU: add + append + mix + RMSNorm through the modules == one fused call, bit for bit."""
    sample = Sample(T=6, K=2, cap=4, H=64, dtype=torch.bfloat16, layout=layout)
    args = sample.make("cpu")
    m = module_for(sample, args, "cpu")
    norm = RMSNorm(sample.H, eps=1e-5)
    addend = torch.randn(sample.T, sample.H, generator=torch.Generator().manual_seed(3)).to(sample.dtype)
    fused_bank, unfused_bank = bank_for(sample, args, "cpu"), bank_for(sample, args, "cpu")
    out, new_prefix = m.fused(args["prefix_sum"], fused_bank, addend=addend, snapshot=True, out_norm=norm)
    prefix = args["prefix_sum"] + addend
    mix = m(prefix, unfused_bank)  # the snapshot lands after the mix in the schedule; the mix never reads it
    unfused_bank.append(prefix)
    assert torch.equal(bits(new_prefix), bits(prefix))
    assert torch.equal(bits(out), bits(norm(mix)))
    assert torch.equal(bits(fused_bank.storage), bits(unfused_bank.storage))
    assert fused_bank.num_valid_blocks == unfused_bank.num_valid_blocks == sample.K + 1


@torch.no_grad()
def test_fused_with_raw_buffer_writes_slot_k_and_leaves_counting_to_the_caller():
    sample = Sample(T=4, K=1, cap=3, H=32, dtype=torch.float32)
    args = sample.make("cpu")
    m = module_for(sample, args, "cpu")
    buf = args["block_residual"]
    out, new_prefix = m.fused(args["prefix_sum"], buf, sample.K, snapshot=True)
    assert torch.equal(buf[:, sample.K], new_prefix)
    assert buf[:, sample.K + 1:].isnan().all(), "only slot K may be written"
    assert torch.equal(out, m(new_prefix, buf, sample.K))


@pytest.mark.parametrize("layout", ["tokenmajor", "blockmajor"])
def test_bank_views_share_the_one_preallocated_storage(layout: str, device: str):
    T_max, C, H = 9, 4, 16
    bank = ResidualBank(T_max, C, H, layout=layout, dtype=torch.bfloat16, device=device)
    storage, ptr = bank.storage, bank.storage.data_ptr()
    assert bank.buffer.shape == ((T_max, C, H) if layout == "tokenmajor" else (C, T_max, H))
    for step, T in enumerate([1, 7, 9, 3]):
        bank.reset()
        assert bank.num_valid_blocks == 0
        x = torch.full((T, H), float(step + 1), dtype=torch.bfloat16, device=device)
        bank.append(x)
        bank.append(2 * x)
        v = bank.view(T)
        assert v.shape == (T, C, H)
        assert v.stride() == ((C * H, H, 1) if layout == "tokenmajor" else (H, T_max * H, 1))
        assert v.data_ptr() == ptr and v._base is storage, "view(T) must be a view of the storage, not a copy"
        assert torch.equal(v[:, 0], x) and torch.equal(v[:, 1], 2 * x)
        assert bank.num_valid_blocks == 2
    assert bank.storage is storage and bank.storage.data_ptr() == ptr, "the storage was reallocated"


def test_bank_stays_out_of_the_state_dict_and_follows_to():
    bank = ResidualBank(4, 2, 8)
    assert bank.state_dict() == {}
    bank.to(torch.float64)
    assert bank.buffer.dtype == torch.float64 and bank.slot_index.dtype == torch.int64


def test_rms_norm_is_the_reference_formula():
    norm = RMSNorm(24, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 24))
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(bits(norm(x)), bits(rms_norm_reference(x, norm.weight, 1e-5)))
    assert norm(x).dtype == torch.bfloat16


def test_bad_arguments_are_rejected_with_the_value():
    bank = ResidualBank(8, 2, 16)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, max_num_tokens=8\], got 9"):
        bank.view(9)
    bank.append(torch.zeros(3, 16))
    bank.append(torch.zeros(3, 16))
    with pytest.raises(RuntimeError, match=r"num_valid_blocks must be < capacity=2 to take a snapshot, got 2"):
        bank.append(torch.zeros(3, 16))
    with pytest.raises(ValueError, match=r"layout must be one of \('tokenmajor', 'blockmajor'\), got 'rowmajor'"):
        ResidualBank(8, 2, 16, layout="rowmajor")
    with pytest.raises(ValueError, match=r"capacity must be >= 1, got 0"):
        ResidualBank(8, 0, 16)
    m = AttnRes(16)
    with torch.no_grad():
        with pytest.raises(TypeError, match=r"num_valid_blocks is required .* got None"):
            m(torch.zeros(3, 16), bank.view(3))
        with pytest.raises(TypeError,
                           match=r"num_valid_blocks must be None when a ResidualBank is passed .*: 2\), got 1"):
            m(torch.zeros(3, 16), bank, 1)
        with pytest.raises(RuntimeError, match=r"ResidualBank is full"):
            m.fused(torch.zeros(3, 16), bank, snapshot=True)
    assert bank.num_valid_blocks == 2, "a refused snapshot must not be counted"
