"""Input validation for the attention API contract (docs/contract.md).

Every stage calls these before launching anything, so bad input fails with a
message that says what was wrong and what is accepted, never inside a kernel.
The contract's two rules that every other module applies too live here once:
``resolve_window`` (causal means right = 0) and ``resolve_scale`` (the
default softmax scale). So do the checks that every entry point shares
(prefill ``attention``, ``merge_attention_states``, ``decode_attention``):
scalar options, integer ranges, empty sizes, outputs that overlap themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_DTYPES = ("torch.float16", "torch.bfloat16")
FP8_CACHE_DTYPE = "torch.float8_e4m3fn"  # the FP8 KV cache (stage 9): the cache holds K / k_scale, V / v_scale
INT8_CACHE_DTYPE = "torch.int8"          # the int8 KV cache (stage 9), symmetric, with the same scales
QUANTIZED_CACHE_DTYPES = (FP8_CACHE_DTYPE, INT8_CACHE_DTYPE)
FP8_STAGE = (9, "tensor-core decode with an FP8 KV cache")
# What stage 9 adds to decode besides its quantized caches: the serving step's extras.
DECODE_EXTRAS_STAGE = (9, "tensor-core decode: fused append and RoPE, ALiBi, rolling cache, left padding, "
                          "int8 cache, draft tokens, head dims 80, 96, 192 and 192 for q and k with 128 for v")
# Decode head dims (D_qk, D_v) as the prefill ones: what stage 7's decode takes, then stage 9's, which adds 80
# and 96 (Phi-2, Phi-3), 192, and (192, 128) (DeepSeek-V2/V3's MLA with its K and V expanded, as transformers
# runs it); its kernel computes them as 128 and 256, zeros past the real columns.
DECODE_HEAD_DIMS = ((64, 64), (128, 128), (256, 256))
DECODE_HEAD_DIMS_FROM_STAGE_9 = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))


def decode_head_dims(stage: int) -> tuple[tuple[int, int], ...]:
    """The (D_qk, D_v) pairs decode takes in ``stage``."""
    return DECODE_HEAD_DIMS_FROM_STAGE_9 if stage >= DECODE_EXTRAS_STAGE[0] else DECODE_HEAD_DIMS


INT32_MAX = 2**31 - 1  # the kernels take window sizes, sink-token and split counts as 32-bit ints
# The kernels multiply scores by softmax_scale * log2(e) as a float32: it must be a normal float32
# (a zero or denormal scale turns a masked score into -inf * 0 = NaN, an infinite one every score).
FLOAT32_MIN_NORMAL, FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127
SCALE_RANGE = (FLOAT32_MIN_NORMAL / math.log2(math.e), FLOAT32_MAX / math.log2(math.e))

# The stage that adds each optional feature; earlier stages reject it.
FEATURE_STAGE = {
    "causal": (4, "in-kernel sliding-window and causal masking"),
    "window_size": (4, "in-kernel sliding-window and causal masking"),
    "sink_logits": (5, "attention sinks"),
    "num_sink_tokens": (5, "attention sinks"),
    "return_lse": (6, "per-row LSE"),
    "seqlen_k": (2, "multi-tile TMA loading"),  # more keys than one KV tile holds
    "head_dim": (8, "FA3-class prefill"),  # head dims other than 64 and 128 (HEAD_DIMS_FROM_STAGE_8)
}
# Prefill head dims (D_qk, D_v): stages 1-7 take the first two, stage 8 all of them (its TILES).
HEAD_DIMS_BEFORE_STAGE_8 = ((64, 64), (128, 128))
HEAD_DIMS_FROM_STAGE_8 = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))


def distinct_head_dim_v(head_dim: int, head_dim_v: int) -> int:
    """V's head dim as shapes and kernel configurations store it: 0 unless it differs from ``head_dim``, so
    that (128, 128) and 128 are one shape and one compiled kernel."""
    return 0 if head_dim_v == head_dim else head_dim_v


def describe_dims(d: int, d_v: int) -> str:
    """e.g. "head_dim 96", or "head_dim 192 for q and k with 128 for v"."""
    return f"head_dim {d}" if d == d_v else f"head_dim {d} for q and k with {d_v} for v"


def describe_head_dims(pairs) -> str:
    """e.g. "64, 128, or 192 for q and k with 128 for v"."""
    same = [str(d) for d, d_v in pairs if d == d_v]
    split = [f"{d} for q and k with {d_v} for v" for d, d_v in pairs if d != d_v]
    return ", ".join(same) + "".join(f", or {text}" for text in split)


def resolve_window(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) with -1 for an unbounded side: causal is the right bound 0 (bottom-right aligned)."""
    left, right = window_size
    return (left, 0) if causal else (left, right)


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale: ``softmax_scale`` when given, else 1 / sqrt(head_dim)."""
    return float(softmax_scale) if softmax_scale is not None else head_dim ** -0.5


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int  # V's and O's head dim: head_dim unless the stage takes a split pair such as (192, 128)


def _check_tensor(name: str, t, *, rank: int, layout: str, dtypes=SUPPORTED_DTYPES) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(t.shape)} (rank {t.dim()}); expected rank {rank}: {layout}")
    if str(t.dtype) not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(dtypes)}")
    if t.numel() == 0:
        return  # no memory to lay out; the caller rejects the empty size by name
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} has stride {t.stride()}: its last dimension (head dim) must be contiguous "
            "(stride 1); call .contiguous() first"
        )
    per_16_bytes = 16 // t.element_size()
    if any(s % per_16_bytes for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(
            f"{name} has strides {t.stride()} and address {t.data_ptr():#x}: 16-byte copies need a 16-byte "
            f"aligned base and strides that are multiples of {per_16_bytes} elements; call .contiguous() first"
        )


def _check_not_empty(name: str, t, dims: tuple[str, ...]) -> None:
    """Every size of ``t`` is at least 1: an empty grid dimension fails to launch, an empty head count divides by 0."""
    empty = [dim for dim, size in zip(dims, t.shape) if size == 0]
    if empty:
        raise ValueError(f"empty input: {name} has shape {tuple(t.shape)} = [{', '.join(dims)}] with "
                         f"{' and '.join(f'{dim} = 0' for dim in empty)}; every size must be at least 1")


def _overlaps_itself(t) -> bool:
    """Could two indices of ``t`` map to one address? Sorted by stride, each dimension must step past
    everything the smaller ones span (a sufficient test: it also refuses exotic interleaved layouts)."""
    span = 0  # the largest offset the dimensions seen so far reach
    for stride, size in sorted((stride, size) for stride, size in zip(t.stride(), t.shape) if size > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _check_out(out, like, like_name: str, *, layout: str, shape=None) -> None:
    """An output buffer: the layout rules of an input, ``like``'s dtype, its shape (``shape`` when
    given, else ``like``'s), and no element written twice."""
    _check_tensor("out", out, rank=like.dim(), layout=layout)
    if out.dtype != like.dtype:
        raise TypeError(f"out has dtype {out.dtype}; expected {like.dtype} like {like_name}")
    expected = tuple(like.shape) if shape is None else tuple(shape)
    if tuple(out.shape) != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {expected} like {like_name}")
    if _overlaps_itself(out):
        raise ValueError(f"out has shape {tuple(out.shape)} and strides {out.stride()}: two of its elements share "
                         "one address (a zero stride, as in an expanded view), so the kernel's writes would collide; "
                         "out must not overlap itself: pass a fresh tensor (torch.empty) or call .contiguous()")


def _check_softmax_scale(softmax_scale) -> None:
    """None (1/sqrt(head_dim)) or a positive finite number whose float32 scale * log2(e) is a normal number."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    low, high = SCALE_RANGE
    if not low <= softmax_scale <= high:  # also false for NaN
        raise ValueError(f"softmax_scale is {softmax_scale!r}; expected a positive finite float from {low:.3g} to "
                         f"{high:.3g} (the kernels use it in float32), or None for 1/sqrt(head_dim)")


def _is_int32(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= INT32_MAX


def check_int32(name: str, value, *, minimum: int) -> None:
    """An int option the kernels take as a 32-bit int: from ``minimum`` to 2**31 - 1."""
    if not _is_int32(value, minimum):
        raise ValueError(f"{name} must be an int from {minimum} to {INT32_MAX} (a 32-bit int); got {value!r}")


def _check_flag(name: str, value) -> None:
    """A switch such as ``causal``: a string or a tensor would silently count as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")


def _check_window_size(window_size) -> None:
    """A pair (left, right) of 32-bit ints from -1 (-1: that side unbounded)."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(_is_int32(w, -1) for w in window_size)):
        raise ValueError(f"window_size must be a pair (left, right) of ints from -1 to {INT32_MAX} (-1 = unbounded); "
                         f"got {window_size!r}")


def check_attention_inputs(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
                           num_sink_tokens=0, return_lse=False, out=None,
                           head_dims=HEAD_DIMS_FROM_STAGE_8) -> AttentionShape:
    """Validate q, k, v ([B, S_q, H_q, D], [B, S_k, H_kv, D], [B, S_k, H_kv, D_v]) and the options; return the sizes.

    ``head_dims``: the (D, D_v) pairs of the contract; a stage that has not got one yet rejects it in
    ``reject_later_features``. Devices are checked separately by ``check_on_gpu``, right before a launch.
    """
    bshd = "[batch, seqlen, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, rank=4, layout=bshd)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match in [batch, "
                         "seqlen, heads] (their head dims may differ only as a supported pair, such as 192 and 128)")
    _check_not_empty("q", q, ("batch", "S_q", "H_q", "head_dim"))
    _check_not_empty("k", k, ("batch", "S_k", "H_kv", "head_dim"))
    b, s_q, h_q, d = q.shape
    b_k, s_k, h_kv, d_k = k.shape
    if b_k != b:
        raise ValueError(f"q has batch {b} but k/v have batch {b_k}")
    d_v = v.shape[-1]
    if d_k != d:
        raise ValueError(f"q has head_dim {d} but k has head_dim {d_k}; they must match")
    if (d, d_v) not in head_dims:
        raise ValueError(f"{describe_dims(d, d_v)} is not supported; supported: {describe_head_dims(head_dims)}")
    if h_q % h_kv:
        raise ValueError(
            f"q has {h_q} heads and k/v have {h_kv}: H_q must be a multiple of H_kv (GQA/MQA)"
        )
    _check_softmax_scale(softmax_scale)
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    _check_window_size(window_size)
    check_int32("num_sink_tokens", num_sink_tokens, minimum=0)
    check_per_head("sink_logits", sink_logits, h_q, SINK_LOGITS_MEANING)
    if out is not None:
        _check_out(out, q, "q with v's head_dim", layout=bshd, shape=(b, s_q, h_q, d_v))
    return AttentionShape(b, s_q, s_k, h_q, h_kv, d, d_v)


def check_merge_inputs(o_a, lse_a, o_b, lse_b, *, out=None, head_dims=(64, 128)) -> None:
    """Two partial results to merge: O [B, S, H, D] fp16/bf16 and LSE [B, H, S] float32, matching."""
    import torch

    bshd = "[batch, seqlen, heads, head_dim]"
    for name, t in (("o_a", o_a), ("o_b", o_b)):
        _check_tensor(name, t, rank=4, layout=bshd)
    if o_a.dtype != o_b.dtype:
        raise TypeError(f"o_a has dtype {o_a.dtype} but o_b has {o_b.dtype}; they must share one dtype")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a has shape {tuple(o_a.shape)} but o_b has {tuple(o_b.shape)}; they must match")
    _check_not_empty("o_a", o_a, ("batch", "S", "H", "head_dim"))
    if o_a.shape[-1] not in head_dims:
        raise ValueError(f"head_dim {o_a.shape[-1]} is not supported; supported: {', '.join(map(str, head_dims))}")
    b, s, h, _ = o_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float32 (as attention(..., return_lse=True) "
                            "returns it)")
        if t.shape != (b, h, s) or t.stride(-1) != 1:
            raise ValueError(f"{name} has shape {tuple(t.shape)} and strides {t.stride()}; expected [B, H, S] = "
                             f"[{b}, {h}, {s}] with S contiguous (as attention(..., return_lse=True) returns it)")
    if out is not None:
        _check_out(out, o_a, "o_a", layout=bshd)


def check_on_gpu(**tensors) -> None:
    """All tensors on one CUDA device (checked last, so CPU tests reach every other check)."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    for name, device in devices.items():
        if device.type != "cuda":
            raise ValueError(f"{name} is on {device}; the kernels need CUDA tensors (move them with .cuda())")
    if len(set(devices.values())) > 1:
        found = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one CUDA device; got {found}")


def reject_later_features(stage: int, *, causal=False, window_size=(-1, -1), sink_logits=None,
                          num_sink_tokens=0, return_lse=False, seqlen_k=0, max_seqlen_k=None,
                          head_dims=(128, 128)) -> None:
    """Raise NotImplementedError for a feature that a later stage adds.

    ``max_seqlen_k``: the most keys the stage's kernel takes (one KV tile in
    stage 1), or None for any number. ``head_dims``: the call's (D, D_v).
    """
    used = {
        "causal": bool(causal),
        "window_size": tuple(window_size) != (-1, -1),
        "sink_logits": sink_logits is not None,
        "num_sink_tokens": num_sink_tokens != 0,
        "return_lse": bool(return_lse),
        "seqlen_k": max_seqlen_k is not None and seqlen_k > max_seqlen_k,
        "head_dim": tuple(head_dims) not in HEAD_DIMS_BEFORE_STAGE_8,
    }
    for feature, on in used.items():
        added_in, title = FEATURE_STAGE[feature]
        if on and added_in > stage:
            if feature == "seqlen_k":
                raise NotImplementedError(
                    f"stage {stage} handles S_k <= {max_seqlen_k} keys (one KV tile); got S_k = {seqlen_k}. "
                    f"Stage {added_in} ({title}) adds the loop over KV tiles."
                )
            if feature == "head_dim":
                raise NotImplementedError(
                    f"{describe_dims(*head_dims)} is not implemented in stage {stage}, which takes "
                    f"{describe_head_dims(HEAD_DIMS_BEFORE_STAGE_8)}; stage {added_in} ({title}) takes "
                    f"{describe_head_dims(HEAD_DIMS_FROM_STAGE_8)}"
                )
            raise NotImplementedError(
                f"{feature} is not implemented in stage {stage}; stage {added_in} ({title}) adds it"
            )


# ---------------------------------------------------------------- backward (stage 11)

BACKWARD_HEAD_DIMS = HEAD_DIMS_FROM_STAGE_8  # every head dim of the forward it differentiates


def check_backward_inputs(do, q, k, v, o, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                          sink_logits=None, num_sink_tokens=0, dq=None, dk=None, dv=None,
                          deterministic=False) -> AttentionShape:
    """Validate the forward's inputs and options (the prefill rules), then dO, O, the LSE and the gradient
    buffers (stage 11's ``attention_backward``); return the sizes."""
    import torch

    shape = check_attention_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   sink_logits=sink_logits, num_sink_tokens=num_sink_tokens)
    bshd = "[batch, seqlen_q, heads_q, head_dim]"
    o_shape = (shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim_v)
    for name, t in (("do", do), ("o", o)):
        _check_tensor(name, t, rank=4, layout=bshd)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected {q.dtype} like q")
        if tuple(t.shape) != o_shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {o_shape}, the forward's output")
    lse_shape = (shape.batch, shape.heads_q, shape.seqlen_q)
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor (the forward's, from return_lse=True); got {type(lse).__name__}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse has shape {tuple(lse.shape)} and dtype {lse.dtype}; expected {lse_shape} = "
                         "[B, H_q, S_q] float32, as attention(..., return_lse=True) returns it")
    for name, buffer, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buffer is not None:
            _check_tensor(name, buffer, rank=4, layout="like " + {"dq": "q", "dk": "k", "dv": "v"}[name])
            if buffer.dtype != like.dtype or buffer.shape != like.shape:
                raise ValueError(f"{name} has shape {tuple(buffer.shape)} and dtype {buffer.dtype}; expected "
                                 f"{tuple(like.shape)} and {like.dtype}, like the input it is the gradient of")
            if _overlaps_itself(buffer):
                raise ValueError(f"{name} has strides {buffer.stride()}: two of its elements share one address; "
                                 "pass a fresh tensor (torch.empty)")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False; got {deterministic!r}")
    return shape


# ---------------------------------------------------------------- decode (stage 7)

@dataclass(frozen=True)
class DecodeInputShape:
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    capacity: int     # the most keys one sequence can have: S_max, or max_pages * page_size
    page_size: int    # 0 for a contiguous cache
    num_pages: int    # 0 for a contiguous cache
    appends: bool = False      # k_new, v_new: the call writes one row per sequence at cache_seqlens[b]
    rotary_dim: int = 0        # columns rotary_cos/sin rotate (0: no RoPE)
    rotary_positions: int = 0  # rows of rotary_cos/sin: positions 0 .. rotary_positions - 1
    rolling: int = 0           # cache_capacity of a rolling cache, 0 for a linear one
    queries: int = 1           # query tokens per sequence: n of q [B, n, H_q, D] (draft tokens), else 1
    head_dim_v: int = 0        # V's and O's head dim, 0 for head_dim (a split pair such as (192, 128))

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim


def _check_index_tensor(name: str, t, *, rank: int, layout: str) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.int32 ({layout})")
    if t.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(t.shape)} (rank {t.dim()}); expected rank {rank}: {layout}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} has stride {t.stride()}: its last dimension must be contiguous; "
                         "call .contiguous() first")


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                        window_size_left=-1, sink_logits=None, num_sink_tokens=0, num_splits=0, return_lse=False,
                        out=None, head_dims=None, page_sizes=(16, 32, 64, 128, 256), k_scale=None,
                        v_scale=None, stage=7, max_token_stride=None, k_new=None, v_new=None, rotary_cos=None,
                        rotary_sin=None, rotary_interleaved=False, alibi_slopes=None,
                        cache_capacity=None, cache_leftpad=None) -> DecodeInputShape:
    """Validate the decode API's arguments (shapes, dtypes, options); return the sizes.

    Only metadata is read here. The lengths themselves (values of
    cache_seqlens and block_table) are checked by ``check_decode_lengths``,
    the FP8 scales' values by ``check_kv_scale_values``. ``stage``: the
    calling stage; an FP8 or int8 cache (and its scales), the fused append
    (``k_new``, ``v_new``, with ``rotary_cos``/``rotary_sin``), ``alibi_slopes``,
    a rolling cache (``cache_capacity``) and left padding (``cache_leftpad``) need stage 9.
    ``max_token_stride``: the stage's bound on the caches' token stride
    (dimension 1), in elements, if its copies step between tokens with 32-bit offsets.
    ``head_dims``: what the stage takes (default: ``decode_head_dims(stage)``).
    """
    import torch

    head_dims = decode_head_dims(stage) if head_dims is None else head_dims

    queries = _check_decode_q(q, stage)
    cache_layout = ("[batch, S_max, heads_kv, head_dim] (contiguous cache) or "
                    "[num_pages, page_size, heads_kv, head_dim] with a block_table (paged cache)")
    quantized = any(isinstance(t, torch.Tensor) and str(t.dtype) in QUANTIZED_CACHE_DTYPES for t in (k_cache, v_cache))
    if (quantized or k_scale is not None or v_scale is not None) and stage < FP8_STAGE[0]:
        raise NotImplementedError(f"a quantized KV cache (float8_e4m3fn or int8 with k_scale, v_scale) is not "
                                  f"implemented in stage {stage}; stage {FP8_STAGE[0]} ({FP8_STAGE[1]}) adds it")
    extras = {"k_new": k_new, "v_new": v_new, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
              "alibi_slopes": alibi_slopes, "cache_capacity": cache_capacity, "cache_leftpad": cache_leftpad}
    given = [name for name, value in extras.items() if value is not None] + (["rotary_interleaved"]
                                                                             if rotary_interleaved else [])
    if given and stage < DECODE_EXTRAS_STAGE[0]:
        raise NotImplementedError(f"{given[0]} is not implemented in stage {stage}; stage {DECODE_EXTRAS_STAGE[0]} "
                                  f"({DECODE_EXTRAS_STAGE[1]}) adds it")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, rank=4, layout=cache_layout, dtypes=(*SUPPORTED_DTYPES, *QUANTIZED_CACHE_DTYPES))
    if quantized:
        if not (k_cache.dtype == v_cache.dtype):
            raise TypeError(f"k_cache and v_cache must share one dtype; got k_cache {k_cache.dtype}, "
                            f"v_cache {v_cache.dtype}")
    elif not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache must share one dtype; got q {q.dtype}, k_cache {k_cache.dtype}, "
                        f"v_cache {v_cache.dtype}")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)} but v_cache has {tuple(v_cache.shape)}; "
                         "they must match but for the head dim")
    if max_token_stride is not None:
        _check_token_stride(k_cache, v_cache, max_token_stride, stage)
    _check_not_empty("q", q, ("batch", "tokens", "H_q", "head_dim") if q.dim() == 4 else ("batch", "H_q", "head_dim"))
    slot_dims = ("batch", "S_max") if block_table is None else ("num_pages", "page_size")
    _check_not_empty("k_cache", k_cache, (*slot_dims, "H_kv", "head_dim"))
    b, h_q, d = q.shape[0], q.shape[-2], q.shape[-1]
    rows, slots, h_kv, d_k = k_cache.shape
    d_v = v_cache.shape[-1]
    if d_k != d:
        raise ValueError(f"q has head_dim {d} but k_cache has head_dim {d_k}; they must match")
    if (d, d_v) not in head_dims:
        if (d, d_v) in DECODE_HEAD_DIMS_FROM_STAGE_9 and stage < DECODE_EXTRAS_STAGE[0]:
            raise NotImplementedError(f"{describe_dims(d, d_v)} is not implemented in stage {stage}'s decode (it "
                                      f"takes {describe_head_dims(head_dims)}); stage {DECODE_EXTRAS_STAGE[0]} "
                                      f"({DECODE_EXTRAS_STAGE[1]}) adds it")
        raise ValueError(f"{describe_dims(d, d_v)} is not supported; supported: "
                         f"{describe_head_dims(head_dims)}")
    if h_q % h_kv:
        raise ValueError(f"q has {h_q} heads and the cache has {h_kv}: H_q must be a multiple of H_kv (GQA/MQA)")
    _check_index_tensor("cache_seqlens", cache_seqlens, rank=1, layout="[batch] int32")
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries; expected one per sequence ({b})")
    if block_table is None:
        if rows != b:
            raise ValueError(
                f"k_cache has {rows} rows in dimension 0 but q has batch {b}. A contiguous cache is "
                "[batch, S_max, heads_kv, head_dim]; for a paged cache [num_pages, page_size, heads_kv, "
                "head_dim] pass block_table"
            )
        capacity, page_size, num_pages = slots, 0, 0
    else:
        _check_index_tensor("block_table", block_table, rank=2, layout="[batch, max_pages] int32")
        if block_table.shape[0] != b:
            raise ValueError(f"block_table has {block_table.shape[0]} rows; expected one per sequence ({b})")
        if block_table.shape[1] == 0:
            raise ValueError("block_table has 0 columns: every sequence needs room for at least one page")
        page_size, num_pages = slots, rows
        if page_size not in page_sizes:
            raise ValueError(f"page size {page_size} (k_cache.shape[1] of a paged cache) is not supported; "
                             f"supported: {', '.join(map(str, page_sizes))}")
        capacity = block_table.shape[1] * page_size
    _check_softmax_scale(softmax_scale)
    check_int32("window_size_left", window_size_left, minimum=-1)
    check_int32("num_sink_tokens", num_sink_tokens, minimum=0)
    check_int32("num_splits", num_splits, minimum=0)
    _check_flag("return_lse", return_lse)
    check_per_head("sink_logits", sink_logits, h_q, SINK_LOGITS_MEANING)
    _check_kv_scales(k_scale, v_scale, quantized=quantized, cache_dtype=k_cache.dtype, heads_kv=h_kv)
    if out is not None:
        _check_out(out, q, "q with v's head_dim", shape=(*q.shape[:-1], d_v),
                   layout="[batch, heads_q, head_dim_v] or [batch, tokens, heads_q, head_dim_v]")
    check_per_head("alibi_slopes", alibi_slopes, h_q, ALIBI_MEANING)
    rotary_dim, rotary_positions = _check_append(q, k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved,
                                                 heads_kv=h_kv, head_dim_v=d_v)
    if k_new is not None and queries > 1:
        raise ValueError(f"k_new and v_new append one token per sequence, but q has {queries} (shape "
                         f"{tuple(q.shape)} = [batch, tokens, heads_q, head_dim]): write draft tokens' K and V into "
                         "the cache first and pass cache_seqlens with them, or pass one query token")
    rolling = _check_rolling(cache_capacity, capacity, window_size_left, num_sink_tokens, queries)
    if cache_leftpad is not None:
        _check_index_tensor("cache_leftpad", cache_leftpad, rank=1, layout="[batch] int32")
        if cache_leftpad.shape[0] != b:
            raise ValueError(f"cache_leftpad has {cache_leftpad.shape[0]} entries; expected one per sequence ({b})")
        if rolling:
            raise ValueError("cache_leftpad (left-padded sequences) and cache_capacity (a rolling cache) do not go "
                             "together: a rolling cache's rows follow token positions from 0; pass one of them")
    return DecodeInputShape(b, h_q, h_kv, d, capacity, page_size, num_pages, k_new is not None, rotary_dim,
                            rotary_positions, rolling, queries, distinct_head_dim_v(d, d_v))


def _check_decode_q(q, stage: int) -> int:
    """q [batch, heads_q, head_dim], or from stage 9 [batch, tokens, heads_q, head_dim] (draft tokens: the
    last ``tokens`` positions of each sequence). Returns the tokens per sequence."""
    import torch

    if isinstance(q, torch.Tensor) and q.dim() == 4:
        if stage < DECODE_EXTRAS_STAGE[0]:
            raise NotImplementedError(
                f"q of shape {tuple(q.shape)}, several query tokens per sequence ([batch, tokens, heads_q, "
                f"head_dim], draft tokens), is not implemented in stage {stage}; stage {DECODE_EXTRAS_STAGE[0]} "
                f"({DECODE_EXTRAS_STAGE[1]}) adds it. Here q is [batch, heads_q, head_dim]")
        _check_tensor("q", q, rank=4, layout="[batch, tokens, heads_q, head_dim]")
        return q.shape[1]
    layout = "[batch, heads_q, head_dim]"
    if stage >= DECODE_EXTRAS_STAGE[0]:
        layout += " or, with draft tokens, [batch, tokens, heads_q, head_dim]"
    _check_tensor("q", q, rank=3, layout=layout)
    return 1


ROTARY_DIM_MULTIPLE = 16  # the kernel rotates q and k_new 8 columns at a time, each half of rotary_dim whole


def _check_append(q, k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved, *, heads_kv: int,
                  head_dim_v: int) -> tuple[int, int]:
    """The fused append's arguments: k_new [B, H_kv, D] and v_new [B, H_kv, D_v] in q's dtype, both or neither;
    rotary_cos and
    rotary_sin [positions, rotary_dim / 2] in q's dtype, both or neither, only with k_new. Returns
    (rotary_dim, positions), (0, 0) without RoPE."""
    import torch

    _check_flag("rotary_interleaved", rotary_interleaved)
    if (k_new is None) != (v_new is None):
        raise ValueError("pass k_new and v_new together (the new token's K and V rows, [batch, heads_kv, head_dim]), "
                         "or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass rotary_cos and rotary_sin together ([positions, rotary_dim / 2] each), or neither")
    if rotary_interleaved and rotary_cos is None:
        raise ValueError("rotary_interleaved chooses how rotary_cos/sin rotate k_new and q; it needs them")
    if k_new is None:
        if rotary_cos is not None:
            raise ValueError("rotary_cos and rotary_sin rotate the new token's q and k: pass k_new and v_new too "
                             "(rotate q yourself when the cache is already written)")
        return 0, 0
    b, d = q.shape[0], q.shape[-1]
    for name, t, width in (("k_new", k_new, d), ("v_new", v_new, head_dim_v)):
        layout = f"[batch, heads_kv, head_dim] = [{b}, {heads_kv}, {width}], q's dtype"
        _check_tensor(name, t, rank=3, layout=layout)
        if t.dtype != q.dtype or tuple(t.shape) != (b, heads_kv, width):
            raise ValueError(f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}; expected {layout} ({q.dtype})")
    if rotary_cos is None:
        return 0, 0
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            _check_tensor(name, t, rank=2, layout="[positions, rotary_dim / 2] in q's dtype")  # says what is wrong
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected q's dtype {q.dtype} (the products with 16-bit "
                            "cos and sin are exact in float32, so the rotated rows are the reference's bit for bit)")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos has shape {tuple(rotary_cos.shape)} but rotary_sin has "
                         f"{tuple(rotary_sin.shape)}; they must match")
    positions, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
    if positions == 0 or rotary_dim == 0 or rotary_dim > d or rotary_dim % ROTARY_DIM_MULTIPLE:
        raise ValueError(f"rotary_cos has shape {tuple(rotary_cos.shape)}: rotary_dim = 2 x {rotary_cos.shape[1]} "
                         f"= {rotary_dim}; expected at least one position and a rotary_dim that is a multiple of "
                         f"{ROTARY_DIM_MULTIPLE} from {ROTARY_DIM_MULTIPLE} to head_dim ({d})")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _check_tensor(name, t, rank=2, layout="[positions, rotary_dim / 2] in q's dtype")
    return rotary_dim, positions


SINK_LOGITS_MEANING = "one natural-log logit per query head"
ALIBI_MEANING = "one slope per query head: the bias is -slope x |query position - key position|"


def check_per_head(name: str, t, heads: int, meaning: str) -> None:
    """An optional float32 [heads] contiguous tensor."""
    import torch

    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float32 ({meaning})")
    if t.shape != (heads,) or t.stride() != (1,):
        raise ValueError(f"{name} has shape {tuple(t.shape)} and strides {t.stride()}; expected a contiguous "
                         f"[{heads}] float32 tensor ({meaning})")


def _check_rolling(cache_capacity, rows: int, window_size_left: int, num_sink_tokens: int, queries: int = 1) -> int:
    """A rolling cache: cache_capacity rows of the cache hold token t at row t (t < num_sink_tokens) or
    num_sink_tokens + (t - num_sink_tokens) mod (cache_capacity - num_sink_tokens), which keeps every key the
    windows of the last ``queries`` tokens can see only when window_size_left + queries <= cache_capacity -
    num_sink_tokens. Returns the capacity (0: a linear cache)."""
    if cache_capacity is None:
        return 0
    check_int32("cache_capacity", cache_capacity, minimum=1)
    if cache_capacity > rows:
        raise ValueError(f"cache_capacity = {cache_capacity} is more than the cache's {rows} rows per sequence "
                         "(S_max, or max_pages x page_size)")
    if window_size_left < 0 or window_size_left + queries > cache_capacity - num_sink_tokens:
        drafts = f" for each of the {queries} query tokens" if queries > 1 else ""
        raise ValueError(
            f"a rolling cache of cache_capacity = {cache_capacity} rows keeps the {num_sink_tokens} sink tokens and "
            f"the last {cache_capacity - num_sink_tokens} tokens; it needs a window that fits{drafts}: "
            f"window_size_left from 0 to {cache_capacity - num_sink_tokens - queries}; got {window_size_left}")
    return cache_capacity


def _check_token_stride(k_cache, v_cache, limit: int, stage: int) -> None:
    """The step from one cache token to the next (dimension 1) is below ``limit`` elements."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[1] > 1 and t.stride(1) >= limit:
            raise ValueError(
                f"{name} has strides {t.stride()}: from one token to the next (dimension 1) is {t.stride(1)} "
                f"elements; stage {stage} steps between tokens with 32-bit offsets and accepts token strides "
                f"below {limit} elements (a cache laid out [.., tokens, H_kv, D] steps H_kv x D per token)"
            )


def _check_kv_scales(k_scale, v_scale, *, quantized: bool, cache_dtype, heads_kv: int) -> None:
    """A quantized cache needs both scales: float32, [H_kv] or a scalar tensor; a 16-bit cache takes none."""
    import torch

    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale describe a quantized cache (torch.float8_e4m3fn or torch.int8); "
                             f"the cache is {cache_dtype}, so pass neither")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"a {cache_dtype} cache needs {name}: the cache holds K / k_scale and V / v_scale "
                             "(course.runtime.kv_cache.quantize_kv_cache returns both)")
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (float32, [H_kv] or a scalar); got {type(scale).__name__}")
        if str(scale.dtype) != "torch.float32":
            raise TypeError(f"{name} has dtype {scale.dtype}; expected torch.float32")
        if tuple(scale.shape) not in ((), (heads_kv,)):
            raise ValueError(f"{name} has shape {tuple(scale.shape)}; expected [H_kv] = [{heads_kv}] "
                             "(one scale per KV head) or a scalar tensor")


def check_kv_scale_values(k_scale, v_scale) -> None:
    """The FP8 scales' values: finite and > 0 (a 0 scale erases the cache, NaN or inf poisons every output).

    Reads the scales on the host: one device-to-host copy each, skipped inside CUDA graph capture.
    """
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        values = scale.detach().to("cpu").reshape(-1)
        bad = (~(values.isfinite() & (values > 0))).nonzero()
        if len(bad):
            h = int(bad[0])
            raise ValueError(f"{name}[{h}] = {float(values[h])}; scales must be finite and > 0")


def check_decode_values(cache_seqlens, block_table, shape: DecodeInputShape, k_scale=None, v_scale=None,
                        cache_leftpad=None) -> None:
    """The values a decode call's tensors hold: the lengths and pages (``check_decode_lengths``) and the
    FP8 scales (``check_kv_scale_values``). Reads them on the host: a synchronization with the GPU."""
    check_decode_lengths(cache_seqlens, block_table, shape, cache_leftpad)
    check_kv_scale_values(k_scale, v_scale)


def check_decode_lengths(cache_seqlens, block_table, shape: DecodeInputShape, cache_leftpad=None) -> None:
    """The values: 0 <= cache_seqlens[b] <= capacity (one less with a fused append, which writes row
    cache_seqlens[b]; any length in a rolling cache), 0 <= cache_leftpad[b] <= cache_seqlens[b], a
    rotated position (cache_seqlens[b] - cache_leftpad[b]) within rotary_cos, and every page a sequence
    uses is in the pool.

    Reads cache_seqlens (and block_table) on the host: one device-to-host copy
    each when they live on the GPU. A length of 0 is allowed (no visible key:
    O = 0, LSE = -inf, or the sink logit with sinks).
    """
    import torch

    lengths = cache_seqlens.detach().to("cpu", torch.int64)
    negative = (lengths < 0).nonzero()
    if len(negative):
        b = int(negative[0])
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])} is negative; lengths must be >= 0")
    keys = lengths + 1 if shape.appends else lengths  # the rows the call reads (and writes)
    too_long = (keys > shape.capacity).nonzero()
    if not shape.rolling and len(too_long):
        b = int(too_long[0])
        where = ("S_max = k_cache.shape[1]" if block_table is None
                 else "max_pages * page_size = block_table.shape[1] * k_cache.shape[1]")
        appended = " plus the appended token" if shape.appends else ""
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])}{appended} is larger than the cache: at most "
                         f"{shape.capacity} keys ({where})")
    padding = torch.zeros_like(lengths)
    if cache_leftpad is not None:
        padding = cache_leftpad.detach().to("cpu", torch.int64)
        outside = ((padding < 0) | (padding > lengths)).nonzero()
        if len(outside):
            b = int(outside[0])
            raise ValueError(f"cache_leftpad[{b}] = {int(padding[b])} is outside the sequence's rows 0 .. "
                             f"cache_seqlens[{b}] = {int(lengths[b])}: it is the row of its first real token "
                             "(the number of padding rows before it)")
    if shape.rotary_positions:
        positions = lengths - padding
        beyond = (positions >= shape.rotary_positions).nonzero()
        if len(beyond):
            b = int(beyond[0])
            position = f"cache_seqlens[{b}]" + ("" if cache_leftpad is None else f" - cache_leftpad[{b}]")
            raise ValueError(f"{position} = {int(positions[b])} is the new token's position, but rotary_cos and "
                             f"rotary_sin have {shape.rotary_positions} rows (positions 0 .. "
                             f"{shape.rotary_positions - 1})")
    if block_table is not None:
        rows = keys.clamp(max=shape.rolling) if shape.rolling else keys
        table = block_table.detach().to("cpu", torch.int64)
        needed = (rows + shape.page_size - 1) // shape.page_size
        used = torch.arange(table.shape[1])[None, :] < needed[:, None]
        bad = (used & ((table < 0) | (table >= shape.num_pages))).nonzero()
        if len(bad):
            b, p = (int(i) for i in bad[0])
            raise ValueError(f"block_table[{b}, {p}] = {int(table[b, p])} is not a page of the cache "
                             f"(0 <= page < {shape.num_pages}), and sequence {b} (length {int(lengths[b])}) uses it")


# ---------------------------------------------------------------- variable-length prefill (stage 10)

VARLEN_STAGE = (10, "variable-length and paged prefill")


@dataclass(frozen=True)
class VarlenShape:
    batch: int
    total_q: int
    capacity_k: int   # the most keys one sequence can have: total_k, or max_pages * page_size
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    page_size: int    # 0 for packed K/V
    num_pages: int    # 0 for packed K/V


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                        block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
                        num_sink_tokens=0, return_lse=False, out=None, page_size_multiple=16,
                        head_dims=HEAD_DIMS_FROM_STAGE_8) -> VarlenShape:
    """Validate the variable-length call's shapes, dtypes and options (never the offsets' values: see
    ``check_varlen_values``); return the sizes.

    Packed: q [total_q, H_q, D], k, v [total_k, H_kv, D] with cu_seqlens_q, cu_seqlens_k [B + 1] int32
    (seqused_k [B] optional). Paged: k, v [num_pages, page_size, H_kv, D] with block_table [B, max_pages]
    and seqused_k [B] int32, and cu_seqlens_k None.
    """
    packed = "[total_tokens, heads, head_dim]"
    _check_tensor("q", q, rank=3, layout=packed)
    paged = block_table is not None
    kv_layout = ("[num_pages, page_size, heads_kv, head_dim] (a paged cache, with block_table)" if paged
                 else f"{packed} (packed; for a paged cache [num_pages, page_size, heads_kv, head_dim] pass block_table)")
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t, rank=4 if paged else 3, layout=kv_layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match in all but "
                         "the head dim")
    _check_not_empty("q", q.new_empty(1, *q.shape[1:]) if q.shape[0] == 0 else q, ("total_q", "H_q", "head_dim"))
    _check_not_empty("k", k, ("num_pages", "page_size", "H_kv", "head_dim") if paged else ("total_k", "H_kv", "head_dim"))
    h_q, d = q.shape[1:]
    h_kv, d_k = k.shape[-2:]
    d_v = v.shape[-1]
    if d_k != d:
        raise ValueError(f"q has head_dim {d} but k has head_dim {d_k}; they must match")
    if (d, d_v) not in head_dims:
        raise ValueError(f"{describe_dims(d, d_v)} is not supported; supported: {describe_head_dims(head_dims)}")
    if h_q % h_kv:
        raise ValueError(f"q has {h_q} heads and k/v have {h_kv}: H_q must be a multiple of H_kv (GQA/MQA)")
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, rank=1, layout="[batch + 1] int32 offsets")
    if cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q has shape {tuple(cu_seqlens_q.shape)}; expected [batch + 1] with batch >= 1 "
                         "(offsets 0, len_0, len_0 + len_1, ...)")
    b = cu_seqlens_q.shape[0] - 1
    if paged:
        if cu_seqlens_k is not None:
            raise ValueError("a paged cache (block_table) takes seqused_k for the keys of each sequence; "
                             "cu_seqlens_k must be None")
        if seqused_k is None:
            raise ValueError("a paged cache (block_table) needs seqused_k [batch] int32: how many keys each "
                             "sequence has in its pages")
        _check_index_tensor("block_table", block_table, rank=2, layout="[batch, max_pages] int32")
        if block_table.shape[0] != b or block_table.shape[1] == 0:
            raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected [batch, max_pages] = "
                             f"[{b}, >= 1] (batch from cu_seqlens_q)")
        num_pages, page_size = k.shape[:2]
        if page_size % page_size_multiple:
            raise ValueError(f"page size {page_size} (k.shape[1] of a paged cache) is not supported; it must be a "
                             f"multiple of {page_size_multiple}")
        capacity = block_table.shape[1] * page_size
    else:
        if cu_seqlens_k is None:
            raise ValueError("packed k and v need cu_seqlens_k [batch + 1] int32 (or pass a paged cache with "
                             "block_table and seqused_k)")
        _check_index_tensor("cu_seqlens_k", cu_seqlens_k, rank=1, layout="[batch + 1] int32 offsets")
        if cu_seqlens_k.shape[0] != b + 1:
            raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens_q has {b + 1}; "
                             "both are [batch + 1]")
        num_pages, page_size, capacity = 0, 0, k.shape[0]
    if seqused_k is not None:
        _check_index_tensor("seqused_k", seqused_k, rank=1, layout="[batch] int32")
        if seqused_k.shape[0] != b:
            raise ValueError(f"seqused_k has {seqused_k.shape[0]} entries; expected one per sequence ({b})")
    check_int32("max_seqlen_q", max_seqlen_q, minimum=0)
    check_int32("max_seqlen_k", max_seqlen_k, minimum=0)
    _check_softmax_scale(softmax_scale)
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    _check_window_size(window_size)
    check_int32("num_sink_tokens", num_sink_tokens, minimum=0)
    check_per_head("sink_logits", sink_logits, h_q, SINK_LOGITS_MEANING)
    if out is not None:
        _check_out(out, q, "q with v's head_dim", layout=packed, shape=(q.shape[0], h_q, d_v))
    return VarlenShape(b, q.shape[0], capacity, h_q, h_kv, d, d_v, page_size, num_pages)


def check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                        block_table=None) -> None:
    """The offsets, lengths and pages of a variable-length call: read on the host (a synchronization).

    cu_seqlens start at 0, never decrease and end within their tensor; no sequence is longer than
    max_seqlen_q / max_seqlen_k; seqused_k within the sequence's keys; every page a sequence uses in the pool.
    """
    import torch

    def offsets(name, cu, total, max_len, max_name):
        values = cu.detach().to("cpu", torch.int64)
        if values[0] != 0:
            raise ValueError(f"{name}[0] = {int(values[0])}; offsets start at 0")
        steps = values[1:] - values[:-1]
        if (steps < 0).any():
            i = int((steps < 0).nonzero()[0])
            raise ValueError(f"{name} decreases at {i}: {int(values[i])} then {int(values[i + 1])}; offsets must "
                             "not decrease (sequence i has length cu[i + 1] - cu[i])")
        if values[-1] > total:
            raise ValueError(f"{name}[-1] = {int(values[-1])}, but the tensor has {total} rows")
        if len(steps) and steps.max() > max_len:
            i = int(steps.argmax())
            raise ValueError(f"sequence {i} has {int(steps[i])} rows by {name}, more than {max_name} = {max_len}")
        return steps

    offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    lengths = None
    if cu_seqlens_k is not None:  # with seqused_k, max_seqlen_k bounds the keys used, not the rows
        lengths = offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0],
                          max_seqlen_k if seqused_k is None else INT32_MAX, "max_seqlen_k")
    if seqused_k is not None:
        used = seqused_k.detach().to("cpu", torch.int64)
        limit = lengths if lengths is not None else torch.full_like(used, block_table.shape[1] * k.shape[1])
        bad = ((used < 0) | (used > limit)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"seqused_k[{i}] = {int(used[i])}; expected 0 to {int(limit[i])} (the sequence's "
                             + ("keys by cu_seqlens_k)" if lengths is not None else "pages x page_size)"))
        if used.numel() and used.max() > max_seqlen_k:
            i = int(used.argmax())
            raise ValueError(f"seqused_k[{i}] = {int(used[i])} is more than max_seqlen_k = {max_seqlen_k}")
        if block_table is not None:
            page_size, num_pages = k.shape[1], k.shape[0]
            table = block_table.detach().to("cpu", torch.int64)
            needed = (used + page_size - 1) // page_size
            in_use = torch.arange(table.shape[1])[None, :] < needed[:, None]
            bad = (in_use & ((table < 0) | (table >= num_pages))).nonzero()
            if len(bad):
                i, p = (int(x) for x in bad[0])
                raise ValueError(f"block_table[{i}, {p}] = {int(table[i, p])} is not a page of the cache "
                                 f"(0 <= page < {num_pages}), and sequence {i} (seqused_k {int(used[i])}) uses it")
