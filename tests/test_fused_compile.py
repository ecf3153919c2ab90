"""fused_attn_res under torch.compile: the in-place snapshot survives functionalization without a copy.

Method (how "Inductor does not clone or copy the buffer" is shown):
  torch.compile functionalizes the mutable op into ``auto_functionalized`` (which, taken literally, clones
  the buffer, runs the op on the clone and copies the clone back into the graph input); Inductor's reinplace
  pass is what turns that back into one in-place call. We take the wrapper code Inductor generates
  (``torch._inductor.utils.run_and_get_code``; FX-graph caches off so the code is really generated) and
  check that its ``call`` body (1) allocates nothing (no ``empty_strided``: the op allocates its own two
  [T, H] outputs), (2) runs no Inductor kernel (``cpp_fused_*`` / ``triton_*``: these graphs hold nothing
  but the op and views, so any generated kernel is a copy), (3) has no ``clone`` / ``copy_``, and (4) passes
  every fused_attn_res call the caller's buffer itself: a graph input ``argN_1`` or a
  ``reinterpret_tensor`` view of one. ``test_detector_sees_the_copy_when_reinplacing_is_off`` switches the
  reinplace pass off and shows that the same checks then fail (a clone kernel and a copy-back appear), so
  the checks are not vacuous. On CUDA we also measure: the compiled call's peak extra allocation is less
  than the eager call's plus one buffer.

Results (out, new_prefix and the mutated buffer, byte for byte) equal eager, and ``fullgraph=True``
proves there is no graph break. Every layout is covered: a token-major buffer, a block-major buffer passed
as a ``.transpose(0, 1)`` graph input, a block-major storage transposed inside the graph, and the serving
pattern of a preallocated bank sliced to the current token count (dynamic shapes, two calls: snapshot, then
a mix that reads the snapshot).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import k3_ops  # noqa: F401  (registers the kernels)

OP = torch.ops.kimi_k3.fused_attn_res.default
H, CAP, T_MAX, K, EPS = 64, 8, 16, 2, 1e-6


@pytest.fixture(autouse=True)
def fresh_compile():
    # Generated code must come from this test's compile, not from an on-disk FX-graph cache entry (which is
    # keyed on the graph, not on a monkeypatched pass) or an earlier test's dynamo cache.
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


# --- the compiled functions: one per layout -------------------------------------------------------------
def tokenmajor(prefix, addend, buf, nw, pw, onw):
    return OP(prefix, addend, buf, nw, pw, K, EPS, K, onw, None)


def blockmajor_storage(prefix, addend, storage, nw, pw, onw):
    return OP(prefix, addend, storage.transpose(0, 1), nw, pw, K, EPS, K, onw, None)


def _two_layer_step(prefix, addend, buf, nw, pw, onw):
    # Snapshot new_prefix into slot K (block boundary), then a mix over K + 1 blocks that reads it.
    out, new_prefix = OP(prefix, addend, buf, nw, pw, K, EPS, K, onw, None)
    out2, new_prefix2 = OP(new_prefix, out, buf, nw, pw, K + 1, EPS)
    return out2, new_prefix2


def bank_tokenmajor(prefix, addend, bank, nw, pw, onw):
    return _two_layer_step(prefix, addend, bank[: prefix.shape[0]], nw, pw, onw)


def bank_blockmajor(prefix, addend, bank, nw, pw, onw):
    return _two_layer_step(prefix, addend, bank[:, : prefix.shape[0]].transpose(0, 1), nw, pw, onw)


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: object
    buffer: str  # "tokenmajor" [T, C, H] | "blockmajor_view" [C, T, H].transpose(0, 1) | "blockmajor" [C, T, H]
    bank: bool = False  # the buffer has T_MAX tokens; the graph slices it to T
    dynamic: bool = False

    def make(self, device: str, T: int, seed: int = 0) -> tuple:
        g = torch.Generator().manual_seed(seed)
        rows = T_MAX if self.bank else T
        blocks = torch.randn(rows, CAP, H, generator=g)
        blocks[:, K:] = float("nan")  # unused capacity (the snapshot slot included) is NaN-poisoned
        blocks = blocks.to(device=device, dtype=torch.bfloat16)
        if self.buffer == "tokenmajor":
            buf = blocks
        else:
            storage = torch.empty((CAP, rows, H), device=device, dtype=torch.bfloat16)
            storage.copy_(blocks.transpose(0, 1))
            buf = storage.transpose(0, 1) if self.buffer == "blockmajor_view" else storage
        prefix = torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16)
        addend = torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16)
        nw = (1.0 + 0.1 * torch.randn(H, generator=g)).to(device)
        pw = (torch.randn(1, H, generator=g) * 0.25).to(device)
        onw = (1.0 + 0.1 * torch.randn(H, generator=g)).to(device=device, dtype=torch.bfloat16)
        return prefix, addend, buf, nw, pw, onw


SCENARIOS = [
    Scenario("tokenmajor-input", tokenmajor, "tokenmajor"),
    Scenario("blockmajor-view-input", tokenmajor, "blockmajor_view"),
    Scenario("blockmajor-storage-transposed-in-graph", blockmajor_storage, "blockmajor"),
    Scenario("bank-tokenmajor-sliced-dynamic", bank_tokenmajor, "tokenmajor", bank=True, dynamic=True),
    Scenario("bank-blockmajor-sliced-dynamic", bank_blockmajor, "blockmajor", bank=True, dynamic=True),
]


# --- the code inspection ---------------------------------------------------------------------------------
def _call_body(code: str) -> str:
    # `def call(self, args)` in a runner class (newer torch) or a module-level `def call(args)` (older).
    m = re.search(r"\n([ \t]*)def call\((?:self, )?args\):\n(.*?)\n\1(?:def |\S)", code + "\n<end>", re.S)
    assert m, "no `def call(args)` in Inductor's wrapper code"
    return m.group(2)


def _top_level_args(s: str) -> list[str]:
    """Split ``a, f(b, c), d`` at top-level commas (the argument list of one call)."""
    args, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    args.append(cur.strip())
    return args


def buffer_copy_findings(code: str) -> list[str]:
    """Everything in the generated wrapper that copies, clones or reallocates the buffer; [] if none."""
    body = _call_body(code)
    findings = []
    for pattern, what in [(r"empty_strided\w*\(", "an allocation by Inductor"),
                          (r"\b(?:cpp_fused_\w+|triton_\w+)", "an Inductor-generated kernel (a copy: the graph "
                                                               "holds only the op and views)"),
                          (r"\bclone\b|\.copy_\(|aten\.copy", "a clone / copy")]:
        findings += [f"{what}: {line.strip()}" for line in body.splitlines() if re.search(pattern, line)]
    calls = [m.end() for m in re.finditer(r"torch\.ops\.kimi_k3\.fused_attn_res\.default\(", body)]
    if not calls:
        findings.append("no fused_attn_res call in the wrapper")
    for start in calls:
        buf_arg = _top_level_args(body[start:])[2]
        if not re.fullmatch(r"(arg\d+_1|reinterpret_tensor\(arg\d+_1\b.*\))", buf_arg, re.S):
            findings.append(f"fused_attn_res gets block_residual={buf_arg}, not the caller's buffer")
    return findings


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _compile_and_compare(scenario: Scenario, device: str, T: int, compiled=None):
    args = scenario.make(device, T)
    eager_args = tuple(a.clone() for a in args)  # clone keeps the strides of these dense layouts
    expected = scenario.fn(*eager_args)
    compiled = compiled or torch.compile(scenario.fn, fullgraph=True, dynamic=scenario.dynamic)
    got, codes = run_and_get_code(compiled, *args)
    for g, e in zip(got, expected):
        assert torch.equal(_bits(g), _bits(e)), f"{scenario.name}: compiled output != eager"
    # The caller's buffer was mutated exactly as in eager (NaN poison compared bit for bit).
    assert torch.equal(_bits(args[2]), _bits(eager_args[2])), f"{scenario.name}: compiled buffer != eager buffer"
    return compiled, codes, args


@pytest.mark.parametrize("scenario", [pytest.param(s, id=s.name) for s in SCENARIOS])
def test_compiled_equals_eager_without_buffer_copy(scenario: Scenario, device: str):
    compiled, codes, args = _compile_and_compare(scenario, device, T=5)
    assert len(codes) == 1, f"{scenario.name}: expected one compiled graph, got {len(codes)}"
    findings = buffer_copy_findings(codes[0])
    assert not findings, f"{scenario.name}: Inductor copies the buffer:\n" + "\n".join(findings) + "\n" + codes[0]
    if scenario.bank:
        # Another token count through the same dynamic graph.
        _compile_and_compare(scenario, device, T=3, compiled=compiled)
    if device == "cuda":
        # Measured: the compiled call allocates what the eager call allocates (the op's outputs and its own
        # temporaries), and not a buffer's worth more (a functionalization copy would be a whole buffer).
        buffer_bytes = 5 * CAP * H * args[2].element_size()  # the [T, C, H] the op sees (a bank slice for banks)
        eager_extra = _peak_extra_bytes(scenario.fn, scenario.make(device, 5))
        compiled_extra = _peak_extra_bytes(compiled, scenario.make(device, 5))
        assert compiled_extra < eager_extra + buffer_bytes, (
            f"{scenario.name}: the compiled call allocated {compiled_extra} bytes at peak, eager {eager_extra}, "
            f"buffer {buffer_bytes}")


def _peak_extra_bytes(fn, args) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*args)
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


def test_no_graph_break_report():
    # fullgraph=True above already fails on any break; explain() states it for the serving pattern too.
    scenario = SCENARIOS[3]
    report = torch._dynamo.explain(scenario.fn)(*scenario.make("cpu", 5))
    assert report.graph_break_count == 0 and report.graph_count == 1, str(report.break_reasons)


def test_detector_sees_the_copy_when_reinplacing_is_off(monkeypatch):
    # The negative control of the method above: without Inductor's reinplace pass, auto_functionalized's
    # clone + copy-back stays in the code, and the same checks report it.
    post_grad = pytest.importorskip("torch._inductor.fx_passes.post_grad")
    if not hasattr(post_grad, "reinplace_inplaceable_ops"):
        pytest.skip("this torch has no torch._inductor.fx_passes.post_grad.reinplace_inplaceable_ops to switch off")
    calls = []
    monkeypatch.setattr(post_grad, "reinplace_inplaceable_ops", lambda *args, **kwargs: calls.append(1))
    # A fresh compile: neither dynamo's cache nor Inductor's FX-graph cache may hand back code that was compiled
    # with the pass on (the cache key does not include a monkeypatched pass).
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False):
        _, codes, _ = _compile_and_compare(SCENARIOS[0], "cpu", T=5)
    if not calls:
        pytest.skip(f"torch {torch.__version__}'s Inductor did not run post_grad.reinplace_inplaceable_ops here, "
                    "so switching it off cannot produce the copy this control looks for")
    findings = buffer_copy_findings(codes[0])
    if not findings and torch.__version__ < "2.13":
        # Seen on the H200 image's torch 2.11: the pass ran (and was switched off), yet the generated code still
        # called the op in place on the graph input, so something else reinplaces there and this switch cannot
        # provoke the copy. The control was validated on torch 2.13 (CI), where it must find the copy.
        pytest.skip(f"torch {torch.__version__} keeps the op in place even with post_grad.reinplace_inplaceable_ops "
                    "off; this negative control needs torch >= 2.13")
    assert any("allocation" in f for f in findings) and any("not the caller's buffer" in f for f in findings), (
        "with reinplacing off the checks should see the functionalization copy:\n" + codes[0])
