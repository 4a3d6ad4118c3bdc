"""Stage 7: decode attention with a split-KV (multi-block) reduction.

Compared with stage 6, this stage adds a second kernel, for one query token
per sequence against its KV cache, because generating text runs it once per
token and it has none of prefill's structure: no tile of queries to feed
WGMMA, a memory-bound loop, and too little work per sequence to fill the GPU
unless a sequence's keys are split across CTAs and merged with stage 6's LSE
arithmetic.

Decode is the other half of serving: every sequence of a batch brings ONE new
query token (per query head), and it attends to the whole KV cache of its
sequence, which can be 100k tokens long, each sequence with its own length.
There is almost no arithmetic per byte: every key and value is read once and
used for a dot product or a multiply-add with a handful of query heads. The
kernel is bound by memory bandwidth, and the stage is about moving bytes:

1. One CTA takes one (sequence, KV head, split): a slice of that sequence's
   keys, for ALL the query heads that share the KV head (GQA), so every K/V
   byte is read from HBM once per group, not once per query head.
2. Inside the CTA a key belongs to D/8 threads that each copy 16 bytes of its
   K row and 16 bytes of its V row with cp.async into their own slots of a
   shared-memory ring, STAGES - 1 loop iterations ahead of the compute, so the
   loads of the next keys are always in flight; the dot products are finished
   with warp shuffles, and every group of threads keeps an online softmax
   (running max, sum, O) per head.
3. The groups of a CTA are merged through shared memory (the ring's bytes,
   free by then) into the split's partial result: normalized O and its
   log-sum-exp, written to an fp32 workspace in global memory.
4. Each CTA then arrives on a per-(sequence, KV head) counter with a gpu-scope
   acquire-release atomic. The CTA that arrives last reads every split's
   partial, folds them in with the online softmax rule (the LSE merge of
   stage 6; the sink logit exactly once, at the end), writes O and LSE, and
   resets the counter to 0 for the next launch (and the next CUDA graph replay).

Sliding windows and sink tokens change only which keys a sequence sees: the
visible keys are enumerated directly (the sink tokens, then the window), so a
window of 4k keys costs 4k keys however long the cache is. Contiguous caches
[B, S_max, H_kv, D] and paged caches [num_pages, page_size, H_kv, D] with a
block table share one kernel; the page size is a compile-time constant.

Run it:
    python -m course check 7 --impl solutions   # this stage's tests
    python solutions/stage07_decode.py          # one launch against the reference (needs a Hopper GPU)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import LoadCacheMode, cpasync
from cutlass.memory import SmemAllocator

from course.runtime import launch, validation
from course.runtime.compile import cross_compile, cute_dtype, symbolic_tensor

STAGE = 7
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128, 256)  # powers of two: a row's page and slot are a shift and a mask
HEADS_PER_CTA = (1, 2, 4, 8)  # query heads one CTA computes (compile-time); larger groups use several CTAs
NUM_THREADS = 128  # 4 warps per CTA
VEC = 8  # elements per thread per key: 8 x 16 bits = one 16-byte load
# Keys each key group computes per loop iteration, by heads per CTA: the more heads, the more
# registers per key.
UNROLL = {1: 4, 2: 4, 4: 4, 8: 2}
# Iterations of K/V in flight: each thread copies its 16-byte pieces of the next STAGES - 1
# iterations' keys into its own slots of a shared-memory ring with cp.async while it computes.
STAGES = 3
SHARED_BYTES_PER_SM = 228 * 1024  # H100 (sm_90)
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
MIN_KEYS_PER_SPLIT = 128  # the auto split count never gives a split fewer keys than this
# CTAs per SM the auto split count aims at for few sequences: 2 keep enough copies in flight to
# stream HBM at full speed, and cost less than 3 shorter splits (fewer prologues and partials,
# a shorter combine).
SPLIT_CTAS_PER_SM = 2
REGISTERS_PER_THREAD = {1: 128, 2: 128, 4: 168, 8: 248}  # most ptxas uses (sm_90a, any config), by heads per CTA


def threads_per_key(head_dim: int) -> int:
    """A key's D elements are spread over D/8 threads, 16 bytes each (8, 16 or 32 threads)."""
    return head_dim // VEC


def unroll(heads: int) -> int:
    """Keys each key group loads per loop iteration (4 at 4 heads per CTA)."""
    return UNROLL[heads]


def keys_per_iteration(head_dim: int, heads: int = 4) -> int:
    """Keys one CTA loads per loop iteration: (128 / threads_per_key) key groups x unroll(heads) keys each."""
    return NUM_THREADS // threads_per_key(head_dim) * unroll(heads)


def work_bytes(head_dim: int, heads: int) -> int:
    """Shared memory for the cp.async ring, reused by the merge: the larger of the two.

    The ring holds STAGES iterations of 16-byte K and V pieces per thread; the
    merge holds every key group's max, sum and O columns (fp32) for each head.
    """
    ring = STAGES * 2 * unroll(heads) * NUM_THREADS * VEC * 2
    merge = 4 * (NUM_THREADS // threads_per_key(head_dim)) * heads * (head_dim + 2)
    return max(ring, merge)


def combine_loads(heads: int, head_dim: int) -> int:
    """16-byte partial-O loads each thread of the last CTA keeps in flight (4 registers each).

    32, so that the 32 splits of a short sequence are one L2 round trip, where
    the registers allow it (4 or more heads per CTA, D <= 128); 16 elsewhere,
    where 32 would spill.
    """
    return 32 if heads >= 4 and head_dim <= 128 else 16


def heads_per_cta(group_size: int) -> int:
    """The compiled head count for a GQA group: the smallest of 1, 2, 4, 8 that holds it (8 at most)."""
    return next((h for h in HEADS_PER_CTA if h >= group_size), HEADS_PER_CTA[-1])


# --8<-- [start:split_ranges]
def split_range(num_visible: int, num_splits: int, split: int, head_dim: int, heads: int = 4) -> tuple[int, int]:
    """[begin, end) of the visible keys (in enumeration order) that ``split`` reads.

    The visible keys are cut into ``num_splits`` equal chunks, each rounded up
    to whole loop iterations of the kernel; splits past the end get an empty
    range. The kernel computes exactly this (``visible_key_range`` and the
    split arithmetic in ``kernel``); the PyTorch model below uses it too.
    """
    step = keys_per_iteration(head_dim, heads)
    chunk = -(-num_visible // num_splits)
    chunk = -(-chunk // step) * step
    begin = min(split * chunk, num_visible)
    return begin, min(begin + chunk, num_visible)
# --8<-- [end:split_ranges]


def visible_keys_of(seqlen: int, window_size_left: int, num_sink_tokens: int) -> list[int]:
    """The keys a query at position seqlen - 1 sees, in the order the kernel enumerates them."""
    lo = max(0, seqlen - 1 - window_size_left) if window_size_left >= 0 else 0
    return list(range(min(num_sink_tokens, lo))) + list(range(lo, seqlen))


# --8<-- [start:key_range]
@cute.jit
def visible_key_range(seqlen: Int32, window_left: Int32, num_sink_tokens: Int32):
    """(window start, sink keys before it, number of visible keys) for one sequence.

    The query sits at position seqlen - 1 and sees keys [lo, seqlen), where lo
    is 0 without a window; keys j < num_sink_tokens stay visible below lo. The
    visible keys are enumerated as v = 0, 1, ...: first the n_sink sink keys,
    then the window, so key(v) = v for v < n_sink and v - n_sink + lo after.
    Keys outside the window are never touched, not even as masked loads.
    """
    lo = Int32(0)
    if window_left >= 0:
        lo = cutlass.max(seqlen - 1 - window_left, Int32(0))
    n_sink = cutlass.min(num_sink_tokens, lo)
    return lo, n_sink, n_sink + seqlen - lo
# --8<-- [end:key_range]


# --8<-- [start:softmax]
@cute.jit
def online_softmax_update(scores: cute.Tensor, rV: cute.Tensor, row_max: cute.Tensor,
                          row_sum: cute.Tensor, acc: cute.Tensor):
    """Fold UNROLL new keys into one key group's running softmax, for every query head.

    ``scores[h, u]``: the score of key u for head h, already multiplied by
    softmax_scale * log2(e) (so exp2 gives the softmax numerator); -inf for a
    key past the end of the split. ``rV[u, i]``: this thread's 8 elements of
    key u's V row (fp16/bf16). ``row_max[h]``, ``row_sum[h]``: the running max
    (log2 units) and sum; ``acc[h, i]``: the running unnormalized O of this
    thread's 8 columns. All threads of a key group hold the same scores, max
    and sum; each holds its own 8 columns of O.
    """
    num_heads, unroll = cute.size(scores, mode=[0]), cute.size(scores, mode=[1])
    # TODO(stage 7): For each head h, fold the UNROLL new keys into the key group's running state:
    #   afterwards row_max[h] is the max of every score seen, and row_sum[h] and acc[h, :] (fp32)
    #   are the softmax numerators' sum and V-weighted sum over every key seen, relative to that
    #   max (the old values were relative to the old max). Scores are already in exp2 units. A
    #   -inf score adds nothing; while every score seen is -inf all stays 0, never NaN.
    #   (page: The online softmax of a key group)
    raise NotImplementedError("TODO(stage 7) in online_softmax_update(): For each head h, fold the UNROLL new keys into the key group's running state: afterwards row_max[h] is the max of every score seen, and row_sum[h] and acc[h, :] (fp32) are the softmax numerators' sum and V-weighted sum over every key seen, relative to that max (the old values were relative to the old max). Scores are already in exp2 units. A -inf score adds nothing; while every score seen is -inf all stays 0, never NaN. (page: The online softmax of a key group) Hints, one at a time: python -m course hint 7 (docs/stages/07-decode.md as raw markdown shows them all at once)")
# --8<-- [end:softmax]


# --8<-- [start:partial]
@cute.jit
def split_partial(maxes: cute.Tensor, sums: cute.Tensor, accs: cute.Tensor, h: Int32, quad: Int32,
                  o: cute.Tensor) -> Float32:
    """Merge the thread groups' states for head h into the split's O (4 columns) and LSE.

    ``maxes[g, h]``, ``sums[g, h]``, ``accs[g, h, d]`` hold group g's running
    max (log2 units), sum and unnormalized O. ``o`` receives columns
    4 * quad .. 4 * quad + 3 of O, normalized by the split's own sum. Returns
    the split's LSE in log2 units (-inf, and O = 0, when the split saw no key).
    """
    num_groups = cute.size(maxes, mode=[0])
    part = cute.make_rmem_tensor((4,), Float32)
    # TODO(stage 7): Merge the key groups' states for head h (each relative to its own max) into the
    #   split's result: o gets the 4 columns of O that quad selects, normalized by the split's own
    #   sum, and lse, for the return below, the split's LSE in log2 units. A group that saw no key
    #   weighs nothing; a split that saw none gives o = 0 and lse = -inf, never NaN. part holds
    #   one group's 4 columns. (page: From key groups to the split's partial)
    raise NotImplementedError("TODO(stage 7) in split_partial(): Merge the key groups' states for head h (each relative to its own max) into the split's result: o gets the 4 columns of O that quad selects, normalized by the split's own sum, and lse, for the return below, the split's LSE in log2 units. A group that saw no key weighs nothing; a split that saw none gives o = 0 and lse = -inf, never NaN. part holds one group's 4 columns. (page: From key groups to the split's partial) Hints, one at a time: python -m course hint 7 (docs/stages/07-decode.md as raw markdown shows them all at once)")
    return lse
# --8<-- [end:partial]


# --8<-- [start:arrive]
@cute.jit
def arrive_and_elect_last(counter: cute.Pointer, num_splits: Int32, s_flag: cute.Tensor) -> Int32:
    """Count this CTA's split as done; return 1 in every thread of the CTA that finished last.

    Call it after every thread has stored its part of the split's partial.
    The partials of all splits must be visible to the last CTA before it reads
    them: the barrier orders this CTA's stores before thread 0's atomic, whose
    release half publishes them at gpu scope, and the atomic of the last
    arriver also acquires every earlier CTA's release.
    """
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.sync_threads()  # every thread's partial stores happen before thread 0's release
    if tidx == 0:
        # TODO(stage 7): Thread 0 counts this CTA's split on counter with one atomic that both
        #   publishes this CTA's partials (release) and sees every earlier CTA's (acquire), at GPU
        #   scope; s_flag[0] = 1 if this CTA arrived last of num_splits, else 0. Exactly one CTA
        #   per launch sees 1. (page: Memory ordering: barrier, atomic, barrier)
        raise NotImplementedError("TODO(stage 7) in arrive_and_elect_last(): Thread 0 counts this CTA's split on counter with one atomic that both publishes this CTA's partials (release) and sees every earlier CTA's (acquire), at GPU scope; s_flag[0] = 1 if this CTA arrived last of num_splits, else 0. Exactly one CTA per launch sees 1. (page: Memory ordering: barrier, atomic, barrier) Hints, one at a time: python -m course hint 7 (docs/stages/07-decode.md as raw markdown shows them all at once)")
        if s_flag[0] == 1:
            # TODO(stage 7): The last CTA puts the counter back to 0, so the next launch and every
            #   CUDA graph replay start from zero. Nobody else touches it in this launch: no
            #   ordering is needed. (page: Memory ordering: barrier, atomic, barrier)
            raise NotImplementedError('TODO(stage 7) in arrive_and_elect_last(): The last CTA puts the counter back to 0, so the next launch and every CUDA graph replay start from zero. Nobody else touches it in this launch: no ordering is needed. (page: Memory ordering: barrier, atomic, barrier) Hints, one at a time: python -m course hint 7 (docs/stages/07-decode.md as raw markdown shows them all at once)')
    cute.arch.sync_threads()  # the flag is in shared memory for everybody
    return s_flag[0]
# --8<-- [end:arrive]


# --8<-- [start:combine]
@cute.jit
def fold_in_split(lse: Float32, part: cute.Tensor, state: cute.Tensor, o: cute.Tensor):
    """Fold one split's partial into a running combine: the online softmax again, now over splits.

    ``lse``: the split's LSE (log2 units, -inf for a split that saw no key);
    ``part``: 4 columns of its normalized O. ``state[0]``: the running max M
    of the LSEs so far; ``state[1]``: the running total, sum_s exp2(lse_s - M);
    ``o``: sum_s exp2(lse_s - M) * O_s for the same 4 columns.
    """
    # TODO(stage 7): Fold one split into the running combine: afterwards state[0] is the max of
    #   every LSE folded so far, state[1] the sum of the splits' weights and o the weighted sum of
    #   their O, both relative to it (the docstring's invariant; the old values were relative to
    #   the old max). A split with lse -inf weighs 0; while every LSE seen is -inf all stays 0,
    #   never NaN. (page: The combine)
    raise NotImplementedError("TODO(stage 7) in fold_in_split(): Fold one split into the running combine: afterwards state[0] is the max of every LSE folded so far, state[1] the sum of the splits' weights and o the weighted sum of their O, both relative to it (the docstring's invariant; the old values were relative to the old max). A split with lse -inf weighs 0; while every LSE seen is -inf all stays 0, never NaN. (page: The combine) Hints, one at a time: python -m course hint 7 (docs/stages/07-decode.md as raw markdown shows them all at once)")


@cute.jit
def finish_combine(state: cute.Tensor, o: cute.Tensor, sink_log2: Float32, has_sink: cutlass.Constexpr):
    """After the last split: fold in the sink logit (once, here), normalize o; return the LSE (log2 units).

    A sink adds exp2(sink - M) to the denominator only. An all-empty row (no
    visible key, no sink) has total 0: O = 0 and LSE = -inf, never NaN.
    """
    # TODO(stage 7): With a sink (has_sink, decided at compile time: no sink code otherwise) the
    #   sink logit joins the denominator once, as a term with no value. Then o is the combined O
    #   divided by the total, and lse, for the return below, the row's LSE in log2 units. A total
    #   of 0 (nothing visible, no sink) gives o = 0 and lse = -inf, never NaN. (page: The combine)
    raise NotImplementedError("TODO(stage 7) in finish_combine(): With a sink (has_sink, decided at compile time: no sink code otherwise) the sink logit joins the denominator once, as a term with no value. Then o is the combined O divided by the total, and lse, for the return below, the row's LSE in log2 units. A total of 0 (nothing visible, no sink) gives o = 0 and lse = -inf, never NaN. (page: The combine) Hints, one at a time: python -m course hint 7 (docs/stages/07-decode.md as raw markdown shows them all at once)")
    return lse
# --8<-- [end:combine]


@cute.jit
def cache_row(v: Int32, v_end: Int32, n_sink: Int32, lo: Int32) -> Int32:
    """The token position of visible key ``v``; past the split's end, the split's last key (a valid row)."""
    v = cutlass.min(v, v_end - 1)
    return Int32(cutlass.select_(v < n_sink, v, v - n_sink + lo))


@cute.jit
def pool_page(page: Int32, num_pages: Int32) -> Int32:
    """A block-table entry clamped to the pool: a wrong table reads a wrong page, never memory outside the
    cache (the host reads the table only when asked: ``check_lengths``)."""
    return cutlass.max(cutlass.min(page, num_pages - 1), Int32(0))


class SplitKVDecode:
    """Grid (num_splits, H_kv x head chunks, B); one CTA = one split of one KV head's keys, all its query heads."""

    num_threads = NUM_THREADS

    def __init__(self, config: DecodeConfig):
        self.dtype = config.cute_dtype
        self.head_dim = config.head_dim
        self.heads = config.heads
        self.page_size = config.page_size  # 0: contiguous cache
        self.has_sink = config.has_sink
        self.write_lse = config.write_lse
        self.tpk = threads_per_key(config.head_dim)
        self.groups = NUM_THREADS // self.tpk
        self.unroll = unroll(config.heads)
        self.keys_per_iter = keys_per_iteration(config.head_dim, config.heads)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,           # [B, H_q, D]
        mK: cute.Tensor,           # [B, S_max, H_kv, D] or [pages, page_size, H_kv, D]
        mV: cute.Tensor,
        mSeqlens: cute.Tensor,     # [B] int32
        mBlockTable: cute.Tensor,  # [B, max_pages] int32 (unused for a contiguous cache)
        mSink: cute.Tensor,        # [H_q] float32 (unused without sinks)
        mO: cute.Tensor,           # [B, H_q, D]
        mLSE: cute.Tensor,         # [B, H_q] float32 (unused without return_lse)
        mPartO: cute.Tensor,       # [B, H_q, num_splits, D] float32 workspace
        mPartLSE: cute.Tensor,     # [B, H_q, num_splits] float32 workspace
        mCounters: cute.Tensor,    # [>= B * H_kv * chunks] int32, zero between launches
        scale_log2: Float32,
        window_left: Int32,
        num_sink_tokens: Int32,
        stream,
    ):
        work_words = work_bytes(self.head_dim, self.heads) // 4  # a local: the annotations below see locals

        @cute.struct
        class SharedStorage:
            # First the cp.async ring, then (same bytes) the key groups' states for the merge.
            work: cute.struct.Align[cute.struct.MemRange[Float32, work_words], 128]
            flag: cute.struct.MemRange[Int32, 1]

        self.shared_storage = SharedStorage

        # --8<-- [start:grid]
        batch, heads_q, heads_kv = mQ.shape[0], mQ.shape[1], mK.shape[2]
        chunks = (heads_q // heads_kv + self.heads - 1) // self.heads
        num_splits = mPartLSE.shape[2]
        grid = (num_splits, heads_kv * chunks, batch)
        # --8<-- [end:grid]
        self.kernel(
            mQ, mK, mV, mSeqlens, mBlockTable, mSink, mO, mLSE, mPartO, mPartLSE, mCounters,
            scale_log2, window_left, num_sink_tokens,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 # Tell ptxas how many CTAs share an SM (it budgets registers for that), and
                 # give shared memory the largest carveout: the rings of all of them must fit.
                 min_blocks_per_mp=ctas_per_sm(self.heads, self.head_dim), preferred_smem_carveout=100)

    # --8<-- [start:key_row]
    @cute.jit
    def lookup_pages(self, r_page: cute.Tensor, mBlockTable: cute.Tensor, batch: Int32, first: Int32,
                     v_end: Int32, n_sink: Int32, lo: Int32):
        """Paged cache: ``r_page[u]``, the pool page that holds key first + u * groups, from the block table.

        The main loop calls it one iteration before the copies that need the
        pages, so the block-table load is in flight during a whole iteration of
        compute instead of stalling the copies behind it. Contiguous: nothing.
        """
        if cutlass.const_expr(self.page_size != 0):
            for u in cutlass.range_constexpr(self.unroll):
                row = cache_row(first + u * self.groups, v_end, n_sink, lo)
                r_page[u] = mBlockTable[batch, row >> (self.page_size.bit_length() - 1)]  # row // page_size

    @cute.jit
    def key_row(self, mKV: cute.Tensor, page_or_batch: Int32, row: Int32, head_kv: Int32,
                lane: Int32) -> cute.Tensor:
        """This thread's 8 elements of K (or V) at token ``row`` of ``head_kv``: of sequence
        ``page_or_batch`` in a contiguous cache, of pool page ``page_or_batch`` in a paged one."""
        if cutlass.const_expr(self.page_size == 0):
            kv_row = mKV[page_or_batch, row, head_kv, None]
        else:
            page = pool_page(page_or_batch, mKV.shape[0])
            kv_row = mKV[page, row & (self.page_size - 1), head_kv, None]  # row % page_size
        return cute.local_tile(kv_row, (VEC,), (lane,))
    # --8<-- [end:key_row]

    # --8<-- [start:issue_loads]
    @cute.jit
    def issue_loads(self, s_ring: cute.Tensor, stage: Int32, mK: cute.Tensor, mV: cute.Tensor,
                    r_page: cute.Tensor, batch: Int32, head_kv: Int32, first: Int32, v_end: Int32,
                    n_sink: Int32, lo: Int32, tidx: Int32, lane: Int32):
        """Start the cp.async copies of one iteration's keys (visible keys first + u * groups) into ring ``stage``.

        Nothing waits here: the 16-byte copies run while the thread computes
        on earlier stages. Past the split's end it re-reads the split's last
        key (a valid row); the main loop masks its score. A paged cache takes
        the pages from ``r_page`` (``lookup_pages``).
        """
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=LoadCacheMode.GLOBAL), self.dtype,
                                   num_bits_per_copy=128)
        for u in cutlass.range_constexpr(self.unroll):
            row = cache_row(first + u * self.groups, v_end, n_sink, lo)
            page_or_batch = batch if cutlass.const_expr(self.page_size == 0) else r_page[u]
            cute.copy(atom, self.key_row(mK, page_or_batch, row, head_kv, lane), s_ring[stage, 0, u, tidx, None])
            cute.copy(atom, self.key_row(mV, page_or_batch, row, head_kv, lane), s_ring[stage, 1, u, tidx, None])
    # --8<-- [end:issue_loads]

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mSeqlens: cute.Tensor,
        mBlockTable: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLSE: cute.Tensor,
        mCounters: cute.Tensor,
        scale_log2: Float32,
        window_left: Int32,
        num_sink_tokens: Int32,
    ):
        heads, d, tpk, groups = self.heads, self.head_dim, self.tpk, self.groups
        tidx, _, _ = cute.arch.thread_idx()
        split, kv_chunk, batch = cute.arch.block_idx()
        num_splits, kv_ctas, _ = cute.arch.grid_dim()

        # --8<-- [start:heads]
        # GQA: the CTA's query heads are `heads` consecutive heads of one KV head's group.
        group_size = mQ.shape[1] // mK.shape[2]
        chunks = (group_size + heads - 1) // heads
        head_kv = kv_chunk // chunks
        first_head = head_kv * group_size + (kv_chunk % chunks) * heads
        heads_here = cutlass.min(group_size - (kv_chunk % chunks) * heads, Int32(heads))
        # --8<-- [end:heads]

        # --8<-- [start:threads]
        # A key is read by `tpk` = D/8 consecutive threads (a "key group"), 16 bytes each.
        lane = tidx % tpk          # which 8 columns of the row
        key_group = tidx // tpk    # which key of each `groups`-wide step
        # --8<-- [end:threads]

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # [stage, K or V, u, thread, 8 elements]: each thread's own 16-byte slots.
        s_ring = storage.work.get_tensor(
            cute.make_ordered_layout((STAGES, 2, self.unroll, NUM_THREADS, VEC), order=(4, 3, 2, 1, 0)),
            dtype=self.dtype)
        # After the main loop the ring is free: the merge reuses its bytes.
        work = storage.work.data_ptr()
        s_max = cute.make_tensor(work, cute.make_layout((groups, heads), stride=(heads, 1)))
        s_sum = cute.make_tensor(work + groups * heads, cute.make_layout((groups, heads), stride=(heads, 1)))
        s_acc = cute.make_tensor(work + 2 * groups * heads,
                                 cute.make_layout((groups, heads, d), stride=(heads * d, d, 1)))
        s_flag = storage.flag.get_tensor(cute.make_layout(1))

        # --8<-- [start:query]
        # This thread's 8 query columns for each head, in fp32, pre-multiplied by
        # softmax_scale * log2(e): a dot product is then a score in exp2 units.
        r_q = cute.make_rmem_tensor(cute.make_ordered_layout((heads, VEC), order=(1, 0)), Float32)
        r_q_in = cute.make_rmem_tensor((VEC,), self.dtype)
        for h in cutlass.range_constexpr(heads):
            head = first_head + cutlass.min(Int32(h), heads_here - 1)  # spare slots repeat a real head
            cute.autovec_copy(cute.local_tile(mQ[batch, head, None], (VEC,), (lane,)), r_q_in)
            for i in cutlass.range_constexpr(VEC):
                r_q[h, i] = r_q_in[i].to(Float32) * scale_log2
        # --8<-- [end:query]

        # --8<-- [start:split]
        # The split's slice [v_begin, v_end) of the sequence's visible keys.
        if cutlass.const_expr(self.page_size == 0):
            capacity = mK.shape[1]
        else:
            capacity = mBlockTable.shape[1] * self.page_size
        seqlen = cutlass.max(cutlass.min(mSeqlens[batch], capacity), Int32(0))  # never outside the cache
        lo, n_sink, num_visible = visible_key_range(seqlen, window_left, num_sink_tokens)
        step = self.keys_per_iter
        chunk = (num_visible + num_splits - 1) // num_splits
        chunk = (chunk + step - 1) // step * step
        v_begin = cutlass.min(split * chunk, num_visible)
        v_end = cutlass.min(v_begin + chunk, num_visible)
        num_iters = (v_end - v_begin + step - 1) // step
        # --8<-- [end:split]

        # --8<-- [start:main_loop]
        row_max = cute.make_rmem_tensor((heads,), Float32)
        row_sum = cute.make_rmem_tensor((heads,), Float32)
        acc = cute.make_rmem_tensor(cute.make_ordered_layout((heads, VEC), order=(1, 0)), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc.fill(0.0)
        # Row u of r_k / r_v: this thread's 16 bytes of key u, read back from its ring slots.
        r_k = cute.make_rmem_tensor(cute.make_ordered_layout((self.unroll, VEC), order=(1, 0)), self.dtype)
        r_v = cute.make_rmem_tensor(cute.make_ordered_layout((self.unroll, VEC), order=(1, 0)), self.dtype)
        scores = cute.make_rmem_tensor((heads, self.unroll), Float32)
        # Paged cache: row st < STAGES - 1 holds the pages of prologue iteration st's copies, the last
        # row those of the next copies the loop issues.
        r_pages = cute.make_rmem_tensor(cute.make_ordered_layout((STAGES, self.unroll), order=(1, 0)), Int32)
        issue_loads, lookup_pages = self.issue_loads, self.lookup_pages
        # Prologue: all the block-table loads it needs at once, then the first STAGES - 1 iterations'
        # copies start before any compute.
        for st in cutlass.range_constexpr(STAGES):
            if st < num_iters:
                lookup_pages(r_pages[st, None], mBlockTable, batch, v_begin + st * step + key_group, v_end, n_sink, lo)
        for st in cutlass.range_constexpr(STAGES - 1):
            if st < num_iters:
                issue_loads(s_ring, Int32(st), mK, mV, r_pages[st, None], batch, head_kv,
                            v_begin + st * step + key_group, v_end, n_sink, lo, tidx, lane)
            cute.arch.cp_async_commit_group()  # one group per iteration, empty or not, so the count below holds
        for it in cutlass.range(num_iters, unroll=1):
            ahead = it + STAGES - 1
            if ahead < num_iters:  # into the slot iteration it - 1 has finished reading
                issue_loads(s_ring, ahead % STAGES, mK, mV, r_pages[STAGES - 1, None], batch, head_kv,
                            v_begin + ahead * step + key_group, v_end, n_sink, lo, tidx, lane)
            if ahead + 1 < num_iters:  # the next iteration's pages: the load has a whole iteration to land
                lookup_pages(r_pages[STAGES - 1, None], mBlockTable, batch, v_begin + (ahead + 1) * step + key_group,
                             v_end, n_sink, lo)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(STAGES - 1)  # this thread's copies of iteration it have landed
            stage = it % STAGES
            first = v_begin + it * step + key_group
            for u in cutlass.range_constexpr(self.unroll):
                cute.autovec_copy(s_ring[stage, 0, u, tidx, None], r_k[u, None])
                cute.autovec_copy(s_ring[stage, 1, u, tidx, None], r_v[u, None])
            for u in cutlass.range_constexpr(self.unroll):
                valid = first + u * groups < v_end
                for h in cutlass.range_constexpr(heads):
                    dot = Float32(0.0)
                    for i in cutlass.range_constexpr(VEC):
                        dot = dot + r_q[h, i] * r_k[u, i].to(Float32)
                    # Each thread of the key group holds the sum of its 8 products: a
                    # butterfly over the group leaves the full dot product in all of them.
                    dot = cute.arch.warp_reduction_sum(dot, threads_in_group=tpk)
                    scores[h, u] = Float32(cutlass.select_(valid, dot, -Float32.inf))
            online_softmax_update(scores, r_v, row_max, row_sum, acc)
        # --8<-- [end:main_loop]

        # --8<-- [start:merge_groups]
        # Every key group's (max, sum, O columns) into shared memory, then one
        # (O, LSE) for the split, written to the fp32 workspace. The states go
        # where the ring was: wait until no copy is in flight and every thread
        # has read its last slots.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        for h in cutlass.range_constexpr(heads):
            if lane == 0:
                s_max[key_group, h] = row_max[h]
                s_sum[key_group, h] = row_sum[h]
            for i in cutlass.range_constexpr(VEC):
                s_acc[key_group, h, lane * VEC + i] = acc[h, i]
        cute.arch.sync_threads()
        # One thread per (head, 4 columns): the groups' weights once per head, 16-byte stores.
        head_quads = d // 4  # 4-column pieces of one head's row
        o_part = cute.make_rmem_tensor((4,), Float32)
        for k in cutlass.range_constexpr((heads * head_quads + NUM_THREADS - 1) // NUM_THREADS):
            quad = tidx + k * NUM_THREADS
            h = cutlass.min(quad // head_quads, heads_here - 1)  # spare threads redo a real head, never stored
            lse = split_partial(s_max, s_sum, s_acc, h, quad % head_quads, o_part)
            if quad // head_quads < heads_here:
                cute.autovec_copy(o_part, cute.local_tile(mPartO[batch, first_head + h, split, None], (4,),
                                                          (quad % head_quads,)))
                if quad % head_quads == 0:
                    mPartLSE[batch, first_head + h, split] = lse
        # --8<-- [end:merge_groups]

        # --8<-- [start:last_block]
        counter = mCounters.iterator + (batch * kv_ctas + kv_chunk)
        if arrive_and_elect_last(counter, num_splits, s_flag) == 1:
            # This CTA finished last: every split's partial is in the workspace.
            # Each thread owns 4 columns of one head (a 16-byte load per split)
            # and folds the splits in one pass, in rounds: first the loads of
            # combine_loads() splits, all in flight at once, then their folds. The
            # partials sit in L2, and this chain of L2 round trips is the end of
            # the kernel.
            per_thread = (heads * head_quads + NUM_THREADS - 1) // NUM_THREADS
            per_round = max(1, combine_loads(heads, d) // per_thread)  # splits per round
            o = cute.make_rmem_tensor(cute.make_ordered_layout((per_thread, 4), order=(1, 0)), Float32)
            state = cute.make_rmem_tensor(cute.make_ordered_layout((per_thread, 2), order=(1, 0)), Float32)
            parts = cute.make_rmem_tensor(cute.make_ordered_layout((per_thread, per_round, 4), order=(2, 1, 0)),
                                          Float32)
            lses = cute.make_rmem_tensor(cute.make_ordered_layout((per_thread, per_round), order=(1, 0)), Float32)
            o.fill(0.0)
            for k in cutlass.range_constexpr(per_thread):
                state[k, 0] = -Float32.inf
                state[k, 1] = Float32(0.0)
            for first_split in cutlass.range(0, num_splits, per_round, unroll=1):
                for k in cutlass.range_constexpr(per_thread):
                    quad = tidx + k * NUM_THREADS
                    h = cutlass.min(quad // head_quads, heads_here - 1)  # spare threads redo a real head, never stored
                    for j in cutlass.range_constexpr(per_round):
                        # Past the last split: reload it and fold it in with LSE -inf, which adds nothing.
                        s = cutlass.min(first_split + j, num_splits - 1)
                        cute.autovec_copy(cute.local_tile(mPartO[batch, first_head + h, s, None], (4,),
                                                          (quad % head_quads,)), parts[k, j, None])
                        lses[k, j] = Float32(cutlass.select_(first_split + j < num_splits,
                                                             mPartLSE[batch, first_head + h, s], -Float32.inf))
                for k in cutlass.range_constexpr(per_thread):
                    for j in cutlass.range_constexpr(per_round):
                        fold_in_split(lses[k, j], parts[k, j, None], state[k, None], o[k, None])
            out = cute.make_rmem_tensor((4,), self.dtype)
            for k in cutlass.range_constexpr(per_thread):
                quad = tidx + k * NUM_THREADS
                h = cutlass.min(quad // head_quads, heads_here - 1)
                sink_log2 = Float32(0.0)
                if cutlass.const_expr(self.has_sink):
                    sink_log2 = mSink[first_head + h] * LOG2_E
                lse = finish_combine(state[k, None], o[k, None], sink_log2, self.has_sink)
                if quad // head_quads < heads_here:  # a real head (heads_here <= heads, so also a real piece)
                    for i in cutlass.range_constexpr(4):
                        out[i] = o[k, i].to(self.dtype)
                    cute.autovec_copy(out, cute.local_tile(mO[batch, first_head + h, None], (4,), (quad % head_quads,)))
                    if cutlass.const_expr(self.write_lse):
                        if quad % head_quads == 0:
                            mLSE[batch, first_head + h] = lse * LN_2  # natural log, as the API returns it
        # --8<-- [end:last_block]


# --8<-- [start:configs]
@dataclass(frozen=True)
class DecodeConfig:
    """What one compiled decode kernel is specialized for; batch, lengths, head counts, the page
    count and the split count are runtime values."""

    dtype: str = "float16"
    head_dim: int = 128
    page_size: int = 0         # 0: a contiguous cache; else the (compile-time) page size of a paged one
    heads: int = 4             # query heads one CTA computes (HEADS_PER_CTA)
    has_sink: bool = False     # sink logits
    write_lse: bool = False    # also write the LSE

    @property
    def cute_dtype(self):
        import torch

        return cute_dtype(getattr(torch, self.dtype))

    @property
    def name(self) -> str:
        layout = f"paged{self.page_size}" if self.page_size else "contiguous"
        return (f"{self.dtype}_d{self.head_dim}_{layout}_h{self.heads}"
                f"{'_sink' if self.has_sink else ''}{'_lse' if self.write_lse else ''}")


def fake_decode_tensors(torch_dtype, head_dim: int, page_size: int):
    import torch
    from cutlass.cute.runtime import make_fake_tensor

    symbols: dict = {}

    def small(dtype, shape):  # int32/fp32 tensors with a contiguous last mode and any row stride
        extents = tuple(symbols.setdefault(e, cute.sym_int(symbol=e)) if isinstance(e, str) else e for e in shape)
        stride = tuple(cute.sym_int64() for _ in shape[:-1]) + (1,)
        return make_fake_tensor(dtype, extents, stride, assumed_align=4)

    q = symbolic_tensor(torch_dtype, ("B", "H_q", head_dim), symbols=symbols)
    rows = ("B_kv", "S_max") if page_size == 0 else ("pages", page_size)
    k = symbolic_tensor(torch_dtype, (*rows, "H_kv", head_dim), symbols=symbols)
    v = symbolic_tensor(torch_dtype, (*rows, "H_kv", head_dim), symbols=symbols)
    o = symbolic_tensor(torch_dtype, ("B", "H_q", head_dim), symbols=symbols)
    part_o = symbolic_tensor(torch.float32, ("B", "H_q", "splits", head_dim), symbols=symbols)
    seqlens = small(cutlass.Int32, ("B",))
    block_table = small(cutlass.Int32, ("B_table", "max_pages"))
    sink = small(cutlass.Float32, ("H_sink",))
    lse = small(cutlass.Float32, ("B_lse", "H_lse"))
    part_lse = small(cutlass.Float32, ("B", "H_q", "splits"))
    counters = small(cutlass.Int32, ("counters",))
    return q, k, v, seqlens, block_table, sink, o, lse, part_o, part_lse, counters


def kernel_and_args(config: DecodeConfig):
    """The kernel and the symbolic arguments it is compiled with (for every batch, length and head count)."""
    import torch

    tensors = fake_decode_tensors(getattr(torch, config.dtype), config.head_dim, config.page_size)
    return SplitKVDecode(config), (*tensors, Float32(1.0), Int32(-1), Int32(0))


def compile_matrix() -> list[DecodeConfig]:
    """Every dtype x head dim x cache layout (contiguous and each page size); the heads per CTA and
    the compiled-out features (sinks, LSE) rotate so that each value meets every head dim."""
    flags = [(False, False), (True, False), (False, True), (True, True)]
    layouts = [(dtype, d, page) for dtype in ("float16", "bfloat16") for d in HEAD_DIMS for page in (0, *PAGE_SIZES)]
    return [DecodeConfig(dtype, d, page, HEADS_PER_CTA[i % len(HEADS_PER_CTA)],
                         *flags[(i // len(HEADS_PER_CTA) + i) % len(flags)])
            for i, (dtype, d, page) in enumerate(layouts)]


KERNEL_CONFIGS = compile_matrix()


def cross_compile_config(config: DecodeConfig, keep: bool = False):
    """Compile for sm_90a on any machine (no GPU needed) and report registers, smem, spills."""
    kernel, args = kernel_and_args(config)
    return cross_compile(kernel, *args, name=f"stage{STAGE:02d}_{config.name}", keep=keep)
# --8<-- [end:configs]


# --8<-- [start:num_splits]
def shared_bytes(head_dim: int, heads: int) -> int:
    """Bytes of the kernel's SharedStorage: the work area and the last-block flag."""
    return -(-(work_bytes(head_dim, heads) + 4) // 128) * 128


def ctas_per_sm(heads: int, head_dim: int = 128) -> int:
    """CTAs of this kernel that fit on one SM at once, by registers and by shared memory.

    64K registers / (registers per thread x 128 threads), with the register
    counts ptxas reports for the sm_90a build (the cross-compile tests check
    them; more heads per CTA, more registers), and 228 KB of shared memory per
    SM / (SharedStorage + the 1 KB the system reserves per CTA).
    """
    registers = -(-REGISTERS_PER_THREAD[heads] // 8) * 8  # allocated per warp in blocks of 256 = 8 per thread
    by_registers = 65536 // (registers * NUM_THREADS)
    by_shared = SHARED_BYTES_PER_SM // (shared_bytes(head_dim, heads) + 1024)
    return max(1, min(16, by_registers, by_shared))


def auto_num_splits(batch: int, kv_ctas: int, max_keys: int, num_sms: int, heads: int = 4,
                    head_dim: int = 128) -> int:
    """The split count for num_splits=0: ``course.runtime.launch.pick_num_splits`` with this kernel's CTAs per
    SM, SPLIT_CTAS_PER_SM for few sequences and at least MIN_KEYS_PER_SPLIT keys per split."""
    return launch.pick_num_splits(batch * kv_ctas, max_keys, num_sms, ctas_per_sm(heads, head_dim),
                                  split_ctas_per_sm=SPLIT_CTAS_PER_SM, min_keys_per_split=MIN_KEYS_PER_SPLIT)
# --8<-- [end:num_splits]


# --8<-- [start:api]
_PLANS: dict = {}


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                     window_size_left=-1, sink_logits=None, num_sink_tokens=0, num_splits=0,
                     return_lse=False, out=None, check_lengths=None):
    """One query token per sequence against its KV cache; the contract is docs/contract.md.

    q [B, H_q, D]; k_cache, v_cache [B, S_max, H_kv, D], or paged [num_pages,
    page_size, H_kv, D] with block_table [B, max_pages] int32; cache_seqlens
    [B] int32. Returns o [B, H_q, D] (and lse [B, H_q] float32 with
    return_lse). ``out`` (optional) receives O. ``check_lengths=True`` reads
    cache_seqlens and the block table on the host (a synchronization) to
    reject lengths beyond the cache and pages outside the pool; ``None``
    follows ``COURSE_CHECK_LENGTHS`` (``launch.check_device_values``).
    Unchecked, the kernel clamps lengths and pages to the cache.
    """
    key = launch.signature(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits, out, softmax_scale,
                           window_size_left, num_sink_tokens, num_splits, return_lse)
    check = launch.check_device_values(check_lengths)
    run = launch.cached_plan(_PLANS, key, lambda: plan_launch(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
        window_size_left=window_size_left, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
        num_splits=num_splits, return_lse=return_lse, out=out, check_lengths=check))
    if check:
        validation.check_decode_values(cache_seqlens, block_table, run.shape)
    return run(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits, out)


def plan_launch(q, k_cache, v_cache, cache_seqlens, *, block_table, softmax_scale, window_size_left, sink_logits,
                num_sink_tokens, num_splits, return_lse, out, check_lengths):
    """Everything ``decode_attention`` does that depends only on the call's signature: validation, the
    split count, the kernel and its compile, placeholders, workspace sizes.

    Returns ``run(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits,
    out)``, which allocates the outputs and workspace and launches.
    """
    import torch

    shape = validation.check_decode_inputs(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
        window_size_left=window_size_left, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
        num_splits=num_splits, return_lse=return_lse, out=out, head_dims=[(d, d) for d in HEAD_DIMS],
        page_sizes=PAGE_SIZES,
    )
    if check_lengths:  # values before devices, so that a CPU test reaches them (decode_attention checks again)
        validation.check_decode_values(cache_seqlens, block_table, shape)
    validation.check_on_gpu(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                            block_table=block_table, sink_logits=sink_logits, out=out)
    device = q.device
    heads = heads_per_cta(shape.heads_q // shape.heads_kv)
    kv_ctas = shape.heads_kv * -(-(shape.heads_q // shape.heads_kv) // heads)
    if num_splits == 0:
        max_keys = shape.capacity if window_size_left < 0 else min(
            shape.capacity, window_size_left + 1 + num_sink_tokens)
        num_splits = auto_num_splits(shape.batch, kv_ctas, max_keys,
                                     torch.cuda.get_device_properties(device).multi_processor_count, heads,
                                     shape.head_dim)
    config = DecodeConfig(str(q.dtype).removeprefix("torch."), shape.head_dim,
                          shape.page_size if block_table is not None else 0, heads, sink_logits is not None,
                          bool(return_lse))
    kernel = launch.compiled((SplitKVDecode, config), lambda: kernel_and_args(config))
    scale_log2 = validation.resolve_scale(softmax_scale, shape.head_dim) * LOG2_E
    no_table = launch.placeholder(device, (1, 1), torch.int32)
    no_sink, no_lse = launch.placeholder(device, (1,)), launch.placeholder(device, (1, 1))
    part_o_shape = (shape.batch, shape.heads_q, num_splits, shape.head_dim)
    part_lse_shape, lse_shape = (shape.batch, shape.heads_q, num_splits), (shape.batch, shape.heads_q)
    partials = launch.DecodePartials(device, part_o_shape, part_lse_shape)
    num_counters = shape.batch * kv_ctas

    def run(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits, out):
        if out is None:
            out = q.new_empty(q.shape)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device) if return_lse else no_lse
        part_o, part_lse = partials.views()
        kernel(q, k_cache, v_cache, cache_seqlens, no_table if block_table is None else block_table,
               no_sink if sink_logits is None else sink_logits, out, lse, part_o, part_lse,
               launch.decode_counters(device, num_counters), scale_log2, window_size_left, num_sink_tokens)
        return (out, lse) if return_lse else out

    run.shape = shape
    return run
# --8<-- [end:api]


def split_kv_model(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                   window_size_left=-1, sink_logits=None, num_sink_tokens=0, num_splits=1):
    """The kernel's algorithm in PyTorch (float64, CPU-friendly): splits, partials, last-block combine.

    Same enumeration of visible keys, same split ranges (``split_range``),
    same per-split partial (O normalized by the split's sum, LSE in log2
    units, -inf for an empty split) and the same combine with the sink added
    once. Returns (o [B, H_q, D], lse [B, H_q] natural log).
    """
    import torch

    b, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    scale = validation.resolve_scale(softmax_scale, d) * LOG2_E
    o = torch.zeros(b, h_q, d, dtype=torch.float64)
    lse_out = torch.full((b, h_q), -math.inf, dtype=torch.float64)
    for bi in range(b):
        keys = visible_keys_of(int(cache_seqlens[bi]), window_size_left, num_sink_tokens)
        if block_table is not None:
            page_size = k_cache.shape[1]
            pages = [int(block_table[bi, j // page_size]) for j in keys]
            k_rows = torch.stack([k_cache[p, j % page_size] for p, j in zip(pages, keys)]) if keys else None
            v_rows = torch.stack([v_cache[p, j % page_size] for p, j in zip(pages, keys)]) if keys else None
        else:
            k_rows = k_cache[bi, keys] if keys else None
            v_rows = v_cache[bi, keys] if keys else None
        for h in range(h_q):
            parts = []
            for split in range(num_splits):
                begin, end = split_range(len(keys), num_splits, split, d, heads_per_cta(group))
                if begin == end:
                    parts.append((torch.zeros(d, dtype=torch.float64), -math.inf))
                    continue
                kk = k_rows[begin:end, h // group].double()
                vv = v_rows[begin:end, h // group].double()
                s = (kk @ q[bi, h].double()) * scale          # log2 units
                m = s.max()
                p = torch.exp2(s - m)
                parts.append(((p @ vv) / p.sum(), float(m + torch.log2(p.sum()))))
            lses = torch.tensor([lse for _, lse in parts], dtype=torch.float64)
            big = lses.max()
            if sink_logits is not None:
                sink = float(sink_logits[h]) * LOG2_E
                big = max(big, torch.tensor(sink, dtype=torch.float64))
            big = big if torch.isfinite(big) else torch.tensor(0.0, dtype=torch.float64)
            w = torch.exp2(lses - big)
            total = w.sum() + (math.pow(2.0, sink - float(big)) if sink_logits is not None else 0.0)
            if total > 0:
                o[bi, h] = sum(wi * oi for wi, (oi, _) in zip(w, parts)) / total
                lse_out[bi, h] = (float(big) + math.log2(float(total))) * LN_2
    return o, lse_out


if __name__ == "__main__":
    from course.testing import demo

    demo.decode(decode_attention, lengths=[1, 300, 5000, 70000], page_size=64)
