"""The course's kernels inside Hugging Face transformers models: the ``"course"`` attention backend.

Importing this module registers the backend with transformers'
``AttentionInterface`` (and its mask with ``AttentionMaskInterface``), so

    import course.integration.models
    model.set_attn_implementation("course")

runs a GPT-OSS, Llama or Qwen-style model's attention on ``course::attention``
(every multi-token forward: the prompt) and ``course::decode_attention``
(one-token steps, over the model's KV cache, and forwards of a few tokens with
nothing for autograd, as assisted generation verifies a draft: stage 9's draft
tokens); course/integration/ops.py says which stage backs each op. The mapping:

- transformers' ``sliding_window = W`` shows a query the ``W`` keys ending at
  its own position (``kv_idx > q_idx - W``): the contract's ``window_size =
  (W - 1, 0)``, ``window_size_left = W - 1`` in decode;
- GPT-OSS's ``s_aux`` (one sink logit per query head) is ``sink_logits``, in
  float32;
- the layer's ``scaling`` is ``softmax_scale`` (None: 1/sqrt(D)); GQA comes from the shapes;
- query/key/value arrive as [B, H, S, D]; the kernels take the transposed
  views [B, S, H, D] as they are (their head dim is contiguous and their
  other strides are multiples of D), so no copy is made.

How many keys a query sees comes from the cache, as transformers' own masks
do it: the backend's mask (``visible_key_counts``) is ``None`` when every key
the cache returns is real (DynamicCache), or the number of real keys per
sequence when the cache has free slots (StaticCache).

Padded batches (an attention mask with zeros, left or right padding, e.g.
``generate`` on prompts of different lengths): the mask says which keys are
real (``PaddedBatch``). Where each row's real tokens are one run (left or
right padding), a decode step reads the cache in place, the padding before
the run skipped (stage 9's ``cache_leftpad``), and so does a prompt under
torch.compile or CUDA-graph capture: ``course::attention_varlen`` (stage 10)
over the rows as they are, one sequence per row's run. Otherwise (eagerly) the
real queries and keys are packed for ``course::attention_varlen`` and the
output is scattered back; padded positions get zeros either way. Packed
sequences (several in one row, with transformers' ``cu_seq_lens_q``/``cu_seq_lens_k``, as
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them) go
to the same op directly.

What the backend cannot do raises instead of giving a wrong answer: padding
that is not one run per row under torch.compile or CUDA-graph capture (an
assertion in the graph), any other mask than causal or sliding-window (custom 4D masks, bidirectional
blocks, packed sequences without ``cu_seq_lens_q``/``cu_seq_lens_k``), dropout, returning
attention weights, soft-capping, non-causal attention, and a backward pass through a padded or
packed batch (equal-length batches train: ``course::attention`` has stage 11's backward).
Packed sequences under torch.compile cannot be told apart from one sequence
without reading the positions, and are not detected there.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field

import torch

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, DynamicLayer, StaticLayer
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.utils.import_utils import is_tracing
except ImportError as error:  # the optional extra
    raise ImportError("course.integration.models needs transformers: pip install -e '.[models]' "
                      "(the version this course is tested with, transformers==5.23.0)") from error

from course import testing
from course.integration import ops
from course.runtime import kv_cache, validation, varlen

NAME = "course"

# Keyword arguments a model may pass to the attention function that this backend cannot honour.
UNSUPPORTED_KWARGS = {
    "output_attentions": "returning attention weights (output_attentions=True)",
    "softcap": "logit soft-capping",
}
OTHER_BACKENDS = "use attn_implementation='eager' or 'sdpa' for it"


# --8<-- [start:mask]
@dataclass(frozen=True)
class PaddedBatch:
    """The backend's mask for a batch with padding: which keys the cache returns are real tokens
    (``real_keys`` bool [B, kv_length]), and the key index of the forward's first query.

    Where each row's real keys are one run, rows ``first_key`` .. ``key_end`` - 1
    (left padding, right padding, a static cache's free slots: ``one_run``),
    the kernels take the rows as they are: decode skips the padding with
    ``cache_leftpad``, prefill under torch.compile runs ``attention_varlen``
    row by row (``row_sequences``). Other masks are packed (``packing``), eagerly.
    """

    real_keys: torch.Tensor
    first_query: torch.Tensor  # the key index of the forward's first query (0-dimensional)
    first_key: torch.Tensor   # int32 [B]: each row's first real key (0 in a row without one)
    key_end: torch.Tensor     # int32 [B]: one past its last real key (0 in a row without one)
    one_run: torch.Tensor     # bool [B]: its real keys are the rows first_key .. key_end - 1, no gap
    _packings: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, real_keys: torch.Tensor, first_query: torch.Tensor) -> PaddedBatch:
        """The mask of ``real_keys`` with each row's run found (a few tensor ops, no host read)."""
        found = real_keys.any(1)
        first = real_keys.int().argmax(1)  # argmax gives the first of equal maxima
        end = real_keys.shape[1] - real_keys.flip(1).int().argmax(1)
        first, end = (torch.where(found, i, 0).to(torch.int32) for i in (first, end))
        return cls(real_keys, first_query, first, end, real_keys.sum(1) == end - first)

    # ``generate`` with a static cache makes the masks before the forward (``.contiguous()`` on each) and hands
    # them to the model, whose mask creation passes a made mask on as it does transformers' 4-D ones.
    ndim = 4

    def contiguous(self) -> PaddedBatch:
        return self

    def rows_are_runs(self) -> bool:
        """Whether every row's real keys are one run. Eagerly, read once per forward (a host read);
        under torch.compile or CUDA-graph capture assumed, with an assertion in the graph."""
        if is_tracing(self.real_keys):
            torch._assert_async(self.one_run.all(), "the course backend under torch.compile or CUDA-graph capture "
                                                    "takes padded batches whose real tokens are one run per row "
                                                    f"(left or right padding); run others eagerly, or {OTHER_BACKENDS}")
            return True
        if "runs" not in self._packings:
            self._packings["runs"] = bool(self.one_run.all())
        return self._packings["runs"]

    def real_queries(self, q_length: int) -> torch.Tensor:
        """Bool [B, q_length]: which of the forward's queries are real tokens."""
        return self.real_keys.index_select(1, self.first_query + torch.arange(q_length, device=self.real_keys.device))

    def decode_lengths(self) -> torch.Tensor:
        """The decode kernel's cache_seqlens: each row's key_end, 0 where the query is padding (its
        output is then 0, as the packed path leaves it)."""
        return torch.where(self.real_queries(1)[:, 0], self.key_end, 0).to(torch.int32)

    def row_sequences(self, q_length: int) -> RowSequences:
        """The batch as ``attention_varlen`` sequences over its rows flattened ([B * S, H, D]), nothing
        packed: sequence 2b + 1 is row b's real queries against its run of keys (``cu_seqlens_k`` at
        b S_k + first_key, ``seqused_k`` the run's length), causal, each sequence's last query on its
        last key; sequences 2b (and 2B) are the padding between real queries, against no key, so their
        rows get 0 as the packed path leaves them."""
        batch, kv_length = self.real_keys.shape
        real_q = self.real_queries(q_length)
        has_query = real_q.any(1)
        q_start = torch.where(has_query, real_q.int().argmax(1), 0)
        q_end = torch.where(has_query, q_length - real_q.flip(1).int().argmax(1), 0)
        rows = torch.arange(batch, device=self.real_keys.device)
        bounds = torch.stack([rows * q_length + q_start, rows * q_length + q_end], 1).flatten()
        cu_seqlens_q = torch.cat([bounds.new_zeros(1), bounds, bounds.new_full((1,), batch * q_length)])
        run_start = (rows * kv_length + self.first_key).repeat_interleave(2)
        cu_seqlens_k = torch.cat([run_start, run_start.new_full((2,), batch * kv_length)])
        run = torch.where(has_query, self.key_end - self.first_key, 0)
        seqused_k = torch.stack([torch.zeros_like(run), run], 1).flatten()
        return RowSequences(*(t.to(torch.int32) for t in (cu_seqlens_q, cu_seqlens_k,
                                                          torch.cat([seqused_k, seqused_k.new_zeros(1)]))))

    def packing(self, q_length: int) -> Packing:
        """Where the real queries and keys of every layer of this forward are: made once (one host read of
        their counts), then every layer packs and scatters with index copies that wait for nothing."""
        if q_length not in self._packings:
            real_q = self.real_queries(q_length)
            offsets = [torch.nn.functional.pad(m.sum(1).cumsum(0), (1, 0)).to(torch.int32)
                       for m in (real_q, self.real_keys)]
            rows = [m.flatten().nonzero().squeeze(1) for m in (real_q, self.real_keys)]
            self._packings[q_length] = Packing(*rows, *offsets)
        return self._packings[q_length]


@dataclass(frozen=True)
class Packing:
    """The rows of [B * S] that are real queries and keys, and the offsets of each sequence's rows."""

    q_rows: torch.Tensor
    k_rows: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor


@dataclass(frozen=True)
class RowSequences:
    """``attention_varlen``'s offsets for a padded batch's rows taken as they are (``row_sequences``)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_k: torch.Tensor


PACKED_ROWS = "packed rows"  # the mask of several sequences in one row: the layer needs cu_seq_lens_q/k


def visible_key_counts(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None,
                       allow_is_causal_skip=True, use_vmap=False, device=None, **kwargs):
    """The backend's "mask": the number of real keys per sequence (int32 [B]), which is the decode
    kernel's ``cache_seqlens``, or None for a prompt whose keys are all real; a ``PaddedBatch`` when the
    attention mask has padding (or, under torch.compile, may have).

    transformers calls it once per forward and mask type (full, sliding) with
    the cache's sizes: ``q_offset`` tokens were cached before this forward, and
    the keys returned start at token ``kv_offset``. A StaticCache has slots
    past the real keys (its ``q_offset`` is a tensor: the count stays on the
    GPU, so a CUDA graph of a decode step replays with the right lengths). A
    decode step always gets the counts, made here once for every layer.
    """
    if isinstance(attention_mask, PaddedBatch) or is_key_counts(attention_mask):  # made ahead by generate
        return attention_mask
    if packed_rows(q_length, allow_is_causal_skip, use_vmap):
        return PACKED_ROWS
    if has_padding(attention_mask):
        return padded_batch(attention_mask, q_offset, kv_offset, kv_length)
    real = q_offset + q_length - kv_offset
    if not isinstance(real, torch.Tensor):
        if real == kv_length and q_length > 1:
            return None
        return torch.full((batch_size,), min(real, kv_length), dtype=torch.int32, device=device)
    # (view(1) first: .contiguous() leaves a one-element expand with stride 0, which the kernels refuse)
    return torch.clamp(real, max=kv_length).to(device=device, dtype=torch.int32).view(1).expand(batch_size).contiguous()
# --8<-- [end:mask]


def is_key_counts(attention_mask) -> bool:
    """Whether the mask is this backend's own counts (int32 [B]), which ``generate`` made before the forward
    and hands back, rather than transformers' 2D mask."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1 and attention_mask.dtype == torch.int32


def padded_batch(attention_mask, q_offset, kv_offset, kv_length) -> PaddedBatch:
    """The 2D mask [B, tokens seen] cut to the keys the cache returns (tokens kv_offset onwards; a
    StaticCache's free slots past the seen tokens are not real)."""
    # A copy, not a view of the mask: a view's row stride and offset change with every step, and CUDA-graph
    # trees would record a new graph for each (a compiled step takes the batch as an input).
    real = attention_mask[:, kv_offset:kv_offset + kv_length].bool().contiguous()
    if real.shape[1] < kv_length:
        real = torch.nn.functional.pad(real, (0, kv_length - real.shape[1]), value=False)
    # A tensor (a static cache's stays one: reading it would wait for the GPU), also where it was an int that
    # changes every step (a sliding-window layer's), on which a compiled step would specialize and recompile.
    first_query = q_offset - kv_offset
    if not isinstance(first_query, torch.Tensor):
        first_query = torch.tensor(first_query, device=real.device)
    return PaddedBatch.of(real, first_query)


def packed_rows(q_length, allow_is_causal_skip, use_vmap) -> bool:
    """Does transformers ask for a mask a causal kernel cannot give (raising), or for packed rows?"""
    if use_vmap:
        raise NotImplementedError(f"the course backend computes causal and sliding-window masks only; this model "
                                  f"adds a mask function (e.g. bidirectional image tokens): {OTHER_BACKENDS}")
    return not allow_is_causal_skip and q_length > 1 and not is_tracing()


def has_padding(attention_mask) -> bool:
    """Whether the 2D mask has a zero. Under torch.compile or CUDA-graph capture the answer would need a
    host read: there a mask is taken as padded (a ``PaddedBatch`` of real rows runs as fast)."""
    if attention_mask is None:
        return False
    if is_tracing(attention_mask):
        return True
    return not bool(attention_mask.all())


def reject_unsupported(module, attention_mask, dropout, kwargs) -> None:
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 1:
        raise NotImplementedError(f"the course backend takes no explicit attention mask (got one of shape "
                                  f"{tuple(attention_mask.shape)}): {OTHER_BACKENDS}")
    if dropout:
        raise NotImplementedError(f"the course kernels have no attention dropout (got dropout={dropout}); call "
                                  "model.eval(), or set attention_dropout=0.0")
    for name, what in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) not in (None, False):
            raise NotImplementedError(f"the course backend does not support {what}: {OTHER_BACKENDS}")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise NotImplementedError(f"the course backend computes causal attention only: {OTHER_BACKENDS}")


def window_left(sliding_window) -> int:
    """transformers' ``sliding_window = W`` (W keys, the query's own included) as the contract's left bound."""
    return sliding_window - 1 if sliding_window else -1


# --8<-- [start:backend]
def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      s_aux=None, **kwargs):
    """The attention function transformers calls in each layer: [B, H, S, D] in, ([B, S_q, H_q, D], None) out.

    ``attention_mask`` is what ``visible_key_counts`` returned. A forward of
    one token per sequence is a decode step; any longer one goes to prefill.
    """
    reject_unsupported(module, attention_mask, dropout, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views, no copy
    features = dict(softmax_scale=scaling, sink_logits=None if s_aux is None else s_aux.float().contiguous(),
                    window_size_left=window_left(sliding_window))
    drafts = (kwargs.get("cu_seq_lens_q") is None and attention_mask is not PACKED_ROWS
              and not isinstance(attention_mask, PaddedBatch) and draft_tokens(q, k, v))
    if k.dtype in kv_cache.QUANTIZED_DTYPES:  # a quantized_cache: the decode kernel reads it, the rest dequantized
        k_scale, v_scale = quantized_scales(module, key)
        if q.shape[1] == 1 and (not isinstance(attention_mask, PaddedBatch) or attention_mask.rows_are_runs()):
            return decode(q[:, 0], k, v, attention_mask, k_scale=k_scale, v_scale=v_scale, **features).unsqueeze(1), None
        if drafts:
            return decode(q, k, v, attention_mask, k_scale=k_scale, v_scale=v_scale, **features), None
        k, v = kv_cache.dequantize(k, k_scale, q.dtype), kv_cache.dequantize(v, v_scale, q.dtype)
    if kwargs.get("cu_seq_lens_q") is not None:
        return packed(q, k, v, kwargs, **features), None
    if attention_mask is PACKED_ROWS:
        raise NotImplementedError("the course backend computes causal and sliding-window masks only; transformers "
                                  "asked for another mask (e.g. packed sequences in one row without "
                                  f"cu_seq_lens_q/k): {OTHER_BACKENDS}")
    if isinstance(attention_mask, PaddedBatch):
        return padded(q, k, v, attention_mask, **features), None
    if q.shape[1] == 1:
        return decode(q[:, 0], k, v, attention_mask, **features).unsqueeze(1), None
    if drafts:
        return decode(q, k, v, attention_mask, **features), None
    return prefill(q, k, v, attention_mask, **features), None


def draft_tokens(q, k, v) -> bool:
    """Whether a forward of a few tokens per sequence (``q`` [B, n, H_q, D], n > 1) runs on the decode
    kernel as draft tokens: at most ``varlen.DRAFT_ROWS`` query rows per KV head (stage 10's rule for the
    same choice), a head dim and a decode stage that take them, and nothing for autograd to record (the
    decode op has no backward). It reads the cache in place, a static one's free slots included, where
    prefill would cut the real keys out."""
    backing = ops.backing()
    return (1 < q.shape[1] and q.shape[1] * q.shape[2] // k.shape[2] <= varlen.DRAFT_ROWS
            and (q.shape[-1], v.shape[-1]) in validation.decode_head_dims(backing.decode)
            and backing.decode >= validation.DECODE_EXTRAS_STAGE[0]
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))))


def decode(q, k, v, key_counts, **features):
    """One query token per sequence (``q`` [B, H_q, D]), or a few (draft tokens, [B, n, H_q, D]), against
    the cache: ``course::decode_attention``. ``key_counts``: the
    real keys per sequence (``visible_key_counts``), or a ``PaddedBatch`` whose rows are runs (the
    padding before each run skipped with ``cache_leftpad``); None (a caller without transformers'
    mask): all."""
    if isinstance(key_counts, PaddedBatch):
        features["cache_leftpad"] = key_counts.first_key
        key_counts = key_counts.decode_lengths()
    if key_counts is None:
        key_counts = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    decode_attention = ops.decode_attention if eager_inference(q, k, v) else torch.ops.course.decode_attention
    return decode_attention(q, k, v, key_counts, check_lengths=False, **features)


def prefill(q, k, v, key_counts, **features):
    """The prompt (or a chunk of it): ``course::attention``, causal, queries aligned with the last keys.

    With a StaticCache the keys include free slots: the real ones are cut out
    first, which reads their count on the host (one synchronization per layer).
    """
    if key_counts is not None:
        real = int(key_counts.max())
        k, v = k[:, :real], v[:, :real]
    if eager_inference(q, k, v):
        return ops.attention(q, k, v, causal=True, **features)
    return torch.ops.course.attention(q, k, v, causal=True, **features)[0]  # (O, LSE): the LSE is for the backward


def eager_inference(*tensors) -> bool:
    """Whether a call may skip its custom op and run the op's Python function directly: in eager mode
    with nothing for autograd to record. The op's dispatch costs the host about as much as the launch;
    torch.compile needs the op (it traces it), and autograd needs it for the backward (or to say there is none)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def padded(q, k, v, batch: PaddedBatch, *, window_size_left, **features):
    """A batch with padding. Rows that are runs of real tokens: a decode step reads the cache in place
    (``decode``); a prompt under torch.compile runs row by row (``row_sequences``), where packing would
    give data-dependent shapes. Otherwise (eagerly) the real queries and keys packed,
    ``course::attention_varlen`` (causal, each sequence's last query on its last key), and the output
    scattered back, zeros at the padding."""
    attention_varlen = ops.attention_varlen if eager_inference(q, k, v) else torch.ops.course.attention_varlen
    if batch.rows_are_runs():
        if q.shape[1] == 1:
            return decode(q[:, 0], k, v, batch, window_size_left=window_size_left, **features).unsqueeze(1)
        if is_tracing(q):
            rows = batch.row_sequences(q.shape[1])
            out = attention_varlen(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), rows.cu_seqlens_q,
                                   rows.cu_seqlens_k, 2 * q.shape[1], k.shape[1], seqused_k=rows.seqused_k,
                                   causal=True, window_size_left=window_size_left, **features)
            return out.view(*q.shape[:2], *out.shape[1:])
    where = batch.packing(q.shape[1])

    def pack(t, rows):
        return t.reshape(-1, *t.shape[2:]).index_select(0, rows)

    out = attention_varlen(pack(q, where.q_rows), pack(k, where.k_rows), pack(v, where.k_rows), where.cu_seqlens_q,
                           where.cu_seqlens_k, q.shape[1], where.k_rows.numel(), causal=True,
                           window_size_left=window_size_left, **features)
    full = out.new_zeros((q.shape[0] * q.shape[1], *out.shape[1:]))
    return full.index_copy_(0, where.q_rows, out).view(*q.shape[:2], *out.shape[1:])


def packed(q, k, v, kwargs, *, window_size_left, **features):
    """Sequences packed in one row, with transformers' cu_seq_lens_q/k: ``course::attention_varlen`` directly."""
    if q.shape[0] != 1:
        raise NotImplementedError(f"packed sequences come in one row (batch 1); got batch {q.shape[0]}")
    attention_varlen = ops.attention_varlen if eager_inference(q, k, v) else torch.ops.course.attention_varlen
    out = attention_varlen(q[0], k[0], v[0], kwargs["cu_seq_lens_q"].int(), kwargs["cu_seq_lens_k"].int(),
                               int(kwargs.get("max_length_q") or q.shape[1]),
                               int(kwargs.get("max_length_k") or k.shape[1]), causal=True,
                               window_size_left=window_size_left, **features)
    return out[None]


# --8<-- [end:backend]


def register() -> str:
    """Register the backend (attention function and mask) under ``NAME``; returns the name."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, visible_key_counts)
    return NAME


register()


# ---------------------------------------------------------------- small models with random weights

# --8<-- [start:configs]
def gpt_oss_config(num_layers: int = 4, hidden_size: int = 512, vocab_size: int = 2048, **overrides):
    """GPT-OSS's attention exactly, the rest small: 64 query heads over 8 KV heads, head dim 64, a sink
    logit per head, sliding-window (128) layers alternating with full ones.

    Every token uses all 4 experts (top-k = number of experts): the router then
    has no top-k cut whose winner could flip between fp32 and bf16, so the logits
    of two precisions differ only by rounding.
    """
    settings = dict(num_hidden_layers=num_layers, hidden_size=hidden_size, intermediate_size=hidden_size,
                    vocab_size=vocab_size, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    sliding_window=128, num_local_experts=4, num_experts_per_tok=4)
    return transformers.GptOssConfig(**{**settings, **overrides})


def llama_config(num_layers: int = 4, hidden_size: int = 512, vocab_size: int = 2048, **overrides):
    """A Llama with the same attention shapes (64 / 8 heads, head dim 64) and no sinks or windows."""
    settings = dict(num_hidden_layers=num_layers, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                    vocab_size=vocab_size, num_attention_heads=64, num_key_value_heads=8, head_dim=64)
    return transformers.LlamaConfig(**{**settings, **overrides})


def deepseek_v3_config(num_layers: int = 4, hidden_size: int = 512, vocab_size: int = 2048, **overrides):
    """DeepSeek-V3's attention (multi-head latent attention, MLA) at its head dims, the rest small: queries
    and keys of 192 columns (128 without position, 64 rotated), values of 128, 16 heads. transformers caches
    the latents and expands K and V from them at every step, so prefill and decode both get the (192, 128)
    pair. Dense layers only: every layer's MLP is the same function in both precisions (no expert choice)."""
    settings = dict(num_hidden_layers=num_layers, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                    vocab_size=vocab_size, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                    kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    first_k_dense_replace=num_layers)
    return transformers.DeepseekV3Config(**{**settings, **overrides})
# --8<-- [end:configs]


def random_model(config, *, seed: int = 0, device="cpu", experts_implementation: str | None = None):
    """A float32 model of ``config`` with random weights, in eval mode, on ``device``.

    GPT-OSS's sink logits are drawn from N(0, 1) rather than its tiny default
    init, so that they change the softmax as trained sinks do.
    ``experts_implementation`` (GPT-OSS) picks transformers' mixture-of-experts
    code; ``"batched_mm"`` runs in any dtype on any device and has no
    data-dependent shapes (torch.compile, CUDA graphs).
    """
    torch.manual_seed(seed)
    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    with torch.device(device):  # initialized where it runs: a billion random weights are slow on a CPU
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                parameter.normal_()
    return model.eval()


def in_dtype(model, dtype, attn_implementation: str):
    """A copy of ``model`` in ``dtype`` that uses ``attn_implementation``."""
    copied = copy.deepcopy(model).to(dtype)
    copied.set_attn_implementation(attn_implementation)
    return copied


def incremental_logits(model, ids, prompt: int, cache=None, attention_mask=None, step: int = 1):
    """Logits [B, S - prompt + 1, V] at positions prompt - 1 ... S - 1 of ``ids`` [B, S]: the first ``prompt``
    tokens in one forward (prefill), then ``step`` tokens per forward over the KV cache (decode steps; with
    ``step`` > 1 as assisted generation verifies a draft).

    ``cache``: the transformers cache to fill (a DynamicCache when None). ``attention_mask`` [B, S]: 0 at
    padding; each forward gets the mask of the tokens so far and, as ``generate`` does, positions that
    count real tokens only.
    """
    cache = cache if cache is not None else transformers.DynamicCache(config=model.config)

    def forward(start, end):
        if attention_mask is None:
            return model(ids[:, start:end], past_key_values=cache, use_cache=True)
        mask = attention_mask[:, :end]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:end]
        return model(ids[:, start:end], attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=True)

    logits = [forward(0, prompt).logits[:, -1:]]
    for i in range(prompt, ids.shape[1], step):
        logits.append(forward(i, min(i + step, ids.shape[1])).logits)
    return torch.cat(logits, dim=1)


def graph_safe_cache(model, max_cache_len: int):
    """A static KV cache that a raw CUDA graph of a decode step can replay: every layer, sliding-window
    layers included, keeps all ``max_cache_len`` tokens, and the kernels apply the windows.

    transformers' StaticCache gives sliding-window layers a ring of ``sliding_window`` slots whose fill
    level is a Python int, and builds index tensors from it: a graph would freeze both at capture. Here
    every layer's length is a GPU tensor, so ``visible_key_counts`` hands the decode kernel the right
    length at every replay.
    """
    return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(model.config.num_hidden_layers)])


# --8<-- [start:quantized_cache]
CALIBRATION_HEADROOM = 2.0  # later tokens up to twice the prompt's largest magnitude (per head) are not clamped
# {attention module: the quantized cache layer that updated last}: the scales the backend reads. Kept off the
# module itself, so that copying a model (in_dtype, fine-tuning) does not copy its cache.
QUANTIZED_CACHE_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class QuantizedKV:
    """A cache layer that stores K and V quantized (FP8 e4m3 or int8, one float32 scale per KV head) as
    stage 9's decode kernel reads them; mixed into transformers' DynamicLayer or StaticLayer.

    The layer's first update (the prompt) sets the scales (``scales``: k_scale, v_scale [H_kv]):
    ``CALIBRATION_HEADROOM`` x each head's largest magnitude over the batch, padding included, lands on the
    format's largest value (serving engines calibrate offline, or, as here, from the first forward).
    Every update quantizes its rows with ``kv_cache.quantize_rows``, the rounding of the decode kernel's
    fused append; larger values clamp. ``reset()`` empties the cache and calibrates again on the next
    prompt. ``keys`` and ``values`` hold the bytes (uint8: not every copy op takes float8);
    ``keys.view(quantized_dtype)`` reads them.

    The layer returns the quantized cache: the course backend's decode step reads it as it is, with the
    scales of the layer that updated last for its attention module (``QUANTIZED_CACHE_OF``), and its
    prompt paths read it dequantized. With ``dequantized`` it returns the values the cache stands for, in
    the model's dtype, so that any attention implementation can run on the same cache.
    """

    def __init__(self, dtype, module, dequantized=False, **kwargs):
        super().__init__(**kwargs)
        self.quantized_dtype, self.module, self.dequantized = dtype, module, dequantized
        heads, device = module.config.num_key_value_heads, next(module.parameters()).device
        self.scales = tuple(torch.ones(heads, dtype=torch.float32, device=device) for _ in range(2))
        self.calibrated = False

    def update(self, key_states, value_states, *args, **kwargs):
        implementation = self.module.config._attn_implementation
        if not self.dequantized and implementation != NAME:
            raise ValueError(f"attn_implementation {implementation!r} cannot read a quantized KV cache: use "
                             f"model.set_attn_implementation({NAME!r}), or quantized_cache(..., dequantized=True), "
                             "which hands any implementation the values the cache stands for")
        if QUANTIZED_CACHE_OF.get(self.module) is not self:  # another cache of this model ran last
            QUANTIZED_CACHE_OF[self.module] = self
        rows = []
        for scale, states in zip(self.scales, (key_states, value_states)):
            if not self.calibrated:  # [B, H_kv, S, D] -> the [.., .., H_kv, D] of kv_cache
                scale.copy_(kv_cache.head_scales(states.transpose(1, 2), self.quantized_dtype, CALIBRATION_HEADROOM))
            quantized = kv_cache.quantize_rows(states, scale.view(1, -1, 1, 1), self.quantized_dtype)
            rows.append(quantized.view(torch.uint8))
        self.calibrated = True
        keys, values = (t.view(self.quantized_dtype) for t in super().update(*rows, *args, **kwargs))
        if self.dequantized:
            return tuple(kv_cache.dequantize(t.transpose(1, 2), scale, key_states.dtype).transpose(1, 2)
                         for t, scale in zip((keys, values), self.scales))
        return keys, values

    def reset(self):
        super().reset()
        self.calibrated = False


def quantized_scales(module, key):
    """(k_scale, v_scale) of the quantized cache whose keys ``key`` reach ``module``'s attention; in eager
    mode checked to be that cache's (its bytes are the ones being read)."""
    layer = QUANTIZED_CACHE_OF.get(module)
    if layer is None or (not torch.compiler.is_compiling()
                         and layer.keys.untyped_storage().data_ptr() != key.untyped_storage().data_ptr()):
        raise ValueError(f"{key.dtype} keys reached the course backend from a quantized cache made for another "
                         "model object: make it with models.quantized_cache(model) on the model that runs it "
                         "(models.in_dtype returns a copy: make the cache after it)")
    return layer.scales


def quantized_cache(model, dtype=torch.float8_e4m3fn, max_cache_len: int | None = None, dequantized=False):
    """A KV cache for ``model`` that holds K and V as ``dtype`` (torch.float8_e4m3fn or torch.int8), half the
    bytes of a 16-bit cache: ``model.generate(ids, past_key_values=models.quantized_cache(model))``.

    Dynamic (grows with the tokens) or, with ``max_cache_len``, static and graph-safe as
    ``graph_safe_cache``. Every layer, sliding-window ones included, keeps every token: the kernels apply
    the windows. The cache belongs to ``model`` (the object: a copy needs a cache of its own); several
    caches of one model may take turns.
    """
    if dtype not in kv_cache.QUANTIZED_DTYPES:
        raise TypeError(f"quantized_cache holds torch.float8_e4m3fn or torch.int8; got dtype={dtype}")
    attention = {m.layer_idx: m for m in model.modules() if type(m).__name__.endswith("Attention")
                 and getattr(m, "layer_idx", None) is not None}
    layers = []
    for index in range(model.config.num_hidden_layers):
        if max_cache_len:
            layer = QuantizedStaticLayer(dtype, attention[index], dequantized=dequantized, max_cache_len=max_cache_len)
            for scale in layer.scales:  # a CUDA graph reads them in place, like the cache
                torch._dynamo.mark_static_address(scale)
        else:
            layer = QuantizedDynamicLayer(dtype, attention[index], dequantized=dequantized)
        layers.append(layer)
    return Cache(layers=layers)


class QuantizedDynamicLayer(QuantizedKV, DynamicLayer):
    """transformers' DynamicLayer, quantized."""


class QuantizedStaticLayer(QuantizedKV, StaticLayer):
    """transformers' StaticLayer, quantized."""
# --8<-- [end:quantized_cache]


def logit_errors(logits, baseline, reference) -> testing.ErrorReport:
    """The yardstick of the course's tests, for logits: the errors of ``logits`` (the course backend) and of
    ``baseline`` (transformers' eager attention in the same dtype) against ``reference`` (eager in float32).
    ``.ok`` when the course's are within 2x of the baseline's (plus a small epsilon)."""
    ours = (logits.float() - reference.float()).abs()
    theirs = (baseline.float() - reference.float()).abs()
    return testing.ErrorReport(ours.max().item(), ours.mean().item(), theirs.max().item(), theirs.mean().item())
