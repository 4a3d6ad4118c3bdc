"""The reference attention: the whole API contract in plain PyTorch, in float64 by default.

This is the ground truth every kernel is tested against, so it is written for
clarity, not speed: build the visibility mask from the definitions in
docs/contract.md, take a numerically safe softmax (with the optional sink logit in
the denominator only), and return O and the natural-log LSE.
"""

from __future__ import annotations

import math

import torch

from course.runtime import validation


def visible_keys(seqlen_q: int, seqlen_k: int, *, causal: bool = False, window_size=(-1, -1),
                 num_sink_tokens: int = 0, device=None) -> torch.Tensor:
    """Bool [S_q, S_k]: may query i attend to key j?

    Bottom-right aligned: with offset = S_k - S_q, key j is visible to query i
    iff i + offset - left <= j <= i + offset + right (-1 = unbounded side);
    causal means right = 0. Keys j < num_sink_tokens ignore the left bound.
    """
    left, right = validation.resolve_window(causal, window_size)
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
    scale = validation.resolve_scale(softmax_scale, d)
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


def attention_backward(do, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
                       num_sink_tokens=0, out=None, operands=None, dtype=torch.float64):
    """(dq, dk, dv[, dsink]) of ``attention`` by the formulas stage 11 computes, in ``dtype``:

    P = softmax(S) (the sink in the denominator), D = rowsum(dO * O), dV = P^T dO, dP = dO V^T,
    dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q (dK, dV summed over each KV head's group),
    dsink = -sum over rows of exp(sink - LSE) D. Gradients in ``dtype``, dsink float32.
    ``out``: D from this O (a 16-bit forward's, as every FlashAttention backward takes it) instead of the exact one.
    ``operands``: P and dS rounded to this dtype before the products that take them (as tensor cores do).
    """
    b, s_q, h_q, d = q.shape
    h_kv = k.shape[2]
    group = h_q // h_kv
    scale = validation.resolve_scale(softmax_scale, d)
    qh = q.to(dtype).transpose(1, 2)
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    doh = do.to(dtype).transpose(1, 2)
    exact_out, lse = attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, return_lse=True, dtype=dtype)
    out = exact_out if out is None else out
    lse = lse.to(dtype).unsqueeze(-1)
    mask = visible_keys(s_q, k.shape[1], causal=causal, window_size=window_size, num_sink_tokens=num_sink_tokens,
                        device=q.device)
    scores = ((qh @ kh.transpose(-1, -2)) * scale).masked_fill(~mask, -math.inf)
    p = torch.where(torch.isinf(lse), torch.zeros_like(scores), torch.exp(scores - lse))  # rows without keys: 0
    row_d = (doh * out.to(dtype).transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (doh @ vh.transpose(-1, -2) - row_d)
    if operands is not None:
        p, ds = p.to(operands).to(dtype), ds.to(operands).to(dtype)
    dq = scale * ds @ kh
    dk = (scale * ds.transpose(-1, -2) @ qh).view(b, h_kv, group, k.shape[1], d).sum(2)
    dv = (p.transpose(-1, -2) @ doh).view(b, h_kv, group, k.shape[1], v.shape[-1]).sum(2)
    grads = tuple(g.transpose(1, 2).contiguous() for g in (dq, dk, dv))
    if sink_logits is None:
        return grads
    p_sink = torch.exp(sink_logits.to(device=q.device, dtype=dtype).view(1, h_q, 1, 1) - lse)
    p_sink = torch.nan_to_num(p_sink, nan=0.0)  # -inf - -inf: no sink and no key
    return (*grads, -(p_sink * row_d).sum(dim=(0, 2, 3)).float())


# ---------------------------------------------------------------- decode (stage 7)

def decode_visible_keys(seqlen: int, *, window_size_left: int = -1, num_sink_tokens: int = 0,
                        device=None) -> torch.Tensor:
    """Bool [seqlen]: may the query of a sequence of ``seqlen`` cached tokens attend to key j?

    The query sits at position seqlen - 1 (the newest token), so every cached
    key j < seqlen is visible, except that a left window hides the keys with
    j < seqlen - 1 - window_size_left; keys j < num_sink_tokens stay visible.
    """
    j = torch.arange(seqlen, device=device)
    visible = torch.ones(seqlen, dtype=torch.bool, device=device)
    if window_size_left >= 0:
        visible &= (j >= seqlen - 1 - window_size_left) | (j < num_sink_tokens)
    return visible


def decode_keys_values(k_cache, v_cache, batch: int, seqlen: int, block_table=None):
    """The first ``seqlen`` cached K and V rows [seqlen, H_kv, D] of sequence ``batch``.

    A paged cache [num_pages, page_size, H_kv, D] is gathered through
    block_table[batch]: key j lives in page block_table[batch, j // page_size]
    at row j % page_size.
    """
    if block_table is None:
        return k_cache[batch, :seqlen], v_cache[batch, :seqlen]
    page_size = k_cache.shape[1]
    j = torch.arange(seqlen, device=k_cache.device)
    pages = block_table[batch].to(device=k_cache.device, dtype=torch.long)[j // page_size]
    return k_cache[pages, j % page_size], v_cache[pages, j % page_size]


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                     window_size_left=-1, sink_logits=None, num_sink_tokens=0, return_lse=False,
                     k_scale=None, v_scale=None, dtype=torch.float64):
    """O [B, H_q, D] (and LSE [B, H_q] float32) of one query token per sequence, computed in ``dtype``.

    q [B, H_q, D]; k_cache, v_cache [B, S_max, H_kv, D] or paged [num_pages,
    page_size, H_kv, D] with block_table [B, max_pages]; cache_seqlens [B].
    An FP8 cache comes with ``k_scale``, ``v_scale`` ([H_kv] or scalars): it
    holds K / k_scale and V / v_scale, dequantized here in ``dtype``.
    Sequence by sequence: the visible keys from ``decode_visible_keys``, then
    the same safe softmax as ``attention`` (sink logit in the denominator
    only). A sequence with no visible key gets O = 0 and LSE = -inf (or the
    sink logit).
    """
    b, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    k_factor, v_factor = (torch.ones(1, 1, 1, dtype=dtype, device=q.device) if s is None
                          else s.to(device=q.device, dtype=dtype).reshape(1, -1, 1) for s in (k_scale, v_scale))
    group = h_q // h_kv
    scale = validation.resolve_scale(softmax_scale, d)
    o = torch.zeros(b, h_q, d, dtype=dtype, device=q.device)
    lse = torch.full((b, h_q), -math.inf, dtype=torch.float32, device=q.device)
    lengths = [int(n) for n in cache_seqlens.tolist()]
    for bi, seqlen in enumerate(lengths):
        k, v = decode_keys_values(k_cache, v_cache, bi, seqlen, block_table)
        k, v = k.to(device=q.device, dtype=dtype) * k_factor, v.to(device=q.device, dtype=dtype) * v_factor
        qb = q[bi].to(dtype).view(h_kv, group, d)                          # [H_kv, G, D]
        scores = torch.einsum("hgd,jhd->hgj", qb, k) * scale              # [H_kv, G, L]
        mask = decode_visible_keys(seqlen, window_size_left=window_size_left,
                                   num_sink_tokens=num_sink_tokens, device=q.device)
        scores = scores.masked_fill(~mask, -math.inf).reshape(h_q, seqlen)
        row_max = scores.amax(dim=-1, keepdim=True) if seqlen else torch.full(
            (h_q, 1), -math.inf, dtype=dtype, device=q.device)
        if sink_logits is not None:
            sink = sink_logits.to(device=q.device, dtype=dtype).view(h_q, 1)
            row_max = torch.maximum(row_max, sink)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # nothing visible
        p = torch.exp(scores - row_max)                                    # [H_q, L]
        denom = p.sum(dim=-1, keepdim=True)
        if sink_logits is not None:
            denom = denom + torch.exp(sink - row_max)
        pv = torch.einsum("hgj,jhd->hgd", p.view(h_kv, group, seqlen), v).reshape(h_q, d)
        o[bi] = pv / torch.where(denom > 0, denom, torch.ones_like(denom))
        lse[bi] = (torch.log(denom) + row_max).squeeze(-1).float()
    return (o, lse) if return_lse else o


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Merge two results over disjoint key sets (docs/contract.md): returns (O float64, LSE float32).

    M = max(lse_a, lse_b) (0 if both are -inf), w = exp(lse - M),
    lse = M + log(w_a + w_b), O = (w_a O_a + w_b O_b) / (w_a + w_b); zero
    weights give O = 0 and LSE = -inf.
    """
    la, lb = lse_a.double(), lse_b.double()
    top = torch.maximum(la, lb)
    top = torch.where(torch.isinf(top) & (top < 0), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(la - top), torch.exp(lb - top)
    total = w_a + w_b
    lse = (top + torch.log(total)).float()
    safe = torch.where(total > 0, total, torch.ones_like(total))
    scale_a = (torch.where(total > 0, w_a / safe, torch.zeros_like(total))).transpose(1, 2)[..., None]
    scale_b = (torch.where(total > 0, w_b / safe, torch.zeros_like(total))).transpose(1, 2)[..., None]
    return scale_a * o_a.double() + scale_b * o_b.double(), lse
