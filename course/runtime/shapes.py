"""The problem sizes the benchmarks and the status table time: one prefill or decode shape each.

A shape knows the work it asks for (flops, the least bytes any kernel must
move), so every table computes TFLOP/s and GB/s the same way. Nothing here
imports torch or a kernel: the stage registry (``course.runtime.stages``) lists each
stage's shapes, and ``course.tools.bench`` times them.
"""

from __future__ import annotations

from dataclasses import dataclass

from course.runtime import validation


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "float16"
    causal: bool = False
    window: tuple = (-1, -1)
    sinks: bool = False  # a sink logit per head (random values)
    lse: bool = False  # also write the per-row LSE
    head_dim_v: int = 0  # V's and O's head dim when it differs from head_dim (stage 8), else 0

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def dims_label(self) -> str:
        """``D=128``, or ``D=192/128`` for (D_qk, D_v)."""
        return f"D={self.head_dim}" + (f"/{self.dv}" if self.dv != self.head_dim else "")

    @property
    def label(self) -> str:
        label = f"B={self.batch} H={self.heads} S_q={self.seqlen_q} S_k={self.seqlen_k} {self.dims_label} {self.dtype}"
        if self.causal:
            label += " causal"
        if self.window != (-1, -1):
            label += f" window={self.window}"
        if self.sinks:
            label += " sinks"
        if self.lse:
            label += " +LSE"
        return label

    @property
    def features(self) -> dict:
        """The keyword arguments that select this shape's mask in ``attention``."""
        features = {"causal": self.causal, "window_size": self.window} if self.causal or self.window != (-1, -1) else {}
        return {**features, "return_lse": True} if self.lse else features

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs the mask lets through: the work any kernel must do."""
        import numpy as np

        left, right = validation.resolve_window(self.causal, self.window)
        diag = np.arange(self.seqlen_q) + self.seqlen_k - self.seqlen_q
        hi = np.minimum(self.seqlen_k - 1, diag + right) if right >= 0 else np.full_like(diag, self.seqlen_k - 1)
        lo = np.maximum(0, diag - left) if left >= 0 else np.zeros_like(diag)
        return int(np.clip(hi - lo + 1, 0, None).sum())

    @property
    def flops(self) -> int:
        """Two GEMMs per visible (query, key) pair and head: 2 * D flops for Q K^T, 2 * D_v for P V."""
        return 2 * self.batch * self.heads * (self.head_dim + self.dv) * self.visible_pairs

    @property
    def bytes_moved(self) -> int:
        """Q, K, V read and O written once: the least any kernel must move."""
        return 2 * self.batch * self.heads * (self.seqlen_q + self.seqlen_k) * (self.head_dim + self.dv)


@dataclass(frozen=True)
class DecodeShape:
    """One decode benchmark: B sequences of ``seqlen_k`` cached tokens, one query token each."""

    batch: int
    seqlen_k: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    paged: bool = False
    page_size: int = 64

    @property
    def label(self) -> str:
        layout = f"paged {self.page_size}" if self.paged else "contiguous"
        return (f"B={self.batch} L={self.seqlen_k} H_q={self.heads_q} H_kv={self.heads_kv} "
                f"D={self.head_dim} {self.dtype} {layout}")

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V every decode kernel must read once (2 bytes per fp16/bf16 element)."""
        return 2 * self.batch * self.seqlen_k * self.heads_kv * self.head_dim * 2


@dataclass(frozen=True)
class RaggedShape:
    """One variable-length benchmark (stage 10): sequences of their own lengths, packed back to back, with
    K and V packed too or in a paged cache of ``page_size``-token pages (0: packed)."""

    name: str
    lengths_q: tuple
    lengths_k: tuple
    heads_q: int = 16
    heads_kv: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    causal: bool = True
    page_size: int = 0

    @property
    def label(self) -> str:
        layout = f"paged {self.page_size}" if self.page_size else "packed"
        return (f"{self.name}, H_q={self.heads_q} H_kv={self.heads_kv} D={self.head_dim} {self.dtype}"
                f"{' causal' if self.causal else ''}, {layout}")

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs the mask lets through, each sequence on its own (bottom-right aligned)."""
        return sum(PrefillShape(1, 1, s_q, s_k, self.head_dim, causal=self.causal).visible_pairs
                   for s_q, s_k in zip(self.lengths_q, self.lengths_k) if s_q and s_k)

    @property
    def flops(self) -> int:
        """Two GEMMs per visible pair and query head: the useful work, whatever a kernel computes."""
        return 4 * self.heads_q * self.head_dim * self.visible_pairs

    @property
    def decode_sized(self) -> bool:
        """A few queries per sequence: a launch of microseconds, timed in CUDA graphs (host time aside)."""
        return max(self.lengths_q) <= 16
