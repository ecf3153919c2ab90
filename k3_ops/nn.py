"""Model-level building blocks for Kimi K3's Block AttnRes: ``AttnRes`` and ``ResidualBank``.

``AttnRes`` holds the two checkpoint tensors of one mix, named as in the checkpoint so that weights load by
name (``<prefix>.norm.weight`` [H] and ``<prefix>.proj.weight`` [1, H]), and calls
``torch.ops.kimi_k3.attn_res`` (or the fused serving op, ``AttnRes.fused``). ``ResidualBank`` owns the one
preallocated block-snapshot buffer of a forward pass, hands out the [T, C, H] views the ops take and counts
the valid blocks through the layer schedule (docs/attn_res.md, "Kimi K3 call schedule").

Both are thin: every number is computed by the ops, so the modules trace under torch.compile (fullgraph) and
torch.export, and a CUDA-graph replay re-runs exactly the captured kernels. The only Python state is the
bank's ``num_valid_blocks`` counter, a plain int: it is the same at every call of a given layer, so compiled
code specialises on it once, not per step.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .ops import _norm_eps
from .reference import rms_norm_reference

__all__ = ["RMSNorm", "AttnRes", "ResidualBank"]

LAYOUTS = ("tokenmajor", "blockmajor")


class RMSNorm(nn.Module):
    """RMSNorm with the checkpoint's parameter name (``weight`` [H]) and the engines' ``variance_epsilon``.

    ``forward(x)``: x [..., H] of any floating dtype; normalised and scaled in FP32 (FP64 for fp64 x), returned
    in x's dtype. It is ``k3_ops.reference.rms_norm_reference``, the formula of the fused op's output norm, so
    ``norm(attn_res(...))`` and ``attn_res.fused(..., out_norm=norm)`` agree.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class ResidualBank(nn.Module):
    """The preallocated block-snapshot buffer of one forward pass, and its valid-block count.

    Args:
        max_num_tokens: T_max, the most tokens one step may carry (a serving engine's max batched tokens).
        capacity: C, the number of snapshot slots (Kimi K3: 8).
        hidden_size: H.
        layout: ``"tokenmajor"`` (storage [T_max, C, H]) or ``"blockmajor"`` (storage [C, T_max, H], the
            TensorRT-LLM / TokenSpeed layout).
        dtype, device: of the storage (the model's activation dtype).

    The storage is allocated once here, as a non-persistent module buffer (it follows ``.to(device)`` and stays
    out of the state dict); nothing reallocates it per step. ``buffer`` is its 3-D view. ``view(T)`` hands out the
    logical [T, C, H] view of its first T token rows (for block-major storage,
    ``buffer.narrow(1, 0, T).transpose(0, 1)``): a view, never a copy. Slots ``>= num_valid_blocks`` hold stale or
    uninitialised data and are never read by the ops.

    Per step: ``reset()``, then each snapshot either ``append(prefix)`` (unfused: a copy into the next free
    slot) or ``AttnRes.fused(..., snapshot=True)`` (the op writes the slot, the bank counts it).
    """

    def __init__(self, max_num_tokens: int, capacity: int, hidden_size: int, *, layout: str = "tokenmajor",
                 dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        for name, value in (("max_num_tokens", max_num_tokens), ("capacity", capacity),
                            ("hidden_size", hidden_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_num_tokens = int(max_num_tokens)
        self.capacity = int(capacity)
        self.hidden_size = int(hidden_size)
        self.layout = layout
        self.shape = ((self.max_num_tokens, self.capacity, self.hidden_size) if layout == "tokenmajor"
                      else (self.capacity, self.max_num_tokens, self.hidden_size))
        # The storage is flat and ``buffer`` is its 3-D view. Why: when an op mutates a view that has its base's
        # strides (buffer.narrow(0, 0, T) of a 3-D base), torch.compile's auto_functionalize describes it as a
        # slice by comparing sizes in Python, which is a guard on the token count (an error when the count is
        # unbacked, a recompile at T == T_max when it is backed). A base of another rank is never taken for
        # a slice: the view is replayed with as_strided, with no guard.
        self.register_buffer("storage", torch.empty(math.prod(self.shape), dtype=dtype, device=device),
                             persistent=False)
        # Slot indices for the token-major unfused snapshot (index_copy_ needs an index tensor; keeping them
        # here means no host-to-device copy inside a captured graph).
        self.register_buffer("slot_index", torch.arange(self.capacity, device=device), persistent=False)
        self.num_valid_blocks = 0

    @property
    def buffer(self) -> torch.Tensor:
        """The storage as [T_max, C, H] (token-major) or [C, T_max, H] (block-major)."""
        return self.storage.view(self.shape)

    def reset(self) -> None:
        """Start a new step: no valid blocks. The storage is kept as it is (no fill, no reallocation)."""
        self.num_valid_blocks = 0

    def view(self, num_tokens: int | torch.SymInt) -> torch.Tensor:
        """[num_tokens, C, H] view of the storage (strided for block-major storage); shares its memory."""
        if torch.compiler.is_compiling():
            # A Python `if` on a symbolic token count would be a guard (data-dependent, i.e. an error, when
            # the count is unbacked); torch._check becomes a deferred runtime assert, whose own message names
            # the rule and the symbol ("u0 <= 512"). No message closure: not every release's dynamo traces one.
            torch._check(num_tokens <= self.max_num_tokens)
        elif not 0 <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"num_tokens must be in [0, max_num_tokens={self.max_num_tokens}], got {num_tokens}")
        # narrow, not buffer[:T]: a slice's length is min(T, T_max), and under torch.compile a broadcast check
        # on that min() would guard "== 1" for T = 1 (a recompile for the next T); narrow's is exactly T.
        if self.layout == "tokenmajor":
            return self.buffer.narrow(0, 0, num_tokens)
        return self.buffer.narrow(1, 0, num_tokens).transpose(0, 1)

    def next_slot(self) -> int:
        """The slot the next snapshot goes to (= num_valid_blocks); raises when the bank is full."""
        if self.num_valid_blocks >= self.capacity:
            raise RuntimeError(f"ResidualBank is full: num_valid_blocks must be < capacity={self.capacity} "
                               f"to take a snapshot, got {self.num_valid_blocks}")
        return self.num_valid_blocks

    def commit_snapshot(self) -> None:
        """Count the snapshot just written into ``next_slot()`` (by the fused op)."""
        self.num_valid_blocks = self.next_slot() + 1

    def append(self, prefix_sum: torch.Tensor) -> None:
        """Unfused snapshot: copy prefix_sum [T, H] into the next free slot and count it."""
        slot = self.next_slot()
        T = prefix_sum.shape[0]
        # The writes are chosen so that torch.compile does not specialise on T = 1 with backed size-oblivious
        # symbols: a copy_ into the strided [T, H] token-major slot trips copy_'s overlap check (a guard
        # T == 1); index_copy_ does not. A block-major slot row is contiguous, where copy_ is guard-free.
        if self.layout == "tokenmajor":
            self.view(T).index_copy_(1, self.slot_index.narrow(0, slot, 1), prefix_sum.unsqueeze(1))
        else:
            self.buffer.select(0, slot).narrow(0, 0, T).copy_(prefix_sum)
        self.num_valid_blocks = slot + 1

    def extra_repr(self) -> str:
        return (f"max_num_tokens={self.max_num_tokens}, capacity={self.capacity}, hidden_size={self.hidden_size}, "
                f"layout={self.layout!r}, dtype={self.buffer.dtype}, num_valid_blocks={self.num_valid_blocks}")


BankOrBuffer = ResidualBank | torch.Tensor


def _blocks_and_count(prefix_sum: torch.Tensor, bank_or_buffer: BankOrBuffer,
                      num_valid_blocks: int | None) -> tuple[torch.Tensor, int]:
    if isinstance(bank_or_buffer, ResidualBank):
        if num_valid_blocks is not None:
            raise TypeError(f"num_valid_blocks must be None when a ResidualBank is passed (the bank counts its "
                            f"blocks: {bank_or_buffer.num_valid_blocks}), got {num_valid_blocks}")
        return bank_or_buffer.view(prefix_sum.shape[0]), bank_or_buffer.num_valid_blocks
    if num_valid_blocks is None:
        raise TypeError("num_valid_blocks is required when a [T, C, H] buffer tensor is passed instead of a "
                        "ResidualBank, got None")
    return bank_or_buffer, num_valid_blocks


class AttnRes(nn.Module):
    """One Block AttnRes mix with checkpoint-named parameters.

    Parameters (names and shapes as in the checkpoint): ``norm.weight`` [H] (an RMSNorm-like submodule that
    also carries ``variance_epsilon`` = eps) and ``proj.weight`` [1, H] (a bias-free ``nn.Linear(H, 1)``).
    ``proj.weight`` starts at zero, so an unloaded module scores every candidate 0 and averages them.

    Calls take the snapshots as a ``ResidualBank`` (its view and count are used) or as a [T, C, H] tensor
    (token-major, or a block-major buffer's ``.transpose(0, 1)``) plus ``num_valid_blocks``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, device=device, dtype=dtype)
        self.proj = nn.Linear(hidden_size, 1, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.proj.weight)

    @property
    def eps(self) -> float:
        return self.norm.variance_epsilon

    def forward(self, prefix_sum: torch.Tensor, bank_or_buffer: BankOrBuffer,
                num_valid_blocks: int | None = None) -> torch.Tensor:
        """``attn_res(prefix_sum, blocks, norm.weight, proj.weight, K, eps)``.

        prefix_sum: [T, H] (bf16 / fp16 / fp32 / fp64, any strides). Returns a new contiguous [T, H] tensor
        of prefix_sum's dtype. Nothing is written.
        """
        blocks, k = _blocks_and_count(prefix_sum, bank_or_buffer, num_valid_blocks)
        return torch.ops.kimi_k3.attn_res.default(prefix_sum, blocks, self.norm.weight, self.proj.weight, k,
                                                   self.eps)

    def fused(self, prefix_sum: torch.Tensor, bank_or_buffer: BankOrBuffer,
              num_valid_blocks: int | None = None, *, addend: torch.Tensor | None = None,
              snapshot: bool = False, out_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The serving variant (``kimi_k3::fused_attn_res``): residual add, snapshot, mix, output norm.

        Args:
            prefix_sum: [T, H], never mutated. addend: optional [T, H] like prefix_sum, never mutated.
            snapshot: write ``new_prefix = prefix_sum + addend`` into the next free slot (slot K) in place;
                a bank then counts it (K + 1 for the next call); with a raw buffer the caller does.
            out_norm: optional RMSNorm-like module (``.weight`` [H], ``.variance_epsilon`` or ``.eps``) applied
                to the dtype-rounded mix, as the layer's following RMSNorm would.

        Returns:
            ``(out, new_prefix)``: both new contiguous [T, H] tensors of prefix_sum's dtype. Inference only:
            the op raises if any input requires grad (use ``forward`` for training).
        """
        bank = bank_or_buffer if isinstance(bank_or_buffer, ResidualBank) else None
        blocks, k = _blocks_and_count(prefix_sum, bank_or_buffer, num_valid_blocks)
        write_idx = (bank.next_slot() if bank is not None else k) if snapshot else -1
        norm_weight = None if out_norm is None else out_norm.weight
        norm_eps = None if out_norm is None else _norm_eps(out_norm)
        out, new_prefix = torch.ops.kimi_k3.fused_attn_res.default(
            prefix_sum, addend, blocks, self.norm.weight, self.proj.weight, k, self.eps, write_idx, norm_weight,
            norm_eps)
        if snapshot and bank is not None:
            bank.commit_snapshot()
        return out, new_prefix
