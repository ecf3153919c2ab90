"""k3_ops.vllm_ascend: vLLM-Ascend's Kimi K3 AttnRes call forms replayed with the argument lists its models pass,
on the CPU kernels, on the CUDA launch policy under the Triton interpreter, and on the simulated Ascend device
(PrivateUse1, tests/test_npu_simulated.py). vLLM-Ascend cannot be installed here (its build needs CANN); the call
sites were read from its public sources:

- form 1, release line: vllm-project/vllm-ascend, branch releases/v0.26.0rc at cf0baa38dfb2aef4faf6baaaa97beb4ac974ae35,
  vllm_ascend/models/kimi_k3.py: ``_apply_attention_residual(prefix_sum, block_residual, projection, norm)`` calls
  the module global ``apply_attn_res(prefix_sum, block_residual, projection, norm)``
  (vllm_ascend/ops/triton/kimi_k3/attention_residual.py, K = ``block_residual.shape[1]``), then, with flash-comm on,
  ``torch.ops.vllm.maybe_chunk_residual(prefix_sum, mixed)``; the decoder layer grows the buffer with ``torch.cat``
  and mixes only when ``block_residual.shape[1] > 0``; the model's last mix uses ``output_attn_res_proj`` /
  ``output_attn_res_norm``. The same wrapper in vllm-ascend/vllm-ascend-kimi-k3 at
  0fd07898ed0fc4e09a059754211a447c8ccad132, vllm_ascend/models/kimi_k3_text.py; pull request #13763 (head
  2224b5e99827456e8e4d5fd60ece9d4267f5fdea) puts the AscendC op's first form inside it on A3 / A5:
  ``torch.ops._C_ascend.attn_res_fwd(prefix_sum, block_residual, projection.weight, norm.weight,
  norm.variance_epsilon)``.
- form 2, main line: pull request #14454 (head e4f0a9e5484c472cabbc76583d959996356e3076),
  vllm_ascend/models/kimi_k3.py: ``_apply_ascend_attn_res(prefix_sum, block_residual, proj, norm,
  num_valid_blocks)`` returns ``prefix_sum`` when K <= 0, else the Triton ``apply_attn_res(prefix_sum,
  block_residual, proj, norm, num_valid_blocks)``; the layer passes ``self.prev_valid_blocks = cdiv(layer_idx, B)``,
  snapshots with ``block_residual[:, self.block_write_idx, :].copy_(prefix_sum)`` and mixes before the MLP with
  ``prev_valid_blocks + is_block_write_layer``; the model preallocates ``cdiv(end_layer, B)`` slots and makes its last
  mix with K = that count. Pull request #14745 (head 6dd7f644c504a9b4fb3ef24d1ecfa7c1c2551991) adds the flash-comm
  step to ``_apply_ascend_attn_res``.
- form 3, the AscendC op's fused form: zzhx1/vllm-ascend at 9c1c455d94d139e4dbb6a906d574c66395762b09,
  csrc/attention/attn_res_fwd/README.md and attn_res_fwd_common.h: ``attn_res_fwd(prefix_sum, addend,
  block_residual, proj_weight, norm_weight, norm_eps, num_valid_blocks, output_norm_weight=None,
  output_norm_eps=1e-5, block_write_idx=-1, return_materialized=False, mix=True, optimize_prefill=False) ->
  (output, raw_prefix, materialized)``; its nightly test calls it as ``(prefix, addend, bank, projection, gamma,
  1e-5, valid, output_gamma, 1e-5, write_idx, True, mix, optimize_prefill=...)``.
- form 4: the Triton ``apply_attn_res(prefix_sum, block_residual, proj, norm, *, addend, sum_out, out_norm)`` of
  pull request #15501 (its description: the add rounded once to the storage dtype, the following RMSNorm fused).

Contract checked: the new prefix, the snapshot row and every byte outside it bit for bit; aliases by identity
(``is``) and storage pointers; outputs within the accuracy contract (tests/test_kernels_interpreter.py's
``check_contract``: at most 1.25x the FP32 formula's error against float64, with the interpreter's bf16
truncation accounted for) and bit-equal to the reference on the CPU kernels, where the output norm's rounding point
(form 3: the bf16 mix; form 4: the FP32 mix) is pinned bit for bit.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import pytest
import torch

from k3_ops import reference, vllm_ascend
from k3_ops.testing import assert_close

from conftest import DTYPE_NAMES, requires_cuda, requires_interpreter
from test_fused import NORM_RTOL
from test_kernels_interpreter import check_contract, truncate_to_bf16
from test_npu_simulated import NpuTensor, simulated_npu  # noqa: F401  (the fixture)


def _have_full_op() -> bool:
    return hasattr(torch.ops.kimi_k3.fused_attn_res, "full")


requires_full = pytest.mark.skipif(not _have_full_op(),
                                   reason="kimi_k3::fused_attn_res.full is not registered in this build of k3_ops")


# --- modules shaped like vLLM's, and the devices -----------------------------------------------------------
class _RMSNorm:
    """What the drop-ins read of vLLM's RMSNorm: .weight [H] in the model dtype and .variance_epsilon. (A plain
    object: the simulated device's tensors cannot be nn.Parameters.)"""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.variance_epsilon = weight, eps


class _ReplicatedLinear:
    """What the drop-ins read of vLLM's ReplicatedLinear(H, 1, bias=False): .weight [1, H]."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


@dataclass(frozen=True)
class Call:
    """One AttnRes call site: T tokens, K valid blocks of a C-slot buffer (NaN beyond K), hidden size H."""

    T: int
    K: int
    C: int
    H: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def id(self) -> str:
        return f"T{self.T}-K{self.K}-cap{self.C}-H{self.H}-{DTYPE_NAMES[self.dtype]}"

    def make(self, seed: int = 0) -> dict:
        """CPU tensors and modules in the model dtype, as vLLM-Ascend's bf16 model holds its weights."""
        g = torch.Generator().manual_seed(seed)
        T, K, C, H = self.T, self.K, self.C, self.H
        bank = torch.randn(T, C, H, generator=g) * torch.linspace(0.5, 2.0, C).view(1, C, 1)
        bank[:, K:] = float("nan")  # unused capacity (the snapshot slot included) must never be read
        return dict(
            prefix=(torch.randn(T, H, generator=g) * 1.5).to(self.dtype),
            addend=(torch.randn(T, H, generator=g) * 0.7).to(self.dtype),
            bank=bank.to(self.dtype),
            proj=_ReplicatedLinear((torch.randn(1, H, generator=g) * (2.0 / math.sqrt(H))).to(self.dtype)),
            norm=_RMSNorm((1 + 0.1 * torch.randn(H, generator=g)).to(self.dtype), 1e-6),
            out_norm=_RMSNorm((1 + 0.1 * torch.randn(H, generator=g)).to(self.dtype), 1e-5),
        )


def _to(args: dict, device: torch.device | str) -> dict:
    """The same call on another device: tensors moved, modules rebuilt around moved weights."""
    moved = {}
    for name, value in args.items():
        if isinstance(value, _RMSNorm):
            value = _RMSNorm(value.weight.to(device), value.variance_epsilon)
        elif isinstance(value, _ReplicatedLinear):
            value = _ReplicatedLinear(value.weight.to(device))
        elif isinstance(value, torch.Tensor):
            value = value.to(device)
        moved[name] = value
    return moved


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.raw.clone() if isinstance(t, NpuTensor) else t.detach().to("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = _cpu(t).contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _ptr(t: torch.Tensor) -> int:
    return (t.raw if isinstance(t, NpuTensor) else t).untyped_storage().data_ptr()


class Backend:
    """Where the drop-ins' kimi_k3 calls run: ``cpu`` (the CPU kernels: the reference), ``interpreter`` (the CPU
    dispatch key pointed at the CUDA kernels, run by the Triton interpreter on CPU tensors) or ``npu`` (the simulated
    PrivateUse1 device, the NPU launch policy under the interpreter)."""

    def __init__(self, name: str, device: torch.device | str) -> None:
        self.name, self.device = name, device
        self.calls: list[str] = []  # interpreter: the kimi_k3 ops that reached the CUDA launch policy

    def put(self, args: dict) -> dict:
        return args if self.device == "cpu" else _to(args, self.device)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device == "cpu" else t.to(self.device)

    @property
    def exact(self) -> bool:
        """Whether the kernels compute exactly what the reference computes (and round bf16 to nearest)."""
        return self.name == "cpu"


_REDIRECTED = ("attn_res", "fused_attn_res.full")


@pytest.fixture(params=["cpu", pytest.param("interpreter", marks=[requires_interpreter, pytest.mark.interpreter]),
                        pytest.param("npu", marks=[requires_interpreter, pytest.mark.interpreter]),
                        pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def backend(request):
    if request.param in ("cpu", "cuda"):
        yield Backend(request.param, request.param)
        return
    if request.param == "npu":
        yield Backend("npu", request.getfixturevalue("simulated_npu").device)
        return
    import warnings

    lib = torch.library.Library("kimi_k3", "IMPL")
    calls = (backend := Backend("interpreter", "cpu")).calls

    def redirect(name: str):
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.kimi_k3, packet), overload or "default")
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)

        def kernel(*args, **kwargs):
            calls.append(name)
            return op.redispatch(keys, *args, **kwargs)
        return kernel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name in _REDIRECTED:
            if name != "fused_attn_res.full" or _have_full_op():
                lib.impl(name, redirect(name), "CPU")
    try:
        yield backend
    finally:
        lib._destroy()  # the reference CPU kernels are registered again


def _check_mix(backend: Backend, out: torch.Tensor, prefix: torch.Tensor, bank: torch.Tensor, args: dict, K: int,
               what: str) -> None:
    """out is the mix of bank[:, :K] and prefix (CPU tensors): the reference bit for bit on the CPU kernels, the
    accuracy contract elsewhere."""
    plain = dict(prefix_sum=prefix, block_residual=bank, norm_weight=args["norm"].weight,
                 proj_weight=args["proj"].weight, num_valid_blocks=K, eps=args["norm"].variance_epsilon)
    out = _cpu(out)
    assert backend.name != "interpreter" or backend.calls, f"{what}: the call never reached the CUDA launch policy"
    if backend.exact or K == 0:
        assert torch.equal(_bits(out), _bits(reference.attn_res_reference(**plain))), what
    else:
        check_contract(out, plain, what)


# --- form 1: the release line's Triton global and its wrapper ----------------------------------------------
FORM1 = [Call(T=5, K=3, C=3, H=7168), Call(T=9, K=1, C=1, H=96), Call(T=4, K=2, C=2, H=64, dtype=torch.float32)]


@pytest.mark.parametrize("call", [pytest.param(c, id=c.id) for c in FORM1])
@torch.no_grad()
def test_form1_apply_attn_res_takes_every_slot(backend: Backend, call: Call):
    """``apply_attn_res(prefix_sum, block_residual, proj, norm)``: K = block_residual.size(1) (a torch.cat-grown
    buffer, every slot valid); a new [T, H] tensor; the inputs untouched."""
    cpu_args = call.make()
    args = backend.put(cpu_args)
    prefix_before, bank_before = _bits(args["prefix"]), _bits(args["bank"])
    out = vllm_ascend.apply_attn_res(args["prefix"], args["bank"], args["proj"], args["norm"])
    assert out.shape == (call.T, call.H) and out.dtype == call.dtype and _ptr(out) != _ptr(args["prefix"])
    assert torch.equal(_bits(args["prefix"]), prefix_before) and torch.equal(_bits(args["bank"]), bank_before)
    _check_mix(backend, out, cpu_args["prefix"], cpu_args["bank"], cpu_args, call.C, f"{backend.name}:{call.id}")


class _FlashCommCtx:
    """vLLM-Ascend's ``_EXTRA_CTX`` as the wrapper reads it: ``flash_comm_v1_enabled``, read at every call."""

    def __init__(self, enabled: bool) -> None:
        self.flash_comm_v1_enabled = enabled


_SCHEMAS: list[torch.library.Library] = []  # schemas defined here live as long as the process


def define_chunk_residual_op() -> None:
    """The schema of vLLM-Ascend's ``torch.ops.vllm.maybe_chunk_residual(x, residual)``, once per process."""
    if not hasattr(torch.ops, "vllm") or not hasattr(torch.ops.vllm, "maybe_chunk_residual"):
        schema = torch.library.Library("vllm", "FRAGMENT")
        schema.define("maybe_chunk_residual(Tensor x, Tensor residual) -> Tensor")
        schema.impl("maybe_chunk_residual", lambda x, residual: torch.empty_like(residual), "Meta")
        _SCHEMAS.append(schema)


@pytest.fixture
def chunk_residual_op():
    """``torch.ops.vllm.maybe_chunk_residual(x, residual)``, as vLLM-Ascend registers it (PrivateUse1 there; every
    device here), recording its calls; its value marks the result as the op's (residual * 2)."""
    calls = []
    define_chunk_residual_op()
    lib = torch.library.Library("vllm", "IMPL")

    def kernel(x, residual):
        calls.append((x, residual))
        return residual * 2

    for key in ("CPU", "CUDA", "PrivateUse1"):
        lib.impl("maybe_chunk_residual", kernel, key)
    yield calls
    lib._destroy()


@pytest.mark.parametrize("flash_comm", [False, True], ids=["flash-comm-off", "flash-comm-on"])
@torch.no_grad()
def test_form1_wrapper_keeps_the_flash_comm_step(backend: Backend, flash_comm: bool, chunk_residual_op):
    """``_apply_attention_residual``: the mix, then ``maybe_chunk_residual(prefix_sum, mixed)`` exactly when the
    model's ``_EXTRA_CTX.flash_comm_v1_enabled`` says so."""
    call = Call(T=6, K=2, C=2, H=64)
    cpu_args = call.make()
    args = backend.put(cpu_args)
    out = vllm_ascend.apply_attention_residual(args["prefix"], args["bank"], args["proj"], args["norm"],
                                               extra_ctx=_FlashCommCtx(flash_comm))
    mix = vllm_ascend.apply_attn_res(args["prefix"], args["bank"], args["proj"], args["norm"])
    if flash_comm:
        assert len(chunk_residual_op) == 1 and chunk_residual_op[0][0] is args["prefix"]
        assert torch.equal(_bits(out), _bits(_cpu(mix) * 2)), "the result must be the chunking op's"
    else:
        assert chunk_residual_op == [] and torch.equal(_bits(out), _bits(mix))
    _check_mix(backend, mix, cpu_args["prefix"], cpu_args["bank"], cpu_args, call.C, f"{backend.name}:{call.id}")


# --- form 2: the main line's preallocated buffer -----------------------------------------------------------
FORM2 = [Call(T=5, K=3, C=8, H=7168), Call(T=7, K=1, C=2, H=96), Call(T=3, K=5, C=5, H=64, dtype=torch.float32)]


@pytest.mark.parametrize("call", [pytest.param(c, id=c.id) for c in FORM2])
@torch.no_grad()
def test_form2_reads_only_the_valid_slots(backend: Backend, call: Call):
    """``_apply_ascend_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks)`` and the Triton global it
    calls with K as a fifth argument: the mix of the first K slots (NaN beyond them), the buffer untouched."""
    cpu_args = call.make()
    args = backend.put(cpu_args)
    bank_before = _bits(args["bank"])
    out = vllm_ascend.apply_ascend_attn_res(args["prefix"], args["bank"], args["proj"], args["norm"], call.K)
    same = vllm_ascend.apply_attn_res(args["prefix"], args["bank"], args["proj"], args["norm"], call.K)
    assert torch.equal(_bits(out), _bits(same)) and torch.equal(_bits(args["bank"]), bank_before)
    _check_mix(backend, out, cpu_args["prefix"], cpu_args["bank"], cpu_args, call.K, f"{backend.name}:{call.id}")


@pytest.mark.parametrize("K", [0, -1], ids=["K0", "Kneg"])
def test_form2_returns_prefix_sum_itself_without_blocks(backend: Backend, K: int, chunk_residual_op):
    """K <= 0 (the first layer's attention-side mix): prefix_sum itself, no kernel, no copy, no flash-comm step."""
    args = backend.put(Call(T=4, K=0, C=3, H=64).make())
    out = vllm_ascend.apply_ascend_attn_res(args["prefix"], args["bank"], args["proj"], args["norm"], K,
                                            extra_ctx=_FlashCommCtx(True))
    assert out is args["prefix"] and chunk_residual_op == []


@torch.no_grad()
def test_form2_main_line_layer_schedule(backend: Backend):
    """The main line's layer sequence over a block boundary, with its argument lists: the attention-side mix with
    ``prev_valid_blocks``, the snapshot by ``copy_``, the MLP-side mix with one more block, and the model's last mix
    with every block; each equals the reference on the same buffer state (block size 2, 4 layers, 2 slots)."""
    H, T, B, L = 64, 3, 2, 4
    C = -(-L // B)
    cpu_args = Call(T=T, K=0, C=C, H=H).make(seed=3)
    args = backend.put(cpu_args)
    bank = args["bank"]
    hidden, g = args["prefix"], torch.Generator().manual_seed(5)
    for layer_idx in range(L):
        prev_valid_blocks = -(-layer_idx // B)
        write = layer_idx % B == 0
        prefix_sum = hidden
        mixed = vllm_ascend.apply_ascend_attn_res(prefix_sum, bank, args["proj"], args["norm"], prev_valid_blocks)
        if prev_valid_blocks == 0:
            assert mixed is prefix_sum
        else:
            _check_mix(backend, mixed, _cpu(prefix_sum), _cpu(bank), cpu_args, prev_valid_blocks,
                       f"{backend.name}: layer {layer_idx} attention side")
        if write:
            bank[:, layer_idx // B, :].copy_(prefix_sum)
            assert torch.equal(_bits(bank[:, layer_idx // B]), _bits(prefix_sum))
        attention_output = backend.tensor((torch.randn(T, H, generator=g) * 0.5).to(cpu_args["prefix"].dtype))
        prefix_sum = attention_output if write else prefix_sum + attention_output
        mlp_valid = prev_valid_blocks + (1 if write else 0)
        mixed = vllm_ascend.apply_ascend_attn_res(prefix_sum, bank, args["proj"], args["norm"], mlp_valid)
        _check_mix(backend, mixed, _cpu(prefix_sum), _cpu(bank), cpu_args, mlp_valid,
                   f"{backend.name}: layer {layer_idx} MLP side")
        hidden = prefix_sum + mixed * 0.25
    final = vllm_ascend.apply_ascend_attn_res(hidden, bank, args["proj"], args["norm"], C)
    _check_mix(backend, final, _cpu(hidden), _cpu(bank), cpu_args, C, f"{backend.name}: the model's last mix")


# --- form 3: the AscendC op's fused form -------------------------------------------------------------------
@dataclass(frozen=True)
class Fwd:
    """One ``attn_res_fwd`` call: with or without addend, output norm, snapshot, materialized output, mix."""

    call: Call
    addend: bool = True
    norm: bool = True
    write: bool = True
    materialized: bool = False
    mix: bool = True

    @property
    def id(self) -> str:
        flags = [("add" if self.addend else "noadd"), ("norm" if self.norm else "nonorm"),
                 ("write" if self.write else "nowrite"), ("mat" if self.materialized else "nomat"),
                 ("mix" if self.mix else "nomix")]
        return f"{self.call.id}-{'-'.join(flags)}"


FORM3 = [
    Fwd(Call(T=3, K=4, C=8, H=7168)),  # the K3 hidden size, decode-sized
    Fwd(Call(T=6, K=2, C=4, H=96), materialized=True),  # speculative decoding captures the pre-norm mix
    Fwd(Call(T=5, K=3, C=5, H=64), addend=False, materialized=True),  # raw_prefix is prefix itself
    Fwd(Call(T=4, K=0, C=3, H=64), norm=False),  # the first layer: nothing to mix yet
    Fwd(Call(T=5, K=2, C=4, H=64), addend=True, norm=False, write=False, materialized=True),
    Fwd(Call(T=4, K=3, C=4, H=64, dtype=torch.float32), norm=True, write=True),
    Fwd(Call(T=5, K=2, C=4, H=96), mix=False),  # a pipeline-parallel boundary: the add and the snapshot
    Fwd(Call(T=3, K=1, C=3, H=64), mix=False, addend=False, norm=False, materialized=True),
]


def _expected_fwd(case: Fwd, cpu_args: dict) -> dict:
    """Form 3 on the CPU reference: raw prefix, snapshot, the bf16-rounded mix, the norm of that rounded mix."""
    prefix, bank = cpu_args["prefix"], cpu_args["bank"].clone()
    raw = prefix + cpu_args["addend"] if case.addend else prefix.clone()
    if case.write:
        bank[:, case.call.K] = raw
    K = case.call.K if case.mix else 0
    mix = reference.attn_res_reference(raw, bank, cpu_args["norm"].weight, cpu_args["proj"].weight, K,
                                       cpu_args["norm"].variance_epsilon)
    out = reference.rms_norm_reference(mix, cpu_args["out_norm"].weight, cpu_args["out_norm"].variance_epsilon) \
        if case.norm else mix
    return dict(raw=raw, bank=bank, mix=mix, out=out)


@requires_full
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in FORM3])
@torch.no_grad()
def test_form3_attn_res_fwd(backend: Backend, case: Fwd):
    """``attn_res_fwd(prefix, addend, bank, projection, gamma, eps, valid, output_gamma, out_eps, write_idx,
    return_materialized, mix, optimize_prefill=...)``, positionally as the AscendC op's test calls it: raw_prefix bit
    for bit (IS prefix without an addend), the snapshot row and every other byte of the bank, prefix and addend
    untouched, materialized IS output unless requested, the norm of the bf16-rounded mix."""
    call = case.call
    cpu_args = call.make(seed=11)
    want = _expected_fwd(case, cpu_args)
    args = backend.put(cpu_args)
    prefix, bank = args["prefix"], args["bank"]
    addend = args["addend"] if case.addend else None
    prefix_before, addend_before, bank_before = _bits(prefix), _bits(args["addend"]), _bits(bank)
    write_idx = call.K if case.write else -1
    output, raw_prefix, materialized = vllm_ascend.attn_res_fwd(
        prefix, addend, bank, args["proj"].weight, args["norm"].weight, args["norm"].variance_epsilon, call.K,
        args["out_norm"].weight if case.norm else None, args["out_norm"].variance_epsilon, write_idx,
        case.materialized, case.mix, optimize_prefill=call.T > 4)
    what = f"{backend.name}:{case.id}"

    # Aliases, by identity and by storage.
    if case.addend:
        assert raw_prefix is not prefix and _ptr(raw_prefix) not in (_ptr(prefix), _ptr(bank), _ptr(output))
    else:
        assert raw_prefix is prefix, f"{what}: without an addend raw_prefix must be prefix itself"
    if case.materialized:
        assert materialized is not output and _ptr(materialized) != _ptr(output)
    else:
        assert materialized is output, f"{what}: materialized must be output when not requested"
    assert output.shape == (call.T, call.H) and output.dtype == call.dtype and _ptr(output) != _ptr(prefix)

    # What is written: the snapshot row only; prefix and addend never.
    assert torch.equal(_bits(prefix), prefix_before) and torch.equal(_bits(args["addend"]), addend_before)
    others = [i for i in range(call.C) if i != write_idx]
    assert torch.equal(_bits(bank)[:, others], bank_before[:, others]), f"{what}: bytes outside the slot changed"
    if case.write:
        assert torch.equal(_bits(bank[:, write_idx]), _bits(raw_prefix)), f"{what}: snapshot row != raw_prefix"

    # The add: torch's, rounded to the I/O dtype (the interpreter may truncate a bf16 store instead).
    if backend.exact or not case.addend or call.dtype != torch.bfloat16:
        assert torch.equal(_bits(raw_prefix), _bits(want["raw"])), f"{what}: raw_prefix != round(prefix + addend)"
    else:
        exact = cpu_args["prefix"].float() + cpu_args["addend"].float()
        ok = (_bits(raw_prefix) == _bits(want["raw"])) | (_bits(raw_prefix) == _bits(truncate_to_bf16(exact)))
        assert bool(ok.all()), f"{what}: raw_prefix is neither rounding of prefix + addend"

    # The pre-norm mix, then the output norm of that rounded mix.
    raw_cpu, bank_cpu = _cpu(raw_prefix), _cpu(bank)
    mix = materialized if case.materialized else (output if not case.norm else None)
    if mix is not None:
        _check_mix(backend, mix, raw_cpu, bank_cpu, cpu_args, call.K if case.mix else 0, f"{what}: materialized")
    if case.norm:
        if backend.exact:
            assert torch.equal(_bits(output), _bits(want["out"])), f"{what}: out != rms_norm(bf16 mix)"
        else:
            rounded = _cpu(materialized) if case.materialized else reference.attn_res_reference(
                raw_cpu, bank_cpu, cpu_args["norm"].weight, cpu_args["proj"].weight, call.K if case.mix else 0,
                cpu_args["norm"].variance_epsilon)
            expected = reference.rms_norm_reference(rounded, cpu_args["out_norm"].weight,
                                                    cpu_args["out_norm"].variance_epsilon)
            rtol = NORM_RTOL[call.dtype] * (2 if call.dtype == torch.bfloat16 else 1)
            assert_close(_cpu(output), expected, atol=rtol, rtol=rtol, what=f"{what}: out vs rms_norm(mix)")


@requires_full
@torch.no_grad()
def test_form3_and_form4_norm_different_mixes():
    """The output norm's rounding point, bit for bit on the CPU kernels: form 3 normalises the bf16-rounded mix
    (the AscendC op), form 4 the FP32 mix (vLLM's Triton port); on these inputs the two differ."""
    call = Call(T=8, K=3, C=4, H=256)
    args = call.make(seed=2)
    fwd, _, _ = vllm_ascend.attn_res_fwd(args["prefix"], args["addend"], args["bank"].clone(), args["proj"].weight,
                                         args["norm"].weight, args["norm"].variance_epsilon, call.K,
                                         args["out_norm"].weight, args["out_norm"].variance_epsilon)
    fused = vllm_ascend.apply_attn_res(args["prefix"], args["bank"], args["proj"], args["norm"], call.K,
                                       addend=args["addend"], out_norm=args["out_norm"])
    common = (args["prefix"], args["addend"], args["bank"].clone(), args["norm"].weight, args["proj"].weight, call.K,
              args["norm"].variance_epsilon, -1, args["out_norm"].weight, args["out_norm"].variance_epsilon)
    rounded, _ = reference.fused_attn_res_reference(*common, round_mix=True)
    fp32, _ = reference.fused_attn_res_reference(*common, round_mix=False)
    assert torch.equal(_bits(fwd), _bits(rounded)) and torch.equal(_bits(fused), _bits(fp32))
    assert not torch.equal(_bits(fwd), _bits(fused)), "the inputs do not tell the two rounding points apart"


@pytest.mark.parametrize("valid, write_idx, message", [
    (3, 1, r"block_write_idx must be -1 or in \[num_valid_blocks=3, block_residual.size\(1\)=4\), got 1"),
    (5, -1, r"num_valid_blocks must be in \[0, block_residual.size\(1\)=4\], got 5"),
], ids=["slot-below-valid", "valid-over-capacity"])
def test_form3_without_mix_checks_the_callers_slot(valid: int, write_idx: int, message: str):
    """mix=False still checks the K and the snapshot slot the caller passed, before anything is written."""
    args = Call(T=3, K=3, C=4, H=64).make()
    bank_before = _bits(args["bank"])
    with pytest.raises(ValueError, match=message):
        vllm_ascend.attn_res_fwd(args["prefix"], args["addend"], args["bank"], args["proj"].weight,
                                 args["norm"].weight, 1e-6, valid, None, 1e-5, write_idx, False, False)
    assert torch.equal(_bits(args["bank"]), bank_before)


def test_form3_first_form_mixes_the_slice_it_is_given(backend: Backend):
    """The AscendC op's first form, ``attn_res_fwd(prefix_sum, block_residual[:, :K], proj.weight, norm.weight,
    eps)`` (pull request #13763, inside ``_apply_attention_residual``): every slot of the slice it is given."""
    call = Call(T=4, K=2, C=5, H=64)
    cpu_args = call.make()
    args = backend.put(cpu_args)
    out = vllm_ascend.attn_res_fwd_mix(args["prefix"], args["bank"][:, :call.K], args["proj"].weight,
                                       args["norm"].weight, args["norm"].variance_epsilon)
    _check_mix(backend, out, cpu_args["prefix"], cpu_args["bank"], cpu_args, call.K, f"{backend.name}:{call.id}")


# --- form 4: the Triton global with the add and the following norm fused -----------------------------------
FORM4 = [Call(T=3, K=4, C=8, H=7168), Call(T=6, K=2, C=3, H=96), Call(T=5, K=0, C=2, H=64),
         Call(T=4, K=3, C=3, H=64, dtype=torch.float32)]


@requires_full
@pytest.mark.parametrize("sum_out", [True, False], ids=["sum_out", "no-sum_out"])
@pytest.mark.parametrize("call", [pytest.param(c, id=c.id) for c in FORM4])
@torch.no_grad()
def test_form4_addend_sum_out_out_norm(backend: Backend, call: Call, sum_out: bool):
    """``apply_attn_res(prefix_sum, block_residual, proj, norm, *, addend, sum_out, out_norm)``: bf16(prefix + addend)
    stored INTO the caller's sum_out (its storage, every element), the mix of that sum, the norm of the FP32 mix;
    only the output returned; prefix, addend and the buffer untouched."""
    cpu_args = call.make(seed=7)
    args = backend.put(cpu_args)
    prefix, addend, bank = args["prefix"], args["addend"], args["bank"]
    before = {name: _bits(args[name]) for name in ("prefix", "addend", "bank")}
    target = torch.full_like(prefix, float("nan")) if sum_out else None  # poisoned: every element must be written
    target_ptr = _ptr(target) if sum_out else None
    out = vllm_ascend.apply_attn_res(prefix, bank, args["proj"], args["norm"], call.K, addend=addend,
                                     sum_out=target, out_norm=args["out_norm"])
    what = f"{backend.name}:{call.id}"
    assert isinstance(out, torch.Tensor) and out.shape == (call.T, call.H) and out.dtype == call.dtype
    assert all(torch.equal(_bits(args[name]), before[name]) for name in before), f"{what}: an input was written"
    want_sum = cpu_args["prefix"] + cpu_args["addend"]
    if sum_out:
        assert _ptr(target) == target_ptr and _ptr(out) != target_ptr
        if backend.exact or call.dtype != torch.bfloat16:
            assert torch.equal(_bits(target), _bits(want_sum)), f"{what}: sum_out != round(prefix + addend)"
        else:
            exact = cpu_args["prefix"].float() + cpu_args["addend"].float()
            ok = (_bits(target) == _bits(want_sum)) | (_bits(target) == _bits(truncate_to_bf16(exact)))
            assert bool(ok.all()), f"{what}: sum_out is neither rounding of prefix + addend"
    summed = _cpu(target) if sum_out else want_sum
    expected, _ = reference.fused_attn_res_reference(summed, None, cpu_args["bank"], cpu_args["norm"].weight,
                                                     cpu_args["proj"].weight, call.K,
                                                     cpu_args["norm"].variance_epsilon, -1,
                                                     cpu_args["out_norm"].weight,
                                                     cpu_args["out_norm"].variance_epsilon, round_mix=False)
    if backend.exact:
        assert torch.equal(_bits(out), _bits(expected)), f"{what}: out != rms_norm(FP32 mix of prefix + addend)"
    else:
        rtol = NORM_RTOL[call.dtype] * (2 if call.dtype == torch.bfloat16 else 1)
        assert_close(_cpu(out), expected, atol=rtol, rtol=rtol, what=what)


def test_modules_keep_their_epsilon_names():
    """The modules' epsilon: vLLM's ``variance_epsilon``, or ``eps`` (torch's RMSNorm)."""
    call = Call(T=2, K=1, C=1, H=32, dtype=torch.float32)
    args = call.make()
    torch_norm = types.SimpleNamespace(weight=args["norm"].weight, eps=args["norm"].variance_epsilon)
    a = vllm_ascend.apply_attn_res(args["prefix"], args["bank"], args["proj"], args["norm"])
    b = vllm_ascend.apply_attn_res(args["prefix"], args["bank"], args["proj"], torch_norm)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="norm must carry its epsilon as .variance_epsilon or .eps"):
        vllm_ascend.apply_attn_res(args["prefix"], args["bank"], args["proj"], types.SimpleNamespace(weight=a))


# --- inside torch.compile, as @support_torch_compile traces them ------------------------------------------------
def _compiled_forms(ctx: _FlashCommCtx):
    def form1(prefix, bank, addend, sum_out, proj, norm, out_norm):
        return vllm_ascend.apply_attention_residual(prefix, bank[:, :2], proj, norm, extra_ctx=ctx)

    def form2(prefix, bank, addend, sum_out, proj, norm, out_norm):
        first = vllm_ascend.apply_ascend_attn_res(prefix, bank, proj, norm, 0)
        return vllm_ascend.apply_ascend_attn_res(first + addend, bank, proj, norm, 2, extra_ctx=ctx)

    def form3(prefix, bank, addend, sum_out, proj, norm, out_norm):
        out, raw, mix = vllm_ascend.attn_res_fwd(prefix, addend, bank, proj.weight, norm.weight, 1e-6, 2,
                                                 out_norm.weight, 1e-5, 2, True)
        return out + raw + mix

    def form4(prefix, bank, addend, sum_out, proj, norm, out_norm):
        return vllm_ascend.apply_attn_res(prefix, bank, proj, norm, 2, addend=addend, sum_out=sum_out,
                                          out_norm=out_norm) + sum_out

    return dict(form1=form1, form2=form2, form3=form3, form4=form4)


@pytest.mark.parametrize("flash_comm", [False, True], ids=["flash-comm-off", "flash-comm-on"])
@pytest.mark.parametrize("form", ["form1", "form2", pytest.param("form3", marks=requires_full),
                                  pytest.param("form4", marks=requires_full)])
@torch.no_grad()
def test_drop_ins_trace_in_one_graph(form: str, flash_comm: bool, chunk_residual_op):
    """Each drop-in traced the way vLLM-Ascend's model is (``@support_torch_compile``: dynamo, a dynamic token
    count): one graph, no break (fullgraph), compiled == eager for two token counts."""
    import torch._dynamo

    torch._dynamo.reset()
    fn = _compiled_forms(_FlashCommCtx(flash_comm))[form]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (3, 9):
        args = Call(T=T, K=2, C=3, H=64).make(seed=T)
        inputs = [args["prefix"], args["bank"], args["addend"], torch.zeros_like(args["prefix"]), args["proj"],
                  args["norm"], args["out_norm"]]
        eager_inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        got, want = compiled(*inputs), fn(*eager_inputs)
        assert torch.equal(_bits(got), _bits(want)), f"{form}, T={T}: compiled != eager"
        assert torch.equal(_bits(inputs[1]), _bits(eager_inputs[1])) and torch.equal(_bits(inputs[3]),
                                                                                   _bits(eager_inputs[3]))
    torch._dynamo.reset()
