"""k3_ops.nn inside a model graph: a toy Kimi-K3-style decoder stack under torch.compile.

The stack (``ToyK3Model``) runs the K3 call schedule of docs/attn_res.md with block size 3 and a small hidden
size: a mix before attention and before the MLP of every layer, a snapshot at every block start, a final mix
before the last norm. "Attention" and "MLP" are stand-ins (tanh / SiLU of a bias-free linear): what is under
test is the graph around the ops. It runs unfused (``AttnRes`` + torch adds + ``RMSNorm`` +
``ResidualBank.append`` copies) or fused (``AttnRes.fused``: add, snapshot, mix and norm in one op), over a
token-major or block-major bank whose spare capacity is NaN-poisoned.

Compiled the way vLLM compiles a model: fullgraph, dynamic, and a token dimension that does not specialise
on 1, either unbacked (``mark_unbacked``) or backed with ``backed_size_oblivious``. Checks: no graph break,
one compiled graph for T in 1, 7, 16, 17, 512, compiled == eager bit for bit (aot_eager runs the same
kernels), fused == unfused, and the dynamo graph pinned with expecttest in a normalised, version-independent
rendering (``render_graph``). The test_graph_capture and test_export modules reuse the stack.
"""
from __future__ import annotations

import math
import operator

import expecttest
import pytest
import torch
import torch._dynamo.testing
from torch import fx, nn

import k3_ops  # noqa: F401  (loads the kimi_k3 library)
from k3_ops.nn import AttnRes, ResidualBank, RMSNorm

TOKEN_COUNTS = [1, 7, 16, 17, 512]  # 1 first: a backed symbol would specialise on it
HIDDEN = 32
BLOCK_SIZE = 3


class ToyK3Layer(nn.Module):
    """One decoder layer with checkpoint-style names (attn_res, mlp_res, input_layernorm, ...)."""

    def __init__(self, layer_idx: int, hidden_size: int, block_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.starts_block = layer_idx % block_size == 0
        self.attn_res = AttnRes(hidden_size, dtype=dtype)
        self.mlp_res = AttnRes(hidden_size, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden_size, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, dtype=dtype)
        self.attn = nn.Linear(hidden_size, hidden_size, bias=False, dtype=dtype)
        self.mlp = nn.Linear(hidden_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, prefix: torch.Tensor, bank: ResidualBank) -> torch.Tensor:
        """Unfused schedule; returns the running prefix after the layer."""
        h = prefix if bank.num_valid_blocks == 0 else self.attn_res(prefix, bank)
        if self.starts_block:
            bank.append(prefix)
            prefix = None
        a = torch.tanh(self.attn(self.input_layernorm(h)))
        prefix = a if prefix is None else prefix + a
        h = self.mlp_res(prefix, bank)
        m = nn.functional.silu(self.mlp(self.post_attention_layernorm(h)))
        return prefix + m

    def forward_fused(self, prefix: torch.Tensor, addend: torch.Tensor | None,
                      bank: ResidualBank) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused schedule: each residual add is deferred into the next fused call. Returns (prefix, addend)."""
        x, prefix = self.attn_res.fused(prefix, bank, addend=addend, snapshot=self.starts_block,
                                        out_norm=self.input_layernorm)
        a = torch.tanh(self.attn(x))
        if self.starts_block:  # the snapshot consumed the prefix: the block restarts from the attention output
            x, prefix = self.mlp_res.fused(a, bank, out_norm=self.post_attention_layernorm)
        else:
            x, prefix = self.mlp_res.fused(prefix, bank, addend=a, out_norm=self.post_attention_layernorm)
        return prefix, nn.functional.silu(self.mlp(x))


class ToyK3Model(nn.Module):
    """A few ToyK3Layers, a final mix and norm, and the bank they share (capacity: one spare, poisoned slot)."""

    def __init__(self, num_layers: int = 7, hidden_size: int = HIDDEN, block_size: int = BLOCK_SIZE, *,
                 max_num_tokens: int = 512, layout: str = "tokenmajor", fused: bool = False,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0) -> None:
        super().__init__()
        self.fused = fused
        self.layers = nn.ModuleList(ToyK3Layer(i, hidden_size, block_size, dtype) for i in range(num_layers))
        self.final_res = AttnRes(hidden_size, dtype=dtype)
        self.norm = RMSNorm(hidden_size, dtype=dtype)
        capacity = math.ceil(num_layers / block_size) + 1
        self.bank = ResidualBank(max_num_tokens, capacity, hidden_size, layout=layout, dtype=dtype)
        self._init_weights(seed)
        self.to(device)
        self.bank.buffer.fill_(float("nan"))

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Drawn on the CPU in FP32 from one generator, so every layout / fused / device variant of the same
        # seed holds identical weights. Score weights ~ 2/sqrt(H) per element give a far-from-uniform mix.
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            H = p.shape[-1]
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name == "norm.weight":
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith("proj.weight"):
                v = torch.randn(p.shape, generator=g) * (2.0 / math.sqrt(H))
            else:
                v = torch.randn(p.shape, generator=g) / math.sqrt(H)
            p.copy_(v)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [T, H] embeddings -> [T, H] final-normed hidden states."""
        bank = self.bank
        bank.reset()
        if not self.fused:
            prefix = hidden_states
            for layer in self.layers:
                prefix = layer(prefix, bank)
            return self.norm(self.final_res(prefix, bank))
        prefix, addend = hidden_states, None
        for layer in self.layers:
            prefix, addend = layer.forward_fused(prefix, addend, bank)
        out, _ = self.final_res.fused(prefix, bank, addend=addend, out_norm=self.norm)
        return out


def make_input(T: int, hidden_size: int = HIDDEN, dtype: torch.dtype = torch.float32, device="cpu",
               seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + T)
    return torch.randn(T, hidden_size, generator=g).to(device=device, dtype=dtype)


def mark_tokens_unbacked(x: torch.Tensor) -> torch.Tensor:
    """vLLM's unbacked mode: the token dim is an unbacked symbol (never specialised, no 0/1 guards)."""
    # torch._dynamo.decorators holds it in every supported release; the top-level alias is not always there.
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x


def backed_size_oblivious():
    """vLLM's backed mode: backed symbols reasoned about size-obliviously (no specialisation on 0 / 1)."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


# --- normalised graph rendering for expecttest ------------------------------------------------------------
_SKIPPED_TARGETS = {torch.ops.aten._assert_scalar.default, operator.ge, operator.le, operator.gt, operator.lt,
                    operator.eq, torch.ops.aten.sym_size.int, torch._check, torch._check_value}
_TRANSPARENT_METHODS = {"float", "to", "item", "contiguous"}
_TRANSPARENT_FUNCTIONS = {torch.sym_float, float}
_INLINE_VIEW_METHODS = {"narrow", "select", "transpose", "unsqueeze"}


def render_graph(gm: fx.GraphModule, example_inputs, names: dict[int, str]) -> str:
    """One line per compute node of a dynamo graph, with version-independent names.

    Placeholders are named by identity of the example input (``names``: id(tensor) -> e.g. the parameter's
    FQN, "x", "bank"), symbolic sizes print as ``T``. A 0-d float input (an eps that dynamic=True left
    unspecialised) prints as its value, like a specialised float constant would, so the rendering does not
    depend on the release's float specialisation. Size queries, runtime asserts and scalar/dtype conversions
    are elided; views and indexing print inline, so the bank views show up as ``bank.narrow(0, 0, T)`` /
    ``bank.narrow(1, 0, T).transpose(0, 1)``.
    """
    label: dict[fx.Node, str] = {}
    lines: list[str] = []

    def show(a) -> str:
        if isinstance(a, fx.Node):
            return label.get(a, "?")
        if isinstance(a, slice):
            parts = ["" if v is None else show(v) for v in (a.start, a.stop)]
            return ":".join(parts) + ("" if a.step is None else f":{show(a.step)}")
        if isinstance(a, (tuple, list)):
            return "(" + ", ".join(show(v) for v in a) + ("," if len(a) == 1 else "") + ")"
        if isinstance(a, torch.SymInt):
            return "T"
        if isinstance(a, float):
            return f"{a:g}"
        return repr(a)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.SymInt) or (isinstance(value, int) and not isinstance(value, bool)):
            label[node] = "T"
        elif isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
            label[node] = show(value.item())
        else:
            label[node] = names.get(id(value), node.name)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            lines.append(f"return {show(node.args[0])}")
            continue
        value = node.meta.get("example_value")
        if node.target in _SKIPPED_TARGETS or node.target == "size" or isinstance(value, torch.SymInt):
            label[node] = "T" if isinstance(value, torch.SymInt) else "?"
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            base, index = node.args
            if isinstance(base, fx.Node) and base.target == "size":  # an int size, e.g. H
                label[node] = repr(value) if isinstance(value, int) else "T"
                continue
            label[node] = f"{show(base)}[{show(index).strip('()').rstrip(',')}]"
            continue
        if (node.op == "call_method" and node.target in _TRANSPARENT_METHODS) or (
                node.op == "call_function" and node.target in _TRANSPARENT_FUNCTIONS):
            label[node] = show(node.args[0])
            continue
        if node.op == "call_method" and node.target == "view" and show(node.args[0]) == "bank":
            label[node] = "bank"  # ResidualBank.buffer: the flat storage seen as 3-D
            continue
        if node.op == "call_method" and node.target in _INLINE_VIEW_METHODS:
            label[node] = f"{show(node.args[0])}.{node.target}({', '.join(show(a) for a in node.args[1:])})"
            continue
        if isinstance(node.target, torch._ops.OpOverload):
            op = f"{node.target.namespace}.{node.target._schema.name.split('::')[-1]}"
        elif node.op == "call_method":
            op = f"{show(node.args[0])}.{node.target}"
            node_args = node.args[1:]
        else:
            op = getattr(node.target, "__name__", str(node.target))
        args = node.args if node.op != "call_method" else node_args
        shown = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()]
        name = f"v{len(lines)}"
        label[node] = name
        lines.append(f"{name} = {op}({', '.join(shown)})")
    return "\n".join(lines)


class GraphRecorder:
    """A dynamo backend that records each graph's rendering and runs the graph as is (eager kernels)."""

    def __init__(self, model: nn.Module, x_names: dict[int, str]) -> None:
        self.model = model
        self.x_names = x_names
        self.renderings: list[str] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        names = {id(p): n for n, p in self.model.named_parameters()}
        names[id(self.model.bank.storage)] = "bank"
        names[id(self.model.bank.slot_index)] = "slot_index"
        names.update(self.x_names)
        self.renderings.append(render_graph(gm, example_inputs, names))
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


MODES = ["unbacked", "backed_size_oblivious"]
VARIANTS = [pytest.param(dict(fused=f, layout=lay), id=f"{'fused' if f else 'unfused'}-{lay}")
            for f in (False, True) for lay in ("tokenmajor", "blockmajor")]


def _run_compiled(model: nn.Module, mode: str, T: int, compiled) -> torch.Tensor:
    x = make_input(T)
    if mode == "unbacked":
        mark_tokens_unbacked(x)
        return compiled(x)
    with backed_size_oblivious():
        return compiled(x)


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_fused_stack_equals_unfused_stack(variant):
    """Eager: the fused schedule produces the unfused outputs and the same bank, bit for bit on CPU."""
    unfused = ToyK3Model(layout=variant["layout"], fused=False)
    fused = ToyK3Model(layout=variant["layout"], fused=True)
    for T in (1, 7):
        x = make_input(T)
        torch.testing.assert_close(fused(x), unfused(x), rtol=0, atol=0)
        assert fused.bank.num_valid_blocks == unfused.bank.num_valid_blocks == math.ceil(7 / BLOCK_SIZE)
        assert torch.equal(fused.bank.view(T).view(torch.int32), unfused.bank.view(T).view(torch.int32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_compiled_stack_one_graph_no_recompile_equals_eager(variant, mode):
    """fullgraph + dynamic, the token dim never specialised: after the first T nothing recompiles (dynamo is
    told to raise on a recompile, and the backend is not called again), and compiled == eager bit for bit.

    The first call may call the backend twice: with dynamic=True dynamo first passes the float eps values
    as tensors, AOT's tensorify pass specialises them (they feed the ops' ``float eps``) and restarts the
    analysis once. That is one compilation of one frame, not a recompile."""
    model = ToyK3Model(**variant)
    eager = ToyK3Model(**variant)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    first_compile = None
    for T in TOKEN_COUNTS:
        with torch._dynamo.config.patch(error_on_recompile=first_compile is not None):
            got = _run_compiled(model, mode, T, compiled)
        first_compile = counter.frame_count if first_compile is None else first_compile
        want = eager(make_input(T))
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, T=T: f"T={T}: {m}")
        # The bank holds the same snapshots: the in-place writes survived functionalization.
        assert torch.equal(model.bank.view(T).view(torch.int32), eager.bank.view(T).view(torch.int32)), f"T={T}"
    assert counter.frame_count == first_compile, f"backend called again after T={TOKEN_COUNTS[0]}"
    mixes = 2 * len(model.layers)
    assert counter.op_count > mixes, f"op_count={counter.op_count} cannot hold the {mixes} mixes"


@torch.no_grad()
def test_compiled_stack_refuses_more_tokens_than_the_bank_holds():
    """ResidualBank.view's torch._check(T <= max_num_tokens) survives compilation: an oversized step fails
    instead of writing past the bank. (Which exception depends on the release: with an unbacked T dynamo
    turns the check into an input guard whose failure it reports as an AssertionError.)"""
    model = ToyK3Model(num_layers=4, fused=True, max_num_tokens=64)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    compiled(mark_tokens_unbacked(make_input(64)))
    with pytest.raises(Exception, match=r"64"):
        compiled(mark_tokens_unbacked(make_input(65)))


@pytest.mark.slow
@pytest.mark.parametrize("variant, mode", [
    pytest.param(dict(fused=False, layout="tokenmajor"), "unbacked", id="unfused-tokenmajor-unbacked"),
    pytest.param(dict(fused=True, layout="blockmajor"), "backed_size_oblivious",
                 id="fused-blockmajor-backed_size_oblivious"),
])
@torch.no_grad()
def test_inductor_compiled_stack_no_recompile_close_to_eager(variant, mode):
    """The default backend (what the CUDA-graph test captures): Inductor lowers the ops as fallback kernels
    around its own fused code. Its norms and linears round differently from eager: FP32 tolerances."""
    model = ToyK3Model(num_layers=4, **variant)
    eager = ToyK3Model(num_layers=4, **variant)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for i, T in enumerate(TOKEN_COUNTS):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _run_compiled(model, mode, T, compiled)
        torch.testing.assert_close(got, eager(make_input(T)), msg=lambda m, T=T: f"T={T}: {m}")
        torch.testing.assert_close(model.bank.view(T), eager.bank.view(T), equal_nan=True,
                                   msg=lambda m, T=T: f"T={T}, bank: {m}")


@torch.no_grad()
def test_plain_backed_dynamic_specialises_on_one():
    """Control for the test above: without unbacked / size-oblivious symbols, T = 1 is specialised and the
    next T recompiles. This is why vLLM's modes exist, and it shows that the check can catch a recompile."""
    model = ToyK3Model()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    compiled(make_input(1))
    with pytest.raises(torch._dynamo.exc.RecompileError), torch._dynamo.config.patch(error_on_recompile=True):
        compiled(make_input(7))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@torch.no_grad()
def test_explain_reports_no_graph_break(fused, mode):
    model = ToyK3Model(fused=fused)
    x = make_input(7)
    if mode == "unbacked":
        mark_tokens_unbacked(x)
        explanation = torch._dynamo.explain(model)(x)
    else:
        with backed_size_oblivious():
            explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    ops = [str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
    name = "kimi_k3.fused_attn_res.default" if fused else "kimi_k3.attn_res.default"
    # Unfused, layer 0's pre-attention mix is skipped (no blocks yet); fused, every mix is one op call.
    assert ops.count(name) == 2 * len(model.layers) + (1 if fused else 0)


class TestPinnedGraph(expecttest.TestCase):
    """The dynamo graph of a 4-layer stack (snapshots at layers 0 and 3), pinned. Regenerate after an
    intended change with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_model_graph.py -k Pinned``."""

    def _render(self, fused: bool, layout: str = "tokenmajor") -> str:
        torch._dynamo.reset()
        model = ToyK3Model(num_layers=4, fused=fused, layout=layout)
        x = mark_tokens_unbacked(make_input(7))
        recorder = GraphRecorder(model, {id(x): "x"})
        with torch.no_grad():
            torch.compile(model, backend=recorder, fullgraph=True, dynamic=True)(x)
        self.assertEqual(len(recorder.renderings), 1)
        return recorder.renderings[0]

    def test_unfused(self):
        self.assertExpectedInline(self._render(fused=False), """\
v0 = bank.narrow(0, 0, T).index_copy_(1, slot_index.narrow(0, 0, 1), x.unsqueeze(1))
v1 = x.square()
v2 = v1.mean(dim=-1, keepdim=True)
v3 = add(v2, 1e-06)
v4 = rsqrt(v3)
v5 = mul(x, v4)
v6 = mul(v5, layers.0.input_layernorm.weight)
v7 = linear(v6, layers.0.attn.weight, None)
v8 = tanh(v7)
v9 = kimi_k3.attn_res(v8, bank.narrow(0, 0, T), layers.0.mlp_res.norm.weight, layers.0.mlp_res.proj.weight, 1, 1e-06)
v10 = v9.square()
v11 = v10.mean(dim=-1, keepdim=True)
v12 = add(v11, 1e-06)
v13 = rsqrt(v12)
v14 = mul(v9, v13)
v15 = mul(v14, layers.0.post_attention_layernorm.weight)
v16 = linear(v15, layers.0.mlp.weight, None)
v17 = silu(v16)
v18 = add(v8, v17)
v19 = kimi_k3.attn_res(v18, bank.narrow(0, 0, T), layers.1.attn_res.norm.weight, layers.1.attn_res.proj.weight, 1, 1e-06)
v20 = v19.square()
v21 = v20.mean(dim=-1, keepdim=True)
v22 = add(v21, 1e-06)
v23 = rsqrt(v22)
v24 = mul(v19, v23)
v25 = mul(v24, layers.1.input_layernorm.weight)
v26 = linear(v25, layers.1.attn.weight, None)
v27 = tanh(v26)
v28 = add(v18, v27)
v29 = kimi_k3.attn_res(v28, bank.narrow(0, 0, T), layers.1.mlp_res.norm.weight, layers.1.mlp_res.proj.weight, 1, 1e-06)
v30 = v29.square()
v31 = v30.mean(dim=-1, keepdim=True)
v32 = add(v31, 1e-06)
v33 = rsqrt(v32)
v34 = mul(v29, v33)
v35 = mul(v34, layers.1.post_attention_layernorm.weight)
v36 = linear(v35, layers.1.mlp.weight, None)
v37 = silu(v36)
v38 = add(v28, v37)
v39 = kimi_k3.attn_res(v38, bank.narrow(0, 0, T), layers.2.attn_res.norm.weight, layers.2.attn_res.proj.weight, 1, 1e-06)
v40 = v39.square()
v41 = v40.mean(dim=-1, keepdim=True)
v42 = add(v41, 1e-06)
v43 = rsqrt(v42)
v44 = mul(v39, v43)
v45 = mul(v44, layers.2.input_layernorm.weight)
v46 = linear(v45, layers.2.attn.weight, None)
v47 = tanh(v46)
v48 = add(v38, v47)
v49 = kimi_k3.attn_res(v48, bank.narrow(0, 0, T), layers.2.mlp_res.norm.weight, layers.2.mlp_res.proj.weight, 1, 1e-06)
v50 = v49.square()
v51 = v50.mean(dim=-1, keepdim=True)
v52 = add(v51, 1e-06)
v53 = rsqrt(v52)
v54 = mul(v49, v53)
v55 = mul(v54, layers.2.post_attention_layernorm.weight)
v56 = linear(v55, layers.2.mlp.weight, None)
v57 = silu(v56)
v58 = add(v48, v57)
v59 = kimi_k3.attn_res(v58, bank.narrow(0, 0, T), layers.3.attn_res.norm.weight, layers.3.attn_res.proj.weight, 1, 1e-06)
v60 = bank.narrow(0, 0, T).index_copy_(1, slot_index.narrow(0, 1, 1), v58.unsqueeze(1))
v61 = v59.square()
v62 = v61.mean(dim=-1, keepdim=True)
v63 = add(v62, 1e-06)
v64 = rsqrt(v63)
v65 = mul(v59, v64)
v66 = mul(v65, layers.3.input_layernorm.weight)
v67 = linear(v66, layers.3.attn.weight, None)
v68 = tanh(v67)
v69 = kimi_k3.attn_res(v68, bank.narrow(0, 0, T), layers.3.mlp_res.norm.weight, layers.3.mlp_res.proj.weight, 2, 1e-06)
v70 = v69.square()
v71 = v70.mean(dim=-1, keepdim=True)
v72 = add(v71, 1e-06)
v73 = rsqrt(v72)
v74 = mul(v69, v73)
v75 = mul(v74, layers.3.post_attention_layernorm.weight)
v76 = linear(v75, layers.3.mlp.weight, None)
v77 = silu(v76)
v78 = add(v68, v77)
v79 = kimi_k3.attn_res(v78, bank.narrow(0, 0, T), final_res.norm.weight, final_res.proj.weight, 2, 1e-06)
v80 = v79.square()
v81 = v80.mean(dim=-1, keepdim=True)
v82 = add(v81, 1e-06)
v83 = rsqrt(v82)
v84 = mul(v79, v83)
v85 = mul(v84, norm.weight)
return (v85,)""")

    def test_fused_blockmajor(self):
        self.assertExpectedInline(self._render(fused=True, layout="blockmajor"), """\
v0 = kimi_k3.fused_attn_res(x, None, bank.narrow(1, 0, T).transpose(0, 1), layers.0.attn_res.norm.weight, layers.0.attn_res.proj.weight, 0, 1e-06, 0, layers.0.input_layernorm.weight, 1e-06)
v1 = linear(v0[0], layers.0.attn.weight, None)
v2 = tanh(v1)
v3 = kimi_k3.fused_attn_res(v2, None, bank.narrow(1, 0, T).transpose(0, 1), layers.0.mlp_res.norm.weight, layers.0.mlp_res.proj.weight, 1, 1e-06, -1, layers.0.post_attention_layernorm.weight, 1e-06)
v4 = linear(v3[0], layers.0.mlp.weight, None)
v5 = silu(v4)
v6 = kimi_k3.fused_attn_res(v3[1], v5, bank.narrow(1, 0, T).transpose(0, 1), layers.1.attn_res.norm.weight, layers.1.attn_res.proj.weight, 1, 1e-06, -1, layers.1.input_layernorm.weight, 1e-06)
v7 = linear(v6[0], layers.1.attn.weight, None)
v8 = tanh(v7)
v9 = kimi_k3.fused_attn_res(v6[1], v8, bank.narrow(1, 0, T).transpose(0, 1), layers.1.mlp_res.norm.weight, layers.1.mlp_res.proj.weight, 1, 1e-06, -1, layers.1.post_attention_layernorm.weight, 1e-06)
v10 = linear(v9[0], layers.1.mlp.weight, None)
v11 = silu(v10)
v12 = kimi_k3.fused_attn_res(v9[1], v11, bank.narrow(1, 0, T).transpose(0, 1), layers.2.attn_res.norm.weight, layers.2.attn_res.proj.weight, 1, 1e-06, -1, layers.2.input_layernorm.weight, 1e-06)
v13 = linear(v12[0], layers.2.attn.weight, None)
v14 = tanh(v13)
v15 = kimi_k3.fused_attn_res(v12[1], v14, bank.narrow(1, 0, T).transpose(0, 1), layers.2.mlp_res.norm.weight, layers.2.mlp_res.proj.weight, 1, 1e-06, -1, layers.2.post_attention_layernorm.weight, 1e-06)
v16 = linear(v15[0], layers.2.mlp.weight, None)
v17 = silu(v16)
v18 = kimi_k3.fused_attn_res(v15[1], v17, bank.narrow(1, 0, T).transpose(0, 1), layers.3.attn_res.norm.weight, layers.3.attn_res.proj.weight, 1, 1e-06, 1, layers.3.input_layernorm.weight, 1e-06)
v19 = linear(v18[0], layers.3.attn.weight, None)
v20 = tanh(v19)
v21 = kimi_k3.fused_attn_res(v20, None, bank.narrow(1, 0, T).transpose(0, 1), layers.3.mlp_res.norm.weight, layers.3.mlp_res.proj.weight, 2, 1e-06, -1, layers.3.post_attention_layernorm.weight, 1e-06)
v22 = linear(v21[0], layers.3.mlp.weight, None)
v23 = silu(v22)
v24 = kimi_k3.fused_attn_res(v21[1], v23, bank.narrow(1, 0, T).transpose(0, 1), final_res.norm.weight, final_res.proj.weight, 2, 1e-06, -1, norm.weight, 1e-06)
return (v24[0],)""")
