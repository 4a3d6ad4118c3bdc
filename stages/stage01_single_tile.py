"""Stage 1: single-tile FMHA on Hopper.

This is the first stage, so it has no predecessor to compare with: it builds
the whole data path of a Hopper attention kernel once, for the simplest case
where every key fits in one tile (S_k <= 128). One CTA takes a 128-row tile of
queries of one (batch, head) and computes

    O = softmax(Q K^T * softmax_scale) V

in a single pass:

1. TMA copies the Q tile and the single K and V tiles from global memory into
   swizzled shared memory; the copies complete on one mbarrier.
2. Two warpgroups (64 query rows each) compute S = Q K^T with WGMMA.
3. Softmax runs in registers: keys beyond S_k are masked, row maxima and sums
   are reduced across the 4 threads that share a row, and the exponentials are
   taken with exp2 after folding softmax_scale * log2(e) into one multiply.
4. P is converted from the fp32 accumulator into the register A operand of the
   second WGMMA, which computes O = P V.
5. O is normalized by the row sums, staged in shared memory and written by a
   TMA store (which also clips the rows of a tail tile that lie beyond S_q).

GQA and MQA come from the head mapping: query head h reads KV head
h // (H_q / H_kv). Stage 2 lifts the S_k <= 128 limit with a pipelined loop
over KV tiles.

Run it:
    python -m course check 1 --impl solutions    # this stage's tests
    python solutions/stage01_single_tile.py      # one launch against the reference (needs a Hopper GPU)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from course.runtime import prefill

STAGE = 1
TILE_M = 128  # query rows per CTA: two warpgroups of 64 rows (one WGMMA M each)
TILE_N = 128  # keys per KV tile; stage 1 has exactly one


# --8<-- [start:layouts]
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
# --8<-- [end:layouts]


# --8<-- [start:gemm]
@cute.jit
def warpgroup_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor):
    """acc = A B over all k-blocks, as one group of asynchronous WGMMAs.

    The first k-block runs with ACCUMULATE off, which zero-initializes acc.
    The caller waits with ``warpgroup.wait_group(0)`` before reading acc.
    """
    # TODO(stage 1): acc = A B over every k-block of tCrA/tCrB, issued as ONE committed group of
    #   asynchronous WGMMAs. Whatever acc held before is discarded (no zero-fill needed); register
    #   writes made before the call must be ordered before the MMAs read them; nothing waits here
    #   (the caller does). tiled_mma is shared by every call: leave its fields alone.
    #   (page: Warpgroups and WGMMA)
    raise NotImplementedError('TODO(stage 1) in warpgroup_gemm(): acc = A B over every k-block of tCrA/tCrB, issued as ONE committed group of asynchronous WGMMAs. Whatever acc held before is discarded (no zero-fill needed); register writes made before the call must be ordered before the MMAs read them; nothing waits here (the caller does). tiled_mma is shared by every call: leave its fields alone. (page: Warpgroups and WGMMA) Hints, one at a time: python -m course hint 1 (docs/stages/01-single-tile.md as raw markdown shows them all at once)')
# --8<-- [end:gemm]


# --8<-- [start:mask]
@cute.jit
def mask_keys_beyond(acc_S: cute.Tensor, tScS: cute.Tensor, seqlen_k: cutlass.Int32):
    """Set scores of keys at or beyond S_k to -inf (TMA filled them with zeros).

    ``tScS`` is an identity tensor partitioned like ``acc_S``: each register's
    (row, col) coordinate inside the tile. A thread's rows all hold the same
    columns, so each column is compared once and masked in every row.
    """
    s = rows_cols_view(acc_S)
    coord = rows_cols_view(tScS)
    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
        if coord[0, c][1] >= seqlen_k:
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                s[r, c] = -cutlass.Float32.inf
# --8<-- [end:mask]


# --8<-- [start:softmax]
@cute.jit
def softmax_rows(acc_S: cute.Tensor, scale_log2: cutlass.Float32) -> cute.Tensor:
    """Exponentiate S in place (P = exp2(S * scale_log2 - rowmax * scale_log2)); return row sums.

    The four threads of a quad hold the columns of the same rows, so the row
    max and the row sum are reduced over the thread's own values first and
    then across the quad.
    """
    s = rows_cols_view(acc_S)
    row_sum = cute.make_rmem_tensor(cute.size(s, mode=[0]), cutlass.Float32)
    # TODO(stage 1): On return every s[r, c] holds P as the docstring defines it, in place of S
    #   (each value in [0, 1]; a -inf score gives 0), and row_sum[r] is the sum of P over the
    #   WHOLE row. A row's columns are spread over the 4 threads of a quad: its max and its sum
    #   must cover all four threads, and all four end with the same values.
    #   (page: Softmax on the accumulator fragment)
    raise NotImplementedError("TODO(stage 1) in softmax_rows(): On return every s[r, c] holds P as the docstring defines it, in place of S (each value in [0, 1]; a -inf score gives 0), and row_sum[r] is the sum of P over the WHOLE row. A row's columns are spread over the 4 threads of a quad: its max and its sum must cover all four threads, and all four end with the same values. (page: Softmax on the accumulator fragment) Hints, one at a time: python -m course hint 1 (docs/stages/01-single-tile.md as raw markdown shows them all at once)")
    return row_sum
# --8<-- [end:softmax]


# --8<-- [start:convert]
@cute.jit
def scores_to_operand_a(acc_S: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    """P in registers as the fp16/bf16 A operand of O = P V (no trip through shared memory)."""
    # TODO(stage 1): Return P as a NEW register tensor of dtype (fp16/bf16) holding acc_S's fp32
    #   values, laid out as the A operand of the P V WGMMA. No value moves between threads and
    #   nothing goes through shared memory; acc_S is left as it is.
    #   (page: From S to P without shared memory)
    raise NotImplementedError("TODO(stage 1) in scores_to_operand_a(): Return P as a NEW register tensor of dtype (fp16/bf16) holding acc_S's fp32 values, laid out as the A operand of the P V WGMMA. No value moves between threads and nothing goes through shared memory; acc_S is left as it is. (page: From S to P without shared memory) Hints, one at a time: python -m course hint 1 (docs/stages/01-single-tile.md as raw markdown shows them all at once)")
# --8<-- [end:convert]


# --8<-- [start:normalize]
@cute.jit
def normalize_rows(acc_O: cute.Tensor, row_sum: cute.Tensor):
    """O /= row sum (every row has at least one visible key in stage 1)."""
    o = rows_cols_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        inv_sum = cute.arch.rcp_approx(row_sum[r])
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] *= inv_sum
# --8<-- [end:normalize]


def bshd_as_rows_dim(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (S, D, H, B): rows and the contiguous K mode first, as TMA and WGMMA index them."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def bshd_as_dim_rows(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (D, S, H, B): V seen as the (N, K) = (D, S_k) B operand of P V."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[3, 1, 2, 0]))


class Attention:
    """One CTA = one 128-row Q tile x the single KV tile (S_k <= 128)."""

    num_threads = 256  # two MMA warpgroups
    max_seqlen_k = TILE_N  # one KV tile: stage 2 adds the loop over tiles

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

        # --8<-- [start:mma]
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
        # --8<-- [end:mma]

        one_stage = (None, None, 0)
        sQ_layout = cute.slice_(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), dtype, 1), one_stage
        )
        sK_layout = cute.slice_(
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), dtype, 1), one_stage
        )
        sV_layout = cute.slice_(
            sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE_M, d, TILE_N), dtype, 1), one_stage
        )

        @cute.struct
        class SharedStorage:
            load_bar: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage

        # --8<-- [start:tma]
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (TILE_M, d))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, (TILE_N, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, (d, TILE_N))
        # O has Q's tile shape, so it is staged in Q's shared memory with Q's layout.
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (TILE_M, d))
        self.load_bytes = (
            cute.size_in_bytes(dtype, sQ_layout)
            + cute.size_in_bytes(dtype, sK_layout)
            + cute.size_in_bytes(dtype, sV_layout)
        )
        # --8<-- [end:tma]

        # --8<-- [start:grid]
        seqlen_q, num_heads_q, batch = mQ.shape[0], mQ.shape[2], mQ.shape[3]
        grid = ((seqlen_q + TILE_M - 1) // TILE_M, num_heads_q, batch)
        # --8<-- [end:grid]
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
        seqlen_k = mK.shape[0]

        # --8<-- [start:head_map]
        # GQA/MQA: a group of H_q / H_kv query heads shares one KV head.
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        # --8<-- [end:head_map]

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        load_bar = storage.load_bar.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        # --8<-- [start:load]
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            cpasync.prefetch_descriptor(tma_o)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(load_bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, d), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, d), (0, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (d, TILE_N), (0, 0))
        one_cta = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        # One thread announces the bytes to expect; the three copies complete on the
        # same mbarrier (out-of-bounds rows arrive as zeros and still count).
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(load_bar, self.load_bytes)
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=load_bar)
            cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=load_bar)
            cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=load_bar)
        cute.arch.mbarrier_wait(load_bar, 0)
        # --8<-- [end:load]

        # --8<-- [start:qk]
        thr_qk = qk_mma.get_slice(tidx)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_M, TILE_N)))
        warpgroup_gemm(qk_mma, acc_S, tSrQ, tSrK)
        warpgroup.wait_group(0)
        # --8<-- [end:qk]

        # --8<-- [start:attend]
        if seqlen_k < TILE_N:  # a full tile needs no mask
            tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
            mask_keys_beyond(acc_S, tScS, seqlen_k)
        row_sum = softmax_rows(acc_S, scale_log2)
        tOrP = scores_to_operand_a(acc_S, self.dtype)

        thr_pv = pv_mma.get_slice(tidx)
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        sO = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # O is staged where Q was
        tOsO = thr_pv.partition_C(sO)
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE_M, d)))
        warpgroup_gemm(pv_mma, acc_O, tOrP, tOrV)
        warpgroup.wait_group(0)
        normalize_rows(acc_O, row_sum)
        # --8<-- [end:attend]

        # --8<-- [start:epilogue]
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.arch.sync_threads()  # every warpgroup is done reading Q before O overwrites it
        cute.autovec_copy(rO, tOsO)
        # Make the generic-proxy stores visible to the TMA (async proxy) before it reads them.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        gO = cute.local_tile(mO[None, None, head, batch], (TILE_M, d), (m_block, 0))
        bOsO, bOgO = cpasync.tma_partition(tma_o, 0, one_cta, cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
        if warp_idx == 0:
            with cute.arch.elect_one():  # one thread issues the store and waits for its group
                cute.copy(tma_o, bOsO, bOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # --8<-- [end:epilogue]


# --8<-- [start:api]
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
# --8<-- [end:api]


if __name__ == "__main__":
    from course.testing import demo

    demo.prefill(attention, seqlen_q=300, seqlen_k=100)
