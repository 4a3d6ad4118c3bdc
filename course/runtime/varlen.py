"""Host code of the variable-length prefill (stage 10): its configurations, cross-compile, validation and launch.

Stage 10's kernel takes packed sequences: q [total_q, H_q, D] with
``cu_seqlens_q`` [B + 1] (sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]),
and K, V either packed the same way (``cu_seqlens_k``) or in a paged cache
[num_pages, page_size, H_kv, D] with ``block_table`` [B, max_pages] and
``seqused_k`` [B]. Its call signature is

    (mQ, mK, mV, mO, mLSE, mSinks, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBlockTable, mAlibi,
     scale_log2, window_left, window_right, num_sink_tokens, write_lse, stream)

The lengths stay on the GPU: the host reads only the tensors' sizes, so a
call never waits for the GPU and a CUDA graph replays it with other lengths.
``attention_dense`` runs the same kernel on [B, S, H, D] tensors, as B
sequences of one length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from course.runtime import launch, prefill, validation
from course.runtime.compile import cross_compile, symbolic_tensor
from course.runtime.prefill import LOG2_E, KernelConfig

PAGE_SIZE_MULTIPLE = 16  # a paged copy is whole 16-row pieces of a KV tile (see VarlenConfig.page_rows)


@dataclass(frozen=True)
class VarlenConfig(KernelConfig):
    """Stage 8's ``KernelConfig`` and how K and V are read: packed, or from pages ``page_rows`` rows at a time."""

    page_rows: int = 0            # paged K/V: rows per TMA copy, gcd(KV tile, page size); 0: packed K/V
    page_gather: bool = False     # paged K/V copied row by row (cp.async) by the producer warpgroup, not by TMA
    has_seqused_k: bool = False   # packed K/V with seqused_k: the slots past it may hold anything
    has_alibi: bool = False       # ALiBi slopes: a bias on every tile's scores

    @property
    def name(self) -> str:
        """stage 8's name, then ``_p16`` (paged, 16 rows per copy; ``_p16g`` gathered) or ``_u`` (seqused_k), and
        ``_alibi``."""
        kv = f"_p{self.page_rows}" if self.page_rows else ("_u" if self.has_seqused_k else "")
        kv += "g" if self.page_gather else ""
        return super().name + kv + ("_alibi" if self.has_alibi else "")


def page_rows(tile_n: int, page_size: int) -> int:
    """Rows per paged copy: the most that divide both the KV tile and the page, so no copy crosses a page."""
    return math.gcd(tile_n, page_size)


def kernel_configs(stage: int, gathers) -> list[VarlenConfig]:
    """What stage 10's cross-compile test compiles: packed K/V with stage 8's features off and all on at
    D = 64 and 128 (fp16 and bf16), with seqused_k; paged at 16, 32, 64 and 128 rows per copy; and every
    other head dim pair paged with every feature on; paged copies gathered where ``gathers(D, D_v, rows)``
    says. The last one has every feature on."""
    every = dict(has_left=True, has_right=True, has_sink_tokens=True)
    configs = [VarlenConfig(dtype, d, **flags) for d in (64, 128) for dtype in prefill.DTYPES
               for flags in ({}, every)]
    configs += [VarlenConfig("float16", 128, has_right=True, has_seqused_k=True)]
    configs += [VarlenConfig("bfloat16", d, has_right=True, page_rows=rows) for d in (64, 128) for rows in (16, 32, 64, 128)]
    others = [pair for pair in validation.HEAD_DIMS_FROM_STAGE_8 if pair not in validation.HEAD_DIMS_BEFORE_STAGE_8]
    configs += [VarlenConfig(prefill.DTYPES[i % 2], d, head_dim_v=validation.distinct_head_dim_v(d, d_v), page_rows=16, **every)
                for i, (d, d_v) in enumerate(others)]
    configs += [VarlenConfig("bfloat16", 64, has_right=True, has_alibi=True),  # ALiBi: causal, and with everything
                VarlenConfig("float16", 128, page_rows=64, has_alibi=True, **every)]
    configs += [VarlenConfig("float16", 128, page_rows=128, **every)]
    return [replace(c, page_gather=gathers(c.head_dim, c.dv, c.page_rows)) for c in configs]


def fake_arguments(config: VarlenConfig) -> tuple:
    """The symbolic arguments one compile serves every shape with (see prefill.fake_arguments)."""
    import cutlass
    import torch

    dtype, d, dv = getattr(torch, config.dtype), config.head_dim, config.dv
    symbols: dict = {}
    q = symbolic_tensor(dtype, ("T_q", "H_q", d), symbols=symbols)
    o = symbolic_tensor(dtype, ("T_q", "H_q", dv), symbols=symbols)
    rows = ("pages", "page_size") if config.page_rows else ("T_k",)
    k = symbolic_tensor(dtype, (*rows, "H_kv", d), symbols=symbols)
    v = symbolic_tensor(dtype, (*rows, "H_kv", dv), symbols=symbols)

    def small(dtype, shape):  # no TMA reads these: any stride, 4-byte aligned
        return symbolic_tensor(dtype, shape, symbols={}, align=4, stride_divisibility=1)

    lse = small(torch.float32, (1, "h", "t"))
    sinks = symbolic_tensor(torch.float32, ("H_q",), symbols=symbols, align=4, stride_divisibility=1)
    cu_q, cu_k = small(torch.int32, ("b1",)), small(torch.int32, ("b1k",))
    seqused, table = small(torch.int32, ("b",)), small(torch.int32, ("bt", "max_pages"))
    alibi = small(torch.float32, ("H_alibi",))
    return (q, k, v, o, lse, sinks, cu_q, cu_k, seqused, table, alibi, cutlass.Float32(1.0), cutlass.Int32(0),
            cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0))


def cross_compile_config(kernel_class, config: VarlenConfig, *, stage: int, keep: bool = False):
    """Compile ``kernel_class(config)`` for sm_90a on any machine; report registers, smem, spills."""
    return cross_compile(kernel_class(config), *fake_arguments(config), name=f"stage{stage:02d}_{config.name}",
                         keep=keep)


# ---------------------------------------------------------------- the calls

_PLANS: dict = {}


def attention_varlen(stage: int, kernel_class, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     seqused_k=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                     sink_logits=None, num_sink_tokens=0, return_lse=False, out=None, check_lengths=None,
                     alibi_slopes=None, decode=None):
    """Validate (once per signature), compile once per configuration, launch; return O (and LSE [H_q, total_q]).

    With ``check_lengths`` (or ``COURSE_CHECK_LENGTHS=1``) the offsets, lengths and pages are read on
    the host and checked (``validation.check_varlen_values``): a synchronization with the GPU.
    ``decode``: a decode stage's module (stage 9's) that takes the calls ``takes_draft_tokens`` picks.
    """
    key = (kernel_class, decode, *launch.signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   seqused_k, block_table, softmax_scale, causal, window_size,
                                                   sink_logits, num_sink_tokens, return_lse, out, alibi_slopes))
    run = launch.cached_plan(_PLANS, key, lambda: plan_varlen(
        stage, kernel_class, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, return_lse=return_lse, out=out,
        alibi_slopes=alibi_slopes, decode=decode))
    if launch.check_device_values(check_lengths):
        validation.check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       seqused_k=seqused_k, block_table=block_table)
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, sink_logits, out, alibi_slopes)


def plan_varlen(stage: int, kernel_class, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                seqused_k, block_table, softmax_scale, causal, window_size, sink_logits, num_sink_tokens,
                return_lse, out, alibi_slopes=None, decode=None):
    """Everything ``attention_varlen`` does that depends only on the call's signature; returns
    ``run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, sink_logits, out, alibi_slopes)``."""
    shape = validation.check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, return_lse=return_lse, out=out)
    validation.check_per_head("alibi_slopes", alibi_slopes, shape.heads_q, validation.ALIBI_MEANING)
    validation.check_on_gpu(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                            block_table=block_table, sink_logits=sink_logits, out=out, alibi_slopes=alibi_slopes)
    if decode is not None and takes_draft_tokens(decode, shape, max_seqlen_q, causal, window_size):
        return _plan_draft_tokens(decode, shape, max_seqlen_q, causal=causal, window_size=window_size,
                                  softmax_scale=softmax_scale, num_sink_tokens=num_sink_tokens, return_lse=return_lse)
    return _plan_launch(kernel_class, q, shape, causal=causal, window_size=window_size, sink_logits=sink_logits,
                        num_sink_tokens=num_sink_tokens, softmax_scale=softmax_scale, return_lse=return_lse,
                        paged=block_table is not None, has_seqused_k=seqused_k is not None,
                        has_alibi=alibi_slopes is not None)


def _plan_launch(kernel_class, q, shape: validation.VarlenShape, *, causal, window_size, sink_logits,
                 num_sink_tokens, softmax_scale, return_lse, paged: bool, has_seqused_k: bool,
                 has_alibi: bool = False):
    import torch

    # The window clamps as in prefill, with the largest S_q and S_k any sequence can have.
    bounds = validation.AttentionShape(shape.batch, shape.total_q, shape.capacity_k, shape.heads_q, shape.heads_kv,
                                       shape.head_dim, shape.head_dim_v)
    left, right, num_sink_tokens = prefill.kernel_window(causal, window_size, num_sink_tokens, bounds)
    tiles = kernel_class.tiles_for(shape.head_dim, shape.head_dim_v)
    rows = page_rows(tiles.tile_n, shape.page_size) if paged else 0
    config = VarlenConfig(str(q.dtype).removeprefix("torch."), shape.head_dim, left >= 0, right >= 0,
                          left >= 0 and num_sink_tokens > 0,
                          validation.distinct_head_dim_v(shape.head_dim, shape.head_dim_v),
                          page_rows=rows, page_gather=kernel_class.gathers(shape.head_dim, shape.head_dim_v, rows),
                          has_seqused_k=has_seqused_k and not paged, has_alibi=has_alibi)
    kernel = launch.compiled((kernel_class, config), lambda: (kernel_class(config), fake_arguments(config)))
    device = q.device
    out_shape = (shape.total_q, shape.heads_q, shape.head_dim_v)
    no_lse = launch.placeholder(device, (1, 1, 1))
    no_sinks = launch.placeholder(device, (shape.heads_q,), fill=float("-inf"))  # a -inf sink is no sink
    no_index = launch.placeholder(device, (1, 1), dtype=torch.int32)  # an index tensor the call has not got
    scale_log2 = validation.resolve_scale(softmax_scale, shape.head_dim) * LOG2_E
    write_lse = int(bool(return_lse))

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, sink_logits, out, alibi_slopes=None):
        if out is None:
            out = q.new_empty(out_shape)
        lse = torch.empty((1, shape.heads_q, shape.total_q), device=device, dtype=torch.float32) if return_lse \
            else no_lse
        if shape.total_q:
            kernel(q, k, v, out, lse, no_sinks if sink_logits is None else sink_logits, cu_seqlens_q,
                   no_index[0] if cu_seqlens_k is None else cu_seqlens_k,
                   no_index[0] if seqused_k is None else seqused_k,
                   no_index if block_table is None else block_table,
                   no_lse[0, 0] if alibi_slopes is None else alibi_slopes,
                   scale_log2, left, right, num_sink_tokens, write_lse)
        return (out, lse[0]) if return_lse else out

    return run


# --8<-- [start:draft_tokens]
# Query rows per KV head (tokens x G) up to which a few tokens per sequence against a paged cache run on
# the decode kernel: its CTAs hold up to 64 rows (4 row tiles) and split the keys among CTAs, where a
# prefill CTA computes 128 query rows, of which tokens x G are real, over all of a sequence's keys.
DRAFT_ROWS = 64


def takes_draft_tokens(decode, shape: validation.VarlenShape, max_seqlen_q: int, causal: bool, window_size) -> bool:
    """Whether the ``decode`` stage computes this call: every sequence has max_seqlen_q query tokens
    (total_q = B x max_seqlen_q, none longer), the last ones of its keys in a paged cache, each seeing
    the keys up to its own position (causal, or one token) as the decode stage's draft tokens do, at most
    DRAFT_ROWS rows per KV head, and a head dim and page size the decode stage takes."""
    _, right = validation.resolve_window(causal, window_size)
    return (shape.page_size in decode.PAGE_SIZES and max_seqlen_q >= 1 and shape.total_q == shape.batch * max_seqlen_q
            and (right == 0 or max_seqlen_q == 1) and max_seqlen_q * shape.heads_q // shape.heads_kv <= DRAFT_ROWS
            and (shape.head_dim, shape.head_dim_v) in decode.HEAD_DIMS)


def _plan_draft_tokens(decode, shape: validation.VarlenShape, tokens: int, *, causal, window_size, softmax_scale,
                       num_sink_tokens, return_lse):
    """The call as ``decode.decode_attention`` on q [B, tokens, H_q, D] (packed rows, seen so), the cache
    lengths ``seqused_k``; O written in place, the LSE [B, H_q, tokens] returned as [H_q, total_q]."""
    left, _ = validation.resolve_window(causal, window_size)
    as_tokens = (shape.batch, tokens, shape.heads_q)

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, sink_logits, out, alibi_slopes=None):
        result = out if out is not None else q.new_empty((*q.shape[:-1], shape.head_dim_v))
        o = decode.decode_attention(q.view(*as_tokens, shape.head_dim), k, v, seqused_k, block_table=block_table,
                                    softmax_scale=softmax_scale, window_size_left=left, sink_logits=sink_logits,
                                    num_sink_tokens=num_sink_tokens, return_lse=return_lse,
                                    out=result.view(*as_tokens, shape.head_dim_v),
                                    alibi_slopes=alibi_slopes, check_lengths=False)
        if not return_lse:
            return result
        return result, o[1].permute(1, 0, 2).reshape(shape.heads_q, shape.total_q)

    return run
# --8<-- [end:draft_tokens]


# ---------------------------------------------------------------- [B, S, H, D] through the same kernel

_DENSE_PLANS: dict = {}
_OFFSETS: dict = {}


def uniform_offsets(device, batch: int, seqlen: int):
    """cu_seqlens of ``batch`` sequences of ``seqlen`` rows each, made once per (device, batch, seqlen)."""
    import torch

    key = (str(device), batch, seqlen)
    if key not in _OFFSETS:
        if len(_OFFSETS) >= launch.MAX_PLANS:
            _OFFSETS.clear()
        _OFFSETS[key] = launch.persistent(
            device, lambda: torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device))
    return _OFFSETS[key]


def attention_dense(stage: int, kernel_class, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    sink_logits=None, num_sink_tokens=0, return_lse=False, out=None, alibi_slopes=None):
    """The prefill contract on [B, S, H, D] (validated as every prefill stage does), computed as B packed
    sequences of one length: O [B, S_q, H_q, D_v] (and LSE [B, H_q, S_q])."""
    key = (kernel_class, *launch.signature(q, k, v, sink_logits, out, softmax_scale, causal, window_size,
                                           num_sink_tokens, return_lse, alibi_slopes))
    run = launch.cached_plan(_DENSE_PLANS, key, lambda: plan_dense(
        stage, kernel_class, q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, return_lse=return_lse, out=out,
        alibi_slopes=alibi_slopes))
    return run(q, k, v, sink_logits, out, alibi_slopes)


def plan_dense(stage: int, kernel_class, q, k, v, *, softmax_scale, causal, window_size, sink_logits,
               num_sink_tokens, return_lse, out, alibi_slopes=None):
    shape = validation.check_attention_inputs(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, sink_logits=sink_logits,
        num_sink_tokens=num_sink_tokens, return_lse=return_lse, out=out)
    validation.check_per_head("alibi_slopes", alibi_slopes, shape.heads_q, validation.ALIBI_MEANING)
    validation.check_on_gpu(q=q, k=k, v=v, out=out, sink_logits=sink_logits, alibi_slopes=alibi_slopes)
    b, s_q, s_k = shape.batch, shape.seqlen_q, shape.seqlen_k
    packed = validation.VarlenShape(b, b * s_q, b * s_k, shape.heads_q, shape.heads_kv, shape.head_dim,
                                    shape.head_dim_v, 0, 0)
    launch_packed = _plan_launch(kernel_class, q, packed, causal=causal, window_size=window_size,
                                 sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                                 softmax_scale=softmax_scale, return_lse=return_lse, paged=False, has_seqused_k=False,
                                 has_alibi=alibi_slopes is not None)
    device = q.device
    cu_q, cu_k = uniform_offsets(device, b, s_q), uniform_offsets(device, b, s_k)
    out_shape = (b, s_q, shape.heads_q, shape.head_dim_v)

    def run(q, k, v, sink_logits, out, alibi_slopes=None):
        result = out if out is not None else q.new_empty(out_shape)
        packed_out = result.view(b * s_q, shape.heads_q, shape.head_dim_v) if _is_viewable(result) else None
        o = launch_packed(q.reshape(b * s_q, shape.heads_q, shape.head_dim), k.reshape(b * s_k, shape.heads_kv,
                          shape.head_dim), v.reshape(b * s_k, shape.heads_kv, shape.head_dim_v), cu_q, cu_k, None,
                          None, sink_logits, packed_out, alibi_slopes)
        o, lse = o if return_lse else (o, None)
        if packed_out is None:
            result.copy_(o.view(out_shape))
        if not return_lse:
            return result
        return result, lse.view(shape.heads_q, b, s_q).transpose(0, 1).contiguous()

    return run


def _is_viewable(t) -> bool:
    """Can [B, S, H, D] ``t`` be seen as [B * S, H, D] without a copy, with 16-byte aligned strides?"""
    b, s, h, d = t.shape
    return (b == 1 or t.stride(0) == s * t.stride(1)) and t.stride(-1) == 1
