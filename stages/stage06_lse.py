"""Stage 6: per-row LSE and merging partial results.

Compared with stage 5, this stage also returns the log-sum-exp of every query
row, because it is what makes attention composable: two attention results over
disjoint sets of keys (sink or compressed tokens | a sliding window, or the
splits of a long KV cache in stage 7) merge exactly into the result over the
union, using only their outputs and their LSEs.

* ``return_lse=True`` writes float32, natural-log LSE [B, H_q, S_q], sink term
  included: LSE = log(sum_j exp(s_j * softmax_scale) + exp(sink)). A row with
  no visible key has LSE = -inf (or the sink logit when there is one). The
  kernel has everything already: the row max and the row sum; one thread of
  each quad writes its rows' values (predicated on S_q). It compiles out when
  not requested.
* ``merge_attention_states(o_a, lse_a, o_b, lse_b)`` merges two partial
  results, as a small CuTe kernel (one thread per 8 output values); the
  PyTorch version is ``course.testing.reference.merge_attention_states``.

Run it:
    python -m course check 6 --impl solutions    # this stage's tests
    python solutions/stage06_lse.py              # one launch against the reference (needs a Hopper GPU)
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from course.runtime import launch, prefill, validation
from course.runtime.compile import cross_compile, symbolic_tensor

STAGE = 6
TILE_M = 128  # query rows per CTA: two warpgroups of 64 rows (one WGMMA M each)
TILE_N = 128  # keys per KV tile
KV_STAGES = 2  # buffers in each of the K and V rings
MMA_WARPS = 8  # the two consumer warpgroups; each warp releases a buffer once
PRODUCER_REGS, MMA_REGS = 24, 240  # setmaxnreg: 128 * 24 + 256 * 240 <= 64K registers
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def acc_layout_as_rows_cols(acc_layout: cute.Layout) -> cute.Layout:
    """View a WGMMA accumulator fragment as (rows, cols) of this thread's values.

    A thread's fragment of an (M, N) accumulator has shape ((2, 2, N/8), MMA_M,
    MMA_N): 2 adjacent columns, 2 rows 8 apart, N/8 column groups. Regrouping
    the modes gives ((2, MMA_M), (2, N/8, MMA_N)) so that row r of the view is
    one query row and its columns are that row's keys held by this thread.
    """
    col_major = cute.make_layout(acc_layout.shape)
    rows_cols = cute.make_layout(
        (
            (col_major.shape[0][1], col_major.shape[1]),
            (col_major.shape[0][0], col_major.shape[0][2], col_major.shape[2]),
        ),
        stride=(
            (col_major.stride[0][1], col_major.stride[1]),
            (col_major.stride[0][0], col_major.stride[0][2], col_major.stride[2]),
        ),
    )
    return cute.composition(acc_layout, rows_cols)


def rows_cols_view(t: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(t.iterator, acc_layout_as_rows_cols(t.layout))


def acc_layout_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """Reinterpret the S accumulator fragment as the A-operand fragment of P V.

    For 16-bit inputs the C fragment of S = Q K^T and the A fragment of
    O = P V hold the same (row, key) pairs in the same thread: only the
    grouping differs. ((2, 2, N/8), MMA_M, MMA_N) becomes ((2, 2, 2), MMA_M,
    (N/16, MMA_N)): every 16 keys form one k-block of the second GEMM.
    """
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )


@cute.jit
def warpgroup_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                   zero_init: cutlass.Constexpr = True):
    """acc = A B (or acc += A B without ``zero_init``), as one group of asynchronous WGMMAs.

    With ``zero_init`` the first k-block runs with ACCUMULATE off, which
    zero-initializes acc. The caller waits with ``warpgroup.wait_group(0)``
    before reading acc.
    """
    # [exercise 1] acc = A B (acc += A B when zero_init is False) over every k-block of tCrA/tCrB,
    #   issued as ONE committed group of asynchronous WGMMAs. With zero_init, whatever acc held is
    #   discarded (no zero-fill needed); register writes made before the call must be ordered
    #   before the MMAs read them; nothing waits here (the caller does). tiled_mma is shared by
    #   every call: leave its fields alone. (stage 1 page: Warpgroups and WGMMA)
    mma_atom = cute.make_mma_atom(tiled_mma.op)  # a private atom: its ACCUMULATE field is ours to set
    warpgroup.fence()
    for k_block in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init or k_block != 0)
        cute.gemm(mma_atom, acc, tCrA[None, None, k_block], tCrB[None, None, k_block], acc)
    warpgroup.commit_group()
    # [/exercise]


class WindowMask:
    """Which keys the rows of this CTA's Q tile may see (bottom-right aligned, docs/contract.md).

    With offset = S_k - S_q, row i sees key j iff j < S_k and
    i + offset - left <= j <= i + offset + right. An unbounded side (-1) is
    compiled out through ``has_left`` / ``has_right``.
    """

    def __init__(self, m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config):
        self.row0 = m_block * TILE_M
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.offset = seqlen_k - seqlen_q
        self.left, self.right = left, right
        self.num_sink_tokens = num_sink_tokens  # keys below it ignore the left bound
        self.has_left, self.has_right = config.has_left, config.has_right
        self.has_sink_tokens = config.has_sink_tokens

    @cute.jit
    def kv_block_range(self):
        """[n_block_min, n_block_max): the KV tiles with a visible key for some row of this tile."""
        # [exercise 4] n_block_max and n_block_min bound the half-open range of KV tiles that
        #   holds every key visible to some row of this Q tile (its rows stop at S_q in the tail
        #   tile), from the first row's first visible key to the last row's last. Too long is
        #   correct but slow; too short drops keys. Both lie in [0, number of KV tiles],
        #   n_block_min <= n_block_max (an empty range is fine), and an unbounded side compiles to
        #   no code. Int32 division truncates toward zero.
        #   (stage 4 page: Skipping tiles: the block range)
        n_block_max = (self.seqlen_k + TILE_N - 1) // TILE_N
        n_block_min = cutlass.Int32(0)
        if cutlass.const_expr(self.has_right):
            last_row = cutlass.min(self.row0 + TILE_M, self.seqlen_q) - 1
            key_end = cutlass.max(cutlass.min(last_row + self.offset + self.right + 1, self.seqlen_k), 0)
            n_block_max = (key_end + TILE_N - 1) // TILE_N
        if cutlass.const_expr(self.has_left):
            key_start = cutlass.max(self.row0 + self.offset - self.left, 0)
            n_block_min = cutlass.min(key_start // TILE_N, n_block_max)
        # [/exercise]
        return n_block_min, n_block_max

    @cute.jit
    def sink_block_count(self, n_block_min: cutlass.Int32):
        """How many tiles of sink tokens lie below the window's range (visited first)."""
        count = cutlass.Int32(0)
        if cutlass.const_expr(self.has_sink_tokens):
            # [exercise 5] Set count to the number of KV tiles that hold a sink token (key <
            #   num_sink_tokens) and lie below n_block_min: the tiles the loop visits before the
            #   window's range. A tile already in the range must not be visited twice.
            #   (stage 5 page: Sink tokens: visible despite the window)
            count = cutlass.min((self.num_sink_tokens + TILE_N - 1) // TILE_N, n_block_min)
            # [/exercise]
        return count

    @cute.jit
    def kv_block(self, i: cutlass.Int32, n_sink_blocks: cutlass.Int32, n_block_min: cutlass.Int32):
        """The KV tile of loop step ``i``: the sink tiles first, then the window's range."""
        n_block = n_block_min + i - n_sink_blocks
        if i < n_sink_blocks:
            n_block = i
        return n_block

    @cute.jit
    def tile_is_partial(self, n_block: cutlass.Int32):
        """Does KV tile ``n_block`` hold a masked key for some row? Full tiles skip the mask."""
        partial = (n_block + 1) * TILE_N > self.seqlen_k
        if cutlass.const_expr(self.has_right):
            partial = partial | ((n_block + 1) * TILE_N - 1 > self.row0 + self.offset + self.right)
        if cutlass.const_expr(self.has_left):
            partial = partial | (n_block * TILE_N < self.row0 + TILE_M - 1 + self.offset - self.left)
        return partial

    @cute.jit
    def outside_left_bound(self, key: cutlass.Int32, key_start: cutlass.Int32):
        """Is ``key`` left of its row's window? Sink tokens never are."""
        outside = key < key_start
        if cutlass.const_expr(self.has_sink_tokens):
            # [exercise 5] outside ends True only for a key that is left of its row's window AND
            #   is not a sink token (key < num_sink_tokens): sink tokens ignore the left bound,
            #   never the right one. Both conditions are runtime Booleans, which Python's
            #   and/or/not cannot combine. (stage 5 page: Sink tokens: visible despite the window)
            outside = outside & (key >= self.num_sink_tokens)
            # [/exercise]
        return outside

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32):
        """Set S to -inf outside each row's visible keys, from every register's (row, col)."""
        s = rows_cols_view(acc_S)
        coord = rows_cols_view(tScS)
        key0 = n_block * TILE_N
        # [exercise 4] Every s[r, c] whose key its row may not see (outside the row's window, or
        #   at or past S_k: the rule of The semantics) becomes -inf; visible scores stay as they
        #   are. coord gives each register's (row, col) inside this Q tile and KV tile, not in the
        #   sequence. An unbounded side compiles to no code. The left bound goes through
        #   outside_left_bound, which exempts sink tokens. (stage 4 page: Masking in registers)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            row = self.row0 + coord[r, 0][0]
            key_end = self.seqlen_k
            if cutlass.const_expr(self.has_right):
                key_end = cutlass.min(key_end, row + self.offset + self.right + 1)
            key_start = row + self.offset - self.left
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                key = key0 + coord[r, c][1]
                if key >= key_end:
                    s[r, c] = -cutlass.Float32.inf
                if cutlass.const_expr(self.has_left):
                    if self.outside_left_bound(key, key_start):
                        s[r, c] = -cutlass.Float32.inf
        # [/exercise]


@cute.jit
def online_softmax(acc_S: cute.Tensor, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                   scale_log2: cutlass.Float32):
    """Fold one tile into the running statistics: S becomes P in place, and O and the
    row sums are rescaled to the new row maxima.

    ``row_max`` is quad-reduced (all 4 threads of a row agree on it);
    ``row_sum`` holds this thread's columns only until the final reduction.
    """
    s = rows_cols_view(acc_S)
    o = rows_cols_view(acc_O)
    # [exercise 3] For each row r: after this tile, row_max[r] is the max over every key seen so
    #   far (the same in the 4 threads of the quad), S holds P relative to it, and row_sum[r] and
    #   row r of O are relative to it too: what they held before was relative to the old max.
    #   row_max stays in raw score units (scale_log2 is applied once, inside the exponent);
    #   row_sum holds this thread's columns only. A row that has seen no visible key yet (max
    #   -inf) gets P = 0 and keeps O and its sum at 0, never NaN.
    #   (stage 3 page: From two passes to one; stage 4 page: Rows with no visible key)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        tile_max = s[r, 0]
        for c in cutlass.range_constexpr(1, cute.size(s, mode=[1])):
            tile_max = cute.arch.fmax(tile_max, s[r, c])
        new_max = cute.arch.fmax(row_max[r], cute.arch.warp_reduction_max(tile_max, threads_in_group=4))
        # A row that has seen no visible key yet has max -inf: exponentiate against 0
        # instead, so masked scores give exp2(-inf) = 0 and never inf - inf = NaN.
        ref_max = new_max
        if new_max == -cutlass.Float32.inf:
            ref_max = cutlass.Float32(0.0)
        # Raw units in, one multiply by scale_log2: the max is never kept pre-scaled.
        correction = cute.math.exp2((row_max[r] - ref_max) * scale_log2, fastmath=True)
        max_scaled = ref_max * scale_log2
        thread_sum = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - max_scaled, fastmath=True)
            thread_sum += s[r, c]
        row_sum[r] = row_sum[r] * correction + thread_sum
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] *= correction
        row_max[r] = new_max
    # [/exercise]


@cute.jit
def quad_allreduce(values: cute.Tensor, reduce):
    """Combine each row statistic over the 4 threads of a quad (they hold the same rows)."""
    for r in cutlass.range_constexpr(cute.size(values)):
        values[r] = reduce(values[r], threads_in_group=4)


@cute.jit
def scores_to_operand_a(acc_S: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    """P in registers as the fp16/bf16 A operand of O = P V (no trip through shared memory)."""
    # [exercise 1] Return P as a NEW register tensor of dtype (fp16/bf16) holding acc_S's fp32
    #   values, laid out as the A operand of the P V WGMMA. No value moves between threads and
    #   nothing goes through shared memory; acc_S is left as it is.
    #   (stage 1 page: From S to P without shared memory)
    rP = cute.make_rmem_tensor_like(acc_S, dtype)
    rP.store(acc_S.load().to(dtype))
    return cute.make_tensor(rP.iterator, acc_layout_as_operand_a(rP.layout))
    # [/exercise]


@cute.jit
def load_tile(pipe, state, tma_atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor, n_block: cutlass.Int32):
    """Producer step: wait for an empty buffer, then TMA KV tile ``n_block`` into it.

    The copy completes on the buffer's "full" barrier, which ``producer_acquire``
    armed with the tile's byte count; ``producer_commit`` is a no-op for TMA.
    """
    # [exercise 2] Producer step: KV tile n_block (the runtime index, never a trace-time constant)
    #   lands in the ring buffer that state points at. The copy may start only once that buffer is
    #   empty, and must complete on that buffer's full barrier, which the consumers wait on. The
    #   caller advances state. (stage 2 page: Producer and consumer steps)
    pipe.producer_acquire(state)
    cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))
    pipe.producer_commit(state)
    # [/exercise]


@cute.jit
def tile_scores(qk_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                pipeline_k, k_state, tScS: cute.Tensor, n_block: cutlass.Int32, mask: WindowMask):
    """Consumer step: S = Q K_n^T for KV tile ``n_block``, invisible keys masked.

    Waits for the K buffer to be full and releases it as soon as the WGMMAs
    that read it have completed, so the producer can refill it early.
    """
    # [exercise 2] Consumer step: on return acc_S = Q K^T for the K tile in the ring buffer that
    #   k_state points at. Read the buffer only once it is full, and hand it back to the producer
    #   as soon as (and not before) the WGMMAs that read it have completed. The caller advances
    #   k_state. (stage 2 page: Producer and consumer steps)
    pipeline_k.consumer_wait(k_state)
    warpgroup_gemm(qk_mma, acc_S, tSrQ, tSrK[None, None, None, k_state.index])
    warpgroup.wait_group(0)
    pipeline_k.consumer_release(k_state)
    # [/exercise]
    # Only tiles that straddle a boundary pay for the mask. (A runtime `if` may not carry a
    # plain Python object such as `mask` across it; its bound method is fine.)
    apply_mask = mask.apply
    if mask.tile_is_partial(n_block):
        apply_mask(acc_S, tScS, n_block)


@cute.jit
def attend_kv_tiles(qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, acc_S: cute.Tensor, acc_O: cute.Tensor,
                    tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrV: cute.Tensor, pipeline_k, k_state,
                    pipeline_v, v_state, tScS: cute.Tensor, n_tiles: cutlass.Int32, n_sink_blocks: cutlass.Int32,
                    n_block_min: cutlass.Int32, mask: WindowMask, row_max: cute.Tensor, row_sum: cute.Tensor,
                    scale_log2: cutlass.Float32, dtype: cutlass.Constexpr):
    """One pass over the visible KV tiles: online softmax, O += P V, row sums."""
    # [exercise 3] One pass over the KV tiles (n_tiles loop steps: the sink tiles, then the
    #   window's range), in the producer's order: afterwards acc_O is the sum of P V relative to
    #   the final row_max (unnormalized) and row_max/row_sum are the online softmax's. Each K and
    #   V buffer is used only once full and released once the WGMMAs that read it have completed;
    #   O may be rescaled, and P's registers reused, only while no P V WGMMA that reads them is in
    #   flight. (stage 3 page: The loop)
    kv_block = mask.kv_block  # (a runtime loop may not carry the mask object; its bound method is fine)
    for i in cutlass.range(n_tiles, unroll=1):
        n_block = kv_block(i, n_sink_blocks, n_block_min)
        tile_scores(qk_mma, acc_S, tSrQ, tSrK, pipeline_k, k_state, tScS, n_block, mask)
        k_state.advance()
        online_softmax(acc_S, acc_O, row_max, row_sum, scale_log2)
        tOrP = scores_to_operand_a(acc_S, dtype)
        pipeline_v.consumer_wait(v_state)
        warpgroup_gemm(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        v_state.advance()
    # [/exercise]


# --8<-- [start:normalize]
@cute.jit
def normalize_rows(acc_O: cute.Tensor, row_sum: cute.Tensor, row_max: cute.Tensor, scale_log2: cutlass.Float32,
                   sink_log2: cutlass.Float32, lse: cute.Tensor):
    """O /= the softmax denominator; ``lse[r]`` gets the row's natural-log LSE.

    In log2 units the denominator is 2^top * denominator, with top = max * scale_log2
    (and the sink logit, -inf without sink logits, brought to the common reference
    top = max(max * scale_log2, sink)). So LSE = (top + log2(denominator)) * ln 2,
    which is -inf for a row with no visible key and no sink (or a -inf one), and
    the sink logit for a row with only the sink.
    """
    o = rows_cols_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        max_scaled = row_max[r] * scale_log2
        top = cute.arch.fmax(max_scaled, sink_log2)
        # No visible key and a -inf sink: both terms are exp2(-inf) = 0 against 0, as the softmax
        # does for a -inf max, never exp2(-inf - (-inf)) = NaN; the row is empty: O = 0, LSE = -inf.
        if top == -cutlass.Float32.inf:
            top = cutlass.Float32(0.0)
        rescale = cute.math.exp2(max_scaled - top, fastmath=True)
        denominator = row_sum[r] * rescale + cute.math.exp2(sink_log2 - top, fastmath=True)
        inv_sum = rescale * cute.arch.rcp_approx(denominator)
        if denominator == 0.0:
            inv_sum = cutlass.Float32(0.0)
        # TODO(stage 6): lse[r] is the row's log-sum-exp in NATURAL-log units, from top and
        #   denominator above (what they mean: the docstring). A row with no visible key gets -inf
        #   and a row with only a sink the sink logit, without a special case.
        #   (page: The LSE is already in the kernel)
        raise NotImplementedError("TODO(stage 6) in normalize_rows(): lse[r] is the row's log-sum-exp in NATURAL-log units, from top and denominator above (what they mean: the docstring). A row with no visible key gets -inf and a row with only a sink the sink logit, without a special case. (page: The LSE is already in the kernel) Hints, one at a time: python -m course hint 6 (docs/stages/06-lse.md as raw markdown shows them all at once)")
        for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):
            o[r, c] *= inv_sum


@cute.jit
def store_lse(lse: cute.Tensor, mLSE: cute.Tensor, tScS: cute.Tensor, row0: cutlass.Int32, seqlen_q: cutlass.Int32,
              head: cutlass.Int32, batch: cutlass.Int32, mma_tidx: cutlass.Int32):
    """Write every row's LSE to mLSE[batch, head, row]: each quad holds its rows 4 times, so its first thread writes."""
    coord = rows_cols_view(tScS)
    # TODO(stage 6): mLSE[batch, head, row] gets lse[r] for every row this thread holds that lies
    #   below seqlen_q (the tail tile), written by exactly one thread per row: the 4 threads of a
    #   quad all hold the same rows. coord gives each register's row inside the Q tile.
    #   (page: The LSE is already in the kernel)
    raise NotImplementedError("TODO(stage 6) in store_lse(): mLSE[batch, head, row] gets lse[r] for every row this thread holds that lies below seqlen_q (the tail tile), written by exactly one thread per row: the 4 threads of a quad all hold the same rows. coord gives each register's row inside the Q tile. (page: The LSE is already in the kernel) Hints, one at a time: python -m course hint 6 (docs/stages/06-lse.md as raw markdown shows them all at once)")
# --8<-- [end:normalize]


def bshd_as_rows_dim(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (S, D, H, B): rows and the contiguous K mode first, as TMA and WGMMA index them."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def bshd_as_dim_rows(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (D, S, H, B): V seen as the (N, K) = (D, S_k) B operand of P V."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[3, 1, 2, 0]))


class Attention:
    """Stage 5's kernel, which can also write every row's LSE (compiled out when not requested)."""

    num_threads = 384  # warpgroup 0: TMA producer; warpgroups 1-2: MMA consumers

    def __init__(self, config: prefill.KernelConfig):
        self.config = config  # what this kernel is compiled for: a feature that is off compiles out
        self.dtype = config.cute_dtype
        self.head_dim = config.head_dim

    # Every prefill stage has this signature, so one host function (course.runtime.prefill) compiles and
    # launches them all; a stage ignores the arguments of features it does not have yet.
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        num_sink_tokens: cutlass.Int32,
        write_lse: cutlass.Int32,
        stream,
    ):
        dtype, d = self.dtype, self.head_dim
        mQ, mK, mO = bshd_as_rows_dim(mQ), bshd_as_rows_dim(mK), bshd_as_rows_dim(mO)
        mV = bshd_as_dim_rows(mV)

        # S = Q K^T: both operands K-major (head_dim contiguous), from shared memory.
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (2, 1, 1), (64, TILE_N),
        )
        # O = P V: P from registers (K-major), V MN-major (head_dim contiguous).
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN,
            cutlass.Float32, (2, 1, 1), (64, d), warpgroup.OperandSource.RMEM,
        )

        one_stage = (None, None, 0)
        sQ_layout = cute.slice_(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), dtype, 1), one_stage
        )
        # K and V keep a stage mode: KV_STAGES buffers each.
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), dtype, KV_STAGES)
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE_M, d, TILE_N), dtype, KV_STAGES)

        @cute.struct
        class SharedStorage:
            load_bar: cute.struct.MemRange[cutlass.Int64, 1]
            k_bars: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]  # full + empty per buffer
            v_bars: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (TILE_M, d))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(sK_layout, one_stage), (TILE_N, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, cute.slice_(sV_layout, one_stage), (d, TILE_N))
        # O has Q's tile shape, so it is staged in Q's shared memory with Q's layout.
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (TILE_M, d))
        self.q_bytes = cute.size_in_bytes(dtype, sQ_layout)
        self.kv_bytes = cute.size_in_bytes(dtype, cute.slice_(sK_layout, one_stage))  # one K or V tile

        seqlen_q, num_heads_q, batch = mQ.shape[0], mQ.shape[2], mQ.shape[3]
        grid = ((seqlen_q + TILE_M - 1) // TILE_M, num_heads_q, batch)
        self.kernel(
            qk_mma, pv_mma, tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV, tma_o, tma_mO,
            mLSE, mSinks, scale_log2, window_left, window_right, num_sink_tokens, write_lse, sQ_layout, sK_layout,
            sV_layout,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        num_sink_tokens: cutlass.Int32,
        write_lse: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
    ):
        d = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        mask = WindowMask(m_block, mQ.shape[0], mK.shape[0], window_left, window_right, num_sink_tokens,
                          self.config)
        n_block_min, n_block_max = mask.kv_block_range()
        n_sink_blocks = mask.sink_block_count(n_block_min)  # sink tiles below the window's range
        n_tiles = n_sink_blocks + n_block_max - n_block_min  # producer and consumers walk the same tiles
        kv_block = mask.kv_block  # (a runtime `if` may not carry the mask object; its bound method is fine)

        # GQA/MQA: a group of H_q / H_kv query heads shares one KV head.
        head_kv = head // (mQ.shape[2] // mK.shape[2])

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        load_bar = storage.load_bar.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        # A "full" barrier per buffer completes when its TMA bytes have landed (one
        # producer arrival + tx bytes); an "empty" barrier when all MMA warps released it.
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_WARPS)
        pipeline_k = pipeline.PipelineTmaAsync.create(
            num_stages=KV_STAGES, producer_group=producer, consumer_group=consumers,
            tx_count=self.kv_bytes, barrier_storage=storage.k_bars.data_ptr(), defer_sync=True,
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            num_stages=KV_STAGES, producer_group=producer, consumer_group=consumers,
            tx_count=self.kv_bytes, barrier_storage=storage.v_bars.data_ptr(), defer_sync=True,
        )
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            cpasync.prefetch_descriptor(tma_o)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(load_bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every barrier is initialized before anyone uses one

        # The last mode of gK / gV is the KV-tile index: the loops below select the
        # tile with their runtime loop variable (pinning it to 0 would load tile 0 forever).
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, d), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, d), (None, 0))  # (TILE_N, d, n_blocks)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (d, TILE_N), (0, None))  # (d, TILE_N, n_blocks)
        one_cta = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(load_bar, self.q_bytes)
                cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=load_bar)
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
                for i in cutlass.range(n_tiles, unroll=1):  # the sink tiles, then the window's tiles
                    n_block = kv_block(i, n_sink_blocks, n_block_min)
                    load_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, n_block)
                    k_state.advance()
                    load_tile(pipeline_v, v_state, tma_v, tVgV, tVsV, n_block)
                    v_state.advance()
                # Wait until the consumers released the last buffers before the CTA may exit.
                pipeline_k.producer_tail(k_state)
                pipeline_v.producer_tail(v_state)
        else:
            cute.arch.setmaxregister_increase(MMA_REGS)
            mma_tidx = tidx - 128
            # --8<-- [start:consumer]
            thr_qk = qk_mma.get_slice(mma_tidx)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, N, K, KV_STAGES)
            acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_M, TILE_N)))
            tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
            thr_pv = pv_mma.get_slice(mma_tidx)
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, N, K, KV_STAGES)
            sO = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # O is staged where Q was
            tOsO = thr_pv.partition_C(sO)  # (made before the loops, which rebind pv_mma's fields)
            acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE_M, d)))
            rows = cute.size(rows_cols_view(acc_S), mode=[0])
            row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
            row_sum = cute.make_rmem_tensor(rows, cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)
            acc_O.fill(0.0)
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
            cute.arch.mbarrier_wait(load_bar, 0)

            attend_kv_tiles(qk_mma, pv_mma, acc_S, acc_O, tSrQ, tSrK, tOrV, pipeline_k, k_state,
                            pipeline_v, v_state, tScS, n_tiles, n_sink_blocks, n_block_min, mask, row_max,
                            row_sum, scale_log2, self.dtype)
            quad_allreduce(row_sum, cute.arch.warp_reduction_sum)
            # Natural-log units, never scaled by softmax_scale; -inf without sink logits: no term at all.
            sink_log2 = mSinks[head] * LOG2_E
            lse = cute.make_rmem_tensor(rows, cutlass.Float32)
            normalize_rows(acc_O, row_sum, row_max, scale_log2, sink_log2, lse)
            if write_lse != 0:  # a runtime choice: one uniform branch at the end of the tile
                store_lse(lse, mLSE, tScS, m_block * TILE_M, mQ.shape[0], head, batch, mma_tidx)
            # --8<-- [end:consumer]

            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            rO.store(acc_O.load().to(self.dtype))
            # The producer warpgroup is not part of this: a named barrier over the 256 MMA threads.
            cute.arch.barrier(barrier_id=1, number_of_threads=2 * 128)  # all done reading Q
            cute.autovec_copy(rO, tOsO)
            # Make the generic-proxy stores visible to the TMA (async proxy) before it reads them.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=2 * 128)

            gO = cute.local_tile(mO[None, None, head, batch], (TILE_M, d), (m_block, 0))
            bOsO, bOgO = cpasync.tma_partition(tma_o, 0, one_cta, cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
            if warp_idx == 4:  # the first MMA warp
                with cute.arch.elect_one():  # one thread issues the store and waits for its group
                    cute.copy(tma_o, bOsO, bOgO)
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)


KERNEL_CONFIGS = prefill.kernel_configs(STAGE)  # each combination of this stage's features, compiled on its own


def cross_compile_config(config: prefill.KernelConfig, keep: bool = False):
    """Compile for sm_90a on any machine (no GPU needed) and report registers, smem, spills."""
    return prefill.cross_compile_config(Attention, config, stage=STAGE, keep=keep)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
              sink_logits=None, num_sink_tokens=0, return_lse=False, out=None):
    """Attention over [B, S, H, D] fp16/bf16 CUDA tensors; the contract is docs/contract.md.

    ``out`` (optional) receives O; tests pass a NaN-poisoned buffer to prove
    every element is written. With ``return_lse`` returns (O, LSE [B, H_q, S_q] float32).
    """
    return prefill.attention(STAGE, Attention, q, k, v, softmax_scale=softmax_scale, causal=causal,
                             window_size=window_size, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                             return_lse=return_lse, out=out)



# --8<-- [start:merge]
@cute.jit
def merge_weights(lse_a: cutlass.Float32, lse_b: cutlass.Float32):
    """(w_a, w_b, lse): the weights of two partial results over disjoint keys, and the merged LSE.

    With M = max(lse_a, lse_b) (0 when both parts are empty): w = exp(lse - M) / total,
    total = exp(lse_a - M) + exp(lse_b - M), lse = M + log(total). An empty part
    (LSE -inf) weighs 0; two empty parts give weights 0 and LSE -inf, never NaN.
    """
    # TODO(stage 6): Define e_a, e_b, inv_total and lse for the return below: with its weights, w_a
    #   O_a + w_b O_b is attention over the union of the two disjoint key sets, and lse its LSE,
    #   in natural-log units like the inputs. No exp may overflow however large the LSEs are; an
    #   empty part (lse -inf) weighs 0; two empty parts give weights 0 and lse -inf, never NaN.
    #   (page: Why LSE)
    raise NotImplementedError('TODO(stage 6) in merge_weights(): Define e_a, e_b, inv_total and lse for the return below: with its weights, w_a O_a + w_b O_b is attention over the union of the two disjoint key sets, and lse its LSE, in natural-log units like the inputs. No exp may overflow however large the LSEs are; an empty part (lse -inf) weighs 0; two empty parts give weights 0 and lse -inf, never NaN. (page: Why LSE) Hints, one at a time: python -m course hint 6 (docs/stages/06-lse.md as raw markdown shows them all at once)')
    return e_a * inv_total, e_b * inv_total, lse


class MergeStates:
    """O, LSE = merge(O_a, LSE_a, O_b, LSE_b): one thread per 8 values (16 bytes) of a row, as many whole
    rows per CTA of 128 threads as fit (the threads left over at D = 80, 96, 192 idle)."""

    vec = 8

    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.threads_per_row = head_dim // self.vec
        self.rows_per_cta = 128 // self.threads_per_row

    @cute.jit
    def __call__(self, mOa: cute.Tensor, mLa: cute.Tensor, mOb: cute.Tensor, mLb: cute.Tensor,
                 mO: cute.Tensor, mL: cute.Tensor, stream):
        batch, seqlen, heads = mOa.shape[0], mOa.shape[1], mOa.shape[2]
        grid = ((seqlen + self.rows_per_cta - 1) // self.rows_per_cta, heads, batch)
        self.kernel(mOa, mLa, mOb, mLb, mO, mL).launch(grid=grid, block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOa: cute.Tensor, mLa: cute.Tensor, mOb: cute.Tensor, mLb: cute.Tensor,
               mO: cute.Tensor, mL: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        s_block, head, batch = cute.arch.block_idx()
        row = s_block * self.rows_per_cta + tidx // self.threads_per_row
        chunk = tidx % self.threads_per_row
        if row < mOa.shape[1] and tidx < self.rows_per_cta * self.threads_per_row:
            w_a, w_b, lse = merge_weights(mLa[batch, head, row], mLb[batch, head, row])
            o_a = cute.local_tile(mOa[batch, row, head, None], (self.vec,), (chunk,))
            o_b = cute.local_tile(mOb[batch, row, head, None], (self.vec,), (chunk,))
            o = cute.local_tile(mO[batch, row, head, None], (self.vec,), (chunk,))
            merged = o_a.load().to(cutlass.Float32) * w_a + o_b.load().to(cutlass.Float32) * w_b
            o.store(merged.to(self.dtype))
            if chunk == 0:
                mL[batch, head, row] = lse
# --8<-- [end:merge]


# O's head dims: every D_v of the prefill contract (stage 8 merges its own results with this kernel too).
MERGE_HEAD_DIMS = tuple(sorted({d_v for _, d_v in validation.HEAD_DIMS_FROM_STAGE_8}))
MERGE_CONFIGS = [(dtype, d) for dtype in prefill.DTYPES for d in MERGE_HEAD_DIMS]


def merge_kernel_and_args(torch_dtype, head_dim: int):
    import torch

    symbols: dict = {}
    o_a, o_b, o = (symbolic_tensor(torch_dtype, ("B", "S", "H", head_dim), symbols=symbols) for _ in range(3))
    l_a, l_b, lse = (symbolic_tensor(torch.float32, ("B", "H", "S"), symbols=symbols, align=4, stride_divisibility=1)
                     for _ in range(3))
    return MergeStates(launch.cute_dtype(torch_dtype), head_dim), (o_a, l_a, o_b, l_b, o, lse)


def cross_compile_merge(dtype: str, head_dim: int, keep: bool = False):
    import torch

    kernel, args = merge_kernel_and_args(getattr(torch, dtype), head_dim)
    return cross_compile(kernel, *args, name=f"stage06_merge_{dtype}_d{head_dim}", keep=keep)


# --8<-- [start:merge_api]
def merge_attention_states(o_a, lse_a, o_b, lse_b, *, out=None):
    """Merge two attention results over disjoint key sets: returns (O, LSE) of their union.

    o_*: [B, S, H, D] fp16/bf16; lse_*: [B, H, S] float32 natural log (as ``attention`` returns).
    """
    import torch

    validation.check_merge_inputs(o_a, lse_a, o_b, lse_b, out=out, head_dims=MERGE_HEAD_DIMS)
    validation.check_on_gpu(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=out)
    out = o_a.new_empty(o_a.shape) if out is None else out
    lse = torch.empty_like(lse_a)
    kernel = launch.compiled((MergeStates, o_a.dtype, o_a.shape[-1]),
                             lambda: merge_kernel_and_args(o_a.dtype, o_a.shape[-1]))
    kernel(o_a, lse_a, o_b, lse_b, out, lse)
    return out, lse
# --8<-- [end:merge_api]


if __name__ == "__main__":
    import torch

    from course.testing import demo

    demo.prefill(attention, seqlen_q=300, seqlen_k=1000, window_size=(128, 0), num_sink_tokens=4,
                 sink_logits=torch.linspace(-2, 2, 8, device="cuda"), return_lse=True)
