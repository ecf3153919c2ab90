"""A toy Kimi-K3-style decoder stack for the fused-op tests: the call schedule of /work/shared/attn_res.md
("Kimi K3 call schedule") at a small scale, run two ways.

- ``forward_unfused``: what a model without the fused op does: ``k3_ops.attn_res`` for every mix, torch
  adds for the residual stream, ``torch.nn.functional.rms_norm`` (FP32, cast back) for the norms and an
  explicit ``copy_`` for every block snapshot.
- ``forward_fused``: one ``k3_ops.fused_attn_res`` per mix; each absorbs the pending residual add, the
  snapshot at a block boundary and the RMSNorm that follows the mix.

"Attention" and "MLP" are small deterministic stand-ins, ``tanh(x @ W)`` with a fixed random W per layer:
only the residual bookkeeping around them matters here. Self-contained on purpose (k3_ops.nn is the
model-level API; this stack tests the op, not the modules).

Schedule per layer l (block size B; K = number of snapshots taken so far):
    h = prefix if K == 0 else mix(prefix, blocks[:K], attn_res)          # before attention
    if l % B == 0: blocks[K] = prefix; K += 1; prefix = None             # snapshot
    a = attn(input_layernorm(h));  prefix = a if prefix is None else prefix + a
    h = mix(prefix, blocks[:K], mlp_res)                                 # before the MLP
    m = mlp(post_attention_layernorm(h));  prefix = prefix + m
and a final mix before the final norm. In the fused form ``prefix + m`` is deferred into the next call's
``addend``, so each layer makes exactly two fused calls and the model one more.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import k3_ops


@dataclass(frozen=True)
class ToyK3Config:
    hidden: int = 48
    num_layers: int = 7  # block boundaries at layers 0, 3, 6: three snapshots
    block_size: int = 3
    capacity: int = 4  # one slot more than the stack fills: it stays NaN-poisoned, never read or written
    dtype: torch.dtype = torch.bfloat16
    layout: str = "tokenmajor"  # or "blockmajor": a [C, T, H] buffer passed as .transpose(0, 1)
    eps: float = 1e-6  # the AttnRes norms
    norm_eps: float = 1e-5  # the decoder's RMSNorms

    @property
    def num_snapshots(self) -> int:
        return math.ceil(self.num_layers / self.block_size)


@dataclass
class _Layer:
    attn_res_norm: torch.Tensor
    attn_res_proj: torch.Tensor
    mlp_res_norm: torch.Tensor
    mlp_res_proj: torch.Tensor
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    w_attn: torch.Tensor
    w_mlp: torch.Tensor


#: One trace entry per sublayer input (and the final output): (name, tensor). Comparing traces tells where two
#: runs part ways.
Trace = list[tuple[str, torch.Tensor]]


class ToyK3:
    def __init__(self, config: ToyK3Config, device: str | torch.device = "cpu", seed: int = 0):
        if config.num_snapshots > config.capacity:
            raise ValueError(f"capacity must hold ceil(num_layers / block_size)={config.num_snapshots} snapshots, "
                             f"got {config.capacity}")
        self.config = config
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(seed)
        H, dt = config.hidden, config.dtype

        def gamma():  # norm weights near 1
            return (1.0 + 0.1 * torch.randn(H, generator=g)).to(self.device, dt)

        def proj():  # nn.Linear(H, 1) weight; score spread ~ N(0, 2^2) as in the shared samples
            return (torch.randn(1, H, generator=g) * (2.0 / math.sqrt(H))).to(self.device, dt)

        def linear():
            return (torch.randn(H, H, generator=g) / math.sqrt(H)).to(self.device, dt)

        self.layers = [_Layer(gamma(), proj(), gamma(), proj(), gamma(), gamma(), linear(), linear())
                       for _ in range(config.num_layers)]
        self.final_res_norm, self.final_res_proj, self.final_norm = gamma(), proj(), gamma()

    # --- inputs ---------------------------------------------------------------------------------------------
    def embeddings(self, num_tokens: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, self.config.hidden, generator=g).to(self.device, self.config.dtype)

    def new_buffer(self, num_tokens: int) -> torch.Tensor:
        """The preallocated [T, C, H] block buffer (a view for block-major), all of it NaN-poisoned."""
        c = self.config
        if c.layout == "tokenmajor":
            return torch.full((num_tokens, c.capacity, c.hidden), float("nan"), device=self.device, dtype=c.dtype)
        if c.layout == "blockmajor":
            storage = torch.full((c.capacity, num_tokens, c.hidden), float("nan"), device=self.device, dtype=c.dtype)
            return storage.transpose(0, 1)
        raise ValueError(f"layout must be 'tokenmajor' or 'blockmajor', got {c.layout!r}")

    # --- sublayers ------------------------------------------------------------------------------------------
    @staticmethod
    def attn(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ layer.w_attn)

    @staticmethod
    def mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ layer.w_mlp)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """torch's RMSNorm in FP32 of the dtype-rounded input, cast back (the unfused model's norm)."""
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        return torch.nn.functional.rms_norm(x.to(compute), (x.shape[-1],), weight.to(compute),
                                            self.config.norm_eps).to(x.dtype)

    # --- the two pipelines ----------------------------------------------------------------------------------
    def forward_unfused(self, x: torch.Tensor, buf: torch.Tensor,
                        norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Trace:
        """attn_res + torch adds + RMSNorm + snapshot copies. ``norm(x, weight)`` defaults to ``rms_norm``."""
        c, norm = self.config, norm or self.rms_norm
        trace: Trace = []
        K, prefix = 0, x
        for i, p in enumerate(self.layers):
            h = prefix if K == 0 else k3_ops.attn_res(prefix, buf, p.attn_res_norm, p.attn_res_proj, K, c.eps)
            if i % c.block_size == 0:
                buf[:, K].copy_(prefix)
                K, prefix = K + 1, None
            h = norm(h, p.input_layernorm)
            trace.append((f"layer{i}.attn_in", h))
            a = self.attn(p, h)
            prefix = a if prefix is None else prefix + a
            h = norm(k3_ops.attn_res(prefix, buf, p.mlp_res_norm, p.mlp_res_proj, K, c.eps), p.post_attention_layernorm)
            trace.append((f"layer{i}.mlp_in", h))
            prefix = prefix + self.mlp(p, h)
        h = k3_ops.attn_res(prefix, buf, self.final_res_norm, self.final_res_proj, K, c.eps)
        trace.append(("final", norm(h, self.final_norm)))
        return trace

    def forward_fused(self, x: torch.Tensor, buf: torch.Tensor,
                      fused: Callable[..., tuple[torch.Tensor, torch.Tensor]] = k3_ops.fused_attn_res) -> Trace:
        """One fused call per mix. ``fused`` has the signature of ``k3_ops.fused_attn_res`` (tests pass a
        checking wrapper)."""
        c = self.config
        trace: Trace = []
        K, prefix, pending = 0, x, None  # pending: the MLP output not yet added to prefix
        for i, p in enumerate(self.layers):
            snapshot = i % c.block_size == 0
            h, new_prefix = fused(prefix, pending, buf, p.attn_res_norm, p.attn_res_proj, K, c.eps,
                                  block_write_idx=K if snapshot else -1, out_norm_weight=p.input_layernorm,
                                  out_norm_eps=c.norm_eps)
            if snapshot:  # new_prefix is now block K; the next prefix starts from the attention output
                K += 1
            trace.append((f"layer{i}.attn_in", h))
            a = self.attn(p, h)
            base, addend = (a, None) if snapshot else (new_prefix, a)
            h, prefix = fused(base, addend, buf, p.mlp_res_norm, p.mlp_res_proj, K, c.eps,
                              out_norm_weight=p.post_attention_layernorm, out_norm_eps=c.norm_eps)
            trace.append((f"layer{i}.mlp_in", h))
            pending = self.mlp(p, h)
        out, _ = fused(prefix, pending, buf, self.final_res_norm, self.final_res_proj, K, c.eps,
                       out_norm_weight=self.final_norm, out_norm_eps=c.norm_eps)
        trace.append(("final", out))
        return trace
