"""The course's final kernels as PyTorch custom ops: ``course::attention``, ``course::decode_attention`` and
``course::decode_attention_append`` (the decode step that writes the new token to the cache).

Registered with ``torch.library``, each op has a fake (meta) implementation
that only computes the output's shape, so ``torch.compile(fullgraph=True)``
traces a model that calls them without running a kernel, and CUDA-graph
capture records the kernels like any other launch. ``course::attention``
returns (O, LSE) and is differentiable: its backward is ``course::attention_backward``
(stage 11's kernel); the decode and variable-length ops are forward-only, a
backward through them raises.

Which code backs the ops is one setting, ``use_stages``:

- ``prefill``: the prefill stage (``attention`` on [B, S, H, D]); by default
  the final prefill kernel, stage 8 (FA3-class).
- ``decode``: the decode stage (``decode_attention``); by default the final decode kernel, stage 9
  (tensor cores, and an FP8 cache with ``k_scale``/``v_scale``).
- ``impl``: ``"solutions"`` (the reference solutions), ``"stages"`` (your
  code), or ``"reference"``: course/testing/reference.py in float64, after the
  kernels' own input validation (all but the device check), so that a CPU can
  check what a model hands the kernels.

The environment variables ``COURSE_PREFILL_STAGE``, ``COURSE_DECODE_STAGE``
and ``COURSE_IMPL`` set the same three at import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from course.runtime import stages, validation
from course.testing import reference

PREFILL_STAGE = 8  # the final prefill kernel (FA3-class)
DECODE_STAGE = 9  # the final decode kernel (tensor cores, FP8 cache)
VARLEN_STAGE = 10  # the variable-length and paged prefill kernel behind course::attention_varlen
BACKWARD_STAGE = 11  # the backward pass behind course::attention_backward
IMPLS = (*stages.IMPLS, "reference")


@dataclass(frozen=True)
class Backing:
    """What runs behind the ops: a prefill stage, a decode stage, and whose code."""

    prefill: int = PREFILL_STAGE
    decode: int = DECODE_STAGE
    impl: str = "solutions"


def _checked(backing: Backing) -> Backing:
    if backing.impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {backing.impl!r}")
    for kind, number in (("prefill", backing.prefill), ("decode", backing.decode)):
        stage = stages.get(number)
        if stage.kind != kind:
            raise ValueError(f"stage {number} ({stage.title}) is a {stage.kind} stage; {kind}= takes a {kind} stage")
    return backing


_backing = _checked(Backing(int(os.environ.get("COURSE_PREFILL_STAGE", PREFILL_STAGE)),
                            int(os.environ.get("COURSE_DECODE_STAGE", DECODE_STAGE)),
                            os.environ.get("COURSE_IMPL", "solutions")))


def use_stages(prefill: int | None = None, decode: int | None = None, impl: str | None = None) -> Backing:
    """Choose what backs the ops from now on (``None`` keeps the current choice); returns the new setting.

    The choice is read at every call, so it also applies to models compiled before it.
    """
    global _backing, _functions
    changes = {name: value for name, value in (("prefill", prefill), ("decode", decode), ("impl", impl))
               if value is not None}
    _backing = _checked(replace(_backing, **changes))
    _functions = None
    return _backing


def backing() -> Backing:
    """The current setting."""
    return _backing


# ---------------------------------------------------------------- the float64 reference behind impl="reference"

def reference_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
                        num_sink_tokens=0):
    """course.testing.reference.attention on inputs the prefill kernels accept; O in q's dtype."""
    validation.check_attention_inputs(q, k, v, softmax_scale=softmax_scale, window_size=window_size,
                                      sink_logits=sink_logits, num_sink_tokens=num_sink_tokens)
    return reference.attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               sink_logits=sink_logits, num_sink_tokens=num_sink_tokens).to(q.dtype)


def reference_attention_with_lse(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 sink_logits=None, num_sink_tokens=0, return_lse=True):
    """``reference_attention`` with the LSE: (O in q's dtype, LSE [B, H_q, S_q] float32)."""
    validation.check_attention_inputs(q, k, v, softmax_scale=softmax_scale, window_size=window_size,
                                      sink_logits=sink_logits, num_sink_tokens=num_sink_tokens)
    out, lse = reference.attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, return_lse=True)
    return out.to(q.dtype), lse


def reference_attention_backward(do, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 sink_logits=None, num_sink_tokens=0, deterministic=False):
    """course.testing.reference.attention_backward (float64) after stage 11's input validation:
    (dq, dk, dv[, dsink]), the gradients in q's dtype (deterministic either way)."""
    validation.check_backward_inputs(do, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                                     deterministic=deterministic)
    grads = reference.attention_backward(do, q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, sink_logits=sink_logits,
                                         num_sink_tokens=num_sink_tokens)
    return (*(g.to(q.dtype) for g in grads[:3]), *grads[3:])


def reference_decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                               window_size_left=-1, sink_logits=None, num_sink_tokens=0, num_splits=0,
                               check_lengths=None, k_scale=None, v_scale=None, **extras):
    """course.testing.reference.decode_attention on inputs the decode kernel accepts; O in q's dtype.
    ``extras``: stage 9's serving extras (``k_new``, ``v_new``, ``rotary_cos``, ``rotary_sin``,
    ``rotary_interleaved``, ``alibi_slopes``, ``cache_capacity``, ``cache_leftpad``); with ``k_new`` the caches get the new rows,
    in place, as the kernel writes them.

    The lengths (and scales) are on the host anyway: they are checked unless ``check_lengths=False``.
    """
    shape = validation.check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                           softmax_scale=softmax_scale, window_size_left=window_size_left,
                                           sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                                           num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
                                           stage=_backing.decode, **extras)
    if check_lengths is not False:
        validation.check_decode_values(cache_seqlens, block_table, shape, k_scale, v_scale,
                                       extras.get("cache_leftpad"))
    out = reference.decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                     softmax_scale=softmax_scale, window_size_left=window_size_left,
                                     sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, k_scale=k_scale,
                                     v_scale=v_scale, **extras).to(q.dtype)
    if extras.get("k_new") is not None:
        appended = reference.append_to_cache(k_cache, v_cache, cache_seqlens, block_table=block_table,
                                             k_scale=k_scale, v_scale=v_scale, num_sink_tokens=num_sink_tokens,
                                             **reference.append_options(extras))
        k_cache.copy_(appended[0])
        v_cache.copy_(appended[1])
    return out


def reference_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                               block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                               sink_logits=None, num_sink_tokens=0):
    """course.testing.reference.attention on each sequence of a variable-length call; O in q's dtype."""
    validation.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   seqused_k=seqused_k, block_table=block_table, softmax_scale=softmax_scale,
                                   causal=causal, window_size=window_size, sink_logits=sink_logits,
                                   num_sink_tokens=num_sink_tokens)
    validation.check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                                   block_table=block_table)
    from course import testing

    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    inputs = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                  block_table=block_table)
    cu_q = cu_seqlens_q.tolist()
    for b, q_b, k_b, v_b in testing.varlen_sequences(inputs):
        if q_b.shape[1] and k_b.shape[1]:  # no key: O = 0 (a sink has no value)
            out[cu_q[b]:cu_q[b + 1]] = reference.attention(
                q_b, k_b, v_b, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                sink_logits=sink_logits, num_sink_tokens=num_sink_tokens)[0].to(q.dtype)
    return out


_functions = None  # (prefill, decode) of the current backing, resolved at the first call after a change


def _resolve():
    global _functions
    if _backing.impl == "reference":
        _functions = reference_attention, reference_decode_attention
    else:
        _functions = (stages.get(_backing.prefill).load(_backing.impl).attention,
                      stages.get(_backing.decode).load(_backing.impl).decode_attention)
    return _functions


def prefill_function():
    """The ``attention`` function the setting picks."""
    return (_functions or _resolve())[0]


def decode_function():
    """The ``decode_attention`` function the setting picks."""
    return (_functions or _resolve())[1]


def prefill_with_lse_function():
    """``attention`` of the setting's prefill stage, called for (O, LSE)."""
    if _backing.impl == "reference":
        return reference_attention_with_lse
    return prefill_function()


def backward_function():
    """The ``attention_backward`` function the setting's impl picks (stage 11's)."""
    if _backing.impl == "reference":
        return reference_attention_backward
    return stages.get(BACKWARD_STAGE).load(_backing.impl).attention_backward


def varlen_function():
    """The ``attention_varlen`` function the setting's impl picks (stage 10's)."""
    if _backing.impl == "reference":
        return reference_attention_varlen
    return stages.get(VARLEN_STAGE).load(_backing.impl).attention_varlen


# ---------------------------------------------------------------- the ops

# Defined with torch.library's low-level API (a schema and a kernel per op): a call goes from the
# dispatcher straight to the Python function, which costs the host less than torch.library.custom_op's
# wrapper (course host-bench measures what each call costs).
_LIBRARY = torch.library.Library("course", "DEF")

# --8<-- [start:attention_op]
_LIBRARY.define("attention(Tensor q, Tensor k, Tensor v, Tensor? sink_logits=None, float? softmax_scale=None, "
                "bool causal=False, int window_size_left=-1, int window_size_right=-1, int num_sink_tokens=0) "
                "-> (Tensor, Tensor)")


def attention(q, k, v, sink_logits=None, softmax_scale=None, causal=False, window_size_left=-1,
              window_size_right=-1, num_sink_tokens=0):
    """Prefill attention (docs/contract.md) on [B, S, H, D]: O [B, S_q, H_q, D_v], a new contiguous tensor.

    The op ``course::attention`` returns (O, LSE [B, H_q, S_q] float32): the LSE is what its backward needs.
    """
    return prefill_function()(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=(window_size_left, window_size_right), sink_logits=sink_logits,
                              num_sink_tokens=num_sink_tokens)


LSE_STAGE = validation.FEATURE_STAGE["return_lse"][0]


def _has_lse() -> bool:
    return _backing.impl == "reference" or _backing.prefill >= LSE_STAGE


def _attention_with_lse(q, k, v, sink_logits=None, softmax_scale=None, causal=False, window_size_left=-1,
                        window_size_right=-1, num_sink_tokens=0):
    """The op's kernel: (O, LSE); a prefill stage before the LSE's gives NaN for it (and no backward)."""
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=(window_size_left, window_size_right),
                   sink_logits=sink_logits, num_sink_tokens=num_sink_tokens)
    if not _has_lse():
        out = prefill_function()(q, k, v, **options)
        return out, torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    return prefill_with_lse_function()(q, k, v, return_lse=True, **options)


@torch.library.register_fake("course::attention")
def _attention_fake(q, k, v, sink_logits=None, softmax_scale=None, causal=False, window_size_left=-1,
                    window_size_right=-1, num_sink_tokens=0):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))
# --8<-- [end:attention_op]


# --8<-- [start:backward_op]
_LIBRARY.define("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                "Tensor? sink_logits=None, float? softmax_scale=None, bool causal=False, int window_size_left=-1, "
                "int window_size_right=-1, int num_sink_tokens=0, bool deterministic=False) "
                "-> (Tensor, Tensor, Tensor, Tensor)")


def attention_backward(grad_out, q, k, v, out, lse, sink_logits=None, softmax_scale=None, causal=False,
                       window_size_left=-1, window_size_right=-1, num_sink_tokens=0, deterministic=False):
    """(dq, dk, dv, dsink) of ``course::attention`` (stage 11); dsink is empty without sink logits."""
    grads = backward_function()(grad_out.contiguous(), q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                window_size=(window_size_left, window_size_right), sink_logits=sink_logits,
                                num_sink_tokens=num_sink_tokens, deterministic=deterministic)
    return (*grads[:3], grads[3] if sink_logits is not None else q.new_empty((0,), dtype=torch.float32))


@torch.library.register_fake("course::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, out, lse, sink_logits=None, softmax_scale=None, causal=False,
                             window_size_left=-1, window_size_right=-1, num_sink_tokens=0, deterministic=False):
    dsink = q.new_empty((0 if sink_logits is None else sink_logits.shape[0],), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


_OPTIONS = ("softmax_scale", "causal", "window_size_left", "window_size_right", "num_sink_tokens")


def _save_for_backward(ctx, inputs, output):
    q, k, v, sink_logits, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sink_logits)
    ctx.options = dict(zip(_OPTIONS, options))
    ctx.mark_non_differentiable(lse)


def _attention_grads(ctx, grad_out, grad_lse):
    """The LSE is not differentiable (its gradient is ignored); sink logits get theirs when they require one.
    Under ``torch.use_deterministic_algorithms(True)`` the backward adds dQ in a fixed order (bit-identical runs)."""
    if not _has_lse():
        raise NotImplementedError(f"course::attention's backward needs the forward's LSE: the ops are backed by "
                                  f"prefill stage {_backing.prefill}, and stage {LSE_STAGE} adds the LSE "
                                  f"(ops.use_stages(prefill={PREFILL_STAGE}) for the final kernel)")
    q, k, v, out, lse, sink_logits = ctx.saved_tensors
    dq, dk, dv, dsink = torch.ops.course.attention_backward(
        grad_out, q, k, v, out, lse, sink_logits, **ctx.options,
        deterministic=torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, (dsink if sink_logits is not None else None), None, None, None, None, None


torch.library.register_autograd("course::attention", _attention_grads, setup_context=_save_for_backward)
# --8<-- [end:backward_op]


_DECODE_OPTIONS = ("Tensor? block_table=None, Tensor? sink_logits=None, float? softmax_scale=None, "
                   "int window_size_left=-1, int num_sink_tokens=0, int num_splits=0, bool? check_lengths=None, "
                   "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? alibi_slopes=None, int? cache_capacity=None, "
                   "Tensor? cache_leftpad=None")
_LIBRARY.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
                f"{_DECODE_OPTIONS}) -> Tensor")
# The same step with the new token written to the cache: the caches are mutated (a!, b!), so that
# torch.compile and CUDA graphs keep the write in order with the reads of later steps.
_LIBRARY.define("decode_attention_append(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
                "Tensor k_new, Tensor v_new, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
                f"bool rotary_interleaved=False, {_DECODE_OPTIONS}) -> Tensor")


def _decode(q, k_cache, v_cache, cache_seqlens, *, block_table, softmax_scale, window_size_left, sink_logits,
            num_sink_tokens, num_splits, check_lengths, **extras):
    """Both decode ops' call of the backing decode function. ``extras``: the stage-9 arguments; only those a
    call uses are passed on, as an earlier decode stage has no such keyword (and says so if one is used)."""
    given = {name: value for name, value in extras.items() if value is not None and value is not False}
    if given and _backing.decode < validation.DECODE_EXTRAS_STAGE[0] and _backing.impl != "reference":
        stage, what = validation.DECODE_EXTRAS_STAGE
        raise NotImplementedError(f"{next(iter(given))} is not implemented in stage {_backing.decode}; stage "
                                  f"{stage} ({what}) adds it")
    return decode_function()(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                             softmax_scale=softmax_scale, window_size_left=window_size_left,
                             sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, num_splits=num_splits,
                             check_lengths=check_lengths, **given)


def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, sink_logits=None, softmax_scale=None,
                     window_size_left=-1, num_sink_tokens=0, num_splits=0, check_lengths=None, k_scale=None,
                     v_scale=None, alibi_slopes=None, cache_capacity=None, cache_leftpad=None):
    """Decode attention (docs/contract.md): one query token per sequence, O [B, H_q, D], or (stage 9) n draft
    tokens per sequence, q and O [B, n, H_q, D].

    ``check_lengths``: as the stage's ``decode_attention`` (``None``: only
    with ``COURSE_CHECK_LENGTHS=1``, as reading the lengths on the host waits
    for the GPU). A quantized (FP8 or int8) cache comes with ``k_scale`` and
    ``v_scale``; ``alibi_slopes``, a rolling cache (``cache_capacity``) and
    left-padded sequences (``cache_leftpad``) as stage 9 takes them.
    """
    return _decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                   window_size_left=window_size_left, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                   num_splits=num_splits, check_lengths=check_lengths, k_scale=k_scale, v_scale=v_scale,
                   alibi_slopes=alibi_slopes, cache_capacity=cache_capacity, cache_leftpad=cache_leftpad)


@torch.library.register_fake("course::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, cache_seqlens, block_table=None, sink_logits=None,
                           softmax_scale=None, window_size_left=-1, num_sink_tokens=0, num_splits=0,
                           check_lengths=None, k_scale=None, v_scale=None, alibi_slopes=None, cache_capacity=None,
                           cache_leftpad=None):
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))  # O has V's head dim


def decode_attention_append(q, k_cache, v_cache, cache_seqlens, k_new, v_new, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=False, block_table=None, sink_logits=None, softmax_scale=None,
                            window_size_left=-1, num_sink_tokens=0, num_splits=0, check_lengths=None, k_scale=None,
                            v_scale=None, alibi_slopes=None, cache_capacity=None, cache_leftpad=None):
    """One decode step that appends its token (docs/contract.md, the serving extras): k_new and v_new
    [B, H_kv, D] are written to the caches at position cache_seqlens[b] (rotated with rotary_cos/sin),
    and the query attends to the cache_seqlens[b] + 1 keys. cache_seqlens is not changed."""
    return _decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                   window_size_left=window_size_left, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                   num_splits=num_splits, check_lengths=check_lengths, k_new=k_new, v_new=v_new,
                   rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                   k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes, cache_capacity=cache_capacity,
                   cache_leftpad=cache_leftpad)


@torch.library.register_fake("course::decode_attention_append")
def _decode_attention_append_fake(q, k_cache, v_cache, cache_seqlens, k_new, v_new, rotary_cos=None,
                                  rotary_sin=None, rotary_interleaved=False, block_table=None, sink_logits=None,
                                  softmax_scale=None, window_size_left=-1, num_sink_tokens=0, num_splits=0,
                                  check_lengths=None, k_scale=None, v_scale=None, alibi_slopes=None,
                                  cache_capacity=None, cache_leftpad=None):
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))  # O has V's head dim


_LIBRARY.define("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, "
                "int max_seqlen_q, int max_seqlen_k, Tensor? seqused_k=None, Tensor? block_table=None, "
                "Tensor? sink_logits=None, float? softmax_scale=None, bool causal=False, int window_size_left=-1, "
                "int window_size_right=-1, int num_sink_tokens=0) -> Tensor")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                     block_table=None, sink_logits=None, softmax_scale=None, causal=False, window_size_left=-1,
                     window_size_right=-1, num_sink_tokens=0):
    """Variable-length (and paged) prefill (docs/contract.md, stage 10): O [total_q, H_q, D_v], a new tensor."""
    return varlen_function()(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                             block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                             window_size=(window_size_left, window_size_right), sink_logits=sink_logits,
                             num_sink_tokens=num_sink_tokens)


@torch.library.register_fake("course::attention_varlen")
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                           block_table=None, sink_logits=None, softmax_scale=None, causal=False, window_size_left=-1,
                           window_size_right=-1, num_sink_tokens=0):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


# One kernel for every device: the stage's own checks say what a CPU tensor may and may not do.
_LIBRARY.impl("attention", _attention_with_lse, "CompositeExplicitAutograd")
_LIBRARY.impl("attention_backward", attention_backward, "CompositeExplicitAutograd")
_LIBRARY.impl("attention_varlen", attention_varlen, "CompositeExplicitAutograd")
_LIBRARY.impl("decode_attention", decode_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("decode_attention_append", decode_attention_append, "CompositeExplicitAutograd")


def _no_backward(op_name: str):
    def backward(ctx, grad):
        raise NotImplementedError(f"{op_name} is forward-only: stage 11's backward covers course::attention "
                                  "([B, S, H, D], equal lengths) only. Run this under torch.no_grad() (inference), "
                                  "train with equal-length batches, or use another attention implementation.")

    return backward


def _nothing_to_save(ctx, inputs, output):
    pass


torch.library.register_autograd("course::decode_attention", _no_backward("course::decode_attention"),
                                setup_context=_nothing_to_save)
torch.library.register_autograd("course::attention_varlen", _no_backward("course::attention_varlen"),
                                setup_context=_nothing_to_save)
