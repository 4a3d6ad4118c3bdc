"""The reference attention: the whole API contract in plain PyTorch, in float64 by default.

This is the ground truth every kernel is tested against, so it is written for
clarity, not speed: build the visibility mask from the definitions in
COURSE.md, take a numerically safe softmax (with the optional sink logit in
the denominator only), and return O and the natural-log LSE.
"""

from __future__ import annotations

import math

import torch


def visible_keys(seqlen_q: int, seqlen_k: int, *, causal: bool = False, window_size=(-1, -1),
                 num_sink_tokens: int = 0, device=None) -> torch.Tensor:
    """Bool [S_q, S_k]: may query i attend to key j?

    Bottom-right aligned: with offset = S_k - S_q, key j is visible to query i
    iff i + offset - left <= j <= i + offset + right (-1 = unbounded side);
    causal means right = 0. Keys j < num_sink_tokens ignore the left bound.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= (j >= diag - left) | (j < num_sink_tokens)
    return visible


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
              num_sink_tokens=0, return_lse=False, dtype=torch.float64):
    """O (and LSE) for q [B, S_q, H_q, D], k/v [B, S_k, H_kv, D], computed in ``dtype``.

    O is returned in ``dtype``; LSE [B, H_q, S_q] is float32 like the kernels'.
    A row with no visible key has O = 0 and LSE = -inf (or the sink logit).
    """
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = h_q // h_kv
    qh = q.to(dtype).transpose(1, 2)                                    # [B, H_q, S_q, D]
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)   # [B, H_q, S_k, D]
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    mask = visible_keys(s_q, s_k, causal=causal, window_size=window_size,
                        num_sink_tokens=num_sink_tokens, device=q.device)
    scores = scores.masked_fill(~mask, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    if sink_logits is not None:
        sink = sink_logits.to(device=q.device, dtype=dtype).view(1, h_q, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # empty rows
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    if sink_logits is not None:
        denom = denom + torch.exp(sink - row_max)
    o = (p @ vh) / torch.where(denom > 0, denom, torch.ones_like(denom))
    o = o.transpose(1, 2).contiguous()
    if not return_lse:
        return o
    lse = (torch.log(denom) + row_max).squeeze(-1).float()             # log(0) = -inf for empty rows
    return o, lse
