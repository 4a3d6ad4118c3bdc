"""Testing helpers shared by every stage: inputs, NaN poisoning, the error yardstick.

The yardstick: a kernel in fp16/bf16 can't match a float64 reference exactly,
so its error is compared with the error PyTorch's own attention makes on the
same inputs in the same precision. A kernel passes when its error is within
``TOLERANCE_FACTOR`` times PyTorch's (plus a small epsilon).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from course.testing import reference

TOLERANCE_FACTOR = 2.0
EPSILON = 1e-4

# Shape sweeps shared by the stages' GPU tests.
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
GQA_HEADS = ((4, 4), (8, 2), (8, 1))  # (H_q, H_kv): ratios 1, 4, 8
# (S_q, S_k) with S_k <= 128: tile multiples, tails on both sides, S_q != S_k both ways, S_k = 1.
SINGLE_TILE_LENGTHS = ((128, 128), (1, 1), (300, 100), (77, 128), (1000, 1), (64, 127), (129, 65), (513, 37))
# Any S_k: one tile, around a tile boundary, many tiles; S_q != S_k both ways.
MULTI_TILE_LENGTHS = ((1, 1), (128, 127), (200, 128), (129, 129), (256, 256), (77, 1000), (1000, 300), (300, 4097))


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
               seed=0, kv_tile_offsets=None, head_dim_v=None):
    """Fresh N(0, 1) q, k, v (v with ``head_dim_v``, by default ``head_dim``). ``kv_tile_offsets`` (a tile
    size) shifts each KV tile's values by a different amount, so a kernel that reads the wrong tile fails loudly."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)
    q = rand(batch, seqlen_q, heads_q, head_dim)
    k = rand(batch, seqlen_k, heads_kv, head_dim)
    v = rand(batch, seqlen_k, heads_kv, head_dim if head_dim_v is None else head_dim_v)
    if kv_tile_offsets:
        tile = torch.arange(seqlen_k).div(kv_tile_offsets, rounding_mode="floor").float()
        shift = (tile % 5 - 2).view(1, seqlen_k, 1, 1)
        v = v + shift
        k = k + 0.5 * shift
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return torch.full_like(t, float("nan"))


def poisoned_decode_out(q: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """A decode call's output buffer full of NaN: q's shape with V's head dim."""
    return torch.full((*q.shape[:-1], v_cache.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)


def torch_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    sink_logits=None, num_sink_tokens=0, alibi_slopes=None):
    """PyTorch's SDPA in the inputs' precision, with the same semantics as the contract.

    Masks go in as a boolean attn_mask; a sink logit becomes an extra key with
    zero value whose score is set through an additive float mask.
    """
    import torch.nn.functional as F

    s_q, s_k, h_q = q.shape[1], k.shape[1], q.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    visible = reference.visible_keys(s_q, s_k, causal=causal, window_size=window_size,
                                     num_sink_tokens=num_sink_tokens, device=q.device)
    bias = torch.zeros(1, h_q, s_q, s_k, device=q.device, dtype=torch.float32)
    if alibi_slopes is not None:
        bias = bias + reference.alibi_bias(s_q, s_k, alibi_slopes, dtype=torch.float32, device=q.device)
    bias = bias.to(q.dtype).masked_fill(~visible, -math.inf)
    if sink_logits is not None:
        kh = torch.cat([kh, kh.new_zeros(*kh.shape[:2], 1, kh.shape[3])], dim=2)
        vh = torch.cat([vh, vh.new_zeros(*vh.shape[:2], 1, vh.shape[3])], dim=2)
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


def assert_in_ptx(ptx: str, instruction: str, why: str) -> None:
    """A compiled kernel's PTX holds ``instruction``; if not, say what is missing and why it belongs (not the PTX)."""
    if instruction not in ptx:
        raise AssertionError(f"the kernel's PTX has no {instruction}: {why}")


def assert_split_kv_decode_in_ptx(ptx: str) -> None:
    """What stage 7's and 9's decode kernels share in their PTX: 16-byte cp.async copies of the cache, and the
    last-block protocol (an acq_rel arrival, the last CTA's relaxed reset of the counter)."""
    assert_in_ptx(ptx, "cp.async.cg.shared.global", "K/V rows must stream in with 16-byte cp.async copies")
    assert_in_ptx(ptx, "atom.global.acq_rel.add", "arrival: an acq_rel atomic")
    assert_in_ptx(ptx, "st.relaxed.gpu.global", "the last CTA resets its arrival counter with a relaxed store, so "
                  "that the next launch finds 0 (arrive_and_elect_last, stage 7; page: The multi-block reduction)")


def assert_no_nan(out, where: str, index_names: str, why: str) -> None:
    """Fail with the count and the first position of NaN outputs, and what NaN means for this kernel."""
    nan = torch.isnan(out)
    if nan.any():
        idx = nan.nonzero()[0].tolist()
        raise AssertionError(f"{where}: {nan.sum().item()} of {out.numel()} outputs are NaN "
                             f"(first at {index_names} = {idx}). {why}")


def assert_attention_matches(out, q, k, v, where: str = "", **features) -> ErrorReport:
    """Fail with a message that says what is wrong when ``out`` is not a correct attention output."""
    assert_no_nan(out, where, "[b, s, h, d]",
                  "The output buffer was filled with NaN before the launch: NaN means an element was never "
                  "written (check the epilogue / tail tiles) or the softmax produced inf - inf.")
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


# ---------------------------------------------------------------- decode (stage 7)

# KV lengths for the decode tests: 1 and 2 keys, around a power of two, one past 4096, long caches.
DECODE_LENGTHS = (1, 2, 127, 128, 4097, 32768, 131072)


def random_decode_inputs(lengths, heads_q, heads_kv, head_dim, dtype, *, page_size=None, capacity=None,
                         head_dim_v=None, device="cuda", seed=0) -> dict:
    """Fresh N(0, 1) inputs of ``decode_attention``: q and a KV cache holding ``lengths[b]`` tokens of sequence b.

    Returns a dict with q, k_cache, v_cache, cache_seqlens and block_table, to
    be passed as ``decode_attention(**inputs)``. Every cache slot that no
    sequence owns is NaN, so a kernel that reads past a sequence's length (or
    outside its pages) produces NaN.

    Contiguous (``page_size=None``): k/v_cache [B, capacity, H_kv, D] with
    capacity max(lengths) + 5 by default, block_table None. Paged: the pages
    of all sequences are shuffled in one pool [num_pages, page_size, H_kv, D]
    with two spare pages; block_table [B, max_pages] int32 holds -1 past a
    sequence's last page. ``head_dim_v``: v_cache's head dim (default: D).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = [int(n) for n in lengths]
    batch = len(lengths)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(batch, heads_q, head_dim)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if page_size is None:
        capacity = capacity if capacity is not None else max(lengths) + 5
        k_cache = randn(batch, capacity, heads_kv, head_dim)
        v_cache = randn(batch, capacity, heads_kv, head_dim_v)
        for b, n in enumerate(lengths):
            k_cache[b, n:] = float("nan")
            v_cache[b, n:] = float("nan")
        return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=None)
    pages_per_seq = [-(-n // page_size) for n in lengths]
    max_pages = max(1, max(pages_per_seq))
    if capacity is not None:
        max_pages = max(max_pages, -(-capacity // page_size))
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache, v_cache = (torch.full((num_pages, page_size, heads_kv, d), float("nan"), dtype=dtype, device=device)
                        for d in (head_dim, head_dim_v))
    table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    for b, (n, pages) in enumerate(zip(lengths, pages_per_seq)):
        if not pages:
            continue
        own = torch.tensor([order.pop() for _ in range(pages)])
        table[b, :pages] = own
        for cache in (k_cache, v_cache):
            rows = randn(pages * page_size, heads_kv, cache.shape[-1])
            rows[n:] = float("nan")  # the tail of the last page belongs to nobody
            cache[own.to(device)] = rows.view(pages, page_size, heads_kv, cache.shape[-1])
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=table.to(device))


def rotary_tables(positions: int, rotary_dim: int, dtype, *, base: float = 10000.0, device="cuda"):
    """(cos, sin) [positions, rotary_dim / 2] in ``dtype``: RoPE's angles t x base^(-2i / rotary_dim)."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def alibi_slopes(heads: int, device="cuda") -> torch.Tensor:
    """ALiBi's slopes [heads] float32: 2^(-8 (h + 1) / heads) (the paper's geometric sequence)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32, device=device)


def append_decode_inputs(lengths, heads_q, heads_kv, head_dim, dtype, *, page_size=None, head_dim_v=None,
                         device="cuda", seed=0) -> dict:
    """``random_decode_inputs`` with room for one more token per sequence (the row at position
    lengths[b] is NaN, and in the cache's pages) and that token's ``k_new`` [B, H_kv, D], ``v_new``
    [B, H_kv, D_v]."""
    lengths = [int(n) for n in lengths]
    inputs = random_decode_inputs([n + 1 for n in lengths], heads_q, heads_kv, head_dim, dtype,
                                  page_size=page_size, head_dim_v=head_dim_v, device=device, seed=seed)
    for b, n in enumerate(lengths):
        for cache in (inputs["k_cache"], inputs["v_cache"]):
            if page_size is None:
                cache[b, n] = float("nan")
            else:
                cache[int(inputs["block_table"][b, n // page_size]), n % page_size] = float("nan")
    inputs["cache_seqlens"] = torch.tensor(lengths, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    new = [torch.randn(len(lengths), heads_kv, cache.shape[-1], generator=gen, device=device).to(dtype)
           for cache in (inputs["k_cache"], inputs["v_cache"])]
    return {**inputs, "k_new": new[0], "v_new": new[1]}


def rolling_decode_inputs(lengths, capacity: int, heads_q, heads_kv, head_dim, dtype, *, page_size=None,
                          device="cuda", seed=0) -> dict:
    """Decode inputs on a rolling cache of ``capacity`` rows per sequence (``cache_capacity``): every row a
    sequence has written holds a token (the latest one of its slot), rows it has not reached yet are NaN.
    Lengths may exceed the capacity. Paged: the same rows in ceil(capacity / page_size) shuffled pages per
    sequence."""
    lengths = [int(n) for n in lengths]
    rows = capacity if page_size is None else -(-capacity // page_size) * page_size  # whole pages
    inputs = random_decode_inputs([min(n, capacity) for n in lengths], heads_q, heads_kv, head_dim, dtype,
                                  capacity=rows, device=device, seed=seed)
    if page_size is not None:  # page p of sequence b goes to pool page order[b * pages + p]
        order = torch.randperm(len(lengths) * rows // page_size, generator=torch.Generator().manual_seed(seed))
        for name in ("k_cache", "v_cache"):
            pages = inputs[name].reshape(-1, page_size, heads_kv, head_dim)
            inputs[name] = torch.empty_like(pages)
            inputs[name][order.to(device)] = pages
        inputs["block_table"] = order.view(len(lengths), -1).to(device=device, dtype=torch.int32)
    inputs["cache_seqlens"] = torch.tensor(lengths, dtype=torch.int32, device=device)
    return inputs


def torch_decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                           window_size_left=-1, sink_logits=None, num_sink_tokens=0, alibi_slopes=None,
                           cache_capacity=None, cache_leftpad=None):
    """PyTorch's SDPA in the inputs' precision, sequence by sequence, with the decode contract's masks, sink,
    ALiBi bias, rolling cache and left padding (no append: ``compare_decode_with_reference`` appends first);
    draft tokens (q [B, n, H_q, D]) one token at a time, as the reference takes them."""
    import torch.nn.functional as F

    options = dict(block_table=block_table, softmax_scale=softmax_scale, window_size_left=window_size_left,
                   sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, alibi_slopes=alibi_slopes,
                   cache_capacity=cache_capacity, cache_leftpad=cache_leftpad)
    if q.dim() == 4:
        n = q.shape[1]
        return torch.stack([torch_decode_attention(
            q[:, i], k_cache, v_cache, reference.draft_token_seqlens(cache_seqlens, n, i, cache_leftpad), **options)
            for i in range(n)], dim=1)

    h_q, h_kv = q.shape[1], k_cache.shape[2]
    out = q.new_zeros((*q.shape[:-1], v_cache.shape[-1]))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    visible = reference.decode_positions(cache_seqlens, window_size_left=window_size_left,
                                         num_sink_tokens=num_sink_tokens, cache_leftpad=cache_leftpad, device=q.device)
    for b, (seqlen, positions) in enumerate(zip(cache_seqlens.tolist(), visible)):
        k, v = reference.decode_keys_values(k_cache, v_cache, b, positions, block_table,
                                            num_sink_tokens=num_sink_tokens, cache_capacity=cache_capacity)
        kh, vh = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]          # [1, H_kv, n, D]
        bias = torch.zeros(1, h_q, 1, len(positions), device=q.device, dtype=torch.float32)
        if alibi_slopes is not None:
            bias = bias - alibi_slopes.float().view(1, h_q, 1, 1) * (seqlen - 1 - positions).float()
        bias = bias.to(q.dtype)
        if sink_logits is not None:
            kh = torch.cat([kh, kh.new_zeros(1, h_kv, 1, kh.shape[3])], dim=2)
            vh = torch.cat([vh, vh.new_zeros(1, h_kv, 1, vh.shape[3])], dim=2)
            bias = torch.cat([bias, sink_logits.to(q.dtype).view(1, h_q, 1, 1)], dim=-1)
        if kh.shape[2] == 0:
            continue  # no key and no sink: O = 0
        o = F.scaled_dot_product_attention(q[b][None, :, None, :], kh, vh, attn_mask=bias, scale=scale,
                                           enable_gqa=h_kv != h_q)
        out[b] = torch.nan_to_num(o[0, :, 0], nan=0.0)
    return out


APPEND_FEATURES = ("k_new", "v_new", "rotary_cos", "rotary_sin", "rotary_interleaved")


def appended_decode_inputs(inputs: dict, features: dict) -> tuple[dict, dict]:
    """(inputs, features) of the same decode step with the new token already appended: the caches (copies)
    hold it (``reference.append_to_cache``), q is rotated, cache_seqlens counts it, and the append
    options are gone. Without ``k_new``: the arguments unchanged."""
    if features.get("k_new") is None:
        return inputs, {k: v for k, v in features.items() if k not in APPEND_FEATURES}
    k_cache, v_cache = reference.append_to_cache(inputs["k_cache"], inputs["v_cache"], inputs["cache_seqlens"],
                                                 block_table=inputs.get("block_table"),
                                                 **reference.append_options(features))
    q = inputs["q"]
    if features.get("rotary_cos") is not None:
        positions = reference.new_token_positions(inputs["cache_seqlens"], features.get("cache_leftpad"))
        q = reference.rotary(q, features["rotary_cos"], features["rotary_sin"], positions,
                             features.get("rotary_interleaved", False))
    return ({**inputs, "q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": inputs["cache_seqlens"] + 1},
            {k: v for k, v in features.items() if k not in APPEND_FEATURES})


def compare_decode_with_reference(out, *, q, k_cache, v_cache, cache_seqlens, block_table=None,
                                  **features) -> ErrorReport:
    """Errors of a decode output and of PyTorch's own attention against the float64 reference.

    A quantized cache (``k_scale``, ``v_scale`` among the features): the reference
    dequantizes it in float64, and PyTorch's attention runs in q's dtype on the
    same dequantized cache, so the tolerance is PyTorch's error on the values
    the quantized cache stands for. A fused append (``k_new``): both run on the
    cache with the new token appended and q rotated as the contract says.
    """
    from course.runtime import kv_cache

    inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table)
    inputs, features = appended_decode_inputs(inputs, features)
    ref = reference.decode_attention(**inputs, **features).float()
    k_scale, v_scale = features.pop("k_scale", None), features.pop("v_scale", None)
    if k_scale is not None:
        inputs.update(k_cache=kv_cache.dequantize(inputs["k_cache"], k_scale, q.dtype),
                      v_cache=kv_cache.dequantize(inputs["v_cache"], v_scale, q.dtype))
    baseline = torch_decode_attention(**inputs, **features).float()
    diff = (out.float() - ref).abs()
    base = (baseline - ref).abs()
    return ErrorReport(diff.max().item(), diff.mean().item(), base.max().item(), base.mean().item())


LSE_TOLERANCE = 1e-3  # natural-log units; the kernels compute LSE in fp32 from fp16/bf16 scores


def assert_lse_close(lse, ref_lse, where: str, index_names: str) -> None:
    """An LSE against the reference's: no NaN, -inf exactly where the reference has it, within LSE_TOLERANCE."""
    if torch.isnan(lse).any():
        raise AssertionError(f"{where}: LSE has NaN at {index_names} = {torch.isnan(lse).nonzero()[0].tolist()}")
    inf_ref, inf_out = torch.isneginf(ref_lse), torch.isneginf(lse)
    if not torch.equal(inf_ref, inf_out):
        idx = (inf_ref != inf_out).nonzero()[0].tolist()
        raise AssertionError(f"{where}: LSE at {index_names} = {idx} is {lse[tuple(idx)].item()}, the reference "
                             f"{ref_lse[tuple(idx)].item()} (-inf exactly when no key and no sink)")
    err = (lse[~inf_ref] - ref_lse[~inf_ref]).abs()
    if err.numel() and err.max().item() > LSE_TOLERANCE:
        raise AssertionError(f"{where}: LSE differs from the reference by up to {err.max().item():.2e} "
                             f"(tolerance {LSE_TOLERANCE})")


def assert_decode_matches(out, inputs: dict, where: str = "", lse=None, **features) -> ErrorReport:
    """Fail with a readable message when a decode output (and LSE) is not what the reference computes."""
    names = "[b, token, h, d]" if out.dim() == 4 else "[b, h, d]"
    assert_no_nan(out, where, names,
                  "The output was NaN before the launch and the cache is NaN past every sequence's length: NaN "
                  "means an element was never written, a key past the length (or outside the sequence's pages) "
                  "was read, or a merge computed inf - inf or 0/0.")
    report = compare_decode_with_reference(out, **inputs, **features)
    if not report.ok:
        ref = reference.decode_attention(**inputs, **features).float()
        worst = (out.float() - ref).abs().flatten().argmax().item()
        idx = [int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape)]
        lengths = inputs["cache_seqlens"].tolist()
        raise AssertionError(
            f"{where}: output differs from the reference: {report}. Worst element at {names} = {idx} "
            f"(sequence length {lengths[idx[0]]})."
        )
    if lse is not None:
        _, ref_lse = reference.decode_attention(**inputs, **features, return_lse=True)
        assert_lse_close(lse, ref_lse, where, "[b, h, token]" if out.dim() == 4 else "[b, h]")
    return report


# ---------------------------------------------------------------- variable-length prefill (stage 10)

def random_varlen_inputs(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, *, page_size=None,
                         head_dim_v=None, seqused=False, device="cuda", seed=0) -> dict:
    """Fresh N(0, 1) inputs of ``attention_varlen``: sequence b has ``lengths_q[b]`` queries and
    ``lengths_k[b]`` keys. Returns the keyword arguments of the call.

    Packed (``page_size=None``): q, k, v packed back to back with cu_seqlens_q/k; with ``seqused``
    every sequence gets 3 more key rows than it uses, NaN, and seqused_k. Paged: k, v are a pool of
    shuffled pages [num_pages, page_size, H_kv, D] (two spare pages) with block_table (-1 past a
    sequence's pages) and seqused_k; every slot no sequence owns is NaN, so a kernel that reads past
    a sequence's keys produces NaN.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths_q, lengths_k = [int(n) for n in lengths_q], [int(n) for n in lengths_k]
    dv = head_dim if head_dim_v is None else head_dim_v

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def offsets(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    total_q = sum(lengths_q)
    inputs = dict(q=randn(total_q, heads_q, head_dim), cu_seqlens_q=offsets(lengths_q),
                  max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    if page_size is None:
        rows = [n + 3 for n in lengths_k] if seqused else lengths_k
        k, v = randn(sum(rows), heads_kv, head_dim), randn(sum(rows), heads_kv, dv)
        cu_k = offsets(rows)
        if seqused:
            for b, n in enumerate(lengths_k):
                k[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
                v[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
        used = torch.tensor(lengths_k, dtype=torch.int32, device=device) if seqused else None
        return dict(inputs, k=k, v=v, cu_seqlens_k=cu_k, seqused_k=used, block_table=None)
    decode = random_decode_inputs(lengths_k, heads_kv, heads_kv, head_dim, dtype, page_size=page_size,
                                  device=device, seed=seed + 1)
    k, v = decode["k_cache"], decode["v_cache"]
    if dv != head_dim:  # V's own head dim: the same pages, other values
        v = torch.where(k[..., :1].isnan(), float("nan"), randn(*k.shape[:-1], dv))
    return dict(inputs, k=k, v=v, cu_seqlens_k=None, seqused_k=decode["cache_seqlens"],
                block_table=decode["block_table"])


def varlen_sequences(inputs: dict):
    """(b, q, k, v) of each sequence of an ``attention_varlen`` call, as [1, S, H, D] tensors."""
    cu_q = inputs["cu_seqlens_q"].tolist()
    used = inputs["seqused_k"].tolist() if inputs["seqused_k"] is not None else None
    for b in range(len(cu_q) - 1):
        q = inputs["q"][cu_q[b]:cu_q[b + 1]]
        if inputs["block_table"] is not None:
            k, v = reference.decode_keys_values(inputs["k"], inputs["v"], b, used[b], inputs["block_table"])
        else:
            start = int(inputs["cu_seqlens_k"][b])
            end = start + used[b] if used is not None else int(inputs["cu_seqlens_k"][b + 1])
            k, v = inputs["k"][start:end], inputs["v"][start:end]
        yield b, q[None], k[None], v[None]


def assert_varlen_matches(out, inputs: dict, where: str = "", lse=None, **features) -> ErrorReport:
    """Fail with a readable message when an ``attention_varlen`` output (and LSE) is not what the float64
    reference computes for each sequence on its own; the tolerance is PyTorch's error on the same sequences."""
    assert_no_nan(out, where, "[row, h, d]",
                  "The output was NaN before the launch and every cache slot past a sequence's keys is NaN: NaN means "
                  "a row was never written (its sequence's last tile?), or a key past the sequence was read.")
    ref, base = torch.zeros_like(out, dtype=torch.float32), torch.zeros_like(out, dtype=torch.float32)
    ref_lse = torch.full(out.shape[1::-1], -math.inf)
    cu_q = inputs["cu_seqlens_q"].tolist()
    for b, q, k, v in varlen_sequences(inputs):
        rows = slice(cu_q[b], cu_q[b + 1])
        if q.shape[1] == 0:
            continue
        if k.shape[1] == 0:  # no key: O = 0, and LSE is the sink logit (or -inf without one)
            sink = features.get("sink_logits")
            o = q.new_zeros(1, q.shape[1], q.shape[2], v.shape[-1], dtype=torch.float64)
            lse_b = (sink.float().view(-1, 1) if sink is not None else torch.full((q.shape[2], 1), -math.inf))
            lse_b = lse_b.cpu().expand(q.shape[2], q.shape[1])[None]
            base[rows] = 0.0
        else:
            o, lse_b = reference.attention(q, k, v, **features, return_lse=True)
            base[rows] = torch_attention(q, k, v, **features)[0].float()
        ref[rows] = o[0].float()
        ref_lse[:, rows] = lse_b[0].cpu()
    diff, base_diff = (out.float() - ref).abs(), (base - ref).abs()
    report = ErrorReport(diff.max().item(), diff.mean().item(), base_diff.max().item(), base_diff.mean().item())
    if not report.ok:
        row, h, d = (int(i) for i in torch.unravel_index(diff.flatten().argmax().cpu(), out.shape))
        b = max(i for i in range(len(cu_q) - 1) if cu_q[i] <= row)
        raise AssertionError(f"{where}: output differs from the reference: {report}. Worst element at [row, h, d] = "
                             f"{[row, h, d]}: row {row - cu_q[b]} of sequence {b}.")
    if lse is not None:
        if tuple(lse.shape) != tuple(ref_lse.shape) or lse.dtype != torch.float32:
            raise AssertionError(f"{where}: LSE has shape {tuple(lse.shape)} and dtype {lse.dtype}; expected "
                                 f"[H_q, total_q] = {list(ref_lse.shape)} float32")
        lse = lse.cpu()
        assert_lse_close(lse, ref_lse, where, "[h, row]")
    return report


# ---------------------------------------------------------------- the backward pass (stage 11)

GRADIENT_NAMES = ("dq", "dk", "dv", "dsink")


def reference_gradients(q, k, v, do, *, sink_logits=None, **features) -> tuple:
    """dq, dk, dv (and dsink) of the float64 reference by autograd: the ground truth of stage 11."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sink = None if sink_logits is None else sink_logits.detach().double().requires_grad_()
    with torch.enable_grad():  # also when called inside a backward pass
        out = reference.attention(*leaves, sink_logits=sink, **features)
        out.backward(do.double())
    grads = [t.grad for t in leaves]
    return tuple(grads if sink is None else grads + [sink.grad])


def torch_gradients(q, k, v, do, *, sink_logits=None, **features) -> tuple:
    """The same gradients from PyTorch's SDPA in q's precision: the yardstick of the backward's error.

    A sink logit is SDPA's extra key of value zero whose score comes from the additive mask
    (``torch_attention``); dsink is the mask's gradient there.
    """
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if sink_logits is not None:
        leaves.append(sink_logits.detach().float().requires_grad_())
    out = torch_attention(*leaves[:3], sink_logits=leaves[3] if sink_logits is not None else None, **features)
    return tuple(torch.nan_to_num(g, nan=0.0) for g in torch.autograd.grad(out, leaves, do))


def assert_gradients_match(grads, q, k, v, do, where: str = "", *, out=None, **features) -> list[ErrorReport]:
    """Each gradient: no NaN, and within TOLERANCE_FACTOR of PyTorch's error against the float64 reference.

    PyTorch's error is the largest of these, per gradient: SDPA's backward (``torch_gradients``), and the
    backward formulas in float64 with the FlashAttention algorithm's own roundings (``reference.attention_backward``
    with ``out`` and ``operands``): D = rowsum(dO * O) from a 16-bit O, P and dS rounded to 16 bits
    where they enter the products, as every FlashAttention backward (FA2-4, cuDNN) takes them, and the
    gradients returned in the kernel's dtype. The 16-bit O is SDPA's and, when given, ``out``: the O the
    backward under test was handed (its forward's). D inherits that O's rounding, and which way each element
    rounded is luck: dsink, a sum of a few rows' D per head, moves by 2x between two equally accurate O's.
    The forward's own checks hold O to the yardstick. dS = P (dP - D)
    cancels where P is near 1 (one key and a sink logit); SDPA's math path, which SDPA takes for sink logits
    (an additive mask), differentiates the softmax instead and does not inherit that error.
    """
    refs = reference_gradients(q, k, v, do, **features)
    sdpa = torch_gradients(q, k, v, do, **features)
    inherited_errors = [reference.attention_backward(do, q, k, v, out=o, operands=q.dtype, **features)
                        for o in (torch_attention(q, k, v, **features), out) if o is not None]
    if len(grads) != len(refs):
        raise AssertionError(f"{where}: {len(grads)} gradients returned; expected {len(refs)} "
                             f"({', '.join(GRADIENT_NAMES[:len(refs)])})")
    reports = []
    for name, grad, ref, base, *inherited in zip(GRADIENT_NAMES, grads, refs, sdpa, *inherited_errors):
        if tuple(grad.shape) != tuple(ref.shape):
            raise AssertionError(f"{where}: {name} has shape {tuple(grad.shape)}; expected {tuple(ref.shape)}")
        assert_no_nan(grad, f"{where} {name}", "its index",
                      "The gradient buffers were filled with NaN before the launch: NaN means an element was never "
                      "written (dK and dV of a KV tile no Q tile sees must still be stored), or P was computed "
                      "as exp(inf - inf) for a row without keys (its LSE is -inf: the preprocess makes it +inf).")
        diff = (grad.double() - ref).abs()
        # the gradients a kernel returns are 16-bit (dsink float32)
        yardsticks = [(t.to(grad.dtype).double() - ref).abs() for t in (base, *inherited)]
        report = ErrorReport(diff.max().item(), diff.mean().item(), max(y.max().item() for y in yardsticks),
                             max(y.mean().item() for y in yardsticks))
        if not report.ok:
            worst = [int(i) for i in torch.unravel_index(diff.flatten().argmax(), grad.shape)]
            raise AssertionError(f"{where}: {name} differs from the float64 reference's gradient: {report}. "
                                 f"Worst element at {worst}.")
        reports.append(report)
    return reports
