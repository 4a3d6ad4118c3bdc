"""Stage 11: the backward pass.

Compared with stage 10, this stage adds the gradients dQ, dK, dV (and the sink
logits' dsink), because training and fine-tuning run them, and they are half
of FlashAttention: the forward keeps only O and the LSE, and the backward
recomputes each probability tile P = exp(S - LSE) from Q, K and the LSE rather
than storing the S_q x S_k matrix. The forward is stage 10's, imported.

FlashAttention-2's algorithm, laid out for Hopper as FlashAttention-3 does:

1. Preprocess (a kernel of its own, ``Preprocess``): D = rowsum(dO * O) per
   query row (the softmax's Jacobian needs it: dS = P * (dP - D)), the LSE
   moved to the log2 domain, +inf where a row saw no key (so P = 0 there),
   both padded to whole Q tiles, and the float32 dQ sum zeroed.
2. One CTA per (KV tile, KV head, batch) keeps its K and V tile in shared
   memory and its dK and dV in registers, and walks every Q tile that sees
   the KV tile (for each query head of its group: GQA's sum over the group
   happens in registers, with no atomics). Per Q tile, with Q, dO, LSE and D
   loaded by a producer warp two tiles ahead:
       S^T  = K Q^T            P^T  = exp2(S^T scale log2(e) - LSE)
       dP^T = V dO^T           dS^T = P^T * (dP^T - D)
       dV  += P^T dO           dK  += dS^T Q
       dQ   = dS K             (added into a float32 dQ in global memory)
   The first two products are computed transposed (K, V are the A operand)
   so that P^T and dS^T land in registers as the A operand of the next two
   (from D = 192, where a warpgroup has fewer keys than a WGMMA's M, the
   other way round: S = Q K^T, dV^T = dO^T P, dK^T = Q^T dS, with P and dS
   through shared memory; KV_TILE_KEYS). dQ needs dS itself, with the Q tile's rows
   as M: dS^T goes to shared memory once, and dQ reads it through a
   transposed view. Q and dO are each read in two orientations (K-major for
   S and dP, M-major for dK and dV); one swizzled layout serves both.
3. dQ: every CTA whose KV tile a Q tile sees adds its share, so the shares are
   summed in float32 in global memory: each MMA warpgroup puts its part of
   each step's dQ in shared memory, in the order its registers hold it
   (``DQTile``), and a warp of the producer warpgroup (the dQ warp) adds it
   with a bulk reduce-add (``cp.reduce.async.bulk``), which the L2 applies;
   ``ConvertDQ`` scales the sum, converts it and puts it in rows.

Masks (causal, windows, sink tokens) choose the Q tiles a KV tile visits and
set S to -inf outside; sink logits change only the LSE (the forward's) and
get their gradient on the host: dsink[h] = -sum over rows of exp(sink - LSE) * D.

Run it:
    python -m course check 11 --impl solutions     # this stage's tests
    python -m solutions.stage11_backward           # one backward against autograd (needs a Hopper GPU)
"""

from __future__ import annotations

import math
from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import CopyUniversalOp, OperandMajorMode, cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from course.runtime import backward
from solutions.stage08_fa3_prefill import (
    LOG2_E,
    REGISTERS,
    WindowMask,
    acc_layout_as_operand_a,
    bshd_as_rows_dim,
    rows_cols_view,
    warpgroup_gemm,
)
from solutions.stage10_varlen_prefill import attention  # noqa: F401 (the forward this stage differentiates)

STAGE = 11
# --8<-- [start:q_tile_rows]
# Query rows per step (the N of S^T = K Q^T, the M of dQ = dS K), per head dim: 128 where the registers and
# shared memory hold a step that wide (D = 64: S^T and dP^T take 64 registers each, dK and dV 32), else 64.
Q_TILE_ROWS = {64: 128, 80: 64, 96: 64, 128: 64, 192: 64, 256: 64}
# Without a mask, D = 128 takes 80 rows (FlashAttention-3's and -4's choice): a fifth fewer steps per KV tile, and
# S^T, dP^T, dV and dK grow from N or K = 64 to 80. 80 is not a multiple of the WGMMA's 64-row M, so dQ is
# computed transposed (DQTile). With a mask they keep 64, as the diagonal tiles would carry more idle rows (not
# measured here).
UNMASKED_Q_TILE_ROWS = {128: 80}


def q_tile_rows(config) -> int:
    """Query rows per step of ``config``'s kernel."""
    masked = config.has_left or config.has_right
    return Q_TILE_ROWS[config.head_dim] if masked else UNMASKED_Q_TILE_ROWS.get(config.head_dim,
                                                                                 Q_TILE_ROWS[config.head_dim])
# --8<-- [end:q_tile_rows]
# --8<-- [start:kv_tile_keys]
# Keys per CTA (its KV tile), per head dim; each MMA warpgroup owns half of them, with their dK and dV. Up to
# D = 128 a warpgroup takes 64 keys, the M of S^T = K Q^T, dK and dV, and P^T and dS^T stay in its registers as
# the A operands of dV and dK. From D = 192 float32 dK and dV of 64 keys would take 2 x D registers a thread,
# more than it has: a warpgroup takes fewer keys (48 at 192, 32 at 256), below the WGMMA's M of 64, so the
# products turn around (``keys_as_m``): S = Q K^T and dP = dO V^T with the keys as N, dV^T = dO^T P and
# dK^T = Q^T dS with the head dim as M. P and dS, the B operands of the last two, go through shared memory.
KV_TILE_KEYS = {64: 128, 80: 128, 96: 128, 128: 128, 192: 96, 256: 64}
# Buffers of P and of dS where they go through shared memory (keys_as_m false), by (D, D_v): two where they fit.
# With one, a warpgroup waits at each step until the other is done with the last step's (DS_EMPTY).
DS_STAGES = {(192, 192): 1, (192, 128): 2, (256, 256): 2}
# --8<-- [end:kv_tile_keys]
Q_STAGES = 2   # buffers of Q (with its LSE), and of dO (with its D) up to D = 128: the producer runs two steps ahead
# --8<-- [start:wide_buffers]
# From D = 192 dO gets one buffer: the producer loads the next step's once this step's dV product has read it (at
# 256 the buffers would not fit in the 227 KiB of shared memory otherwise). At 256 dQ's tile also goes to the dQ
# warp in two rounds of half its columns, through a buffer half as large.
DO_STAGES = {64: 2, 80: 2, 96: 2, 128: 2, 192: 1, 256: 1}  # (1 only where every warpgroup computes dQ)
DQ_ROUNDS = {64: 1, 80: 1, 96: 1, 128: 1, 192: 1, 256: 2}
# --8<-- [end:wide_buffers]
# Whether a warpgroup hands its dQ part to the dQ warp (the proxy fence, then DQ_FULL) only once dK's product is
# done, rather than right after its stores: the fence waits until the stores have landed, and by then they have.
# Measured per head dim (the page): it pays at D = 64 and costs at the others. One round of dQ only.
LATE_DQ_HANDOFF = {64: True, 80: False, 96: False, 128: False, 192: False, 256: False}
MMA_WGS = 2


def kv_tile_keys(head_dim: int) -> int:
    """Keys per CTA (``KV_TILE_KEYS``)."""
    return KV_TILE_KEYS[head_dim]


def keys_as_m(head_dim: int) -> bool:
    """Whether a warpgroup's keys are a whole M of the WGMMA (64): then S^T, dP^T, dV and dK have the keys as
    M; else S, dP, dV^T and dK^T have them as N."""
    return kv_tile_keys(head_dim) // MMA_WGS % 64 == 0


# --8<-- [start:swizzle_span]
# Warpgroups that compute dQ = dS K, each a part of the dQ tile (the other waits): 64 of its rows where the Q
# tile has a block of 64 per warpgroup (128 rows at D = 64), else a part of head_dim's columns. At D = 80 a half
# (40 columns) would cut K's 16-column swizzle atoms, and narrower atoms cost more than the idle warpgroup
# (measured on the page): one warpgroup computes all of dQ, as FlashAttention's Hopper backward does up to D = 96.
DQ_WARPGROUPS = {64: 2, 80: 1, 96: 2, 128: 2, 192: 2, 256: 2}


def swizzle_span(head_dim: int) -> int:
    """The columns whose widest swizzle atom lays out K and V in shared memory: head_dim, unless dQ's warpgroups
    split it (each reads its columns of K) where such an atom would straddle the cut (96: halves of 48, atoms of
    32 columns), then the part (48: atoms of 16)."""
    part = head_dim // DQ_WARPGROUPS[head_dim]
    return head_dim if part & (part - 1) == 0 or part == head_dim else part
# --8<-- [end:swizzle_span]


class Barrier(IntEnum):
    """Named barriers (0 is __syncthreads). DQ_EMPTY and DQ_FULL are one per dQ warpgroup (+ its index), each
    between that warpgroup and the dQ warp."""

    DS_READY = 1                 # both halves of dS^T are in shared memory (dQ = dS K reads both)
    DQ_EMPTY = 2                 # the dQ warp's last reduce-add of this warpgroup's part has read it
    DQ_FULL = DQ_EMPTY + MMA_WGS  # this warpgroup's part of dQ is in shared memory
    EPILOGUE = DQ_FULL + MMA_WGS
    DS_EMPTY = EPILOGUE + 1       # with one dS buffer (keys_as_m false): both warpgroups' last step is done


DQ_PART_THREADS = 128 + 32  # DQ_EMPTY and DQ_FULL: a warpgroup and the dQ warp


@cute.jit
def wait_for_turn(turns: cute.Pointer, turn: cutlass.Int32):
    """Deterministic dQ: wait until ``turns`` counts ``turn`` finished adds into this Q tile. One lane
    polls (an acquire at gpu scope); the warp, which issues the next reduce-add, waits for that lane."""
    if cute.arch.lane_idx() == 0:
        while cute.arch.atomic_add(turns, cutlass.Int32(0), sem="acquire", scope="gpu") != turn:
            pass
    cute.arch.sync_warp()
    cute.arch.fence_proxy("async.global")  # the generic-proxy acquire before the async-proxy reduce-add


@cute.jit
def pass_turn(turns: cute.Pointer):
    """Deterministic dQ: count a reduce-add that has landed in global memory (the caller waited for its
    writes) on ``turns``, with a release: the next tile's add must come after this one's."""
    cute.arch.fence_proxy("async.global")
    if cute.arch.lane_idx() == 0:
        cute.arch.red(turns, cutlass.Int32(1), op="add", dtype="s32", sem="release", scope="gpu")


def ring_buffer(t: cute.Tensor, index: cutlass.Int32) -> cute.Tensor:
    """Buffer ``index`` (the last mode) of a ring of swizzled buffers, as buffer 0 moved by whole buffers.

    Indexed by a run-time value, the mode's swizzled addresses are computed
    per buffer and cost registers the kernel does not have; buffer 0's are
    computed once, and a buffer is a whole number of swizzle periods, so one
    add (of a multiple of the buffer's size, which keeps stmatrix's alignment)
    moves them all.
    """
    origin = (0,) * (cute.rank(t) - 1)
    first = t[(None,) * len(origin) + (0,)]
    stride = cute.crd2idx(origin + (1,), t.layout)
    return cute.make_tensor(first.iterator + cute.assume(index * stride, divby=stride), first.layout)


@dsl_user_op
def bulk_reduce_add_f32(smem: cute.Pointer, gmem: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """Add ``num_bytes`` of contiguous float32 at ``smem`` into ``gmem`` (``cp.reduce.async.bulk``, applied
    at the L2), in the issuing thread's current bulk async group. Both addresses 16-byte aligned."""
    llvm.inline_asm(
        None, [gmem.llvm_ptr, cutlass.Int32(smem.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
               cutlass.Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


# --8<-- [start:dq_tile]
class DQTile:
    """How one step's dQ = dS K (or dQ^T = K^T dS^T, ``transposed``) is shared out and where its float32 values go.

    Each dQ warpgroup computes a part of the (tile_m, D) tile (``parts``: by rows where the Q tile has 64
    rows per warpgroup, else by columns), over ``DQ_ROUNDS`` rounds of ``columns`` columns. A thread
    stores its accumulators in the order it holds them, 16 bytes at a time: vector v of thread t goes to
    float 512 v + 4 t of its warpgroup's part, so a quarter warp writes 128 contiguous bytes (no bank
    conflict, no address arithmetic). ``dQaccum`` keeps each Q tile's tile_m x D floats in the same order
    (round, part, then as stored), so a part is added by one contiguous bulk reduce-add; ``ConvertDQ``
    puts the values back in rows and columns with the same tiled MMA.
    """

    def __init__(self, head_dim: int, tile_m: int):
        self.head_dim, self.tile_m = head_dim, tile_m
        self.wgs = DQ_WARPGROUPS[head_dim]
        self.rounds = DQ_ROUNDS[head_dim]
        self.columns = head_dim // self.rounds
        # Rows not a multiple of 64 (the WGMMA's M): dQ^T = K^T dS^T, the columns as M, split by warpgroup
        self.transposed = tile_m % 64 != 0
        self.shape = (self.columns, tile_m) if self.transposed else (tile_m, self.columns)  # the product's (M, N)
        self.parts = (self.wgs, 1) if self.transposed or tile_m == 64 * self.wgs else (1, self.wgs)
        self.part_floats = tile_m * self.columns // self.wgs
        self.tile_floats = tile_m * head_dim  # a Q tile's share of dQaccum

    def tiled_mma(self, dtype):
        """dQ = dS K (or dQ^T = K^T dS^T), warpgroup w's part of a round: both operands M/N-major."""
        row_parts, col_parts = self.parts
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, cutlass.Float32, (row_parts, col_parts, 1),
            (64, self.shape[1] // col_parts))

    def layout(self):
        """One round in shared memory, or of a Q tile in dQaccum: (floats of a part, part)."""
        return cute.make_layout((self.part_floats, self.wgs))

    def offset(self, dq_round, part):
        """Where ``part`` of round ``dq_round`` starts among a Q tile's floats of dQaccum: the dQ warp adds it
        there, ConvertDQ reads it back from there."""
        return (dq_round * self.wgs + part) * self.part_floats

    def store_copy(self):
        """A thread's accumulators, four at a time, thread t of a warpgroup at 4 t of its part (``layout``)."""
        vector = cute.make_copy_atom(CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(vector, cute.make_layout(128), cute.make_layout(4))
# --8<-- [end:dq_tile]


def transposed(t: cute.Tensor) -> cute.Tensor:
    """The same shared memory with its first two modes swapped: (rows, cols, ...) -> (cols, rows, ...).

    A K-major swizzled tile read this way is the M/N-major operand of the
    transposed product: the bytes do not move.
    """
    order = [1, 0] + list(range(2, cute.rank(t.layout)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def keys_by_rows(t: cute.Tensor, keys_as_m: bool) -> cute.Tensor:
    """A thread's registers of S^T, or of S (``keys_as_m`` false), or their coordinates, as (keys, query rows)."""
    view = rows_cols_view(t)
    return view if keys_as_m else transposed(view)


def smem_operand(thr_mma, t: cute.Tensor, as_b: bool) -> cute.Tensor:
    """WGMMA descriptors of shared-memory tensor ``t`` as ``thr_mma``'s A operand, or B with ``as_b``."""
    return thr_mma.make_fragment_B(thr_mma.partition_B(t)) if as_b else thr_mma.make_fragment_A(thr_mma.partition_A(t))


def score_coordinates(thr_sdp, tile_n: int, tile_m: int, keys_as_m: bool) -> cute.Tensor:
    """The (key, row) of each of a thread's S^T (or S) registers."""
    keys_rows = cute.make_identity_tensor((tile_n, tile_m))
    return thr_sdp.partition_C(keys_rows if keys_as_m else transposed(keys_rows))


# --8<-- [start:mask]
class KeyTileMask(WindowMask):
    """Stage 8's window rules seen from a KV tile: which Q tiles see it, and -inf in S^T elsewhere.

    ``row0`` is set per Q tile (``at``); the rules (bottom-right aligned,
    sink tokens exempt from the left bound) are stage 8's.
    """

    def __init__(self, n_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config, deterministic=False,
                 rotate=0):
        super().__init__(0, seqlen_q, seqlen_k, left, right, num_sink_tokens, config, q_tile_rows(config),
                         kv_tile_keys(config.head_dim))
        self.n_block = n_block
        self.key0 = n_block * self.tile_n
        # Deterministic and unmasked, every KV tile visits every Q tile: with ``rotate`` (the host's choice)
        # tile n starts at Q tile n mod M, so the tiles do not all queue for Q tile 0 (dq_turn).
        self.rotates = deterministic and not (config.has_left or config.has_right)
        if self.rotates:
            self.rotate = rotate
            self.q_tiles = (seqlen_q + self.tile_m - 1) // self.tile_m
            self.kv_tiles = (seqlen_k + self.tile_n - 1) // self.tile_n
            self.rotation = (n_block % self.q_tiles) * rotate

    @cute.jit
    def m_block_range(self):
        """[m_block_min, m_block_max): the Q tiles with a row that sees some key of this KV tile."""
        # TODO(stage 11): The half-open range of Q tiles holding every query row that sees at least
        #   one key of this KV tile: a row sees key j iff j < S_k and row + offset - left <= j <=
        #   row + offset + right, and a sink token (j < num_sink_tokens) ignores the left bound.
        #   Both ends in [0, number of Q tiles], min <= max; an unbounded side compiles to no code.
        #   (stage 11 page: Which Q tiles see a KV tile)
        raise NotImplementedError('TODO(stage 11) in m_block_range(): The half-open range of Q tiles holding every query row that sees at least one key of this KV tile: a row sees key j iff j < S_k and row + offset - left <= j <= row + offset + right, and a sink token (j < num_sink_tokens) ignores the left bound. Both ends in [0, number of Q tiles], min <= max; an unbounded side compiles to no code. (stage 11 page: Which Q tiles see a KV tile) Hints, one at a time: python -m course hint 11 (docs/stages/11-backward.md as raw markdown shows them all at once)')
        return m_block_min, m_block_max

    @cute.jit
    def tile_is_partial(self, m_block: cutlass.Int32):
        """Does Q tile ``m_block`` see only some keys of this KV tile? Full pairs skip the mask."""
        row0 = m_block * self.tile_m
        partial = self.key0 + self.tile_n > self.seqlen_k
        if cutlass.const_expr(self.has_right):
            partial = partial | (self.key0 + self.tile_n - 1 > row0 + self.offset + self.right)
        if cutlass.const_expr(self.has_left):
            partial = partial | (self.key0 < row0 + self.tile_m - 1 + self.offset - self.left)
        return partial

    @cute.jit
    def q_tile(self, step: cutlass.Int32, m_block_min: cutlass.Int32, n_m: cutlass.Int32):
        """The Q tile of this KV tile's ``step``-th visit (for one query head): m_block_min, m_block_min + 1, ...;
        rotated to start at ``rotation`` in the deterministic unmasked kernel."""
        m_block = m_block_min + step
        if cutlass.const_expr(self.rotates):
            m_block = m_block + self.rotation
            if m_block >= m_block_min + n_m:
                m_block = m_block - n_m
        return m_block

    @cute.jit
    def dq_turn(self, m_block: cutlass.Int32):
        """How many KV tiles add into Q tile ``m_block``'s dQ before this one, in the deterministic order:
        descending tiles, the order in which causal CTAs reach a Q tile (the kernel launches them so).

        The tiles that see a Q tile: the sink tokens' [0, sink_tiles) and the window's [first, end), where
        ``first`` holds the first row's first window key and ``end`` bounds the tiles whose m_block_range
        starts at or before ``m_block`` (the right bound). The turn counts those above this one.
        """
        end = (self.seqlen_k + self.tile_n - 1) // self.tile_n
        if cutlass.const_expr(self.has_right):
            rows_end = cutlass.min((m_block + 1) * self.tile_m, self.seqlen_q)  # a tile's first row must be before
            end = cutlass.min(end, (cutlass.max(rows_end + self.offset + self.right, 0) + self.tile_n - 1)
                              // self.tile_n)
        turn = end - 1 - self.n_block
        if cutlass.const_expr(self.has_sink_tokens):
            first = cutlass.max(m_block * self.tile_m + self.offset - self.left, 0) // self.tile_n
            sink_tiles = (self.num_sink_tokens + self.tile_n - 1) // self.tile_n
            if self.n_block < sink_tiles:  # the sink tiles above this one, then the window's
                turn = cutlass.min(sink_tiles, end) - 1 - self.n_block + cutlass.max(end - cutlass.max(first, sink_tiles), 0)
        if cutlass.const_expr(self.rotates):
            if self.rotate != 0:
                turn = self.rotated_dq_turn(m_block)
        return turn

    @cute.jit
    def rotated_dq_turn(self, m_block: cutlass.Int32):
        """dq_turn when tile n visits the Q tiles from n mod M on (M Q tiles, N KV tiles, no mask): tiles take
        their turns in the order in which they reach ``m_block``, and of two that reach it at the same step
        (N > M) the higher goes first. Tile n' reaches it at step (m_block - n') mod M."""
        m, n = self.q_tiles, self.kv_tiles
        arrival = m_block - self.rotation
        if arrival < 0:
            arrival = arrival + m
        # Earlier arrivals: the tiles n' with n' mod M in the cyclic range [m_block - arrival + 1, m_block];
        # each residue below N mod M has N // M + 1 tiles, the others N // M.
        lo = m_block - arrival + 1
        rest = n % m
        earlier = (n // m) * arrival + cutlass.max(cutlass.min(m_block + 1, rest) - cutlass.max(lo, 0), 0)
        if lo < 0:
            earlier = earlier + cutlass.max(rest - (m + lo), 0)
        return earlier + (n - 1 - self.n_block) // m

    @cute.jit
    def apply_by_key(self, s: cute.Tensor, coord: cute.Tensor, m_block: cutlass.Int32):
        """Scores to -inf where a query row may not see a key: ``s`` is S^T's or S's registers as (keys, query
        rows), ``coord`` their (key, row) (``keys_by_rows``)."""
        row0 = m_block * self.tile_m
        # a column (query row) at a time: its bounds are used by its few keys at once, then dead
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                key = self.key0 + coord[r, 0][0]
                row = row0 + coord[r, c][1]
                hidden = key >= self.seqlen_k
                if cutlass.const_expr(self.has_right):
                    hidden = hidden | (key > row + self.offset + self.right)
                if cutlass.const_expr(self.has_left):
                    hidden = hidden | self.outside_left_bound(key, row + self.offset - self.left)
                if hidden:
                    s[r, c] = -cutlass.Float32.inf
# --8<-- [end:mask]


# --8<-- [start:gradients]
@cute.jit
def probabilities_and_score_gradients(p: cute.Tensor, dp: cute.Tensor, coord: cute.Tensor,
                                      sLSE: cute.Tensor, sD: cute.Tensor, scale_log2: cutlass.Float32):
    """P^T = exp2(S^T scale_log2 - LSE_log2) into p, then dS^T = P^T (dP^T - D) into dp.

    ``p`` and ``dp`` are the registers of S^T (or S) and dP^T (or dP) as
    (keys, query rows), ``coord`` their (key, row), counted from the KV
    tile's first key and the Q tile's first row: each column's LSE (log2
    domain, +inf for a row that saw nothing) and D come from shared memory.
    The caller has waited for both products.
    """
    # TODO(stage 11): Every register of p becomes P^T = exp2(S^T * scale_log2 - LSE) and every
    #   register of dp becomes dS^T = P^T * (dP^T - D), for its own (key, query row) pair; sLSE and
    #   sD hold the Q tile's rows. The kernel has no registers to spare: a spill fails the check.
    #   (stage 11 page: The gradient of a softmax)
    raise NotImplementedError("TODO(stage 11) in probabilities_and_score_gradients(): Every register of p becomes P^T = exp2(S^T * scale_log2 - LSE) and every register of dp becomes dS^T = P^T * (dP^T - D), for its own (key, query row) pair; sLSE and sD hold the Q tile's rows. The kernel has no registers to spare: a spill fails the check. (stage 11 page: The gradient of a softmax) Hints, one at a time: python -m course hint 11 (docs/stages/11-backward.md as raw markdown shows them all at once)")
# --8<-- [end:gradients]


def row_threads(head_dim: int, vec: int = 8) -> int:
    """Threads per row of the preprocess: the most, a power of two (a shuffle adds them up), that share
    the row's 16-byte pieces evenly: 8 at D = 64, 16 at 128, 4 at 96, 2 at 80."""
    pieces = head_dim // vec
    return pieces & -pieces


# --8<-- [start:preprocess]
class Preprocess:
    """Before the main kernel, one pass over the rows: D = rowsum(dO * O) in float32 (D_v wide), the LSE in
    log2 units with +inf for a row without keys (and for the padding up to whole Q tiles: P = exp2(S - inf)
    = 0 there), and the float32 dQ sum zeroed (D floats per row of the padded rows, [B, H, S_pad * D]: the
    order within a Q tile is ``DQTile``'s, which zeroing need not know).

    CTAs of 128 threads, ``row_threads`` per row, each taking the row's 8-value (16-byte) pieces chunk,
    chunk + threads_per_row, ... (with ``head_dim_v``, the threads that share both widths evenly, and
    ``pieces_v_per_thread`` of the D_v-wide rows)."""

    vec = 8

    def __init__(self, head_dim: int, head_dim_v: int | None = None):
        head_dim_v = head_dim_v or head_dim
        self.threads_per_row = row_threads(math.gcd(head_dim, head_dim_v), self.vec)
        self.pieces_per_thread = head_dim // self.vec // self.threads_per_row
        self.pieces_v_per_thread = head_dim_v // self.vec // self.threads_per_row
        self.rows_per_cta = 128 // self.threads_per_row

    @cute.jit
    def __call__(self, mdO: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
                 mdQaccum: cute.Tensor, stream):
        grid = ((mLSE2.shape[2] + self.rows_per_cta - 1) // self.rows_per_cta, mLSE2.shape[1], mLSE2.shape[0])
        self.kernel(mdO, mO, mLSE, mLSE2, mD, mdQaccum).launch(grid=grid, block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdO: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
               mdQaccum: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        s_block, head, batch = cute.arch.block_idx()
        row = s_block * self.rows_per_cta + tidx // self.threads_per_row
        chunk = tidx % self.threads_per_row
        partial = cutlass.Float32(0.0)
        lse2 = cutlass.Float32.inf
        if row < mLSE2.shape[2]:
            zeros = cute.make_rmem_tensor(self.vec, cutlass.Float32)
            zeros.fill(0.0)
            pieces = self.pieces_per_thread * self.threads_per_row  # of a row of dQaccum
            for i in cutlass.range_constexpr(self.pieces_per_thread):
                piece = row * pieces + chunk + i * self.threads_per_row
                cute.autovec_copy(zeros, cute.local_tile(mdQaccum[batch, head, None], (self.vec,), (piece,)))
        if row < mdO.shape[1]:
            for i in cutlass.range_constexpr(self.pieces_v_per_thread):
                piece = chunk + i * self.threads_per_row
                do = cute.local_tile(mdO[batch, row, head, None], (self.vec,), (piece,)).load().to(cutlass.Float32)
                o = cute.local_tile(mO[batch, row, head, None], (self.vec,), (piece,)).load().to(cutlass.Float32)
                partial += (do * o).reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
            lse = mLSE[batch, head, row]
            if lse != -cutlass.Float32.inf:
                lse2 = lse * LOG2_E
        # Every lane reduces (a shuffle needs the whole group), rows past S_q with a partial sum of 0.
        d = cute.arch.warp_reduction_sum(partial, threads_in_group=self.threads_per_row)
        if row < mLSE2.shape[2] and chunk == 0:
            mLSE2[batch, head, row] = lse2
            mD[batch, head, row] = d


class ConvertDQ:
    """After the main kernel: dQ = softmax_scale * the float32 sum, in q's dtype. A CTA per Q tile reads the
    tile's sum in ``DQTile``'s order, each thread the values the main kernel's thread of the same index
    stored, and writes them where the same tiled MMA puts them."""

    def __init__(self, head_dim: int, tile_m: int):
        self.dq = DQTile(head_dim, tile_m)

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: cutlass.Float32, stream):
        grid = ((mdQ.shape[1] + self.dq.tile_m - 1) // self.dq.tile_m, mdQ.shape[2], mdQ.shape[0])
        self.kernel(self.dq.tiled_mma(mdQ.element_type), mdQaccum, mdQ, softmax_scale).launch(
            grid=grid, block=[128 * self.dq.wgs, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, dq_mma: cute.TiledMma, mdQaccum: cute.Tensor, mdQ: cute.Tensor,
               softmax_scale: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        dq, shape = self.dq, self.dq.shape
        thr_mma, thr_copy = dq_mma.get_slice(tidx), dq.store_copy().get_slice(tidx % 128)
        tile = cute.local_tile(mdQaccum[batch, head, None], (dq.tile_floats,), (m_block,))
        rows_left = mdQ.shape[1] - m_block * dq.tile_m
        coords = thr_mma.partition_C(cute.make_identity_tensor(shape))
        for dq_round in cutlass.range_constexpr(dq.rounds):
            acc = thr_mma.make_fragment_C(thr_mma.partition_shape_C(shape))
            round_sums = cute.make_tensor(tile.iterator + dq.offset(dq_round, 0), dq.layout())
            sums = thr_copy.partition_S(round_sums[None, tidx // 128])
            cute.autovec_copy(sums, cute.make_tensor(acc.iterator, cute.make_layout(sums.shape)))
            out = cute.make_rmem_tensor_like(acc, mdQ.element_type)
            out.store((acc.load() * softmax_scale).to(mdQ.element_type))
            gdQ = cute.local_tile(mdQ[batch, None, head, None], (dq.tile_m, dq.columns), (m_block, dq_round))
            tdQgdQ = thr_mma.partition_C(transposed(gdQ) if cutlass.const_expr(dq.transposed) else gdQ)
            if rows_left >= dq.tile_m:
                cute.autovec_copy(out, tdQgdQ)
            else:
                for i in cutlass.range_constexpr(cute.size(out)):
                    if coords[i][1 if dq.transposed else 0] < rows_left:
                        tdQgdQ[i] = out[i]
# --8<-- [end:preprocess]


def rows_layout(dtype, shape: tuple, span: int | None = None, order: tuple | None = None) -> cute.ComposedLayout:
    """A swizzled (rows, columns[, buffers]) tile, columns contiguous, of the widest atom that ``span`` columns
    (by default ``swizzle_span`` of the columns) allow; the atoms follow one another down the rows first, or
    along the columns first with ``order=(1, 0)``."""
    span = span or swizzle_span(shape[1])
    atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, span), dtype)
    return cute.tile_to_shape(atom, shape, order=order or tuple(range(len(shape))))


def bhs_as_s_h_b(t: cute.Tensor) -> cute.Tensor:
    """[B, H, S] (LSE, D) -> (S, H, B): the row mode first, as TMA indexes it."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))


class AttentionBackward:
    """dQ (a float32 sum), dK, dV of the attention stage 10 computes, for one ``prefill.KernelConfig``;
    the passes before and after it are ``preprocess`` and ``postprocess``."""

    preprocess, postprocess = Preprocess, ConvertDQ
    q_tile_rows = staticmethod(q_tile_rows)  # the host pads the LSE, D and dQ's sum to whole Q tiles, counts turns
    kv_tile_keys = staticmethod(kv_tile_keys)  # and counts KV tiles: for the launch groups, for the rotated turns

    def __init__(self, config, deterministic: bool = False):
        self.config = config
        self.deterministic = deterministic  # dQ's shares added in a fixed order (KeyTileMask.dq_turn)
        self.dtype = config.cute_dtype
        self.head_dim, self.head_dim_v = config.head_dim, config.dv
        self.tile_m = q_tile_rows(config)
        self.tile_n = kv_tile_keys(config.head_dim)
        self.row_stage = -(-self.tile_m // 32) * 32  # sLSE's and sD's stages: TMA writes to 128-byte boundaries
        # S^T with the keys as M, P^T and dS^T in registers; or S, with P and dS through shared memory (KV_TILE_KEYS)
        self.keys_as_m = keys_as_m(config.head_dim)
        self.score_shape = (self.tile_n, self.tile_m) if self.keys_as_m else (self.tile_m, self.tile_n)
        self.ds_stages = Q_STAGES if self.keys_as_m else DS_STAGES[config.head_dim, config.dv]  # of dS (and of P)
        self.dq = DQTile(config.head_dim, self.tile_m)
        assert not (LATE_DQ_HANDOFF[config.head_dim] and self.dq.rounds > 1), "dK's wait comes in round 0"
        self.mma_threads = 128 * MMA_WGS
        self.num_threads = 128 + self.mma_threads  # producer warpgroup, then the MMA warpgroups

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mD: cute.Tensor, mdQaccum: cute.Tensor, mdQturns: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 scale_log2: cutlass.Float32, softmax_scale: cutlass.Float32, window_left: cutlass.Int32,
                 window_right: cutlass.Int32, num_sink_tokens: cutlass.Int32, rotate: cutlass.Int32,
                 pairs_per_group: cutlass.Int32, stream):
        mQ, mK, mV, mdO = (bshd_as_rows_dim(t) for t in (mQ, mK, mV, mdO))
        mdK, mdV = bshd_as_rows_dim(mdK), bshd_as_rows_dim(mdV)
        mLSE, mD = bhs_as_s_h_b(mLSE), bhs_as_s_h_b(mD)
        sdp_mma, dv_mma, dk_mma, dq_mma = self.tiled_mmas()
        layouts = self.smem_layouts()
        self.define_shared_storage(*layouts)
        sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout = layouts
        one_stage = (None, None, 0)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        d, dv, tile_n = self.head_dim, self.head_dim_v, self.tile_n
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(sQ_layout, one_stage), (self.tile_m, d))
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(g2s, mdO, cute.slice_(sdO_layout, one_stage),
                                                      (self.tile_m, dv))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, (tile_n, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, (tile_n, dv))
        row_layout = cute.make_layout(self.tile_m)
        tma_lse, tma_mLSE = cpasync.make_tiled_tma_atom(g2s, mLSE, row_layout, (self.tile_m,))
        tma_d, tma_mD = cpasync.make_tiled_tma_atom(g2s, mD, row_layout, (self.tile_m,))
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_layout, (tile_n, d))
        tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_layout, (tile_n, dv))
        n_blocks = (mK.shape[0] + tile_n - 1) // tile_n
        self.kernel(
            sdp_mma, dv_mma, dk_mma, dq_mma, tma_q, tma_mQ, tma_do, tma_mdO, tma_k, tma_mK, tma_v, tma_mV,
            tma_lse, tma_mLSE, tma_d, tma_mD, mdQaccum, mdQturns, tma_dk, tma_mdK, tma_dv, tma_mdV,
            scale_log2, softmax_scale, window_left, window_right, num_sink_tokens, rotate, *layouts,
        ).launch(grid=[pairs_per_group, n_blocks, mK.shape[2] * mK.shape[3] // pairs_per_group],
                 block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)  # a register count at entry: without one ptxas may ignore setmaxnreg (C7508)

    def tiled_mmas(self):
        """(S^T = K Q^T and dP^T = V dO^T; dV += P^T dO; dK += dS^T Q; dQ = dS K) as tiled WGMMAs, or with the
        keys as N (``keys_as_m`` false): (S = Q K^T and dP = dO V^T; dV^T += dO^T P; dK^T += Q^T dS; dQ)."""
        dtype, d, dv, wg_keys = self.dtype, self.head_dim, self.head_dim_v, self.tile_n // MMA_WGS
        # Warpgroup w owns keys [wg_keys w, wg_keys (w + 1)) of the KV tile in S^T and dP^T (S and dP), and up to
        # D = 128 in dV and dK.
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        if cutlass.const_expr(self.keys_as_m):
            sdp_mma = sm90_utils.make_trivial_tiled_mma(dtype, dtype, k_major, k_major, cutlass.Float32,
                                                        (MMA_WGS, 1, 1), (64, self.tile_m))
            # P^T and dS^T from registers; dO and Q read M/N-major (head_dim contiguous)
            dv_mma, dk_mma = (sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, k_major, mn_major, cutlass.Float32, (MMA_WGS, 1, 1), (64, n),
                warpgroup.OperandSource.RMEM) for n in (dv, d))
        else:
            sdp_mma = sm90_utils.make_trivial_tiled_mma(dtype, dtype, k_major, k_major, cutlass.Float32,
                                                        (1, MMA_WGS, 1), (64, wg_keys))

            def head_dim_product(n):
                """dV^T (n = D_v) or dK^T (n = D): dO^T and Q^T read M/N-major (head_dim contiguous), P and dS
                K-major (the query rows contiguous). The warpgroups split the head dim (the M) where its halves
                are whole WGMMAs, else the keys."""
                if n // MMA_WGS % 64 == 0:
                    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, mn_major, k_major, cutlass.Float32,
                                                             (MMA_WGS, 1, 1), (64, self.tile_n))
                return sm90_utils.make_trivial_tiled_mma(dtype, dtype, mn_major, k_major, cutlass.Float32,
                                                         (1, MMA_WGS, 1), (64, wg_keys))

            dv_mma, dk_mma = head_dim_product(dv), head_dim_product(d)
        return sdp_mma, dv_mma, dk_mma, self.dq.tiled_mma(dtype)

    def smem_layouts(self):
        """Swizzled layouts: Q and dO rings, K and V, dS (M-major for dQ: a buffer per Q buffer, or with the keys
        as N one, then P's); and dQ's float32 round (``DQTile``, not swizzled)."""
        dtype, d, dv = self.dtype, self.head_dim, self.head_dim_v
        # Q and dO: K-major for S^T and dP^T (S, dP), an M/N-major operand of dK and dV (dK^T, dV^T)
        sQ_layout, sdO_layout = (rows_layout(dtype, (self.tile_m, n, stages), span=n)
                                 for n, stages in ((d, Q_STAGES), (dv, DO_STAGES[d])))
        sK_layout, sV_layout = rows_layout(dtype, (self.tile_n, d)), rows_layout(dtype, (self.tile_n, dv))
        sdS_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (self.tile_m, d, self.tile_n), dtype,
                                                   self.ds_stages * (1 if self.keys_as_m else 2))
        return sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, self.dq.layout()

    @cute.jit
    def define_shared_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout):
        dtype = self.dtype
        sLSE_layout, sD_layout = self.row_layouts()

        @cute.struct
        class SharedStorage:
            kv_bars: cute.struct.MemRange[cutlass.Int64, 2]
            q_bars: cute.struct.MemRange[cutlass.Int64, 2 * Q_STAGES]
            do_bars: cute.struct.MemRange[cutlass.Int64, 2 * DO_STAGES[self.head_dim]]
            sLSE: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sLSE_layout)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sD_layout)], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sdQ_layout)], 1024]

        self.shared_storage = SharedStorage
        one_stage = (None, None, 0)
        row_bytes = self.tile_m * 4
        self.q_bytes = cute.size_in_bytes(dtype, cute.slice_(sQ_layout, one_stage)) + row_bytes  # Q and its LSE
        self.do_bytes = cute.size_in_bytes(dtype, cute.slice_(sdO_layout, one_stage)) + row_bytes  # dO and its D
        self.kv_bytes = cute.size_in_bytes(dtype, sK_layout) + cute.size_in_bytes(dtype, sV_layout)

    @cute.kernel
    def kernel(self, sdp_mma: cute.TiledMma, dv_mma: cute.TiledMma, dk_mma: cute.TiledMma, dq_mma: cute.TiledMma,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               tma_lse: cute.CopyAtom, mLSE: cute.Tensor, tma_d: cute.CopyAtom, mD: cute.Tensor,
               mdQ: cute.Tensor, mdQturns: cute.Tensor, tma_dk: cute.CopyAtom, mdK: cute.Tensor,
               tma_dv: cute.CopyAtom, mdV: cute.Tensor, scale_log2: cutlass.Float32,
               softmax_scale: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
               num_sink_tokens: cutlass.Int32, rotate: cutlass.Int32, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdQ_layout: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        storage = SmemAllocator().allocate(self.shared_storage)
        smem = self.shared_tensors(storage, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout)
        pipes = self.make_pipelines(storage)
        if warp_idx == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_lse, tma_d, tma_dk, tma_dv):
                cpasync.prefetch_descriptor(atom)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Each role reads its coordinates after changing its register count (values live across the
        # change may be spilled).
        if warpgroup_idx > 0:
            cute.arch.setmaxregister_increase(REGISTERS[MMA_WGS][1])
            n_block, _, _ = self.tile_coordinates(mK.shape[2])
            group = mQ.shape[2] // mK.shape[2]
            self.mma(sdp_mma, dv_mma, dk_mma, dq_mma, tma_dk, mdK, tma_dv, mdV, smem, pipes, n_block, group,
                     mQ.shape[0], mK.shape[0], scale_log2, softmax_scale, window_left, window_right,
                     num_sink_tokens, rotate)
        else:
            cute.arch.setmaxregister_decrease(REGISTERS[MMA_WGS][0])
            n_block, head_kv, batch = self.tile_coordinates(mK.shape[2])
            group = mQ.shape[2] // mK.shape[2]
            if warp_idx == 0:
                self.load(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_lse, mLSE, tma_d, mD, smem, pipes,
                          n_block, head_kv, batch, group, window_left, window_right, num_sink_tokens, rotate)
            elif warp_idx == 1:
                self.store_dq(mdQ, mdQturns, smem[5], n_block, head_kv, batch, group, mQ.shape[0],
                              mK.shape[0], window_left, window_right, num_sink_tokens, rotate)

    # --8<-- [start:tile_coordinates]
    @cute.jit
    def tile_coordinates(self, kv_heads: cutlass.Int32):
        """(KV tile, KV head, batch) of this CTA. The grid is (pairs per group, KV tiles, groups) of (KV head,
        batch) pairs (the host's ``pairs_per_group``), and blocks launch with x fastest: within a group, tile 0
        of every pair, then tile 1, so under a causal mask the longest tiles of the group's pairs start first. In
        deterministic mode the tiles go from the last down: a CTA then waits for its turn
        (``KeyTileMask.dq_turn``) only on CTAs that were launched before it."""
        pair_in_group, n_block, launch_group = cute.arch.block_idx()
        pairs_per_group, n_blocks, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.deterministic):
            n_block = n_blocks - 1 - n_block
        pair = launch_group * pairs_per_group + pair_in_group
        return n_block, pair % kv_heads, pair // kv_heads
    # --8<-- [end:tile_coordinates]

    def shared_tensors(self, storage, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout):
        """sQ, sdO, sK, sV, sdS with their swizzled layouts, sdQ, then sLSE and sD (``row_layouts``)."""
        swizzled = tuple(buffer.get_tensor(layout.outer, swizzle=layout.inner) for buffer, layout in (
            (storage.sQ, sQ_layout), (storage.sdO, sdO_layout), (storage.sK, sK_layout), (storage.sV, sV_layout),
            (storage.sdS, sdS_layout)))
        sLSE_layout, sD_layout = self.row_layouts()
        return swizzled + (storage.sdQ.get_tensor(sdQ_layout), storage.sLSE.get_tensor(sLSE_layout),
                           storage.sD.get_tensor(sD_layout))

    def row_layouts(self):
        """sLSE and sD as (tile_m, stages): a float per row, in Q's ring and dO's, whose tiles they ride with."""
        return tuple(cute.make_layout((self.tile_m, stages), stride=(1, self.row_stage))
                     for stages in (Q_STAGES, DO_STAGES[self.head_dim]))

    def make_pipelines(self, storage):
        """K and V (once per CTA), Q with its LSE and dO with its D (rings of Q_STAGES and DO_STAGES)."""
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32)
        pipeline_kv = pipeline.PipelineTmaAsync.create(
            num_stages=1, producer_group=producer, consumer_group=consumers, tx_count=self.kv_bytes,
            barrier_storage=storage.kv_bars.data_ptr(), defer_sync=True)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            num_stages=Q_STAGES, producer_group=producer, consumer_group=consumers, tx_count=self.q_bytes,
            barrier_storage=storage.q_bars.data_ptr(), defer_sync=True)
        pipeline_do = pipeline.PipelineTmaAsync.create(
            num_stages=DO_STAGES[self.head_dim], producer_group=producer, consumer_group=consumers,
            tx_count=self.do_bytes,
            barrier_storage=storage.do_bars.data_ptr(), defer_sync=True)
        return pipeline_kv, pipeline_q, pipeline_do

    def key_tile_mask(self, n_block, seqlen_q, seqlen_k, window_left, window_right, num_sink_tokens, rotate):
        return KeyTileMask(n_block, seqlen_q, seqlen_k, window_left, window_right, num_sink_tokens, self.config,
                           self.deterministic, rotate)

    # --8<-- [start:producer]
    @cute.jit
    def load(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_lse, mLSE, tma_d, mD, smem, pipes,
             n_block: cutlass.Int32, head_kv: cutlass.Int32, batch: cutlass.Int32, group: cutlass.Int32,
             window_left: cutlass.Int32, window_right: cutlass.Int32, num_sink_tokens: cutlass.Int32,
             rotate: cutlass.Int32):
        """The producer warp: this CTA's K and V, then Q, LSE, dO, D of every step, two steps ahead."""
        sQ, sdO, sK, sV, _, _, sLSE, sD = smem
        pipeline_kv, pipeline_q, pipeline_do = pipes
        d, dv = self.head_dim, self.head_dim_v
        one_cta = cute.make_layout(1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, dv), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        pipeline_kv.producer_acquire(kv_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        kv_state.advance()

        mask = self.key_tile_mask(n_block, mQ.shape[0], mK.shape[0], window_left, window_right, num_sink_tokens,
                                  rotate)
        m_block_min, m_block_max = mask.m_block_range()
        n_m = m_block_max - m_block_min
        q_tile = mask.q_tile
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, Q_STAGES)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, DO_STAGES[d])

        for step in cutlass.range(group * n_m, unroll=1):
            head = head_kv * group + step // n_m
            m_block = q_tile(step % n_m, m_block_min, n_m)
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, dv), (None, 0))
            gLSE = cute.local_tile(mLSE[None, head, batch], (self.tile_m,), (None,))
            gD = cute.local_tile(mD[None, head, batch], (self.tile_m,), (None,))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_do, 0, one_cta, cute.group_modes(sdO, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(tma_lse, 0, one_cta, cute.group_modes(sLSE, 0, 1),
                                               cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma_d, 0, one_cta, cute.group_modes(sD, 0, 1),
                                               cute.group_modes(gD, 0, 1))
            pipeline_q.producer_acquire(q_state)
            bar = pipeline_q.producer_get_barrier(q_state)
            cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, q_state.index], tma_bar_ptr=bar)
            cute.copy(tma_lse, tLgL[None, m_block], tLsL[None, q_state.index], tma_bar_ptr=bar)
            q_state.advance()
            pipeline_do.producer_acquire(do_state)
            bar = pipeline_do.producer_get_barrier(do_state)
            cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, do_state.index], tma_bar_ptr=bar)
            cute.copy(tma_d, tDgD[None, m_block], tDsD[None, do_state.index], tma_bar_ptr=bar)
            do_state.advance()
        pipeline_kv.producer_tail(kv_state)
        pipeline_q.producer_tail(q_state)
        pipeline_do.producer_tail(do_state)
    # --8<-- [end:producer]

    # --8<-- [start:dq_warp]
    @cute.jit
    def store_dq(self, mdQ, mdQturns, sdQ, n_block: cutlass.Int32, head_kv: cutlass.Int32,
                 batch: cutlass.Int32, group: cutlass.Int32, seqlen_q: cutlass.Int32, seqlen_k: cutlass.Int32,
                 window_left: cutlass.Int32, window_right: cutlass.Int32, num_sink_tokens: cutlass.Int32,
                 rotate: cutlass.Int32):
        """The dQ warp: every step, each dQ warpgroup's part of the tile into the float32 sum, a bulk reduce-add
        per part (per part of each round, ``DQ_ROUNDS``). The MMA warpgroups only wait for their part's buffer;
        the adds, and in deterministic mode the turns, are this warp's."""
        dq = self.dq
        mask = self.key_tile_mask(n_block, seqlen_q, seqlen_k, window_left, window_right, num_sink_tokens, rotate)
        m_block_min, m_block_max = mask.m_block_range()
        n_m = m_block_max - m_block_min
        q_tile, dq_turn = mask.q_tile, mask.dq_turn
        # DQTile.offset of each part, as a list: a run-time loop cannot carry the DQTile itself
        part_offsets = [[dq.offset(dq_round, wg) for wg in range(dq.wgs)] for dq_round in range(dq.rounds)]
        for step in cutlass.range(group * n_m, unroll=1):
            head = head_kv * group + step // n_m
            m_block = q_tile(step % n_m, m_block_min, n_m)
            for dq_round in cutlass.range_constexpr(dq.rounds):
                for wg in cutlass.range_constexpr(dq.wgs):
                    # Part wg's last add (the groups complete in order) has read its buffer: hand it back.
                    cute.arch.cp_async_bulk_wait_group(dq.wgs - 1 - wg, read=True)
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY) + wg,
                                             number_of_threads=DQ_PART_THREADS)
                if cutlass.const_expr(dq_round == 0):
                    tile = cute.local_tile(mdQ[batch, head, None], (dq.tile_floats,), (m_block,))
                    if cutlass.const_expr(self.deterministic):
                        turns = mdQturns.iterator + cute.crd2idx((batch, head, m_block), mdQturns.layout)
                        wait_for_turn(turns, dq_turn(m_block))
                for wg in cutlass.range_constexpr(dq.wgs):
                    cute.arch.barrier(barrier_id=int(Barrier.DQ_FULL) + wg, number_of_threads=DQ_PART_THREADS)
                    with cute.arch.elect_one():
                        bulk_reduce_add_f32(sdQ[None, wg].iterator, tile.iterator + part_offsets[dq_round][wg],
                                            dq.part_floats * 4)
                    cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                # The next tile's turn comes when this one's adds have landed, not only read shared memory.
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                pass_turn(turns)
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # the buffers outlive every add that reads them
    # --8<-- [end:dq_warp]

    # --8<-- [start:consumer]
    @cute.jit
    def mma(self, sdp_mma, dv_mma, dk_mma, dq_mma, tma_dk, mdK, tma_dv, mdV, smem, pipes,
            n_block: cutlass.Int32, group: cutlass.Int32, seqlen_q: cutlass.Int32, seqlen_k: cutlass.Int32,
            scale_log2: cutlass.Float32, softmax_scale: cutlass.Float32, window_left: cutlass.Int32,
            window_right: cutlass.Int32, num_sink_tokens: cutlass.Int32, rotate: cutlass.Int32):
        """The two MMA warpgroups: every step's five products; dK and dV at the end."""
        sQ, sdO, sK, sV, sdS, sdQ, sLSE, sD = smem
        pipeline_kv, pipeline_q, pipeline_do = pipes
        d = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        mma_tidx = tidx - 128
        mma_wg = cute.arch.make_warp_uniform(mma_tidx // 128)
        # Operands in shared memory are a whole warpgroup's: sliced at the warpgroup's first thread, a
        # warp-uniform index, their WGMMA descriptors are computed once, in uniform registers.
        wg_thread0 = mma_wg * 128
        thr_sdp = sdp_mma.get_slice(mma_tidx)
        thr_sdp_wg = sdp_mma.get_slice(wg_thread0)
        # K and V the A operands of S^T and dP^T, Q and dO (MMA, N, K, stages) the B ones; or the other way round
        tSrK, tSrV = (smem_operand(thr_sdp_wg, t, not self.keys_as_m) for t in (sK, sV))
        tSrQ, tSrdO = (smem_operand(thr_sdp_wg, t, self.keys_as_m) for t in (sQ, sdO))
        acc_St = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C(self.score_shape))
        acc_dPt = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C(self.score_shape))
        tStcSt = score_coordinates(thr_sdp, self.tile_n, self.tile_m, self.keys_as_m)
        # dS^T (and P^T) into the rows-contiguous dS buffers by stmatrix: per instruction four 8x8 blocks, 16 bytes
        # a lane; dS and P (the keys as N) by the transposing stmatrix.
        ds_store = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR if self.keys_as_m else LayoutEnum.COL_MAJOR,
                                                self.dtype, cutlass.Float32)
        thr_ds = cute.make_tiled_copy_C(ds_store, sdp_mma).get_slice(mma_tidx)
        tdSsdS = thr_ds.partition_D(transposed(sdS) if self.keys_as_m else sdS)  # (CPY, CPY_M, CPY_N, buffers)
        thr_dv, thr_dk = dv_mma.get_slice(mma_tidx), dk_mma.get_slice(mma_tidx)
        thr_dv_wg, thr_dk_wg = dv_mma.get_slice(wg_thread0), dk_mma.get_slice(wg_thread0)
        # dO^T and Q^T: (head_dim, rows); the B operands of dV and dK, or the A operands of dV^T and dK^T
        tdVrdO = smem_operand(thr_dv_wg, transposed(sdO), self.keys_as_m)
        tdKrQ = smem_operand(thr_dk_wg, transposed(sQ), self.keys_as_m)
        sdK, sdV = self.gradient_tiles(sK, sV)
        acc_dV = thr_dv.make_fragment_C(thr_dv.partition_shape_C(sdV.shape))
        acc_dK = thr_dk.make_fragment_C(thr_dk.partition_shape_C(sdK.shape))
        dq = self.dq
        dq_threads = 128 * dq.wgs
        computes_dq = mma_tidx < dq_threads if dq.wgs < MMA_WGS else True  # every warpgroup, or the first
        thr_dq = dq_mma.get_slice(mma_tidx % dq_threads)
        thr_dq_wg = dq_mma.get_slice(wg_thread0 % dq_threads)
        # dS: (rows, K = keys, buffers); K^T: (dQ's columns of a round, K = keys), per round. dQ = dS K takes dS
        # as A, K^T as B; dQ^T = K^T dS^T the other way round.
        ds_is_b = dq.transposed
        tdQrdS = smem_operand(thr_dq_wg, sdS, ds_is_b)
        tdQrK = [smem_operand(thr_dq_wg, cute.local_tile(transposed(sK), (dq.columns, self.tile_n), (dq_round, 0)),
                         not ds_is_b) for dq_round in range(dq.rounds)]
        acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C(dq.shape))
        # this warpgroup's part (a warp-uniform index: the part's address is computed once, in uniform registers)
        tdQsdQ = dq.store_copy().get_slice(mma_tidx % 128).partition_D(sdQ[None, mma_wg % dq.wgs])
        tdQrdQ = cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape))  # in the order held
        # P^T and dS^T in 16 bits, in the registers' order of S^T (stage 8's P): the A operands of dV and dK; or P
        # and dS stored for dV^T and dK^T, which read them as (keys, rows): dS's ds_stages buffers, then P's
        rP = cute.make_rmem_tensor_like(acc_St, self.dtype)
        rdS = cute.make_rmem_tensor_like(acc_dPt, self.dtype)
        tdSrP, tdSrdS = thr_ds.retile(rP), thr_ds.retile(rdS)
        if cutlass.const_expr(self.keys_as_m):
            tdVrP = cute.make_tensor(rP.iterator, acc_layout_as_operand_a(rP.layout))
            tdKrdS = cute.make_tensor(rdS.iterator, acc_layout_as_operand_a(rdS.layout))
        else:
            tdVrP = smem_operand(thr_dv_wg, transposed(sdS), True)  # (MMA, N, K, buffers)
            tdKrdS = smem_operand(thr_dk_wg, transposed(sdS), True)

        mask = self.key_tile_mask(n_block, seqlen_q, seqlen_k, window_left, window_right, num_sink_tokens, rotate)
        m_block_min, m_block_max = mask.m_block_range()
        n_m = m_block_max - m_block_min
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, Q_STAGES)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, DO_STAGES[d])
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        pipeline_kv.consumer_wait(kv_state)
        tile_is_partial = mask.tile_is_partial
        apply_mask = mask.apply_by_key
        q_tile = mask.q_tile
        s_by_key, dp_by_key, coord_by_key = (keys_by_rows(t, self.keys_as_m) for t in (acc_St, acc_dPt, tStcSt))
        for step in cutlass.range(group * n_m, unroll=1):
            m_block = q_tile(step % n_m, m_block_min, n_m)
            q, o = q_state.index, do_state.index
            pipeline_q.consumer_wait(q_state)
            self.scores_product(sdp_mma, acc_St, tSrK, tSrQ[None, None, None, q])
            pipeline_do.consumer_wait(do_state)
            self.scores_product(sdp_mma, acc_dPt, tSrV, tSrdO[None, None, None, o])
            warpgroup.wait_group(1)  # S^T is ready; dP^T may still run
            if tile_is_partial(m_block):
                apply_mask(s_by_key, coord_by_key, m_block)
            warpgroup.wait_group(0)
            probabilities_and_score_gradients(s_by_key, dp_by_key, coord_by_key, sLSE[None, q], sD[None, o],
                                              scale_log2)
            rP.store(acc_St.load().to(self.dtype))
            rdS.store(acc_dPt.load().to(self.dtype))
            # dS^T (or P and dS) to shared memory, in the buffer of Q's: its last readers, both warpgroups' MMAs
            # two steps back, were complete before the other warpgroup reached the last step's DS_READY. With one
            # buffer each (DS_STAGES), the last step's: both warpgroups must have passed its end.
            ds = q if cutlass.const_expr(self.ds_stages == Q_STAGES) else 0
            if cutlass.const_expr(self.keys_as_m):
                dS_t = tdKrdS
                warpgroup_gemm(dv_mma, acc_dV, tdVrP, tdVrdO[None, None, None, o], zero_init=False)
                cute.copy(ds_store, tdSrdS, ring_buffer(tdSsdS, q))
            elif cutlass.const_expr(self.ds_stages == Q_STAGES):
                dS_t = tdKrdS[None, None, None, q]
                cute.copy(ds_store, tdSrP, ring_buffer(tdSsdS, Q_STAGES + q))
                cute.copy(ds_store, tdSrdS, ring_buffer(tdSsdS, q))
            else:
                dS_t = tdKrdS[None, None, None, 0]
                cute.arch.barrier(barrier_id=int(Barrier.DS_EMPTY), number_of_threads=self.mma_threads)
                cute.copy(ds_store, tdSrP, tdSsdS[None, None, None, 1])
                cute.copy(ds_store, tdSrdS, tdSsdS[None, None, None, 0])
            cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy stores, then WGMMA reads
            cute.arch.barrier(barrier_id=int(Barrier.DS_READY), number_of_threads=self.mma_threads)
            if cutlass.const_expr(not self.keys_as_m):
                warpgroup_gemm(dv_mma, acc_dV, tdVrdO[None, None, None, o],
                               tdVrP[None, None, None, self.ds_stages + ds], zero_init=False)
            if computes_dq:
                for dq_round in cutlass.range_constexpr(dq.rounds):
                    if cutlass.const_expr(dq.transposed):
                        warpgroup_gemm(dq_mma, acc_dQ, tdQrK[dq_round], tdQrdS[None, None, None, ds])
                    else:
                        warpgroup_gemm(dq_mma, acc_dQ, tdQrdS[None, None, None, ds], tdQrK[dq_round])
                    if cutlass.const_expr(dq_round == 0):
                        self.dk_product(dk_mma, acc_dK, dS_t, tdKrQ[None, None, None, q])
                    # dQ into this warpgroup's part of the buffer while dK's MMAs run; the dQ warp adds it.
                    warpgroup.wait_group(1 if dq_round == 0 else 0)
                    if cutlass.const_expr(dq_round == 0 and DO_STAGES[d] == 1):
                        pipeline_do.consumer_release(do_state)  # dV's product, dO's last reader, is done
                    cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY) + mma_wg, number_of_threads=DQ_PART_THREADS)
                    cute.autovec_copy(tdQrdQ, tdQsdQ)
                    if cutlass.const_expr(LATE_DQ_HANDOFF[d]):
                        warpgroup.wait_group(0)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL) + mma_wg,
                                             number_of_threads=DQ_PART_THREADS)
                warpgroup.wait_group(0)
            else:  # each branch waits for its own MMAs: ptxas serializes them all if a wait spans the two
                self.dk_product(dk_mma, acc_dK, dS_t, tdKrQ[None, None, None, q])
                warpgroup.wait_group(0)
            pipeline_q.consumer_release(q_state)
            if cutlass.const_expr(DO_STAGES[d] > 1):
                pipeline_do.consumer_release(do_state)
            q_state.advance()
            do_state.advance()
        self.store_dk_dv(acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV, thr_dk, thr_dv, mma_tidx, softmax_scale)
        pipeline_kv.consumer_release(kv_state)
    # --8<-- [end:consumer]

    def gradient_tiles(self, sK, sV):
        """dK's and dV's tiles in K's and V's shared memory (the epilogue stores them there), as their products
        hold them: (keys, head dim), or (head dim, keys) with the keys as N."""
        return (sK, sV) if self.keys_as_m else (transposed(sK), transposed(sV))

    def scores_product(self, sdp_mma, acc, keys, rows):
        """S^T = K Q^T (dP^T = V dO^T), or S = Q K^T (dP = dO V^T) with the keys as N."""
        if self.keys_as_m:
            warpgroup_gemm(sdp_mma, acc, keys, rows)
        else:
            warpgroup_gemm(sdp_mma, acc, rows, keys)

    def dk_product(self, dk_mma, acc_dK, dS, Q):
        """dK += dS^T Q, or dK^T += Q^T dS with the keys as N."""
        if self.keys_as_m:
            warpgroup_gemm(dk_mma, acc_dK, dS, Q, zero_init=False)
        else:
            warpgroup_gemm(dk_mma, acc_dK, Q, dS, zero_init=False)

    @cute.jit
    def store_dk_dv(self, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV, thr_dk, thr_dv, mma_tidx,
                    softmax_scale: cutlass.Float32):
        """dK (times softmax_scale) and dV to 16 bits, into K's and V's shared memory, then TMA stores
        (rows past S_k are clipped by the TMA unit). The tile's head and batch are worked out again here: kept
        across the steps they would take registers the MMA warpgroups do not have to spare."""
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        rdK.store((acc_dK.load() * softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.mma_threads)  # K, V read
        sdK, sdV = self.gradient_tiles(sK, sV)
        cute.autovec_copy(rdK, thr_dk.partition_C(sdK))
        cute.autovec_copy(rdV, thr_dv.partition_C(sdV))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.mma_threads)
        if mma_tidx < 32:
            n_block, head_kv, batch = self.tile_coordinates(mdK.shape[2])
            one_cta = cute.make_layout(1)
            gdK = cute.local_tile(mdK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
            gdV = cute.local_tile(mdV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (n_block, 0))
            bsK, bgK = cpasync.tma_partition(tma_dk, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gdK, 0, 2))
            bsV, bgV = cpasync.tma_partition(tma_dv, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gdV, 0, 2))
            cute.copy(tma_dk, bsK, bgK)
            cute.copy(tma_dv, bsV, bgV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the stores have read K's and V's buffers


KERNEL_CONFIGS = backward.kernel_configs()


def cross_compile_config(config, keep: bool = False, deterministic: bool = False):
    """Compile for sm_90a on any machine (no GPU needed) and report registers, smem, spills."""
    return backward.cross_compile_config(AttentionBackward, config, stage=STAGE, deterministic=deterministic,
                                         keep=keep)


def attention_backward(do, q, k, v, o, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                       sink_logits=None, num_sink_tokens=0, dq=None, dk=None, dv=None, deterministic=False):
    """dQ, dK, dV (and dsink with ``sink_logits``) of ``attention`` on [B, S, H, D]; see docs/contract.md.

    ``o`` and ``lse`` are the forward's (``attention(..., return_lse=True)``). ``deterministic=True`` adds
    the KV tiles' dQ shares in a fixed order, so equal inputs give bit-identical gradients.
    """
    return backward.attention_backward(AttentionBackward, do, q, k, v, o, lse, softmax_scale=softmax_scale,
                                       causal=causal, window_size=window_size, sink_logits=sink_logits,
                                       num_sink_tokens=num_sink_tokens, dq=dq, dk=dk, dv=dv,
                                       deterministic=deterministic)


if __name__ == "__main__":
    import torch

    from course.testing import demo

    demo.backward(attention, attention_backward, window_size=(128, 0), num_sink_tokens=4,
                  sink_logits=torch.linspace(-2, 2, 8, device="cuda"))
