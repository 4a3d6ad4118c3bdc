"""The prefill stages' algorithms in PyTorch, tile by tile, at the kernels' tile sizes.

These run anywhere (no GPU): a learner can step through them, print the
running statistics, and see why each stage is correct before writing the
kernel. The tests check them against the float64 reference. Each model mirrors
its kernel: scores in fp32, exponentials in the exp2 domain with
scale_log2 = softmax_scale * log2(e), P rounded to the input dtype before P V.

``bug=`` injects the classic mistake of a stage, so the tests can show that the
inputs they use would catch it.
"""

from __future__ import annotations

import math

import torch

from course.runtime import validation

LOG2_E = math.log2(math.e)


def _heads_first(q, k, v):
    """[B, S, H, D] -> [B, H, S, D] float32, K/V repeated for GQA."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).float()
    kh = k.transpose(1, 2).float().repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).float().repeat_interleave(group, dim=1)
    return qh, kh, vh


def _kv_tiles(seqlen_k: int, tile_n: int, pin_tile_zero: bool = False):
    for n_block in range((seqlen_k + tile_n - 1) // tile_n):
        start = 0 if pin_tile_zero else n_block * tile_n  # the bug: a source slice pinned to tile 0
        yield n_block * tile_n, slice(start, min(start + tile_n, seqlen_k))


def two_pass(q, k, v, *, softmax_scale=None, tile_n: int = 128, bug: str | None = None):
    """Stage 2: pass 1 finds each row's max over all K tiles; pass 2 computes P with it.

    ``bug="tile0"`` loads KV tile 0 for every tile index.
    """
    qh, kh, vh = _heads_first(q, k, v)
    seqlen_k = kh.shape[2]
    scale_log2 = validation.resolve_scale(softmax_scale, q.shape[-1]) * LOG2_E
    tiles = list(_kv_tiles(seqlen_k, tile_n, pin_tile_zero=bug == "tile0"))
    row_max = torch.full(qh.shape[:-1], -math.inf)
    for start, src in tiles:  # pass 1
        scores = qh @ kh[:, :, src].transpose(-1, -2)
        row_max = torch.maximum(row_max, scores[..., : seqlen_k - start].amax(dim=-1))
    row_sum = torch.zeros_like(row_max)
    out = torch.zeros_like(qh)
    for start, src in tiles:  # pass 2
        scores = (qh @ kh[:, :, src].transpose(-1, -2))[..., : seqlen_k - start]
        p = torch.exp2(scores * scale_log2 - (row_max * scale_log2)[..., None])
        row_sum += p.sum(dim=-1)
        out += p.to(q.dtype).float() @ vh[:, :, src][:, :, : p.shape[-1]]
    return (out / row_sum[..., None]).transpose(1, 2).to(q.dtype)


def online(q, k, v, *, softmax_scale=None, tile_n: int = 128, bug: str | None = None):
    """Stage 3: one pass with a running max and sum; O and the sum are rescaled when the max grows.

    ``bug="double_scale"`` keeps the max pre-scaled and multiplies it by
    scale_log2 again in the correction.
    """
    qh, kh, vh = _heads_first(q, k, v)
    seqlen_k = kh.shape[2]
    scale_log2 = validation.resolve_scale(softmax_scale, q.shape[-1]) * LOG2_E
    row_max = torch.full(qh.shape[:-1], -math.inf)
    row_sum = torch.zeros_like(row_max)
    out = torch.zeros_like(qh)
    for start, src in _kv_tiles(seqlen_k, tile_n):
        scores = (qh @ kh[:, :, src].transpose(-1, -2))[..., : seqlen_k - start]
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        if bug == "double_scale":
            correction = torch.exp2((row_max - new_max) * scale_log2 * scale_log2)
        else:
            correction = torch.exp2((row_max - new_max) * scale_log2)
        p = torch.exp2(scores * scale_log2 - (new_max * scale_log2)[..., None])
        row_sum = row_sum * correction + p.sum(dim=-1)
        out = out * correction[..., None] + p.to(q.dtype).float() @ vh[:, :, src][:, :, : p.shape[-1]]
        row_max = new_max
    return (out / row_sum[..., None]).transpose(1, 2).to(q.dtype)


def kv_block_range(m_block: int, seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal=False,
                   tile_m: int = 128, tile_n: int = 128) -> tuple[int, int]:
    """Stage 4's [n_block_min, n_block_max) for Q tile ``m_block``, as WindowMask computes it."""
    left, right = validation.resolve_window(causal, window_size)
    offset = seqlen_k - seqlen_q
    n_block_max, n_block_min = -(-seqlen_k // tile_n), 0
    if right >= 0:
        last_row = min((m_block + 1) * tile_m, seqlen_q) - 1
        key_end = max(min(last_row + offset + right + 1, seqlen_k), 0)
        n_block_max = -(-key_end // tile_n)
    if left >= 0:
        key_start = max(m_block * tile_m + offset - left, 0)
        n_block_min = min(key_start // tile_n, n_block_max)
    return n_block_min, n_block_max


def masked_online(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
                  num_sink_tokens: int = 0, tile_m: int = 128, tile_n: int = 128):
    """Stages 4 and 5: each Q tile visits the tiles of its sink tokens, then its KV block range;
    masked scores are -inf; the sink logit joins the denominator at the end; empty rows give 0."""
    from course.testing.reference import visible_keys

    qh, kh, vh = _heads_first(q, k, v)
    seqlen_q, seqlen_k = qh.shape[2], kh.shape[2]
    scale_log2 = validation.resolve_scale(softmax_scale, q.shape[-1]) * LOG2_E
    visible = visible_keys(seqlen_q, seqlen_k, causal=causal, window_size=window_size,
                           num_sink_tokens=num_sink_tokens)
    out = torch.zeros_like(qh)
    for m_block in range(-(-seqlen_q // tile_m)):
        rows = slice(m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q))
        row_max = torch.full(qh[:, :, rows].shape[:-1], -math.inf)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(qh[:, :, rows])
        n_min, n_max = kv_block_range(m_block, seqlen_q, seqlen_k, window_size, causal, tile_m, tile_n)
        n_sink = min(-(-num_sink_tokens // tile_n), n_min) if window_size[0] >= 0 else 0
        for n_block in [*range(n_sink), *range(n_min, n_max)]:
            keys = slice(n_block * tile_n, min((n_block + 1) * tile_n, seqlen_k))
            scores = (qh[:, :, rows] @ kh[:, :, keys].transpose(-1, -2)).masked_fill(~visible[rows, keys], -math.inf)
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            ref_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)  # rows with no key yet
            correction = torch.exp2((row_max - ref_max) * scale_log2)
            p = torch.exp2(scores * scale_log2 - (ref_max * scale_log2)[..., None])
            row_sum = row_sum * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + p.to(q.dtype).float() @ vh[:, :, keys]
            row_max = new_max
        if sink_logits is None:
            inv_sum = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
        else:  # the sink joins the denominator against a common reference, as in the kernel
            sink_log2 = (sink_logits.float() * LOG2_E).view(1, -1, 1)
            top = torch.maximum(row_max * scale_log2, sink_log2)
            top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # no key, a -inf sink: not -inf - -inf
            rescale = torch.exp2(row_max * scale_log2 - top)
            denominator = row_sum * rescale + torch.exp2(sink_log2 - top)
            inv_sum = torch.where(denominator > 0, rescale / denominator, torch.zeros_like(denominator))
        out[:, :, rows] = acc * inv_sum[..., None]
    return out.transpose(1, 2).to(q.dtype)
