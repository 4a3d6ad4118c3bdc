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


def alibi_bias(seqlen_q: int, seqlen_k: int, slopes, *, dtype=torch.float64, device=None) -> torch.Tensor:
    """[1, H, S_q, S_k]: ALiBi's - slope_h x |query position - key position|, bottom-right aligned (query i
    at position i + S_k - S_q), as FlashAttention's ``alibi_slopes``. In decode every key is at or
    before the query, so this is - slope x (query position - key position)."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    return -slopes.to(device=device, dtype=dtype).view(1, -1, 1, 1) * (i - j).abs().to(dtype)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
              num_sink_tokens=0, return_lse=False, alibi_slopes=None, dtype=torch.float64):
    """O (and LSE) for q [B, S_q, H_q, D], k/v [B, S_k, H_kv, D], computed in ``dtype``.

    O is returned in ``dtype``; LSE [B, H_q, S_q] is float32 like the kernels'.
    A row with no visible key has O = 0 and LSE = -inf (or the sink logit).
    ``alibi_slopes`` [H_q] (stage 10): ``alibi_bias`` added to the scaled scores.
    """
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = validation.resolve_scale(softmax_scale, d)
    group = h_q // h_kv
    qh = q.to(dtype).transpose(1, 2)                                    # [B, H_q, S_q, D]
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)   # [B, H_q, S_k, D]
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    if alibi_slopes is not None:
        scores = scores + alibi_bias(s_q, s_k, alibi_slopes, dtype=dtype, device=q.device)
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


def cache_slot(position, *, num_sink_tokens: int = 0, cache_capacity=None):
    """The cache row of token ``position`` (an int or a tensor): the position itself, or in a rolling cache
    of ``cache_capacity`` rows the first ``num_sink_tokens`` rows fixed and the rest a ring:
    num_sink_tokens + (position - num_sink_tokens) mod (cache_capacity - num_sink_tokens)."""
    if cache_capacity is None:
        return position
    ring = cache_capacity - num_sink_tokens
    rolled = num_sink_tokens + (position - num_sink_tokens) % ring
    if isinstance(position, torch.Tensor):
        return torch.where(position < num_sink_tokens, position, rolled)
    return position if position < num_sink_tokens else rolled


def decode_keys_values(k_cache, v_cache, batch: int, positions, block_table=None, *, num_sink_tokens: int = 0,
                       cache_capacity=None):
    """The cached K and V rows [len(positions), H_kv, D] of sequence ``batch``'s tokens ``positions`` (an int n:
    tokens 0 .. n - 1).

    Token j lives in cache row ``cache_slot(j)`` (j itself unless the cache is
    rolling); a paged cache [num_pages, page_size, H_kv, D] is gathered through
    block_table[batch]: row r lives in page block_table[batch, r // page_size]
    at row r % page_size.
    """
    if isinstance(positions, int):
        positions = torch.arange(positions, device=k_cache.device)
    rows = cache_slot(positions.to(k_cache.device), num_sink_tokens=num_sink_tokens, cache_capacity=cache_capacity)
    if block_table is None:
        return k_cache[batch, rows], v_cache[batch, rows]
    page_size = k_cache.shape[1]
    pages = block_table[batch].to(device=k_cache.device, dtype=torch.long)[rows // page_size]
    return k_cache[pages, rows % page_size], v_cache[pages, rows % page_size]


def rotary(x, cos, sin, positions, interleaved: bool = False):
    """x [B, H, D] with rotary position embeddings at ``positions`` [B], in x's dtype.

    cos, sin [S_rotary, rotary_dim / 2]: the first rotary_dim columns rotate, the
    rest pass through. Column pairs (i, i + rotary_dim / 2) (GPT-NeoX, Llama,
    GPT-OSS) or (2i, 2i + 1) (``interleaved``, GPT-J) rotate by angle i:
    (a, b) -> (a cos - b sin, b cos + a sin), in float32 from x, cos and sin as
    they are (16-bit products are exact in float32: one rounding, then one to x's dtype).
    """
    half = cos.shape[-1]
    pos = positions.to(device=x.device, dtype=torch.long)
    c = cos.to(x.device).float()[pos][:, None, :]  # [B, 1, rotary_dim / 2]
    s = sin.to(x.device).float()[pos][:, None, :]
    xf = x.float()
    rot = xf[..., : 2 * half]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rotated = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rotated, xf[..., 2 * half:]), dim=-1).to(x.dtype)


APPEND_OPTIONS = ("k_new", "v_new", "rotary_cos", "rotary_sin", "rotary_interleaved", "k_scale", "v_scale",
                  "num_sink_tokens", "cache_capacity", "cache_leftpad")


def append_options(features: dict) -> dict:
    """The options of a decode call (a dict of its keyword arguments) that ``append_to_cache`` takes."""
    return {name: features[name] for name in APPEND_OPTIONS if name in features}


def append_to_cache(k_cache, v_cache, cache_seqlens, k_new, v_new, *, block_table=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved=False, k_scale=None, v_scale=None, num_sink_tokens=0,
                    cache_capacity=None, cache_leftpad=None):
    """Copies of the caches with each sequence's new token written at row cache_seqlens[b]: k_new
    rotated (with rotary_cos/sin) at its position, cache_seqlens[b] - cache_leftpad[b], both rounded to
    k_new's dtype, then quantized to the cache's dtype with its scales (``kv_cache.quantize_rows``) for
    an FP8 or int8 cache."""
    from course.runtime import kv_cache

    positions = cache_seqlens.to(device=k_new.device, dtype=torch.long)
    if rotary_cos is not None:
        k_new = rotary(k_new, rotary_cos, rotary_sin, new_token_positions(positions, cache_leftpad),
                       rotary_interleaved)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for new, scale, cache in ((k_new, k_scale, k_cache), (v_new, v_scale, v_cache)):
        rows = new
        if cache.dtype in kv_cache.QUANTIZED_DTYPES:
            rows = kv_cache.quantize_rows(new, scale.to(new.device).reshape(1, -1, 1).float(), cache.dtype)
        for b, position in enumerate(positions.tolist()):
            row = cache_slot(position, num_sink_tokens=num_sink_tokens, cache_capacity=cache_capacity)
            if block_table is None:
                cache[b, row] = rows[b].to(cache.device)
            else:
                page = int(block_table[b, row // cache.shape[1]])
                cache[page, row % cache.shape[1]] = rows[b].to(cache.device)
    return k_cache, v_cache


def padding_rows(cache_leftpad, cache_seqlens) -> torch.Tensor:
    """cache_leftpad as int64 on cache_seqlens' device (zeros when None): each sequence's padding rows."""
    if cache_leftpad is None:
        return torch.zeros_like(cache_seqlens, dtype=torch.long)
    return cache_leftpad.to(device=cache_seqlens.device, dtype=torch.long)


def new_token_positions(cache_seqlens, cache_leftpad=None) -> torch.Tensor:
    """The position (RoPE's) of each sequence's new token, int64: its row cache_seqlens[b] less the
    sequence's padding rows."""
    return cache_seqlens.long() - padding_rows(cache_leftpad, cache_seqlens)


def draft_token_seqlens(cache_seqlens, n: int, i: int, cache_leftpad=None):
    """The cache length draft token i of n sees, per sequence: the cache cut after the token's own position
    cache_seqlens[b] - n + i (never before the sequence's first row: then it sees no key)."""
    floor = padding_rows(cache_leftpad, cache_seqlens).to(cache_seqlens.dtype)
    return torch.maximum(cache_seqlens - (n - 1 - i), floor)


def decode_positions(cache_seqlens, *, window_size_left: int = -1, num_sink_tokens: int = 0, cache_leftpad=None,
                     device=None) -> list[torch.Tensor]:
    """Per sequence, the cache rows (token positions) of the keys its query sees: ``decode_visible_keys`` of
    the sequence after its padding rows, shifted past them."""
    padding = padding_rows(cache_leftpad, cache_seqlens).tolist()
    return [decode_visible_keys(seqlen - pad, window_size_left=window_size_left, num_sink_tokens=num_sink_tokens,
                                device=device).nonzero().flatten() + pad
            for seqlen, pad in zip(cache_seqlens.tolist(), padding)]


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                     window_size_left=-1, sink_logits=None, num_sink_tokens=0, return_lse=False,
                     k_scale=None, v_scale=None, k_new=None, v_new=None, rotary_cos=None, rotary_sin=None,
                     rotary_interleaved=False, alibi_slopes=None, cache_capacity=None, cache_leftpad=None,
                     dtype=torch.float64):
    """O [B, H_q, D_v] (and LSE [B, H_q] float32) of one query token per sequence, computed in ``dtype``;
    of q [B, n, H_q, D], n draft tokens per sequence, O [B, n, H_q, D] and LSE [B, H_q, n]: token i is at
    position cache_seqlens[b] - n + i and sees the keys a one-token decode of the cache cut after it sees.

    q [B, H_q, D]; k_cache, v_cache [B, S_max, H_kv, D] or paged [num_pages,
    page_size, H_kv, D] with block_table [B, max_pages] (v_cache's D is D_v); cache_seqlens [B].
    A quantized cache (FP8 or int8) comes with ``k_scale``, ``v_scale`` ([H_kv]
    or scalars): it holds K / k_scale and V / v_scale, dequantized here in ``dtype``.
    With ``k_new``, ``v_new`` [B, H_kv, D] the new token is appended first
    (``append_to_cache``, on copies) at position cache_seqlens[b], and q and
    k_new are rotated there with ``rotary_cos``/``rotary_sin`` (``rotary``).
    ``alibi_slopes`` [H_q]: score - slope * (query position - key position).
    ``cache_capacity``: a rolling cache (``cache_slot``). ``cache_leftpad`` [B]:
    sequence b is rows cache_leftpad[b] .. of its cache (the rows before are
    padding): its token j is row cache_leftpad[b] + j.
    Sequence by sequence: the visible keys from ``decode_visible_keys``, then
    the same safe softmax as ``attention`` (sink logit in the denominator
    only). A sequence with no visible key gets O = 0 and LSE = -inf (or the
    sink logit).
    """
    if q.dim() == 4:  # draft tokens: token i of n is a one-token decode of the cache cut after its position
        n = q.shape[1]
        results = [decode_attention(
            q[:, i], k_cache, v_cache, draft_token_seqlens(cache_seqlens, n, i, cache_leftpad), block_table=block_table,
            softmax_scale=softmax_scale, window_size_left=window_size_left, sink_logits=sink_logits,
            num_sink_tokens=num_sink_tokens, return_lse=True, k_scale=k_scale, v_scale=v_scale,
            alibi_slopes=alibi_slopes, cache_capacity=cache_capacity, cache_leftpad=cache_leftpad, dtype=dtype)
            for i in range(n)]
        o = torch.stack([o_i for o_i, _ in results], dim=1)
        lse = torch.stack([lse_i for _, lse_i in results], dim=-1)
        return (o, lse) if return_lse else o
    if k_new is not None:
        k_cache, v_cache = append_to_cache(
            k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=block_table, rotary_cos=rotary_cos,
            rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, k_scale=k_scale, v_scale=v_scale,
            num_sink_tokens=num_sink_tokens, cache_capacity=cache_capacity, cache_leftpad=cache_leftpad)
        if rotary_cos is not None:
            q = rotary(q, rotary_cos, rotary_sin, new_token_positions(cache_seqlens, cache_leftpad), rotary_interleaved)
        cache_seqlens = cache_seqlens + 1
    b, h_q, d = q.shape
    h_kv, d_v = k_cache.shape[2], v_cache.shape[-1]
    k_factor, v_factor = (torch.ones(1, 1, 1, dtype=dtype, device=q.device) if s is None
                          else s.to(device=q.device, dtype=dtype).reshape(1, -1, 1) for s in (k_scale, v_scale))
    group = h_q // h_kv
    scale = validation.resolve_scale(softmax_scale, d)
    o = torch.zeros(b, h_q, d_v, dtype=dtype, device=q.device)
    lse = torch.full((b, h_q), -math.inf, dtype=torch.float32, device=q.device)
    lengths = [int(n) for n in cache_seqlens.tolist()]
    visible = decode_positions(cache_seqlens, window_size_left=window_size_left, num_sink_tokens=num_sink_tokens,
                               cache_leftpad=cache_leftpad, device=q.device)
    for bi, (seqlen, positions) in enumerate(zip(lengths, visible)):
        n = len(positions)
        k, v = decode_keys_values(k_cache, v_cache, bi, positions, block_table, num_sink_tokens=num_sink_tokens,
                                  cache_capacity=cache_capacity)
        k, v = k.to(device=q.device, dtype=dtype) * k_factor, v.to(device=q.device, dtype=dtype) * v_factor
        qb = q[bi].to(dtype).view(h_kv, group, d)                          # [H_kv, G, D]
        scores = (torch.einsum("hgd,jhd->hgj", qb, k) * scale).reshape(h_q, n)
        if alibi_slopes is not None:
            distance = (seqlen - 1 - positions).to(dtype)                 # query position - key position
            scores = scores - alibi_slopes.to(device=q.device, dtype=dtype).view(h_q, 1) * distance
        row_max = scores.amax(dim=-1, keepdim=True) if n else torch.full(
            (h_q, 1), -math.inf, dtype=dtype, device=q.device)
        if sink_logits is not None:
            sink = sink_logits.to(device=q.device, dtype=dtype).view(h_q, 1)
            row_max = torch.maximum(row_max, sink)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # nothing visible
        p = torch.exp(scores - row_max)                                    # [H_q, n]
        denom = p.sum(dim=-1, keepdim=True)
        if sink_logits is not None:
            denom = denom + torch.exp(sink - row_max)
        pv = torch.einsum("hgj,jhd->hgd", p.view(h_kv, group, n), v).reshape(h_q, d_v)
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
