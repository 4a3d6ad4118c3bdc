"""Stage 10: variable-length batches and a paged KV cache for prefill.

Compared with stage 8, this stage adds batches whose sequences have different
lengths, packed back to back (``cu_seqlens``), and K and V read from a paged
cache (``block_table``), because that is what callers have: a batch of prompts
padded to its longest one spends the padding's share of the work on nothing,
packed training batches have no padding to add, and a serving engine's chunked
prefill and speculative decoding attend to a cache of pages. Stage 8's kernel
runs unchanged inside: the same ping-pong, overlap, softmax, masks with tile
skipping, sinks, LSE and epilogue, imported. What changes is where a tile's
rows come from and go to:

1. The tile scheduler walks ragged tiles: one linear order, sequence by
   sequence, and inside a sequence stage 8's order (heads in L2 groups, the
   last Q tile first under a causal mask). Which sequence a tile index falls
   in is a prefix sum over the sequences' tile counts, which a warp computes
   32 sequences at a time (``locate``), so the launch needs nothing from the
   host but the tensors' sizes: no copy of the lengths, and a CUDA graph can
   replay it with other lengths.
2. Q, K and V tiles are TMA loads at the sequence's offset (``domain_offset``):
   rows past the end of a sequence belong to the next one (or are zeros past
   the tensor) and are masked like any key past S_k.
3. Paged K and V: a KV tile is ``tile_n // page_rows`` TMA copies of
   ``page_rows`` rows (the largest count that divides both the tile and the
   page), each from the page the block table names; copies past the
   sequence's end read a page outside the pool, which TMA fills with zeros.
   With small pages the producer warpgroup gathers the tile with cp.async
   instead (``gather_paged_tile``): many small TMA copies, issued one by
   one, arrive too late.
4. Rows past the end are never written: a warpgroup whose 64 rows of O are
   all in the sequence stores them with stage 8's TMA store; the one that
   holds the sequence's last rows stores them from registers, row by row,
   so that it cannot overwrite the next sequence. In a cache (paged, or with
   ``seqused_k``) the slots past a sequence's length may hold anything, NaN
   included, and 0 x NaN is NaN: the tile that holds the last key gets its
   V rows past the end zeroed before the P V that reads them.
5. A few query tokens per sequence against a paged cache (speculative
   decoding's draft tokens, or one token) run on stage 9's decode kernel,
   imported: its CTAs pack tokens x G rows per KV head into their MMAs and
   split the keys among CTAs, where this kernel's 128-row Q tile would hold
   tokens x G real rows and one CTA would read a sequence's keys alone
   (``varlen.takes_draft_tokens`` says which calls).

Run it:
    python -m course check 10 --impl solutions     # this stage's tests
    python -m solutions.stage10_varlen_prefill     # one launch against the reference (needs a Hopper GPU)
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from course.runtime import launch, varlen
from solutions import stage09_tc_decode  # draft tokens against a paged cache
from solutions.stage08_fa3_prefill import (  # noqa: F401 (stage 8's kernel, solved: this stage adds to it)
    HEAD_DIMS,
    KV_STAGES,
    L2_BYTES,
    LOG2_E,
    REGISTERS,
    TILES,
    Attention,
    NamedBarrier,
    Step,
    TileScheduler,
    WindowMask,
    attend_kv_tiles_overlapped,
    bshd_as_dim_rows,
    bshd_as_rows_dim,
    load_tile,
    normalize_rows,
    pingpong_start,
    quad_allreduce,
    rows_cols_view,
    spill_bytes_allowed,
    store_lse,
    store_o_rows,
)
from solutions.stage09_tc_decode import zero_filled_copy  # a row piece past S_k: zeros

STAGE = 10


def packed_as_rows_dim(t: cute.Tensor) -> cute.Tensor:
    """[total, H, D] -> (total, D, H): rows and the contiguous K mode first, as stage 8's bshd_as_rows_dim."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))


def packed_as_dim_rows(t: cute.Tensor) -> cute.Tensor:
    """[total, H, D_v] -> (D_v, total, H): V as the (N, K) B operand of P V."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 0, 1]))


# --8<-- [start:sequence]
@cute.jit
def sequence_rows(cu_seqlens: cute.Tensor, batch: cutlass.Int32, total: cutlass.Int32):
    """(start, length) of sequence ``batch`` in a packed tensor of ``total`` rows.

    Clamped to the tensor, so that unchecked offsets (the host reads them only
    when asked) never make a store leave it: a wrong offset gives that
    sequence a wrong answer, never another tensor's memory.
    """
    start = cutlass.min(cutlass.max(cu_seqlens[batch], 0), total)
    end = cutlass.min(cutlass.max(cu_seqlens[batch + 1], start), total)
    return start, end - start


@cute.jit
def sequence_keys(mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor, batch: cutlass.Int32,
                  capacity: cutlass.Int32, paged: cutlass.Constexpr, has_seqused_k: cutlass.Constexpr):
    """(start, S_k) of sequence ``batch``'s keys: packed rows from ``cu_seqlens_k``, or the first
    ``seqused_k`` keys of its pages (``capacity``: the rows of K, or the pages of one block-table row)."""
    start, seqlen_k = cutlass.Int32(0), cutlass.Int32(0)
    if cutlass.const_expr(paged):
        seqlen_k = cutlass.min(cutlass.max(mSeqUsedK[batch], 0), capacity)
    else:
        start, seqlen_k = sequence_rows(mCuSeqlensK, batch, capacity)
        if cutlass.const_expr(has_seqused_k):
            seqlen_k = cutlass.min(cutlass.max(mSeqUsedK[batch], 0), seqlen_k)
    return start, seqlen_k
# --8<-- [end:sequence]


# --8<-- [start:scheduler]
@cute.jit
def warp_inclusive_sum(value: cutlass.Int32) -> cutlass.Int32:
    """Lane l gets the sum of ``value`` over lanes 0..l (five shuffles)."""
    lane = cute.arch.lane_idx()
    for i in cutlass.range_constexpr(5):
        offset = 1 << i
        below = cute.arch.shuffle_sync_up(value, offset)
        if lane >= offset:
            value = value + below
    return value


class VarlenTileScheduler:
    """Which (Q tile, head, sequence) tiles a CTA computes, and in which order.

    The tiles of all sequences form one linear order: sequence by sequence,
    and inside a sequence stage 8's (``TileScheduler`` on that sequence: heads
    in groups whose K and V fit in L2, the last Q tile first under a causal
    mask). The host knows only the tensors' sizes, not the lengths, so the
    grid is sized for the most tiles the packed rows can make (each sequence
    adds at most one partial Q tile): without a causal mask one CTA per SM
    loops over the tiles; under one, a CTA per tile, and the CTAs past the
    last tile find no sequence and exit.
    """

    def __init__(self, mCuSeqlensQ: cute.Tensor, total_q, num_heads, persistent: bool, longest_first: bool,
                 kv_tile_bytes: int, l2_bytes: int, tile_m: int, tile_n: int):
        self.mCuSeqlensQ = mCuSeqlensQ
        self.total_q, self.num_heads = total_q, num_heads
        self.num_batch = mCuSeqlensQ.shape[0] - 1
        self.max_tiles = (total_q + self.num_batch * (tile_m - 1)) // tile_m * num_heads
        self.persistent, self.longest_first = persistent, longest_first
        self.kv_tile_bytes, self.l2_bytes = kv_tile_bytes, l2_bytes
        self.tile_m, self.tile_n = tile_m, tile_n

    def grid(self, num_sms: int):
        if self.persistent:
            return (cutlass.min(self.max_tiles, num_sms), 1, 1)
        return (self.max_tiles, 1, 1)

    @cute.jit
    def tile_range(self):
        """(first, end, step) of this CTA's linear tile indices."""
        first = cute.arch.block_idx()[0]
        end, step = first + 1, cutlass.Int32(1)
        if cutlass.const_expr(self.persistent):
            end, step = self.max_tiles, cute.arch.grid_dim()[0]
        return first, end, step

    @cute.jit
    def tiles_of(self, batch: cutlass.Int32) -> cutlass.Int32:
        """Sequence ``batch``'s tiles: its Q tiles times the heads (0 past the last sequence)."""
        count = cutlass.Int32(0)
        if batch < self.num_batch:
            _, seqlen_q = sequence_rows(self.mCuSeqlensQ, batch, self.total_q)
            count = (seqlen_q + self.tile_m - 1) // self.tile_m * self.num_heads
        return count

    @cute.jit
    def locate(self, tile: cutlass.Int32, batch: cutlass.Int32, batch_start: cutlass.Int32):
        """(batch, batch_start): the sequence whose tiles hold linear index ``tile``, and its first tile;
        batch = the sequence count when no sequence does.

        The search starts at sequence ``batch`` whose first tile is ``batch_start`` (a persistent CTA's
        tiles only grow, so it passes its last answer), and takes 32 sequences per step: each lane
        counts one sequence's tiles, a prefix sum over the warp gives where each one ends, and the
        first lane whose sequence ends past ``tile`` has it. Every lane of the warp must call it.
        """
        # TODO(stage 10): Return the first sequence b >= batch whose tiles [start_b, start_b +
        #   tiles_of(b)) contain `tile`, and start_b, where sequence `batch` starts at batch_start and
        #   each later one where the one before it ends; sequences with no tiles contain nothing.
        #   Past the last sequence: (self.num_batch, anything). All 32 lanes run this together and
        #   must return the same answer; take 32 sequences per step (one per lane), not one.
        raise NotImplementedError('TODO(stage 10) in locate(): Return the first sequence b >= batch whose tiles [start_b, start_b + tiles_of(b)) contain `tile`, and start_b, where sequence `batch` starts at batch_start and each later one where the one before it ends; sequences with no tiles contain nothing. Past the last sequence: (self.num_batch, anything). All 32 lanes run this together and must return the same answer; take 32 sequences per step (one per lane), not one. Hints, one at a time: python -m course hint 10 (docs/stages/10-varlen-prefill.md as raw markdown shows them all at once)')
        return cutlass.min(batch, self.num_batch), batch_start

    @cute.jit
    def coords(self, rank: cutlass.Int32, seqlen_q: cutlass.Int32, seqlen_k: cutlass.Int32):
        """(m_block, head) of tile ``rank`` of one sequence: stage 8's linear order on that sequence alone."""
        one_sequence = TileScheduler(seqlen_q, self.num_heads, 1, seqlen_k, self.kv_tile_bytes, True,
                                     self.longest_first, self.l2_bytes, self.tile_m, self.tile_n)
        m_block, head, _ = one_sequence.coords(rank, one_sequence.l2_group())
        return m_block, head
# --8<-- [end:scheduler]


# --8<-- [start:paged_load]
@cute.jit
def page_lookup(n_block: cutlass.Int32, seqlen_k: cutlass.Int32, page_size: cutlass.Int32, pages: cute.Tensor,
                num_pages: cutlass.Int32, tile_n: cutlass.Constexpr, page_rows: cutlass.Constexpr):
    """The page of copy ``lane`` of KV tile ``n_block`` (``load_paged_tile``'s copies), looked up by that lane:
    all of a tile's pages with one table read per lane. K and V of a tile live in the same pages, so the
    producer looks them up once, for K, and keeps them for V one step later.

    ``pages``: this sequence's row of the block table.
    """
    # TODO(stage 10): Lane c returns the page that holds copy c's rows: keys n_block * tile_n + c *
    #   page_rows onwards (page_rows of them, all in one page). Key j lives in page pages[j // page_size].
    #   A copy whose rows all lie at or past seqlen_k must not read the block table (its entries there may
    #   be anything): its page is num_pages, outside the pool, which TMA fills with zeros.
    raise NotImplementedError("TODO(stage 10) in page_lookup(): Lane c returns the page that holds copy c's rows: keys n_block * tile_n + c * page_rows onwards (page_rows of them, all in one page). Key j lives in page pages[j // page_size]. A copy whose rows all lie at or past seqlen_k must not read the block table (its entries there may be anything): its page is num_pages, outside the pool, which TMA fills with zeros. Hints, one at a time: python -m course hint 10 (docs/stages/10-varlen-prefill.md as raw markdown shows them all at once)")
    return lane_page


@cute.jit
def load_paged_tile(pipe, state, tma_atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor,
                    n_block: cutlass.Int32, page_size: cutlass.Int32, lane_page: cutlass.Int32,
                    tile_n: cutlass.Constexpr, page_rows: cutlass.Constexpr):
    """Producer step of a paged cache: KV tile ``n_block`` as ``tile_n // page_rows`` TMA copies of
    ``page_rows`` rows, each from its page (lane c's ``lane_page``, from ``page_lookup``); all of them
    complete on the buffer's one full barrier. All 32 lanes of the producer warp call it (the copies are
    issued once, as every TMA copy here).

    ``tXgX``: (TMA, page_size // page_rows, pages) of the pool; ``tXsX``: (TMA, tile_n // page_rows,
    KV_STAGES) of the ring.
    """
    # TODO(stage 10): Rows [n_block * tile_n, (n_block + 1) * tile_n) of the sequence land in the
    #   buffer `state` points at, in order, once it is empty, and complete on its full barrier
    #   (armed for a whole tile). Key j lives in row j % page_size of its page; copy c's page is
    #   lane c's lane_page, and every lane must issue the same copies.
    raise NotImplementedError("TODO(stage 10) in load_paged_tile(): Rows [n_block * tile_n, (n_block + 1) * tile_n) of the sequence land in the buffer `state` points at, in order, once it is empty, and complete on its full barrier (armed for a whole tile). Key j lives in row j % page_size of its page; copy c's page is lane c's lane_page, and every lane must issue the same copies. Hints, one at a time: python -m course hint 10 (docs/stages/10-varlen-prefill.md as raw markdown shows them all at once)")
# --8<-- [end:paged_load]


# --8<-- [start:gather]
@dataclasses.dataclass(frozen=True)
class PipelineGather(pipeline.PipelineTmaAsync):
    """Stage 8's K or V ring filled by ``cp.async`` instead of TMA: the full barrier counts the producer
    warpgroup's 128 threads, each arriving once its own copies of the tile have landed
    (``cp.async.mbarrier.arrive``); the MMA warps release buffers as before, one arrival per warp."""

    @staticmethod
    def on(storage_bars, mma_threads: int) -> PipelineGather:
        ring = pipeline.PipelineTmaAsync.create(
            num_stages=KV_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, GATHER_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mma_threads // 32), tx_count=0,
            barrier_storage=storage_bars.data_ptr(), defer_sync=True)
        return PipelineGather(**{field.name: getattr(ring, field.name) for field in dataclasses.fields(ring)})

    def producer_acquire(self, state):
        self.sync_object_empty.wait(state.index, state.phase)  # no byte count to arm: no TMA lands here

    def producer_commit(self, state):
        cute.arch.cp_async_mbarrier_arrive_noinc(self.producer_get_barrier(state))


GATHER_THREADS = 128  # the producer warpgroup: every warp of it copies
# Rows per paged copy up to which the producer warpgroup gathers a KV tile instead of issuing TMA copies, by
# MMA warpgroups; chosen by measurement (the page's "Small pages").
GATHER_PAGE_ROWS = {2: 32, 3: 64}
# setmaxnreg with the gather: the producer threads hold a looked-up row address and the unrolled copy loop's.
# Two MMA warpgroups keep stage 8's split (24 hold the loop; 8 more would cost each MMA thread 8); with three,
# 24 spill, and stage 8 leaves 8 registers per producer thread unallocated (24 x 128 + 160 x 384 < 64K): the
# gather takes them.
GATHER_REGISTERS = {2: (24, 240), 3: (32, 160)}  # (producer, MMA)


@cute.jit
def row_address(mX: cute.Tensor, row: cutlass.Int32, page: cutlass.Int32) -> cutlass.Int64:
    """The global address of ``mX[row, 0, page]``: a row of a page of the pool."""
    return mX[row, None, page].iterator.toint()


@cute.jit
def swizzled_address(sX: cute.Tensor, swizzle: cute.Swizzle, coord) -> cutlass.Int32:
    """The shared-memory address of ``sX[coord]`` as the hardware sees it: ``swizzle`` (Sw<B, M, S> on the
    byte address, as TMA and WGMMA read the buffer) applied to the element's position in the layout."""
    bytes_per_element = sX.element_type.width // 8
    # (the buffer starts at a multiple of the swizzle's period, so its own address is unchanged by it)
    address = cute.recast_ptr(sX.iterator, dtype=sX.element_type).toint() + \
        cute.crd2idx(coord, sX.layout) * bytes_per_element
    mask = ((1 << swizzle.num_bits) - 1) << swizzle.num_base
    return address ^ ((address >> swizzle.num_shift) & mask)


@cute.jit
def gather_paged_tile(pipe, state, mX: cute.Tensor, sX: cute.Tensor, swizzle: cute.Swizzle, n_block: cutlass.Int32,
                      seqlen_k: cutlass.Int32, page_size: cutlass.Int32, pages: cute.Tensor,
                      tile_n: cutlass.Constexpr):
    """Producer step of a paged cache with small pages: KV tile ``n_block`` gathered with 16-byte ``cp.async``
    copies by the producer warpgroup's 128 threads (each calls it), instead of one TMA copy per
    ``page_rows`` rows issued by one thread. Rows at or past ``seqlen_k`` are filled with zeros.

    ``mX``: (page_size, D, pages) of this KV head; ``sX``: (tile_n, D, KV_STAGES), the ring as rows, whose
    pointer carries ``swizzle``; ``pages``: this sequence's row of the block table.
    """
    d = cute.size(sX, mode=[1])
    dtype = sX.element_type
    element_bytes = dtype.width // 8
    piece = 16 // element_bytes  # elements per 16-byte copy
    pieces_per_row = d // piece
    tidx = cute.arch.thread_idx()[0] % GATHER_THREADS
    # 16 rows per pass, 8 threads to a row (8 consecutive lanes), each copying every 8th piece of it.
    rows_per_pass = GATHER_THREADS // 8
    passes = tile_n // rows_per_pass
    assert passes <= 8, "a thread looks up one row: one per pass for the 8 threads of its row"
    row_in_pass, first_piece = tidx // 8, tidx % 8
    # Each thread looks up one row's address, before the wait: the row its 8 threads copy in pass first_piece.
    lookup_key = n_block * tile_n + first_piece * rows_per_pass + row_in_pass
    looked_up = row_address(mX, 0, 0)  # (rows past seqlen_k read nothing: any address of the pool)
    if lookup_key < seqlen_k:
        looked_up = row_address(mX, lookup_key % page_size, pages[lookup_key // page_size])
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=128)
    pipe.producer_acquire(state)
    # This thread's pieces are 16 rows or 8 pieces apart in the buffer: whole periods of the swizzle (which
    # permutes the 16-byte pieces of each 2^(B+M+S) bytes), so their addresses are its first one's plus constants.
    first = swizzled_address(sX, swizzle, (row_in_pass, first_piece * piece, state.index))
    period = 1 << (swizzle.num_bits + swizzle.num_base + swizzle.num_shift)
    for p in cutlass.range_constexpr(passes):
        # Pass p's row, from the lane of this row's group that looked it up (lanes in groups of 8).
        row = cute.arch.shuffle_sync(looked_up, p, mask_and_clamp=(24 << 8) | 31)
        key = n_block * tile_n + p * rows_per_pass + row_in_pass
        for k in cutlass.range_constexpr((pieces_per_row + 7) // 8):
            col = first_piece + 8 * k
            if cutlass.const_expr(pieces_per_row % 8 == 0) or col < pieces_per_row:
                offset = cute.crd2idx((p * rows_per_pass, 8 * k * piece, 0), sX.layout) * element_bytes
                assert offset % period == 0, f"pieces {offset} bytes apart are not whole swizzle periods"
                src = cute.make_ptr(dtype, row + col * 16, cute.AddressSpace.gmem, assumed_align=16)
                dst = cute.make_ptr(dtype, first + offset, cute.AddressSpace.smem, assumed_align=16)
                zero_filled_copy(atom, cute.make_tensor(src, cute.make_layout(piece)),
                                 cute.make_tensor(dst, cute.make_layout(piece)), key < seqlen_k)
    pipe.producer_commit(state)

# --8<-- [end:gather]


@cute.jit
def tile_pages(n_block: cutlass.Int32, paging, tile_n: cutlass.Constexpr, page_rows: cutlass.Constexpr,
               gather: cutlass.Constexpr):
    """What ``load_kv_tile`` needs of the block table for KV tile ``n_block``: this lane's page of it (copy
    ``lane``'s, ``page_lookup``), or 0 where it reads none (packed K and V; the gather looks up its own rows)."""
    lane_page = cutlass.Int32(0)
    if cutlass.const_expr(page_rows > 0 and not gather):
        seqlen_k, page_size, pages, num_pages = paging
        lane_page = page_lookup(n_block, seqlen_k, page_size, pages, num_pages, tile_n, page_rows)
    return lane_page


@cute.jit
def load_kv_tile(pipe, state, tma_atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor, n_block: cutlass.Int32,
                 paging, lane_page: cutlass.Int32, tile_n: cutlass.Constexpr, page_rows: cutlass.Constexpr,
                 gather: cutlass.Constexpr):
    """KV tile ``n_block``: stage 8's one TMA copy from packed rows, ``load_paged_tile`` (page_rows > 0, the
    pages ``tile_pages`` looked up), or ``gather_paged_tile`` (``gather``: ``tXgX`` the head's pool, ``tXsX``
    the ring as rows and its swizzle)."""
    if cutlass.const_expr(gather):
        seqlen_k, page_size, pages, _ = paging
        ring, swizzle = tXsX
        gather_paged_tile(pipe, state, tXgX, ring, swizzle, n_block, seqlen_k, page_size, pages, tile_n)
    elif cutlass.const_expr(page_rows > 0):
        page_size = paging[1]
        load_paged_tile(pipe, state, tma_atom, tXgX, tXsX, n_block, page_size, lane_page, tile_n, page_rows)
    else:
        load_tile(pipe, state, tma_atom, tXgX, tXsX, n_block)


# --8<-- [start:v_tail]
@cute.jit
def zero_v_tail(pipeline_v, v_state, sV: cute.Tensor, n_block: cutlass.Int32, seqlen_k: cutlass.Int32,
                mma_wg: cutlass.Int32, wg_tidx: cutlass.Int32, tile_n: cutlass.Constexpr):
    """Zero the rows of V past S_k in the buffer of KV tile ``n_block`` (the tile that holds the last key).

    Their scores are masked, so P is 0 there, but a cache slot past a
    sequence's length may hold NaN, and the P V WGMMA would add 0 x NaN = NaN.
    Both warpgroups zero the same rows (the same values, whichever is first)
    before their own P V reads them; the producer refills the buffer only
    after both released it.
    """
    valid = seqlen_k - n_block * tile_n
    if valid < tile_n:
        pipeline_v.consumer_wait(v_state)  # the copy has landed (the loop waits again: a completed phase stays so)
        sV_tile = sV[None, None, v_state.index]  # (D_v, tile_n)
        dv = cute.size(sV_tile, mode=[0])
        for e in cutlass.range(wg_tidx, (tile_n - valid) * dv, 128, unroll=1):
            sV_tile[e % dv, valid + e // dv] = sV_tile.element_type(0)
        # Generic-proxy stores, read next by WGMMA (async proxy); every thread's rows before the warpgroup's MMA.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE_WG1) + mma_wg, number_of_threads=128)
# --8<-- [end:v_tail]


# --8<-- [start:bounded_store]
@cute.jit
def store_o_rows_bounded(acc_O: cute.Tensor, gO: cute.Tensor, pv_mma_wg: cute.TiledMma, wg_tidx: cutlass.Int32,
                         valid_rows: cutlass.Int32, dtype: cutlass.Constexpr):
    """The 64 rows of O of a warpgroup that holds a sequence's last rows: rows below ``valid_rows`` go
    straight from registers to ``gO``; the others belong to the next sequence and are not written.

    (stage 8's TMA store writes whole 64-row boxes: it would overwrite them.)
    """
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    rO.store(acc_O.load().to(dtype))
    tOcO = pv_mma_wg.get_slice(wg_tidx).partition_C(cute.make_identity_tensor(gO.shape))
    o, coord = rows_cols_view(rO), rows_cols_view(tOcO)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        row = coord[r, 0][0]
        if row < valid_rows:
            for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):
                gO[row, coord[r, c][1]] = o[r, c]
# --8<-- [end:bounded_store]


# --8<-- [start:alibi]
class AlibiMask(WindowMask):
    """Stage 8's mask plus ALiBi: every score gets - slope x |query position - key position| (bottom-right
    aligned positions, as the mask's), before the mask. The scores are raw (the softmax scale multiplies
    them inside the exponent), so the slope comes in raw units, slope / softmax_scale. Tiles cut by the
    window pay for the bias and the mask (``apply``); full tiles, the bias alone (``apply_full``)."""

    changes_full_tiles = True  # the bias changes every score, so the loop over full tiles calls apply_full

    def __init__(self, m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config, tile_m: int, tile_n: int,
                 slope_raw):
        super().__init__(m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config, tile_m, tile_n)
        self.slope_raw = slope_raw

    @cute.jit
    def apply_full(self, acc_S: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32):
        s = rows_cols_view(acc_S)
        coord = rows_cols_view(tScS)
        key0 = n_block * self.tile_n
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            # The row's distance to its first key here, converted once: the thread's other keys in the tile
            # are that key plus a constant, so each score costs a float subtraction, not a conversion.
            first = cutlass.Float32(self.row0 + coord[r, 0][0] + self.offset - (key0 + coord[r, 0][1]))
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                distance = first - cutlass.Float32(coord[r, c][1] - coord[r, 0][1])
                s[r, c] = s[r, c] - self.slope_raw * abs(distance)

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32):
        self.apply_full(acc_S, tScS, n_block)
        WindowMask.apply(self, acc_S, tScS, n_block)
# --8<-- [end:alibi]


class VarlenAttention(Attention):
    """Stage 8's kernel over packed variable-length sequences, K and V packed or paged (``varlen.VarlenConfig``)."""

    def __init__(self, config: varlen.VarlenConfig):
        super().__init__(config)
        self.page_rows = config.page_rows  # 0: K and V packed like Q
        self.gather = config.page_gather  # paged K/V copied row by row by the producer warpgroup, not by TMA
        # Slots past S_k may hold anything (the gather fills its rows past S_k with zeros itself).
        self.zero_v_tail = (config.page_rows > 0 and not self.gather) or config.has_seqused_k
        self.loader_warps = GATHER_THREADS // 32 if self.gather else 1
        self.registers = (GATHER_REGISTERS if self.gather else REGISTERS)[self.num_wgs]

    @staticmethod
    def tiles_for(head_dim: int, head_dim_v: int):
        """Stage 8's tiling of (D, D_v): the host picks the rows per paged copy from its KV tile."""
        return TILES[head_dim, head_dim_v]

    @staticmethod
    def gathers(head_dim: int, head_dim_v: int, page_rows: int) -> bool:
        """Whether a paged KV tile of ``page_rows`` rows per TMA copy is gathered by cp.async instead."""
        return 0 < page_rows <= GATHER_PAGE_ROWS[TILES[head_dim, head_dim_v].mma_warpgroups]

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        mBlockTable: cute.Tensor,
        mAlibi: cute.Tensor,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        num_sink_tokens: cutlass.Int32,
        write_lse: cutlass.Int32,
        stream,
    ):
        d, dv, n = self.head_dim, self.head_dim_v, self.tile_n
        mQ, mO = packed_as_rows_dim(mQ), packed_as_rows_dim(mO)
        if cutlass.const_expr(self.gather):
            mK, mV = bshd_as_rows_dim(mK), bshd_as_rows_dim(mV)  # (page_size, D, H, pages), read by cp.async
        elif cutlass.const_expr(self.page_rows > 0):
            mK, mV = bshd_as_rows_dim(mK), bshd_as_dim_rows(mV)  # [pages, page_size, H, D]: a page is a "batch"
            k_box, v_box = (self.page_rows, d), (dv, self.page_rows)
        else:
            mK, mV = packed_as_rows_dim(mK), packed_as_dim_rows(mV)
            k_box, v_box = (n, d), (dv, n)
        qk_mma, pv_mma, pv_mma_wg = self.tiled_mmas()
        sQ_layout, sK_layout, sV_layout, sO_layout = self.smem_layouts()
        self.define_shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)
        one_stage = (None, None, 0)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (self.tile_m, d))
        tma_k, tma_mK, tma_v, tma_mV = None, mK, None, mV  # (the gather reads K and V as they are)
        if cutlass.const_expr(not self.gather):
            # One copy's box in the ring: a whole KV tile (packed), or page_rows of its rows (paged; keys are
            # mode 0 of a K tile, mode 1 of a V tile).
            k_copy = cute.composition(cute.slice_(sK_layout, one_stage), cute.make_layout(k_box, stride=(1, n)))
            v_copy = cute.composition(cute.slice_(sV_layout, one_stage), cute.make_layout(v_box, stride=(1, dv)))
            tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, k_copy, k_box)
            tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, v_copy, v_box)
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                    cute.slice_(sO_layout, one_stage), (self.o_rows, dv))
        scheduler = self.varlen_scheduler(mQ, mCuSeqlensQ)
        self.kernel(
            qk_mma, pv_mma, pv_mma_wg, tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV, tma_o, tma_mO, mO,
            mLSE, mSinks, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBlockTable, mAlibi, scale_log2, window_left,
            window_right, num_sink_tokens, write_lse, sQ_layout, sK_layout, sV_layout, sO_layout,
        ).launch(grid=scheduler.grid(launch.sm_count()), block=[self.num_threads, 1, 1], stream=stream)

    def varlen_scheduler(self, mQ: cute.Tensor, mCuSeqlensQ: cute.Tensor) -> VarlenTileScheduler:
        kv_tile_bytes = self.tile_n * (self.head_dim + self.head_dim_v) * self.dtype.width // 8
        return VarlenTileScheduler(mCuSeqlensQ, mQ.shape[0], mQ.shape[2], self.steps >= Step.PERSISTENT and
                                   not self.config.has_right, self.config.has_right, kv_tile_bytes, self.l2_bytes,
                                   self.tile_m, self.tile_n)

    @cute.jit
    def key_capacity(self, mK: cute.Tensor, mBlockTable: cute.Tensor) -> cutlass.Int32:
        """The most keys a sequence may have: K's rows, or a block-table row's pages."""
        capacity = mK.shape[0]
        if cutlass.const_expr(self.page_rows > 0):
            capacity = mBlockTable.shape[1] * mK.shape[0]  # (page_size, D, H, pages): mode 0 is the page size
        return capacity

    def make_pipelines(self, storage):
        """Stage 8's pipelines; with ``gather``, K and V rings that cp.async fills (their barriers initialized
        again, for 128 producer arrivals)."""
        pipeline_q, pipeline_k, pipeline_v = super().make_pipelines(storage)
        if cutlass.const_expr(self.gather):
            pipeline_k, pipeline_v = (PipelineGather.on(bars, self.mma_threads) for bars in (storage.k_bars,
                                                                                           storage.v_bars))
        return pipeline_q, pipeline_k, pipeline_v

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        pv_mma_wg: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_o: cute.CopyAtom,
        tma_mO: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        mBlockTable: cute.Tensor,
        mAlibi: cute.Tensor,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        num_sink_tokens: cutlass.Int32,
        write_lse: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        storage = SmemAllocator().allocate(self.shared_storage)
        sQ, sK, sV, sO, sP = self.shared_tensors(storage, sQ_layout, sK_layout, sV_layout, sO_layout)
        pipeline_q, pipeline_k, pipeline_v = self.make_pipelines(storage)
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every barrier is initialized before anyone uses one

        sequences = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBlockTable)
        window = (window_left, window_right, num_sink_tokens)
        if warpgroup_idx > 0:
            cute.arch.setmaxregister_increase(self.registers[1])
            self.mma(self.varlen_scheduler(mQ, mCuSeqlensQ), qk_mma, pv_mma, pv_mma_wg, tma_o, mQ, mK, tma_mO, mO,
                     mLSE, mSinks, sequences, sK, sQ, sV, sO, sP, pipeline_q, pipeline_k, pipeline_v, scale_log2, window,
                     write_lse, mAlibi)
        else:
            cute.arch.setmaxregister_decrease(self.registers[0])
            if warp_idx < self.loader_warps:
                self.load(self.varlen_scheduler(mQ, mCuSeqlensQ), tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV,
                          sequences, pipeline_q, pipeline_k, pipeline_v, window)

    # --8<-- [start:producer]
    @cute.jit
    def load(self, scheduler: VarlenTileScheduler, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom,
             mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
             sV: cute.Tensor, sequences, pipeline_q, pipeline_k, pipeline_v, window):
        """The producer warp: stage 8's, with each tile's rows at its sequence's offset, K and V from pages
        (with ``gather``, every warp of the producer warpgroup runs it: warp 0 loads Q, all of them K and V)."""
        mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBlockTable = sequences
        window_left, window_right, num_sink_tokens = window
        d, dv, n, rows = self.head_dim, self.head_dim_v, self.tile_n, self.page_rows
        paged = rows > 0
        one_cta = cute.make_layout(1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        capacity = self.key_capacity(mK, mBlockTable)
        page_size, num_pages = mK.shape[0], mK.shape[3] if paged else 0
        loads_q = True  # the producer warp; with the gather, warp 0 of the four
        if cutlass.const_expr(self.gather):
            loads_q = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
            # The rings as rows, (tile_n, D, KV_STAGES), with the swizzles their pointers carry
            _, sK_layout, sV_layout, _ = self.smem_layouts()
            sK = sK, sK_layout.inner
            sV = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2])), sV_layout.inner
        elif cutlass.const_expr(paged):
            # The ring as copies: (TMA, tile_n // rows, KV_STAGES); each copy is `rows` rows of a tile.
            sK = cute.group_modes(cute.flat_divide(sK, (rows, d))[None, None, None, 0, None], 0, 2)
            sV = cute.group_modes(cute.flat_divide(sV, (dv, rows))[None, None, 0, None, None], 0, 2)
        else:
            sK, sV = cute.group_modes(sK, 0, 2), cute.group_modes(sV, 0, 2)
        batch, batch_start = cutlass.Int32(0), cutlass.Int32(0)
        first, end, step = scheduler.tile_range()
        # (a runtime loop may not carry the scheduler object; its bound methods and values are fine)
        locate, coords, num_batch = scheduler.locate, scheduler.coords, scheduler.num_batch
        for tile in cutlass.range(first, end, step, unroll=1):
            batch, batch_start = locate(tile, batch, batch_start)
            if batch < num_batch:
                start_q, seqlen_q = sequence_rows(mCuSeqlensQ, batch, mQ.shape[0])
                start_k, seqlen_k = sequence_keys(mCuSeqlensK, mSeqUsedK, batch, capacity, paged,
                                                  self.config.has_seqused_k)
                m_block, head = coords(tile - batch_start, seqlen_q, seqlen_k)
                mask = WindowMask(m_block, seqlen_q, seqlen_k, window_left, window_right, num_sink_tokens,
                                  self.config, self.tile_m, self.tile_n)
                n_block_min, n_block_max = mask.kv_block_range()
                n_tiles = mask.sink_block_count(n_block_min) + n_block_max - n_block_min
                kv_block = mask.kv_block
                head_kv = head // (mQ.shape[2] // mK.shape[2])  # GQA/MQA
                gQ = cute.local_tile(cute.domain_offset((start_q, 0), mQ[None, None, head]), (self.tile_m, d),
                                     (m_block, 0))
                tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2),
                                                   cute.group_modes(gQ, 0, 2))
                if cutlass.const_expr(self.gather):  # the head's pool, (page_size, D, pages), and the rings as they are
                    tKgK, tKsK, tVgV, tVsV = mK[None, None, head_kv, None], sK, mV[None, None, head_kv, None], sV
                elif cutlass.const_expr(paged):
                    gK = cute.local_tile(mK[None, None, head_kv, None], (rows, d), (None, 0, None))
                    gV = cute.local_tile(mV[None, None, head_kv, None], (dv, rows), (0, None, None))
                else:
                    gK = cute.local_tile(cute.domain_offset((start_k, 0), mK[None, None, head_kv]), (n, d), (None, 0))
                    gV = cute.local_tile(cute.domain_offset((0, start_k), mV[None, None, head_kv]), (dv, n), (0, None))
                if cutlass.const_expr(not self.gather):
                    tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, sK, cute.group_modes(gK, 0, 2))
                    tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, sV, cute.group_modes(gV, 0, 2))
                paging = (seqlen_k, page_size, mBlockTable[batch, None], num_pages) if paged else None
                # Stage 8's order: K of the first tile, then Q; V one tile behind K, from the page K's copies
                # looked up (v_page: this lane's, from the previous step).
                v_page = cutlass.Int32(0)
                if n_tiles > 0:
                    first_block = kv_block(0, n_block_min, n_block_max)
                    v_page = tile_pages(first_block, paging, n, rows, self.gather)
                    load_kv_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, first_block, paging, v_page, n, rows,
                                 self.gather)
                    k_state.advance()
                if loads_q:
                    pipeline_q.producer_acquire(q_state)
                    cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
                    q_state.advance()
                for i in cutlass.range(1, n_tiles, unroll=1):
                    n_block = kv_block(i, n_block_min, n_block_max)
                    k_page = tile_pages(n_block, paging, n, rows, self.gather)
                    load_kv_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, n_block, paging, k_page, n, rows, self.gather)
                    k_state.advance()
                    load_kv_tile(pipeline_v, v_state, tma_v, tVgV, tVsV, kv_block(i - 1, n_block_min, n_block_max),
                                 paging, v_page, n, rows, self.gather)
                    v_state.advance()
                    v_page = k_page
                if n_tiles > 0:
                    load_kv_tile(pipeline_v, v_state, tma_v, tVgV, tVsV, kv_block(n_tiles - 1, n_block_min, n_block_max),
                                 paging, v_page, n, rows, self.gather)
                    v_state.advance()
        if loads_q:
            pipeline_q.producer_tail(q_state)
        pipeline_k.producer_tail(k_state)
        pipeline_v.producer_tail(v_state)
    # --8<-- [end:producer]

    # --8<-- [start:consumer]
    @cute.jit
    def mma(self, scheduler: VarlenTileScheduler, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
            pv_mma_wg: cute.TiledMma, tma_o: cute.CopyAtom, mQ: cute.Tensor, mK: cute.Tensor, tma_mO: cute.Tensor,
            mO: cute.Tensor, mLSE: cute.Tensor, mSinks: cute.Tensor, sequences, sK: cute.Tensor, sQ: cute.Tensor,
            sV: cute.Tensor, sO: cute.Tensor, sP, pipeline_q, pipeline_k, pipeline_v, scale_log2: cutlass.Float32,
            window, write_lse: cutlass.Int32, mAlibi: cute.Tensor):
        """An MMA warpgroup: stage 8's, with each tile's sequence, and O rows stored only inside it."""
        mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBlockTable = sequences
        window_left, window_right, num_sink_tokens = window
        dv = self.head_dim_v
        tidx, _, _ = cute.arch.thread_idx()
        mma_tidx = tidx - 128
        mma_wg = cute.arch.make_warp_uniform(mma_tidx // 128)
        wg_tidx = mma_tidx % 128
        tSrQ, tSrK, tOrV, acc_S, tScS, acc_O, rP, tOrP = self.mma_operands(qk_mma, pv_mma, sQ, sK, sV, sP,
                                                                            mma_tidx, mma_wg)
        rows = cute.size(rows_cols_view(acc_S), mode=[0])
        row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(rows, cutlass.Float32)
        row_scale = cute.make_rmem_tensor(rows, cutlass.Float32)
        lse = cute.make_rmem_tensor(rows, cutlass.Float32)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        capacity = self.key_capacity(mK, mBlockTable)

        pingpong_start(mma_wg)
        batch, batch_start = cutlass.Int32(0), cutlass.Int32(0)
        first, end, step = scheduler.tile_range()
        # (a runtime loop may not carry the scheduler object; its bound methods and values are fine)
        locate, coords, num_batch = scheduler.locate, scheduler.coords, scheduler.num_batch
        for tile in cutlass.range(first, end, step, unroll=1):
            batch, batch_start = locate(tile, batch, batch_start)
            if batch < num_batch:
                start_q, seqlen_q = sequence_rows(mCuSeqlensQ, batch, mQ.shape[0])
                start_k, seqlen_k = sequence_keys(mCuSeqlensK, mSeqUsedK, batch, capacity, self.page_rows > 0,
                                                  self.config.has_seqused_k)
                m_block, head = coords(tile - batch_start, seqlen_q, seqlen_k)
                mask = WindowMask(m_block, seqlen_q, seqlen_k, window_left, window_right, num_sink_tokens,
                                  self.config, self.tile_m, self.tile_n)
                if cutlass.const_expr(self.config.has_alibi):  # the tile's head's slope, in raw score units
                    mask = AlibiMask(m_block, seqlen_q, seqlen_k, window_left, window_right, num_sink_tokens,
                                     self.config, self.tile_m, self.tile_n, mAlibi[head] * LOG2_E / scale_log2)
                n_block_min, n_block_max = mask.kv_block_range()
                n_tiles = mask.sink_block_count(n_block_min) + n_block_max - n_block_min
                row_max.fill(-cutlass.Float32.inf)
                row_sum.fill(0.0)
                acc_O.fill(0.0)
                if cutlass.const_expr(self.zero_v_tail):
                    first_block = mask.kv_block(0, n_block_min, n_block_max)
                    if n_tiles > 0:  # the tile with the last key is the first one visited, if any is
                        zero_v_tail(pipeline_v, v_state, sV, first_block, seqlen_k, mma_wg, wg_tidx, self.tile_n)
                pipeline_q.consumer_wait(q_state)
                k_state, v_state = attend_kv_tiles_overlapped(
                    qk_mma, pv_mma, acc_S, acc_O, rP, tOrP, tSrQ, tSrK, tOrV, pipeline_q, q_state, pipeline_k,
                    k_state, pipeline_v, v_state, tScS, n_tiles, n_block_min, n_block_max, mask, row_max, row_sum,
                    row_scale, scale_log2, mma_wg, self.num_wgs, True, not self.o_in_q)

                quad_allreduce(row_sum, cute.arch.warp_reduction_sum)
                normalize_rows(acc_O, row_sum, row_max, scale_log2, mSinks[head] * LOG2_E, lse)
                if write_lse != 0:  # mLSE is [1, H_q, total_q]: the sequence's rows start at start_q
                    store_lse(lse, cute.domain_offset((0, 0, start_q), mLSE), tScS, m_block * self.tile_m, seqlen_q,
                              head, 0, mma_tidx)
                row0 = (m_block * self.num_wgs + mma_wg) * 64  # this warpgroup's first row in the sequence
                if row0 + 64 <= seqlen_q:
                    gO = cute.local_tile(cute.domain_offset((start_q, 0), tma_mO[None, None, head]), (64, dv),
                                         (m_block * self.num_wgs + mma_wg, 0))
                    store_o_rows(acc_O, sO[None, None, mma_wg], tma_o, gO, pv_mma_wg, mma_wg, wg_tidx, self.dtype,
                                 self.o_in_q)
                elif row0 < seqlen_q:
                    gO = cute.local_tile(cute.domain_offset((start_q, 0), mO[None, None, head]), (64, dv),
                                         (m_block * self.num_wgs + mma_wg, 0))
                    store_o_rows_bounded(acc_O, gO, pv_mma_wg, wg_tidx, seqlen_q - row0, self.dtype)
                if cutlass.const_expr(self.o_in_q):
                    pipeline_q.consumer_release(q_state)  # (stage 8's: after the store has read this warpgroup's O)
                q_state.advance()
        if wg_tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last store has read sO before the CTA exits
    # --8<-- [end:consumer]


KERNEL_CONFIGS = varlen.kernel_configs(STAGE, VarlenAttention.gathers)  # each combination of this stage's features, compiled on its own


def cross_compile_config(config: varlen.VarlenConfig, keep: bool = False):
    """Compile for sm_90a on any machine (no GPU needed) and report registers, smem, spills."""
    return varlen.cross_compile_config(VarlenAttention, config, stage=STAGE, keep=keep)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                     block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), sink_logits=None,
                     num_sink_tokens=0, return_lse=False, out=None, check_lengths=None, alibi_slopes=None):
    """Attention over packed sequences of different lengths; the contract is docs/contract.md.

    ``q`` [total_q, H_q, D]; ``k``, ``v`` [total_k, H_kv, D] with ``cu_seqlens_k``, or a paged cache
    [num_pages, page_size, H_kv, D] with ``block_table`` [B, max_pages] and ``seqused_k`` [B] (then
    ``cu_seqlens_k`` is None). Returns O [total_q, H_q, D_v] (and LSE [H_q, total_q] float32 with
    ``return_lse``). ``alibi_slopes`` [H_q] float32: each score gets - slope x |query position - key position|
    (positions bottom-right aligned, as the masks').
    """
    return varlen.attention_varlen(
        STAGE, VarlenAttention, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        seqused_k=seqused_k, block_table=block_table, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, return_lse=return_lse,
        out=out, check_lengths=check_lengths, alibi_slopes=alibi_slopes, decode=stage09_tc_decode)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
              sink_logits=None, num_sink_tokens=0, return_lse=False, out=None, alibi_slopes=None):
    """Stage 8's ``attention`` on [B, S, H, D], run as B packed sequences of one length by this stage's kernel
    (``alibi_slopes`` as ``attention_varlen``'s)."""
    return varlen.attention_dense(STAGE, VarlenAttention, q, k, v, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                                  return_lse=return_lse, out=out, alibi_slopes=alibi_slopes)


if __name__ == "__main__":
    from course.testing import demo

    demo.varlen(attention_varlen, causal=True)
