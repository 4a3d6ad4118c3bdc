"""Testing helpers shared by every stage: inputs, NaN poisoning, the error yardstick.

The yardstick: a kernel in fp16/bf16 can't match a float64 reference exactly,
so its error is compared with the error PyTorch's own attention makes on the
same inputs in the same precision. A kernel passes when its error is within
``TOLERANCE_FACTOR`` times PyTorch's (plus a small epsilon).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course import reference

TOLERANCE_FACTOR = 2.0
EPSILON = 1e-4

# Shape sweeps shared by the stages' GPU tests.
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
GQA_HEADS = ((4, 4), (8, 2), (8, 1))  # (H_q, H_kv): ratios 1, 4, 8
# (S_q, S_k) with S_k <= 128: tile multiples, tails on both sides, S_q != S_k both ways, S_k = 1.
SINGLE_TILE_LENGTHS = ((128, 128), (1, 1), (300, 100), (77, 128), (1000, 1), (64, 127), (129, 65), (513, 37))


def gpu_skip_reason() -> str | None:
    """Why GPU tests can't run here, or None when a Hopper GPU and the DSL are present."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine: GPU tests need a Hopper GPU (sm_90); the CPU tests still run"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"GPU is {torch.cuda.get_device_name()} (sm_{major}{minor}); these kernels need Hopper (sm_90)"
    try:
        import cutlass  # noqa: F401
    except ImportError as error:
        return f"the CuTe DSL (nvidia-cutlass-dsl) does not import: {error}"
    return None


def random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, *, device="cuda",
               seed=0, kv_tile_offsets=None):
    """Fresh N(0, 1) q, k, v. ``kv_tile_offsets`` (a tile size) shifts each KV tile's
    values by a different amount, so a kernel that reads the wrong tile fails loudly."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)
    q = rand(batch, seqlen_q, heads_q, head_dim)
    k = rand(batch, seqlen_k, heads_kv, head_dim)
    v = rand(batch, seqlen_k, heads_kv, head_dim)
    if kv_tile_offsets:
        tile = torch.arange(seqlen_k).div(kv_tile_offsets, rounding_mode="floor").float()
        shift = (tile % 5 - 2).view(1, seqlen_k, 1, 1)
        v = v + shift
        k = k + 0.5 * shift
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return torch.full_like(t, float("nan"))


def torch_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    sink_logits=None, num_sink_tokens=0):
    """PyTorch's SDPA in the inputs' precision, with the same semantics as the contract.

    Masks go in as a boolean attn_mask; a sink logit becomes an extra key with
    zero value whose score is set through an additive float mask.
    """
    import torch.nn.functional as F

    s_q, s_k, h_q = q.shape[1], k.shape[1], q.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    visible = reference.visible_keys(s_q, s_k, causal=causal, window_size=window_size,
                                     num_sink_tokens=num_sink_tokens, device=q.device)
    bias = torch.zeros(1, h_q, s_q, s_k, device=q.device, dtype=q.dtype).masked_fill(~visible, -math.inf)
    if sink_logits is not None:
        zeros = kh.new_zeros(kh.shape[0], kh.shape[1], 1, kh.shape[3])
        kh, vh = torch.cat([kh, zeros], dim=2), torch.cat([vh, zeros], dim=2)
        sink = sink_logits.to(q.dtype).view(1, h_q, 1, 1).expand(1, h_q, s_q, 1)
        bias = torch.cat([bias, sink], dim=-1)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=softmax_scale,
                                       enable_gqa=kh.shape[1] != h_q)
    return torch.nan_to_num(o.transpose(1, 2), nan=0.0)  # SDPA gives NaN for rows with no visible key


@dataclass
class ErrorReport:
    max_error: float
    mean_error: float
    torch_max_error: float
    torch_mean_error: float

    @property
    def limit_max(self) -> float:
        return TOLERANCE_FACTOR * self.torch_max_error + EPSILON

    @property
    def limit_mean(self) -> float:
        return TOLERANCE_FACTOR * self.torch_mean_error + EPSILON

    @property
    def ok(self) -> bool:
        return self.max_error <= self.limit_max and self.mean_error <= self.limit_mean

    def __str__(self) -> str:
        return (f"max error {self.max_error:.2e} (limit {self.limit_max:.2e}), mean error "
                f"{self.mean_error:.2e} (limit {self.limit_mean:.2e}); PyTorch in the same precision: "
                f"max {self.torch_max_error:.2e}, mean {self.torch_mean_error:.2e}")


def compare_with_reference(out, q, k, v, **features) -> ErrorReport:
    """Errors of ``out`` and of PyTorch's own attention against the float64 reference."""
    ref = reference.attention(q, k, v, **features).float()
    baseline = torch_attention(q, k, v, **features).float()
    diff = (out.float() - ref).abs()
    base = (baseline - ref).abs()
    return ErrorReport(diff.max().item(), diff.mean().item(), base.max().item(), base.mean().item())


def assert_attention_matches(out, q, k, v, where: str = "", **features) -> ErrorReport:
    """Fail with a message that says what is wrong when ``out`` is not a correct attention output."""
    nan = torch.isnan(out)
    if nan.any():
        idx = nan.nonzero()[0].tolist()
        raise AssertionError(
            f"{where}: {nan.sum().item()} of {out.numel()} outputs are NaN (first at [b, s, h, d] = {idx}). "
            "The output buffer was filled with NaN before the launch: NaN means an element was never "
            "written (check the epilogue / tail tiles) or the softmax produced inf - inf."
        )
    report = compare_with_reference(out, q, k, v, **features)
    if not report.ok:
        ref = reference.attention(q, k, v, **features).float()
        worst = (out.float() - ref).abs().flatten().argmax().item()
        idx = list(torch.unravel_index(torch.tensor(worst), out.shape))
        raise AssertionError(
            f"{where}: output differs from the reference: {report}. Worst element at [b, s, h, d] = "
            f"{[int(i) for i in idx]}."
        )
    return report
