"""Stage 9: decode on tensor cores (GQA packing) and an FP8 KV cache.

Compared with stage 7, this stage moves decode's dot products onto the
tensor cores, with all the query heads of a KV head packed into the rows of
one warp-level MMA, and reads an FP8 (e4m3) cache, because at 8 and more
query heads per KV head stage 7's CUDA-core math, not memory, is the limit
(its results on the page trail cuDNN there), and in a memory-bound kernel
half the bytes per token is the biggest lever left.

Everything around the math is stage 7's: one CTA per (sequence, KV head,
split), K and V copied with cp.async into a shared-memory ring, STAGES - 1
iterations ahead; visible keys enumerated directly (sink tokens, then the
window); the split's partial written to an fp32 workspace and merged by the
CTA that arrives last on a per-(sequence, KV head) counter, which it resets
for the next launch. What changes:

1. GQA packing: the group's query heads are the 16 rows (M) of
   ``mma.sync.m16n8k16``; a group of G <= 16 heads is one CTA (rows G..15
   compute and are never stored). Each of the CTA's 4 warps (8 when the
   launch has at most one CTA per SM) takes its own 16 keys per iteration:
   S = Q K^T is 2 MMAs per 16 columns of D (K's 8 keys are N), P V is one
   MMA per 8 columns of D (the 16 keys are K), and P never leaves the
   registers: the MMA's accumulator layout for S is its operand layout for P.
   A larger group takes ceil(G / 16) such CTAs, consecutive in the grid so
   that they read each split's keys together through L2, or, when the launch
   fills the GPU, one CTA of 2 or 4 row tiles (a warp, or with 8 warps two, per 16
   heads, each reading all of its key group's keys), so that K and V are
   read once.
2. Whole-row copies, fragment-order reads: each warp copies its 16 keys' K
   and V rows whole (lane l copies 16-byte chunk l % chunks of a row, so
   every copy instruction reads whole rows, like stage 7's) into its own
   tiles [16 rows, chunks, 16 bytes] of the ring, with an XOR swizzle of the
   chunk index so that each fragment read (8 lanes, one 128-byte wavefront)
   hits 8 different bank groups; one ``sync_warp`` per iteration, after the
   wait, before the reads (rows other lanes copied) and the refill of the
   stage the last iteration read. Then, since a dot product may
   visit D in any order and P V the keys in any order, each thread reads
   exactly the K and V elements its MMA fragments hold into compact
   fragments; Q is loaded once in the same order. (Copying only each lane's
   own fragment elements made L2 serve K rows in 64-byte half lines, at a
   low L2 hit rate: the page measures both.) At
   D = 256, Q's fragment waits in shared memory and P V runs in two halves,
   to fit the registers.
3. FP8: the cache holds K / k_scale and V / v_scale in e4m3. The pieces are
   converted to fp16 in registers (e4m3 -> f16 is exact), k_scale is folded
   into the softmax scale and v_scale into the split's output: two multiplies
   per row, none per element. The bytes per token halve.
4. The split count comes from B x H_kv x ceil(G / 16) CTAs, not from H_q, and
   aims at one (sequence, KV head) stream per SM, so one MQA sequence gets
   about 128 splits. Such a launch, one CTA per SM, takes CTAs of 8 warps:
   a lone warp per scheduler spends most of its time waiting. So does a
   launch with row tiles, whose split count then fills one CTA per SM.
5. Two levels of last CTAs: the splits form groups of SPLITS_PER_GROUP; the
   last CTA of each group folds the group's partials into one, and the last
   of those folds the groups into O. With one combining CTA, the partials of
   128 splits took longer to fold than the cache took to read.
6. A lazy running max: a warp moves its max only when a score exceeds it by
   more than RESCALE_THRESHOLD (in log2 units), so most iterations skip the
   rescale of O, and with it a share of a warp's instructions per 16 keys
   ("Skipping the rescale" on the page counts them).

Run it:
    python -m course check 9 --impl solutions   # this stage's tests
    python -m solutions.stage09_tc_decode       # one launch against the reference (needs a Hopper GPU)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import LoadCacheMode, cpasync, warp
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator

from course.runtime import launch, validation
from course.runtime.compile import cross_compile, cute_dtype, symbolic_tensor

# Stage 7's split-KV machinery, unchanged: the visible keys and their cache rows, a split's partial
# result, the arrival on the counter, and folding partials (and the sink) into O.
from .stage07_decode import (  # noqa: F401
    arrive_and_elect_last,
    cache_row,
    finish_combine,
    fold_in_split,
    pool_page,
    split_partial,
    visible_key_range,
    visible_keys_of,
)

STAGE = 9
# --8<-- [start:computed_head_dim]
# (D_qk, D_v): (192, 128) is DeepSeek-V2/V3's MLA with its K and V expanded, as transformers runs it.
HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))
# The head dim the kernel computes Q, K and V with, by D_qk: 80 and 96 (Phi-2, Phi-3) as 128, 192 as 256,
# the extra columns (and V's past D_v) zeros in shared memory and registers, never read from or written to memory.
COMPUTED_HEAD_DIM = {64: 64, 80: 128, 96: 128, 128: 128, 192: 256, 256: 256}
# --8<-- [end:computed_head_dim]
PAGE_SIZES = (16, 32, 64, 128, 256)  # powers of two: a row's page and slot are a shift and a mask;
# one paged kernel takes them all (the page size is a runtime extent of the cache)
CACHE_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "int8")
QUANTIZED = ("float8_e4m3fn", "int8")  # caches that hold K / k_scale and V / v_scale
# RoPE: none, pairs (i, i + rotary_dim / 2) as GPT-NeoX, Llama and GPT-OSS rotate, or (2i, 2i + 1) as GPT-J.
ROTARY = ("", "halves", "interleaved")
ROWS = 16  # query heads of one row tile: the M of mma.sync.m16n8k16
ROW_TILES = (1, 2, 4)  # row tiles per CTA (row_tiles()): the compiled variants
WARPS = (4, 8)  # warps per CTA (pick_warps()): the compiled variants
KEYS_PER_WARP = 16  # keys a warp takes per loop iteration: 2 MMA columns blocks (N = 8) of S, one K block of P V
# Iterations of K/V in flight: each warp copies the next STAGES - 1 iterations' rows into its tiles
# of a shared-memory ring with cp.async while it computes.
STAGES = 3
COPIES_UNROLLED = 8  # issue_loads' copies unrolled at once (a lane has 16 at D = 256: a runtime loop of 2)
SHARED_BYTES_PER_SM = 228 * 1024  # H100 (sm_90)
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# The automatic split count, measured on the H100 (stage 9's engineering notes, "How many splits"):
# for few sequences one (sequence, KV head) stream per SM, as 132 streaming CTAs already outrun HBM
# (stage 7 aims at 2 CTAs), and no split under 4 loop iterations, whose fixed
# cost (the first copies' latency, the merge, the arrival) a shorter split does not repay.
MIN_KEYS_PER_SPLIT = 256
# Short sequences (fewer than SHORT_SPLITS splits of MIN_KEYS_PER_SPLIT keys): splits of one 8-warp
# iteration, as a sequence of 1024 keys finishes sooner in 8 one-iteration splits than in 4 of two.
SHORT_SPLIT_KEYS, SHORT_SPLITS = 128, 8
# Row tiles (one CTA for up to 64 heads) give each warp 1, 2 or 4 times the math per key: they pay
# when the launch fills every CTA slot with splits of at least this many keys (measured on the H100,
# "Row tiles" in the notes); with fewer, ceil(G / 16) CTAs of one tile, 4x the warps, finish sooner.
MIN_KEYS_PER_TILED_SPLIT = 2048
SPLIT_CTAS_PER_SM = 1
# Splits whose partials the last CTA of their group folds first: the final combine then reads
# SPLITS_PER_GROUP + num_splits / SPLITS_PER_GROUP partials instead of num_splits.
SPLITS_PER_GROUP = 16
# A warp's running max moves only when a new score exceeds it by more than this (log2 units), so most
# iterations skip rescaling O (online_softmax_update); a numerator exp2(s - max) stays below 2^8.
RESCALE_THRESHOLD = 8.0
# A lane's copies of 16 consecutive cache rows step from one address by a 32-bit offset of up to 16
# token strides (lane_copies): token strides from 2**27 elements on are rejected before launch.
MAX_TOKEN_STRIDE = 2**27
# The most registers ptxas uses (sm_90a, any config), by (head dim, cache bytes per element).
REGISTERS_PER_THREAD = {(64, 2): 166, (128, 2): 255, (256, 2): 255, (64, 1): 168, (128, 1): 226, (256, 1): 254}


def cache_bytes(cache_dtype: str) -> int:
    return 1 if cache_dtype in QUANTIZED else 2


def k_piece(cache_dtype: str) -> int:
    """Elements of one 16-byte piece of a K row: 8 (fp16, bf16) or 16 (fp8, int8)."""
    return 16 // cache_bytes(cache_dtype)


def v_piece(cache_dtype: str, head_dim: int) -> int:
    """Elements of one piece of a V row: a thread holds D / 8 of them, 16 bytes at most at a time."""
    return min(16 // cache_bytes(cache_dtype), head_dim // 8)


# --8<-- [start:row_tiles]
def row_tiles(group_size: int, head_dim: int = 128) -> int:
    """The most row tiles of 16 heads one CTA can compute, each on warps / row_tiles of its warps: 1 up
    to 16 heads, 2 up to 32, else 4, so that a group of up to 64 heads reads K and V once. At D = 256
    always 1: the warp's slice loop would spill and Q's fragments fill shared memory."""
    if head_dim > 128:
        return 1
    tiles = -(-group_size // ROWS)
    return tiles if tiles <= 2 else max(ROW_TILES)


def head_chunks(group_size: int, tiles: int) -> int:
    """CTAs (per split) that one KV head's group of query heads takes with ``tiles`` row tiles each."""
    return -(-group_size // (ROWS * tiles))


def pick_row_tiles(batch: int, heads_kv: int, group_size: int, max_keys: int, num_sms: int, head_dim: int = 128,
                   cache_dtype: str = "float16") -> int:
    """The row tiles a launch uses: row_tiles(G, D) when its streams, cut into splits of at least
    MIN_KEYS_PER_TILED_SPLIT keys, fill every CTA slot of the GPU; else 1.

    The ceil(G / 16) CTAs of one tile each read the same keys, side by side
    (the grid makes them consecutive CTAs), so L2 serves most repeats and 4
    times the warps work on the same keys: they win while the GPU has CTA
    slots to spare. With a full GPU the repeats cost, and one CTA of up to 4
    tiles reads K and V once. An FP8 cache follows the same rule. "Row tiles"
    on the page has the measurements behind the threshold.
    """
    tiles = row_tiles(group_size, head_dim)
    if tiles == 1:
        return 1
    streams = batch * heads_kv * head_chunks(group_size, tiles)
    slots = num_sms * ctas_per_sm(head_dim, cache_dtype, tiles)
    return tiles if streams * (max_keys // MIN_KEYS_PER_TILED_SPLIT) >= slots else 1
# --8<-- [end:row_tiles]


def keys_per_iteration(warps: int) -> int:
    """Keys one loop iteration of a CTA reads: 16 per warp."""
    return warps * KEYS_PER_WARP


def work_bytes(head_dim: int, cache_dtype: str, warps: int = 4) -> int:
    """Shared memory for the cp.async ring, reused by the merge: the larger of the two.

    The ring holds STAGES iterations of every warp's 16 keys (K and V rows);
    the merge holds every warp's max, sum and O rows (fp32) for its 16 heads.
    """
    ring = STAGES * keys_per_iteration(warps) * 2 * head_dim * cache_bytes(cache_dtype)
    merge = 4 * warps * ROWS * (head_dim + 2)
    return max(ring, merge)


def q_fragment_bytes(head_dim: int, tiles: int = 1) -> int:
    """Shared memory for Q's MMA fragments (D > 128 only): per row tile, 32 lanes x D / 2 values of 2 bytes."""
    return 32 * head_dim * tiles if head_dim > 128 else 4


def combine_loads(head_dim: int, warps: int = 4) -> tuple[int, int]:
    """(items, slots): a combining thread folds that many of its (head, 4 columns) items at once,
    each over that many slots per round: all its items with 16 16-byte loads in flight at D <= 128
    (4 items at D = 128 with 4 warps, 2 at D = 64); at D = 256 one item at a time over 8 slots, as
    more would spill: the MMA fragments hold most of the registers."""
    if head_dim > 128:
        return 1, 8
    items = ROWS * head_dim // 4 // (32 * warps)
    return items, 16 // items


# --8<-- [start:split_ranges]
def split_range(num_visible: int, num_splits: int, split: int, warps: int = 4) -> tuple[int, int]:
    """[begin, end) of the visible keys (in enumeration order) that ``split`` reads.

    The visible keys are cut into ``num_splits`` equal chunks, each rounded up
    to whole loop iterations (16 keys per warp); splits past the end get an
    empty range. The kernel computes exactly this.
    """
    step = keys_per_iteration(warps)
    chunk = -(-num_visible // num_splits)
    chunk = -(-chunk // step) * step
    begin = min(split * chunk, num_visible)
    return begin, min(begin + chunk, num_visible)
# --8<-- [end:split_ranges]


# --8<-- [start:split_groups]
def split_groups(num_splits: int) -> int:
    """Groups of SPLITS_PER_GROUP splits whose last CTAs fold them before the final combine."""
    return -(-num_splits // SPLITS_PER_GROUP)


def workspace_slots(num_splits: int) -> int:
    """Partials the fp32 workspace holds per head: one per split, then one per group when there are
    several groups (a single group's last CTA writes O directly)."""
    groups = split_groups(num_splits)
    return num_splits + (groups if groups > 1 else 0)
# --8<-- [end:split_groups]


# --8<-- [start:fragments]
# Which keys and columns a thread's MMA fragments hold (lane = 4 * g + kq, g = lane // 4, kq = lane % 4).
# m16n8k16 gives thread (g, kq): of A (16 x 16), rows g and g + 8, columns 2kq, 2kq + 1, 2kq + 8, 2kq + 9;
# of B (16 x 8), column g, rows 2kq, 2kq + 1, 2kq + 8, 2kq + 9; of C (16 x 8), rows g and g + 8,
# columns 2kq and 2kq + 1.
def v_slot_key(slot: int, kq):
    """The key (0..15 of the warp's 16) that value ``slot`` of a thread's V fragment holds: P V's B
    operand rows 2kq, 2kq + 1, 8 + 2kq, 8 + 2kq + 1 (P's columns in this thread)."""
    return 8 * (slot // 2) + 2 * kq + slot % 2


def swizzle(row, chunks: int):
    """Where 16-byte chunk c of tile row ``row`` lives: chunk c ^ swizzle(row).

    The fragments read 8 lanes at a time (one shared-memory wavefront of 128
    bytes): K reads rows g, g + 1 at chunks 4p + kq; V reads rows 2kq (+ 1)
    at chunk 8p + g. Bit 2 of the XOR separates rows 2i and 2i + 1, bits 1-2
    separate rows 0, 2, 4, 6: every wavefront hits 8 different bank groups.
    """
    return (((row & 1) << 2) ^ (((row >> 1) & 3) << 1)) & (chunks - 1)


def score_key(value: int, kq):
    """The key (0..15) of value ``value`` of a thread's S fragment ((2, 2), 1, 2): C columns 2kq, 2kq + 1."""
    return 8 * (value // 4) + 2 * kq + value % 2


def score_row(value: int) -> int:
    """0 for the thread's head g, 1 for head g + 8 (C rows)."""
    return (value // 2) % 2


def o_column(value: int, kq, v_piece_elems: int):
    """The head-dim column of value ``value`` of a thread's O fragment ((2, 2), 1, D / 8).

    O's columns are P V's N: an 8-column block nb of the MMA holds, in column n, the
    element nb % EV of the piece of V that the B operand's column n (thread g = n) loaded,
    piece nb // EV: column (nb // EV) * 8 * EV + n * EV + nb % EV.
    """
    nb, n = value // 4, 2 * kq + value % 2
    return (nb // v_piece_elems) * 8 * v_piece_elems + n * v_piece_elems + nb % v_piece_elems
# --8<-- [end:fragments]


def flat(t: cute.Tensor) -> cute.Tensor:
    """A compact register fragment as a flat vector of its values."""
    return cute.make_tensor(t.iterator, cute.make_layout(cute.size(t)))


# --8<-- [start:zero_filled_copy]
@cute.jit
def zero_filled_copy(atom, src: cute.Tensor, dst: cute.Tensor, valid: cutlass.Boolean):
    """One 16-byte cp.async of ``src`` into ``dst``, or (``valid`` false) one with a source size of 0: it reads
    nothing and fills ``dst`` with zeros."""
    one_copy = cute.make_layout(((cute.size(src),), 1), stride=((1,), 0))
    pred = cute.make_rmem_tensor(cute.make_layout(((cute.size(src),), 1), stride=((0,), 0)), cutlass.Boolean)
    pred[0] = valid
    cute.copy(atom, cute.make_tensor(src.iterator, one_copy), cute.make_tensor(dst.iterator, one_copy), pred=pred)
# --8<-- [end:zero_filled_copy]


# --8<-- [start:softmax]
@cute.jit
def online_softmax_update(scores: cute.Tensor, acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor):
    """Fold one warp's 16 new keys into its running softmax, for the thread's two heads (rows g, g + 8).

    ``scores``: the S fragment (8 values, see ``score_row``), already in exp2
    units and -inf for keys past the split's end; on return it holds the
    numerators p = exp2(s - max). ``acc_o``: the O fragment (4 values per
    8 columns; values 2, 3 of each 4 are row g + 8). ``row_max``: the max each
    row's numerators are relative to, the same in the 4 threads of a row (a
    quad); ``row_sum``: this thread's part of the row's sum (the quad's parts
    are added at the end).

    The max moves only when a new score exceeds it by more than
    RESCALE_THRESHOLD, and then in every row of the warp at once (a warp-uniform
    branch): most iterations skip the rescale of O (64 multiplies per thread at
    D = 128), and a numerator stays below 2^RESCALE_THRESHOLD, which fp16 and
    bf16 hold with their full precision.
    """
    # TODO(stage 9): Fold the 16 new keys into the thread's two rows (score_row: a value's row).
    #   Afterwards: the 4 threads of a row (the quad) hold the same row_max; no score seen so far
    #   exceeds it by more than RESCALE_THRESHOLD; row_sum and the row's O values are relative to
    #   it; scores hold the numerators, already added to row_sum. Whether O is rescaled is one
    #   decision of the whole warp, and a row that has seen only -inf gives 0s, never NaN. Page:
    #   "The online softmax on a fragment" and "A lazy max".
    raise NotImplementedError('TODO(stage 9) in online_softmax_update(): Fold the 16 new keys into the thread\'s two rows (score_row: a value\'s row). Afterwards: the 4 threads of a row (the quad) hold the same row_max; no score seen so far exceeds it by more than RESCALE_THRESHOLD; row_sum and the row\'s O values are relative to it; scores hold the numerators, already added to row_sum. Whether O is rescaled is one decision of the whole warp, and a row that has seen only -inf gives 0s, never NaN. Page: "The online softmax on a fragment" and "A lazy max". Hints, one at a time: python -m course hint 9 (docs/stages/09-tc-decode.md as raw markdown shows them all at once)')
# --8<-- [end:softmax]



# What a serving step does around the attention, in the same launch: the new token's RoPE and its
# append to the cache, ALiBi biases, a rolling cache. Each compiles out when unused.
ROTARY_CHUNK = 8  # columns rotated at a time: 16 bytes of q or k_new


# --8<-- [start:rotary]
@cute.jit
def rotation_inputs(row: cute.Tensor, cos_row: cute.Tensor, sin_row: cute.Tensor, start: Int32, rotary_dim: Int32,
                    interleaved: cutlass.Constexpr) -> tuple:
    """What columns start .. start + 7 of ``row`` [D] need for RoPE, loaded into registers: the columns,
    their partners (non-interleaved) and their angles' cos and sin (``rotate`` does the math). Separate
    loads and math let a caller issue the loads early and use them later.

    cos_row, sin_row [rotary_dim / 2] hold the token position's angles. Pairs
    (i, i + rotary_dim / 2), or (2i, 2i + 1) when ``interleaved``, rotate by
    angle i. ``start`` is a multiple of 8 and rotary_dim of 16, so the 8
    columns are all rotated or all not, and in one half.
    """
    half = rotary_dim // 2
    x = cute.make_rmem_tensor((ROTARY_CHUNK,), row.element_type)
    cute.autovec_copy(cute.local_tile(row, (ROTARY_CHUNK,), (start // ROTARY_CHUNK,)), x)
    angles = ROTARY_CHUNK // 2 if interleaved else ROTARY_CHUNK  # interleaved: pair e // 2 has angle start / 2 + e // 2
    c = cute.make_rmem_tensor((angles,), row.element_type)
    s = cute.make_rmem_tensor((angles,), row.element_type)
    partner = x
    if cutlass.const_expr(interleaved):
        at = cutlass.min(start // 2, half - angles) // angles
    else:
        first_half = start < half
        partner = cute.make_rmem_tensor((ROTARY_CHUNK,), row.element_type)
        partner_start = cutlass.select_(first_half, start + half, start - half)  # in the row: start < D + half
        cute.autovec_copy(cute.local_tile(row, (ROTARY_CHUNK,), (partner_start // ROTARY_CHUNK,)), partner)
        at = cutlass.min(cutlass.select_(first_half, start, start - half), half - ROTARY_CHUNK) // ROTARY_CHUNK
    cute.autovec_copy(cute.local_tile(cos_row, (angles,), (at,)), c)
    cute.autovec_copy(cute.local_tile(sin_row, (angles,), (at,)), s)
    return x, partner, c, s


@cute.jit
def rotate(inputs: tuple, start: Int32, rotary_dim: Int32, interleaved: cutlass.Constexpr, out: cute.Tensor):
    """Columns start .. start + 7 after RoPE, in float32 (``out`` [8]), from ``rotation_inputs``:
    (a, b) -> (a cos - b sin, b cos + a sin); columns from rotary_dim on pass through. Both products
    are exact in float32 (16-bit factors), so the one rounding of their sum is PyTorch's, bit for bit."""
    x, partner, c, s = inputs
    rotates = start < rotary_dim
    for e in cutlass.range_constexpr(ROTARY_CHUNK):
        if cutlass.const_expr(interleaved):
            sign = -1.0 if e % 2 == 0 else 1.0
            turned = Float32(x[e]) * Float32(c[e // 2]) + sign * (Float32(x[e ^ 1]) * Float32(s[e // 2]))
        else:
            sign = Float32(cutlass.select_(start < rotary_dim // 2, Float32(-1.0), Float32(1.0)))
            turned = Float32(x[e]) * Float32(c[e]) + sign * (Float32(partner[e]) * Float32(s[e]))
        out[e] = Float32(cutlass.select_(rotates, turned, Float32(x[e])))


@cute.jit
def rotated_columns(row: cute.Tensor, cos_row: cute.Tensor, sin_row: cute.Tensor, start: Int32, rotary_dim: Int32,
                    interleaved: cutlass.Constexpr, out: cute.Tensor):
    """Columns start .. start + 7 of ``row`` [D] after RoPE, in float32 (``out`` [8]): loads, then math."""
    rotate(rotation_inputs(row, cos_row, sin_row, start, rotary_dim, interleaved), start, rotary_dim, interleaved,
           out)
# --8<-- [end:rotary]


# --8<-- [start:quantize_value]
@cute.jit
def quantize_value(x: Float32, scale: Float32, cache_dtype: cutlass.Constexpr) -> Float32:
    """x / scale as the cache stores it, as a float32: rounded to e4m3 (to nearest even, clamped to +-448) or
    to an int8 (to nearest even, clamped to +-127). ``kv_cache.quantize_rows`` on the host is the same rule."""
    y = x / scale  # IEEE division, as PyTorch's
    if cutlass.const_expr(cache_dtype == "int8"):
        return cutlass.max(cutlass.min(cute.math.roundeven(y), Float32(127.0)), Float32(-127.0))
    return cutlass.max(cutlass.min(y, Float32(448.0)), Float32(-448.0))  # the e4m3 rounding is the store's
# --8<-- [end:quantize_value]


# --8<-- [start:int8_pairs]
# int8 -> fp16 two values at a time: 1024 + (b + 128) is an fp16 whose low byte is b + 128, so flipping
# the sign bit of each byte and placing the byte under 0x64 (prmt) makes it; subtracting 1152 leaves b,
# exactly. Per pair an xor, a byte permute and a half2 subtraction, against a conversion per value and a pack.
INT8_PAIR_SELECTORS = (0x5140, 0x5342)  # bytes (0, 1) and (2, 3) of the word, each under 0x64


@dsl_user_op
def int8_pair_to_f16x2(word: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """Two int8 values of ``word`` (the bytes ``selector`` picks) as an fp16 pair, exactly."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(word).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 biased, half2, bias;\n\t"
        "xor.b32 biased, $1, 0x80808080;\n\t"
        f"prmt.b32 half2, biased, 0x64646464, {selector:#x};\n\t"
        "mov.b32 bias, 0x64806480;\n\t"
        "sub.f16x2 $0, half2, bias;\n\t}",
        "=r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
# --8<-- [end:int8_pairs]


# --8<-- [start:rolling_slot]
@cute.jit
def rolling_slot(position: Int32, num_sink_tokens: Int32, capacity: Int32) -> Int32:
    """The cache row of token ``position`` in a rolling cache of ``capacity`` rows: the sink tokens keep
    rows 0 .. num_sink_tokens - 1, every later token cycles through the rest."""
    ring = capacity - num_sink_tokens
    return Int32(cutlass.select_(position < num_sink_tokens, position,
                                 num_sink_tokens + (position - num_sink_tokens) % ring))
# --8<-- [end:rolling_slot]


# --8<-- [start:sees]
@cute.jit
def sees(key: Int32, query: Int32, window_first: Int32, num_sink_tokens: Int32):
    """Whether the draft token at position ``query`` sees the key at position ``key``: not a later one
    (causal), and one of its window (from ``window_first``) or a sink token."""
    return (key <= query) & ((key >= window_first) | (key < num_sink_tokens))
# --8<-- [end:sees]


class TensorCoreDecode:
    """Grid (num_splits x head chunks, H_kv, B); one CTA = one split of one KV head's keys, for up to
    16 x row_tiles query heads."""

    def __init__(self, config: DecodeConfig):
        self.q_dtype = config.cute_dtype
        self.cache_dtype = cute_dtype(_torch_dtype(config.cache_dtype))
        self.cache_name = config.cache_dtype  # what the host-side sizes (work_bytes, ctas_per_sm) take
        self.quantized = config.cache_dtype in QUANTIZED
        # The MMA's operand type: the query's, or fp16 for an fp8 or int8 cache (e4m3 -> f16 and s8 -> f16
        # are exact).
        self.mma_dtype = Float16 if self.quantized else self.q_dtype
        # The serving extras (compiled out when unused): the new token appended (and rotated), ALiBi,
        # a rolling cache, left-padded sequences.
        self.appends = config.appends
        self.rotary = config.rotary
        self.alibi = config.alibi
        self.rolling = config.rolling
        self.leftpad = config.leftpad
        self.drafts = config.drafts
        self.dim, self.dim_v = config.head_dim, config.dv   # the tensors' head dims: Q and K, V and O
        self.head_dim = COMPUTED_HEAD_DIM[config.head_dim]  # the kernel's: zeros past self.dim (self.dim_v)
        self.paged = config.paged
        self.has_sink = config.has_sink
        self.write_lse = config.write_lse
        self.k_elems = k_piece(config.cache_dtype)
        self.v_elems = v_piece(config.cache_dtype, self.head_dim)
        self.k_pieces = self.head_dim // 4 // self.k_elems  # a thread holds D / 4 of a K row
        self.v_pieces = self.head_dim // 8 // self.v_elems  # and D / 8 of a V row
        # The warp copies its 16 K (and V) rows as 16-byte chunks, a row's chunks on consecutive lanes:
        # every copy instruction reads whole rows, 512 contiguous-per-row bytes.
        self.chunks = self.head_dim // self.k_elems          # 16-byte chunks per row
        self.real_chunks = self.dim // self.k_elems          # those a copy fills; the rest stay zeros
        self.real_v_chunks = self.dim_v // self.k_elems
        self.rows_per_copy = 32 // self.chunks               # rows one copy instruction covers
        self.copies = KEYS_PER_WARP // self.rows_per_copy    # copy instructions per 16 rows
        # At D = 256 the O accumulator alone takes 128 registers: Q's fragment waits in shared memory
        # and is read back every iteration (it is the same for every warp: one copy per lane).
        self.q_in_shared = self.head_dim > 128
        self.num_warps = config.warps
        self.num_threads = 32 * config.warps
        self.keys_per_iteration = keys_per_iteration(config.warps)
        # Row tiles: the CTA's warps split into row_tiles teams of key_groups warps; a team computes
        # 16 heads, each of its warps 16 x row_tiles of each iteration's keys (all of them for 4 tiles
        # of 4 warps).
        self.row_tiles = config.row_tiles
        self.key_groups = config.warps // config.row_tiles
        self.rows = ROWS * config.row_tiles  # query heads per CTA

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,           # [B, H_q, D], or [B, n, H_q, D] with drafts
        mK: cute.Tensor,           # [B, S_max, H_kv, D] or [pages, page_size, H_kv, D]
        mV: cute.Tensor,
        mSeqlens: cute.Tensor,     # [B] int32
        mBlockTable: cute.Tensor,  # [B, max_pages] int32 (unused for a contiguous cache)
        mSink: cute.Tensor,        # [H_q] float32 (unused without sinks)
        mKScale: cute.Tensor,      # [H_kv] or [1] float32 (unused for a 16-bit cache)
        mVScale: cute.Tensor,
        mO: cute.Tensor,           # q's shape
        mLSE: cute.Tensor,         # [B, H_q] float32, or [B, H_q, n] with drafts (unused without return_lse)
        mPartO: cute.Tensor,       # [B, H_q x n, workspace_slots(num_splits), D] float32 workspace
        mPartLSE: cute.Tensor,     # [B, H_q x n, workspace_slots(num_splits)] float32 workspace
        mCounters: cute.Tensor,    # [>= counters_needed(...)] int32, zero between launches
        mKNew: cute.Tensor,        # [B, H_kv, D] the new token's K, V (unused without appends)
        mVNew: cute.Tensor,
        mCos: cute.Tensor,         # [positions, rotary_dim / 2] (unused without rotary)
        mSin: cute.Tensor,
        mAlibi: cute.Tensor,       # [H_q] float32 slopes (unused without alibi)
        mLeftpad: cute.Tensor,     # [B] int32: each sequence's first real row (unused without leftpad)
        scale_log2: Float32,
        window_left: Int32,
        num_sink_tokens: Int32,
        num_splits: Int32,
        cache_capacity: Int32,     # a rolling cache's rows (unused without rolling)
        stream,
    ):
        work_words = work_bytes(self.head_dim, self.cache_name, self.num_warps) // 4
        q_words = q_fragment_bytes(self.head_dim, self.row_tiles) // 4
        new_words = new_token_bytes(self.head_dim, self.cache_name, self.appends) // 4
        q_rows_words = rotated_q_bytes(self.head_dim, self.row_tiles, self.rotary) // 4

        @cute.struct
        class SharedStorage:
            # First the cp.async ring (K, then V), then (same bytes) the warps' states for the merge.
            work: cute.struct.Align[cute.struct.MemRange[Float32, work_words], 128]
            q_fragment: cute.struct.Align[cute.struct.MemRange[Float32, q_words], 16]
            new_token: cute.struct.Align[cute.struct.MemRange[Float32, new_words], 16]
            q_rows: cute.struct.Align[cute.struct.MemRange[Float32, q_rows_words], 16]
            flag: cute.struct.MemRange[Int32, 1]

        self.shared_storage = SharedStorage

        if cutlass.const_expr(self.drafts):
            mQ, mO, mLSE, mSink, mAlibi = self.draft_rows(mQ, mO, mLSE, mSink, mAlibi, mK.shape[2])
        # --8<-- [start:grid]
        batch, heads_q, heads_kv = mQ.shape[0], cute.size(mQ, mode=[1]), mK.shape[2]
        chunks = (heads_q // heads_kv + self.rows - 1) // self.rows
        # The head chunks of one split are consecutive CTAs: they read the same keys, so they start together
        grid = (num_splits * chunks, heads_kv, batch)
        # --8<-- [end:grid]
        self.kernel(
            mQ, mK, mV, mSeqlens, mBlockTable, mSink, mKScale, mVScale, mO, mLSE, mPartO, mPartLSE, mCounters,
            mKNew, mVNew, mCos, mSin, mAlibi, mLeftpad, scale_log2, window_left, num_sink_tokens, cache_capacity,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=ctas_per_sm(self.head_dim, self.cache_name, self.row_tiles, self.num_warps),
                 preferred_smem_carveout=100)

    # --8<-- [start:draft_rows]
    @cute.jit
    def draft_rows(self, mQ: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mSink: cute.Tensor,
                   mAlibi: cute.Tensor, heads_kv: Int32):
        """Draft tokens: n query tokens per sequence as n times the rows of each KV head's group. q and O
        [B, n, H_q, D] are seen as [B, (G, n, H_kv), D]: row token x G + head of a KV head's n x G rows is
        that token's query head, so the kernel, which packs a group's rows into its MMAs, takes them as it
        takes [B, H_q, D]. The LSE [B, H_q, n] likewise, and the per-head sink logits and ALiBi slopes
        repeat for every token (stride 0)."""
        group = mQ.shape[2] // heads_kv
        rows = (group, mQ.shape[1], heads_kv)

        def as_rows(t: cute.Tensor, token: int, head: int) -> cute.Tensor:  # modes token, head -> rows
            strides = (t.stride[head], t.stride[token], group * t.stride[head])
            if cutlass.const_expr(cute.rank(t) == 4):
                return cute.make_tensor(t.iterator, cute.make_layout((t.shape[0], rows, t.shape[3]),
                                                                     stride=(t.stride[0], strides, t.stride[3])))
            return cute.make_tensor(t.iterator, cute.make_layout((t.shape[0], rows), stride=(t.stride[0], strides)))

        def per_head(t: cute.Tensor) -> cute.Tensor:
            return cute.make_tensor(t.iterator, cute.make_layout((rows,), stride=((1, 0, group),)))

        return as_rows(mQ, 1, 2), as_rows(mO, 1, 2), as_rows(mLSE, 2, 1), per_head(mSink), per_head(mAlibi)
    # --8<-- [end:draft_rows]

    # --8<-- [start:key_row]
    @cute.jit
    def key_row(self, v: Int32, v_end: Int32, n_sink: Int32, lo: Int32, rows: tuple) -> Int32:
        """The cache row of visible key ``v`` (past the split's end, of its last key): the token's position
        after the sequence's left padding, or its slot in a rolling cache (``rows`` = (the sequence's first
        real row, num_sink_tokens, cache_capacity))."""
        row = cache_row(v, v_end, n_sink, lo)
        if cutlass.const_expr(self.leftpad):
            row = row + rows[0]
        if cutlass.const_expr(self.rolling):
            row = rolling_slot(row, rows[1], rows[2])
        return row

    @cute.jit
    def lookup_page(self, mBlockTable: cute.Tensor, page_shift: Int32, batch: Int32, first: Int32, v_end: Int32,
                    n_sink: Int32, lo: Int32, rows: tuple, lane: Int32) -> Int32:
        """Paged cache: the pool page of row lane % 16 of the warp's 16 keys from visible key ``first``
        (one block-table load per lane; ``issue_loads`` shuffles each row's page to the lanes that copy it).

        The main loop calls it one iteration before the copies that need the
        pages, so the block-table load is in flight during a whole iteration.
        Contiguous: nothing (0).
        """
        page = Int32(0)
        if cutlass.const_expr(self.paged):
            row = self.key_row(first + lane % KEYS_PER_WARP, v_end, n_sink, lo, rows)
            page = mBlockTable[batch, row >> page_shift]  # row // page_size
        return page

    @cute.jit
    def kv_rows(self, mKV: cute.Tensor, page_or_batch: Int32, row: Int32, head_kv: Int32) -> cute.Tensor:
        """K (or V) of ``head_kv`` from token ``row`` on, [rows, D]: of sequence ``page_or_batch`` in a
        contiguous cache, of pool page ``page_or_batch`` in a paged one (rows past the page's end are
        not this sequence's)."""
        if cutlass.const_expr(not self.paged):
            return cute.domain_offset((row, 0), mKV[page_or_batch, None, head_kv, None])
        page = pool_page(page_or_batch, mKV.shape[0])
        return cute.domain_offset((row & (mKV.shape[1] - 1), 0), mKV[page, None, head_kv, None])  # row % page_size

    @cute.jit
    def rows_in_a_line(self, first: Int32, v_end: Int32, row_first: Int32, row_last: Int32, page_size: Int32):
        """Whether the warp's 16 keys from visible key ``first`` are 16 consecutive cache rows (of one
        page): none past the split's end, none across the edge between the sink keys and the window
        (nor the end of a rolling cache's ring)."""
        line = (first + KEYS_PER_WARP <= v_end) & (row_last - row_first == KEYS_PER_WARP - 1)
        if cutlass.const_expr(self.paged):
            line = line & ((row_first ^ row_last) < page_size)  # the same page: only bits below page_size differ
        return line
    # --8<-- [end:key_row]

    # --8<-- [start:issue_loads]
    @cute.jit
    def issue_loads(self, sK: cute.Tensor, sV: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                    page: Int32, batch: Int32, head_kv: Int32, first: Int32, v_end: Int32,
                    n_sink: Int32, lo: Int32, rows: tuple, lane: Int32):
        """Start the cp.async copies of the warp's 16 keys from visible key ``first`` into its tiles
        ``sK``, ``sV`` [16 rows, chunks, 16 bytes] of one ring stage.

        Lane l copies chunk l % chunks of rows l // chunks, + rows_per_copy, ...:
        each instruction reads whole rows of K (and V), as stage 7's copies do.
        (Letting each lane copy only what its own fragments hold would read a K
        row 64 bytes per instruction, and L2 serves half-lines at half speed.)
        Past the split's end a lane re-reads the split's last key.
        """
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=LoadCacheMode.GLOBAL), self.cache_dtype,
                                   num_bits_per_copy=128)
        chunk = lane % self.chunks
        row_first = self.key_row(first, v_end, n_sink, lo, rows)
        row_last = self.key_row(first + KEYS_PER_WARP - 1, v_end, n_sink, lo, rows)
        # A runtime loop of at most 8 unrolled copies: D = 256's 16 unrolled row addresses took
        # ptxas past its 255 registers (a 24-byte spill in the main loop).
        if self.rows_in_a_line(first, v_end, row_first, row_last, mK.shape[1]):
            # Nearly every slice: one row block per tensor (one page), whose copies step a lane's
            # address by rows_per_copy rows; a lane's own page is the slice's page.
            page_or_batch = batch if cutlass.const_expr(not self.paged) else page
            lane_k = self.lane_copies(self.kv_rows(mK, page_or_batch, row_first, head_kv), lane)
            lane_v = self.lane_copies(self.kv_rows(mV, page_or_batch, row_first, head_kv), lane)
            for i in cutlass.range(self.copies, unroll=COPIES_UNROLLED):
                tile_row = i * self.rows_per_copy + lane // self.chunks
                self.copy_pieces(atom, lane_k[i, None], lane_v[i, None], sK, sV, tile_row, chunk)
        else:
            # The split's last slice (rows past its end re-read its last key), and slices across the
            # sinks' edge or a page boundary: a row, and a page, per copy.
            for i in cutlass.range(self.copies, unroll=COPIES_UNROLLED):
                tile_row = i * self.rows_per_copy + lane // self.chunks
                row = self.key_row(first + tile_row, v_end, n_sink, lo, rows)
                # Paged: row r's page is in lane r (lookup_page).
                page_or_batch = batch if cutlass.const_expr(not self.paged) else cute.arch.shuffle_sync(page, tile_row)
                self.copy_pieces(atom, self.row_piece(self.kv_rows(mK, page_or_batch, row, head_kv), 0, chunk),
                                 self.row_piece(self.kv_rows(mV, page_or_batch, row, head_kv), 0, chunk),
                                 sK, sV, tile_row, chunk)

    @cute.jit
    def lane_copies(self, rows: cute.Tensor, lane: Int32) -> cute.Tensor:
        """The 16-byte pieces lane ``lane`` copies of 16 consecutive rows, [copies, piece]: one 64-bit address,
        then a 32-bit step of rows_per_copy rows per copy (a 64-bit row x stride product per copy took
        about 8 instructions): 16 token strides fit in an Int32, as the host checks (MAX_TOKEN_STRIDE)."""
        first_piece = self.row_piece(rows, lane // self.chunks, lane % self.chunks)
        step = cute.assume(Int32(rows.layout.stride[0]) * self.rows_per_copy, divby=self.k_elems)
        return cute.make_tensor(first_piece.iterator, cute.make_layout((self.copies, self.k_elems), stride=(step, 1)))

    @cute.jit
    def row_piece(self, rows: cute.Tensor, r: Int32, chunk: Int32) -> cute.Tensor:
        """The 16-byte piece ``chunk`` of row ``r`` of a row block [rows, D]."""
        return cute.local_tile(rows[r, None], (self.k_elems,), (chunk,))

    @cute.jit
    def copy_pieces(self, atom, k_piece: cute.Tensor, v_piece: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                    tile_row: Int32, chunk: Int32):
        """Chunk ``chunk`` of a K row and of a V row (16 bytes each) into row ``tile_row`` of the warp's tiles,
        swizzled."""
        at = swizzle(tile_row, self.chunks) ^ chunk
        self.copy_or_zeros(atom, k_piece, sK[tile_row, at, None], chunk, self.real_chunks)
        self.copy_or_zeros(atom, v_piece, sV[tile_row, at, None], chunk, self.real_v_chunks)
    # --8<-- [end:issue_loads]

    # --8<-- [start:copy_or_zeros]
    @cute.jit
    def copy_or_zeros(self, atom, src: cute.Tensor, dst: cute.Tensor, chunk: Int32, real_chunks: int):
        """The 16-byte piece ``chunk`` of a row of ``real_chunks`` pieces into a row of the computed head dim
        (COMPUTED_HEAD_DIM): copied if it holds real columns, else zeros (``zero_filled_copy``). Q's
        padded columns are zeros too, so they add 0 to every score, and V's to no column of O that is
        stored, where stale shared memory could hold a NaN (0 x NaN = NaN). (A branch around the copy
        instead took ptxas past its registers at D = 192.)"""
        if cutlass.const_expr(real_chunks * cute.size(src) == self.head_dim):
            cute.copy(atom, src, dst)  # a row with no padding
        else:
            zero_filled_copy(atom, src, dst, chunk < real_chunks)
    # --8<-- [end:copy_or_zeros]

    # --8<-- [start:ring_barrier]
    @cute.jit
    def ring_barrier(self, key_group: Int32):
        """Before a ring stage is read, and before it is refilled: with one row tile a warp reads only the
        rows it copied (the warp waits for its lanes); with more, each warp of a key group reads the rows
        all of the group's warps copied (the group waits for its warps, on its own named barrier)."""
        if cutlass.const_expr(self.row_tiles == 1):
            cute.arch.sync_warp()
        else:  # barrier 0 is sync_threads'
            cute.arch.barrier(barrier_id=1 + key_group, number_of_threads=32 * self.row_tiles)
    # --8<-- [end:ring_barrier]

    # --8<-- [start:new_token]
    @cute.jit
    def angles(self, mCos: cute.Tensor, mSin: cute.Tensor, position: Int32):
        """The rows of rotary_cos and rotary_sin for the new token's position (the last row past the table:
        the host checks positions only when asked)."""
        at = cutlass.min(position, mCos.shape[0] - 1)
        return mCos[at, None], mSin[at, None]

    @cute.jit
    def rotated_piece(self, row: cute.Tensor, angles: tuple, chunk: Int32) -> cute.Tensor:
        """Piece ``chunk`` (k_elems columns) of a 16-bit row (k_new's, staged), rotated by ``angles`` (the
        position's cos and sin rows, with rotary) and rounded to the row's type, as the reference's rotary()
        rounds it."""
        piece = cute.make_rmem_tensor((self.k_elems,), row.element_type)
        if cutlass.const_expr(not self.rotary):
            cute.autovec_copy(cute.local_tile(row, (self.k_elems,), (chunk,)), piece)
        else:
            cos_row, sin_row = angles
            turned = cute.make_rmem_tensor((ROTARY_CHUNK,), Float32)
            for sub in cutlass.range_constexpr(self.k_elems // ROTARY_CHUNK):
                rotated_columns(row, cos_row, sin_row, chunk * self.k_elems + sub * ROTARY_CHUNK,
                                2 * cos_row.shape[0], self.rotary == "interleaved", turned)
                cute.local_tile(piece, (ROTARY_CHUNK,), (sub,)).store(turned.load().to(row.element_type))
        return piece

    @cute.jit
    def piece_of(self, row: cute.Tensor, piece: Int32) -> cute.Tensor:
        """Piece ``piece`` of a 16-bit row: 8 columns, 16 bytes."""
        return cute.local_tile(row, (ROTARY_CHUNK,), (piece,))

    @cute.jit
    def issue_staging(self, mQ: cute.Tensor, mKNew: cute.Tensor, mVNew: cute.Tensor, angles: tuple, batch: Int32,
                      head_kv: Int32, first_head: Int32, heads_here: Int32, stages_token, tidx: Int32,
                      s_q_rows: cute.Tensor, s_angles: tuple, s_new_raw: cute.Tensor):
        """Start the cp.async copies of what the appends work on, 16 bytes per copy, spread over the CTA's
        threads: with RoPE the CTA's query rows (into ``s_q_rows``; spare rows repeat the last real head)
        and the position's cos and sin rows (``s_angles``); with ``stages_token`` the new token's K and V
        rows (``s_new_raw`` [2, D]). As copies, not loads into registers, they go out before the first
        K/V copies and land before them: a load the compiler places after those copies waits behind
        them."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.q_dtype, num_bits_per_copy=128)
        per_row = self.head_dim // ROTARY_CHUNK  # pieces of a staged row; those past the real ones are zeros
        real, real_v = self.dim // ROTARY_CHUNK, self.dim_v // ROTARY_CHUNK
        if cutlass.const_expr(self.rotary):
            for i in cutlass.range(tidx, self.rows * per_row, self.num_threads, unroll=1):
                row, piece = i // per_row, i % per_row
                self.copy_or_zeros(atom, self.piece_of(mQ[batch, first_head + cutlass.min(row, heads_here - 1), None],
                                                       piece), self.piece_of(s_q_rows[row, None], piece), piece, real)
            per_angles = angles[0].shape[0] // ROTARY_CHUNK  # rotary_dim / 16 pieces per table
            for i in cutlass.range(tidx, 2 * per_angles, self.num_threads, unroll=1):
                if i < per_angles:
                    cute.copy(atom, self.piece_of(angles[0], i), self.piece_of(s_angles[0], i))
                else:
                    cute.copy(atom, self.piece_of(angles[1], i - per_angles), self.piece_of(s_angles[1], i - per_angles))
        if stages_token:
            for i in cutlass.range(tidx, 2 * per_row, self.num_threads, unroll=1):
                piece = i % per_row
                if i < per_row:
                    self.copy_or_zeros(atom, self.piece_of(mKNew[batch, head_kv, None], piece),
                                       self.piece_of(s_new_raw[0, None], piece), piece, real)
                else:
                    self.copy_or_zeros(atom, self.piece_of(mVNew[batch, head_kv, None], piece),
                                       self.piece_of(s_new_raw[1, None], piece), piece, real_v)

    @cute.jit
    def rotate_q_rows(self, s_q_rows: cute.Tensor, angles: tuple, tidx: Int32):
        """RoPE on the CTA's staged query rows, in place, each piece once (not once per warp that holds it).
        A thread takes 8 columns and their partners at + rotary_dim / 2 (halves), or 8 columns (interleaved:
        a pair is inside the piece): no thread writes what another reads. Columns from rotary_dim on stay."""
        cos_row, sin_row = angles
        rotary_dim = 2 * cos_row.shape[0]
        interleaved = self.rotary == "interleaved"
        span = rotary_dim // ROTARY_CHUNK  # work items per row: pieces (interleaved) or pairs of pieces
        if cutlass.const_expr(not interleaved):
            span = span // 2
        turned = cute.make_rmem_tensor((ROTARY_CHUNK,), Float32)
        partner_turned = cute.make_rmem_tensor((ROTARY_CHUNK,), Float32)
        for i in cutlass.range(tidx, self.rows * span, self.num_threads, unroll=1):
            q_row, start = s_q_rows[i // span, None], (i % span) * ROTARY_CHUNK
            inputs = rotation_inputs(q_row, cos_row, sin_row, start, rotary_dim, interleaved)
            rotate(inputs, start, rotary_dim, interleaved, turned)
            if cutlass.const_expr(not interleaved):
                x, partner, c, s = inputs
                rotate((partner, x, c, s), start + rotary_dim // 2, rotary_dim, interleaved, partner_turned)
                cute.local_tile(q_row, (ROTARY_CHUNK,), ((start + rotary_dim // 2) // ROTARY_CHUNK,)).store(
                    partner_turned.load().to(self.q_dtype))
            cute.local_tile(q_row, (ROTARY_CHUNK,), (start // ROTARY_CHUNK,)).store(turned.load().to(self.q_dtype))

    @cute.jit
    def as_stored(self, values: cute.Tensor, scale: Float32) -> cute.Tensor:
        """16-bit values of a new K or V row as the cache stores them: themselves, or quantized with the
        KV head's scale (``quantize_value``)."""
        stored = cute.make_rmem_tensor((cute.size(values),), self.cache_dtype)
        if cutlass.const_expr(not self.quantized):
            stored.store(values.load())
        else:
            scaled = cute.make_rmem_tensor((cute.size(values),), Float32)
            for e in cutlass.range_constexpr(cute.size(values)):
                scaled[e] = quantize_value(Float32(values[e]), scale, self.cache_name)
            stored.store(scaled.load().to(self.cache_dtype))
        return stored

    @cute.jit
    def stage_new_token(self, mK: cute.Tensor, mV: cute.Tensor, s_new_raw: cute.Tensor, angles: tuple,
                        mBlockTable: cute.Tensor, batch: Int32, head_kv: Int32, position: Int32, rows: tuple,
                        tidx: Int32, k_scale: Float32, v_scale: Float32, s_new: cute.Tensor, writes):
        """The new token's K row (rotated by ``angles``, the staged cos and sin) and V row as the cache
        stores them, into ``s_new`` [2, D], from the staged ``s_new_raw``: thread t < D / piece makes K's
        piece t, the next D / piece threads V's. With ``writes`` (one CTA per sequence and KV head) they
        also write their pieces to the cache at ``position`` (its slot in a rolling cache)."""
        row = position
        if cutlass.const_expr(self.rolling):
            row = rolling_slot(position, rows[1], rows[2])
        piece = tidx % self.chunks
        if tidx < 2 * self.chunks:
            stored = cute.make_rmem_tensor((self.k_elems,), self.cache_dtype)
            if tidx < self.chunks:
                stored.store(self.as_stored(self.rotated_piece(s_new_raw[0, None], angles, piece), k_scale).load())
            else:
                values = cute.make_rmem_tensor((self.k_elems,), self.q_dtype)
                cute.autovec_copy(cute.local_tile(s_new_raw[1, None], (self.k_elems,), (piece,)), values)
                stored.store(self.as_stored(values, v_scale).load())
            which = tidx // self.chunks  # 0: K, 1: V
            cute.autovec_copy(stored, cute.local_tile(s_new[which, None], (self.k_elems,), (piece,)))
            if writes & (piece < cutlass.select_(which == 0, Int32(self.real_chunks), Int32(self.real_v_chunks))):
                page_or_batch = batch
                if cutlass.const_expr(self.paged):
                    page_shift = cute.arch.log2_of_pow2_int(Int32(mK.shape[1]))
                    page_or_batch = mBlockTable[batch, row >> page_shift]
                if tidx < self.chunks:
                    k_row = self.kv_rows(mK, page_or_batch, row, head_kv)[0, None]
                    cute.autovec_copy(stored, cute.local_tile(k_row, (self.k_elems,), (piece,)))
                else:
                    v_row = self.kv_rows(mV, page_or_batch, row, head_kv)[0, None]
                    cute.autovec_copy(stored, cute.local_tile(v_row, (self.k_elems,), (piece,)))

    @cute.jit
    def new_token_score(self, s_new: cute.Tensor, kq: Int32, q_pieces: cute.Tensor, new_score: cute.Tensor):
        """Add this thread's part of q . k_new for its two rows to ``new_score``: over the K columns it holds
        (pieces 4p + kq of the staged row), with Q's fragment values for them from ``q_pieces`` [D / 16, 8]
        (r_q, or its copy in shared memory at D = 256, where the registers are short). The quad adds its
        four parts."""
        k_new = cute.make_rmem_tensor((self.k_elems,), self.cache_dtype)
        for p in cutlass.range_constexpr(self.k_pieces):
            cute.autovec_copy(cute.local_tile(s_new[0, None], (self.k_elems,), (4 * p + kq,)), k_new)
            for c in cutlass.range_constexpr(self.k_elems // 4):  # r_q's 8-value slot per 4 columns
                q8 = cute.make_rmem_tensor((8,), self.mma_dtype)
                cute.autovec_copy(q_pieces[p * (self.k_elems // 4) + c, None], q8)
                for e in cutlass.range_constexpr(4):  # column 4c + e of the piece: values (e % 2, row, e // 2)
                    for r in cutlass.range_constexpr(2):
                        new_score[r] = new_score[r] + Float32(q8[e % 2 + 2 * r + 4 * (e // 2)]) * Float32(k_new[4 * c + e])

    @cute.jit
    def fold_new_token(self, s_new: cute.Tensor, kq: Int32, q_pieces: cute.Tensor, score_scale: Float32,
                       row_max: cute.Tensor, row_sum: cute.Tensor, acc_o: cute.Tensor):
        """Fold the new token into the warp's softmax state, one more key: its score (new_token_score, added
        up by the quad) and its V row from ``s_new`` (the thread's O columns n = 2kq, 2kq + 1 of each
        8-column block: o_column). The max becomes the larger of the two; the sum counts the new numerator
        once per row, in the quad's first thread."""
        new_score = cute.make_rmem_tensor((2,), Float32)
        new_score.fill(0.0)
        self.new_token_score(s_new, kq, q_pieces, new_score)
        correction = cute.make_rmem_tensor((2,), Float32)
        p = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            score = cute.arch.warp_reduction_sum(new_score[r], threads_in_group=4) * score_scale
            new_max = cute.arch.fmax(row_max[r], score)  # finite: the new token always sees itself
            correction[r] = cute.math.exp2(row_max[r] - new_max, fastmath=True)  # 0 for a row with no key yet
            p[r] = cute.math.exp2(score - new_max, fastmath=True)
            row_sum[r] = row_sum[r] * correction[r] + Float32(cutlass.select_(kq == 0, p[r], Float32(0.0)))
            row_max[r] = new_max
        stored = cute.make_rmem_tensor((self.v_elems,), self.cache_dtype)
        for c in cutlass.range_constexpr(2):
            for piece in cutlass.range_constexpr(self.head_dim // 8 // self.v_elems):
                cute.autovec_copy(cute.local_tile(s_new[1, None], (self.v_elems,), (8 * piece + 2 * kq + c,)), stored)
                for e in cutlass.range_constexpr(self.v_elems):
                    for r in cutlass.range_constexpr(2):
                        nb = piece * self.v_elems + e
                        acc_o[(c, r), 0, nb] = acc_o[(c, r), 0, nb] * correction[r] + p[r] * Float32(stored[e])
    # --8<-- [end:new_token]

    # --8<-- [start:to_registers]
    @cute.jit
    def piece_to_registers(self, piece: cute.Tensor) -> cute.Tensor:
        """One of this thread's ring pieces in registers, in the MMA's type: e4m3 or int8 -> fp16 on the way
        (exact)."""
        raw = cute.make_rmem_tensor((cute.size(piece),), self.cache_dtype)
        cute.autovec_copy(piece, raw)
        if cutlass.const_expr(not self.quantized):
            return raw
        converted = cute.make_rmem_tensor((cute.size(piece),), self.mma_dtype)
        if cutlass.const_expr(self.cache_name == "int8"):
            words, pairs = cute.recast_tensor(raw, Int32), cute.recast_tensor(converted, Int32)
            for w in cutlass.range_constexpr(cute.size(words)):
                for half in cutlass.range_constexpr(2):
                    pairs[2 * w + half] = int8_pair_to_f16x2(words[w], INT8_PAIR_SELECTORS[half])
        else:
            converted.store(raw.load().to(self.mma_dtype))
        return converted

    @cute.jit
    def q_fragment(self, r_q: cute.Tensor, piece: cute.Tensor, r: int, p: int):
        """The A operand of S = Q K^T: ``piece`` (k_elems values in the MMA's type), the thread's p-th chunk
        (chunk 4p + kq) of the query row of head g + 8r, into ``r_q`` ((2, 2, 2), 1, D / 16), in the MMA's
        value order (column + 1, row + 8, column + 8, then the column block). Its columns are the ones
        k_fragment gives the same elements of K."""
        for e in cutlass.range_constexpr(self.k_elems):
            # TODO(stage 9): Store piece[e] in the slot of r_q (A operand, compact, in
            #   the MMA's value order) for row r (head g + 8r) and the very column that
            #   k_fragment gives the same element of K: any mismatch makes every score
            #   wrong, and nothing crashes (course check 9 emulates the warp's MMAs on
            #   the CPU). Page: "The m16n8k16 fragments".
            raise NotImplementedError('TODO(stage 9) in q_fragment(): Store piece[e] in the slot of r_q (A operand, compact, in the MMA\'s value order) for row r (head g + 8r) and the very column that k_fragment gives the same element of K: any mismatch makes every score wrong, and nothing crashes (course check 9 emulates the warp\'s MMAs on the CPU). Page: "The m16n8k16 fragments". Hints, one at a time: python -m course hint 9 (docs/stages/09-tc-decode.md as raw markdown shows them all at once)')

    @cute.jit
    def q_fragments(self, q_rows: tuple, kq: Int32, r_q: cute.Tensor):
        """Q's fragment for the thread's rows: ``q_rows[r]`` [D] is the query row of row g + 8r (rotated
        already with RoPE), in the MMA's type."""
        for r in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(self.k_pieces):
                raw = cute.make_rmem_tensor((self.k_elems,), self.q_dtype)
                if cutlass.const_expr(4 * p + 3 < self.real_chunks):
                    cute.autovec_copy(cute.local_tile(q_rows[r], (self.k_elems,), (4 * p + kq,)), raw)
                else:  # a padded head dim: zeros past the row's end
                    raw.fill(0.0)
                    if cutlass.const_expr(4 * p < self.real_chunks):
                        if 4 * p + kq < self.real_chunks:
                            cute.autovec_copy(cute.local_tile(q_rows[r], (self.k_elems,), (4 * p + kq,)), raw)
                piece = cute.make_rmem_tensor((self.k_elems,), self.mma_dtype)
                piece.store(raw.load().to(self.mma_dtype))
                self.q_fragment(r_q, piece, r, p)

    @cute.jit
    def share_q(self, r_q_pieces: cute.Tensor, s_q: cute.Tensor, tile: Int32, lane: Int32, key_group: Int32):
        """D = 256: Q's fragment into shared memory, where every warp of the row tile reads it back."""
        if key_group == 0:  # one copy per row tile: its warps hold the same fragment
            cute.autovec_copy(r_q_pieces, s_q[tile, lane, None, None])
        cute.arch.sync_threads()

    @cute.jit
    def k_fragment(self, sK: cute.Tensor, r_k: cute.Tensor, g: Int32, kq: Int32, first_piece: int):
        """The B operand of S = Q K^T from the warp's K tile [16 rows, chunks, 16 bytes] of one stage
        (the column blocks of pieces ``first_piece``, ...: all of them, or half at D = 256).

        ``r_k`` ((2, 2), 2 key blocks, column blocks), in the MMA's value
        order: value v of block kb is the column 2kq + v % 2 + 8 (v // 2) of the
        block, of key 8j + g. The thread takes chunks kq, kq + 4, ... of that row:
        element e of its p-th chunk is its column 4 kb + e % 4 with
        kb = p * E / 4 + e // 4. Q's fragment takes the same columns, so the dot
        products are complete (they visit D in another order).
        """
        elems = self.k_elems
        for j in cutlass.range_constexpr(2):
            row = 8 * j + g
            for p in cutlass.range_constexpr(cute.size(r_k, mode=[2]) * 4 // elems):
                chunk = 4 * (first_piece + p) + kq
                piece = self.piece_to_registers(sK[row, swizzle(row, self.chunks) ^ chunk, None])
                for e in cutlass.range_constexpr(elems):
                    # TODO(stage 9): Store piece[e] in the slot of r_k that the MMA reads as
                    #   the column the docstring assigns it, for key block j: r_k is compact
                    #   (slot i is value i in the MMA's order, whatever a view says). Page:
                    #   "Read what your fragment holds", "Compact fragments".
                    raise NotImplementedError('TODO(stage 9) in k_fragment(): Store piece[e] in the slot of r_k that the MMA reads as the column the docstring assigns it, for key block j: r_k is compact (slot i is value i in the MMA\'s order, whatever a view says). Page: "Read what your fragment holds", "Compact fragments". Hints, one at a time: python -m course hint 9 (docs/stages/09-tc-decode.md as raw markdown shows them all at once)')

    @cute.jit
    def v_fragment(self, sV: cute.Tensor, r_v: cute.Tensor, g: Int32, kq: Int32, first_piece: int):
        """The B operand of O = P V from the warp's V tile of one stage (the column blocks of
        pieces ``first_piece``, ...: all of them, or half at D = 256).

        ``r_v`` ((2, 2), column blocks, 1): value v holds key
        ``v_slot_key(v, kq)`` (P's columns in this thread), in column g of block
        nb: the thread reads EV elements of each of those 4 rows at
        (8p + g) * EV, and element e of piece p is block p * EV + e. Each 32-bit
        register pairs two keys: the packing is where ldmatrix.trans would
        otherwise transpose V.
        """
        elems = self.v_elems
        for slot in cutlass.range_constexpr(4):
            row = v_slot_key(slot, kq)
            for p in cutlass.range_constexpr(cute.size(r_v, mode=[1]) // elems):
                start = (8 * (first_piece + p) + g) * elems  # the piece's first element in the row
                chunk = sV[row, swizzle(row, self.chunks) ^ (start // self.k_elems), None]
                piece = self.piece_to_registers(cute.local_tile(chunk, (elems,), ((start % self.k_elems) // elems,)))
                for e in cutlass.range_constexpr(elems):
                    # TODO(stage 9): Store piece[e] in the slot of r_v that the MMA reads as key
                    #   v_slot_key(slot, kq) (P's key in this thread) at the column block the
                    #   docstring assigns it; r_v is compact, as r_k. Page: "V's B fragment:
                    #   two keys per register", "Compact fragments".
                    raise NotImplementedError('TODO(stage 9) in v_fragment(): Store piece[e] in the slot of r_v that the MMA reads as key v_slot_key(slot, kq) (P\'s key in this thread) at the column block the docstring assigns it; r_v is compact, as r_k. Page: "V\'s B fragment: two keys per register", "Compact fragments". Hints, one at a time: python -m course hint 9 (docs/stages/09-tc-decode.md as raw markdown shows them all at once)')
    # --8<-- [end:to_registers]

    # --8<-- [start:combine_partials]
    @cute.jit
    def combine_item(self, k: int, heads_here: Int32):
        """The combine's item k of this thread: (head, 4-column piece, a real head?). Thread t takes
        pieces t, t + 128, ... of the CTA's heads' rows; spare threads redo a real head, never stored."""
        tidx, _, _ = cute.arch.thread_idx()
        head_quads = self.head_dim // 4
        item = tidx + k * self.num_threads
        return cutlass.min(item // head_quads, heads_here - 1), item % head_quads, item // head_quads < heads_here

    @cute.jit
    def combine(self, mPartO: cute.Tensor, mPartLSE: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                mSink: cute.Tensor, batch: Int32, first_head: Int32, heads_here: Int32, first: Int32, count: Int32,
                slot: Int32, final: cutlass.Constexpr):
        """Fold workspace slots [first, first + count) for every head of the CTA.

        Each thread owns 4 columns of one head per item (a 16-byte load per slot)
        and folds the slots in one pass per combine_loads() items, in rounds:
        first the loads of its slots, all in flight at once, then their folds.
        The partials sit in L2, and this chain of L2 round trips is the end of
        the kernel. ``final``: finish with the sink logit and write O (and the
        LSE); else write the folded (O, LSE) into workspace slot ``slot``, a
        partial like a split's.
        """
        items, per_round = combine_loads(self.head_dim, self.num_warps)  # items folded at once, slots per round
        passes = self.rows * self.head_dim // 4 // self.num_threads  # the thread's items, `items` per pass
        if cutlass.const_expr(per_round < 16):
            # A loop: the pass body is generated once, however many passes.
            for first_item in cutlass.range(0, passes, items, unroll=1):
                self.combine_pass(mPartO, mPartLSE, mO, mLSE, mSink, batch, first_head, heads_here, first, count,
                                  slot, first_item, final)
        else:
            # 16 slots in flight per item (D = 64, 8 warps): unrolled passes, which ptxas fits in fewer
            # registers (REGISTERS_PER_THREAD holds them).
            for first_item in cutlass.range_constexpr(0, passes, items):
                self.combine_pass(mPartO, mPartLSE, mO, mLSE, mSink, batch, first_head, heads_here, first, count,
                                  slot, first_item, final)

    @cute.jit
    def combine_pass(self, mPartO: cute.Tensor, mPartLSE: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                     mSink: cute.Tensor, batch: Int32, first_head: Int32, heads_here: Int32, first: Int32,
                     count: Int32, slot: Int32, first_item, final: cutlass.Constexpr):
        """One pass of ``combine``: this thread's items first_item, first_item + 1, ... folded together."""
        items, per_round = combine_loads(self.head_dim, self.num_warps)  # items folded at once, slots per round
        o = cute.make_rmem_tensor(cute.make_ordered_layout((items, 4), order=(1, 0)), Float32)
        state = cute.make_rmem_tensor(cute.make_ordered_layout((items, 2), order=(1, 0)), Float32)
        parts = cute.make_rmem_tensor(cute.make_ordered_layout((items, per_round, 4), order=(2, 1, 0)), Float32)
        lses = cute.make_rmem_tensor(cute.make_ordered_layout((items, per_round), order=(1, 0)), Float32)
        out = cute.make_rmem_tensor((4,), self.q_dtype)
        o.fill(0.0)
        for k in cutlass.range_constexpr(items):
            state[k, 0] = -Float32.inf
            state[k, 1] = Float32(0.0)
        for round_first in cutlass.range(0, count, per_round, unroll=1):
            for k in cutlass.range_constexpr(items):
                h, quad, _ = self.combine_item(first_item + k, heads_here)
                for j in cutlass.range_constexpr(per_round):
                    # Past the last slot: reload it and fold it in with LSE -inf, which adds nothing.
                    s = first + cutlass.min(round_first + j, count - 1)
                    cute.autovec_copy(cute.local_tile(mPartO[batch, first_head + h, s, None], (4,), (quad,)),
                                      parts[k, j, None])
                    lses[k, j] = Float32(cutlass.select_(round_first + j < count,
                                                         mPartLSE[batch, first_head + h, s], -Float32.inf))
            for k in cutlass.range_constexpr(items):
                for j in cutlass.range_constexpr(per_round):
                    fold_in_split(lses[k, j], parts[k, j, None], state[k, None], o[k, None])
        for k in cutlass.range_constexpr(items):
            h, quad, real = self.combine_item(first_item + k, heads_here)
            head = first_head + h
            if cutlass.const_expr(final):
                sink_log2 = Float32(0.0)
                if cutlass.const_expr(self.has_sink):
                    sink_log2 = mSink[head] * LOG2_E
                lse = finish_combine(state[k, None], o[k, None], sink_log2, self.has_sink)
                if real & (quad < self.dim_v // 4):  # the workspace has the padded head dim, O the real one
                    for i in cutlass.range_constexpr(4):
                        out[i] = o[k, i].to(self.q_dtype)
                    cute.autovec_copy(out, cute.local_tile(mO[batch, head, None], (4,), (quad,)))
                    if cutlass.const_expr(self.write_lse):
                        if quad == 0:
                            mLSE[batch, head] = lse * LN_2  # natural log, as the API returns it
            else:
                lse = finish_combine(state[k, None], o[k, None], Float32(0.0), False)
                if real:
                    cute.autovec_copy(o[k, None], cute.local_tile(mPartO[batch, head, slot, None], (4,), (quad,)))
                    if quad == 0:
                        mPartLSE[batch, head, slot] = lse
    # --8<-- [end:combine_partials]

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mSeqlens: cute.Tensor,
        mBlockTable: cute.Tensor,
        mSink: cute.Tensor,
        mKScale: cute.Tensor,
        mVScale: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLSE: cute.Tensor,
        mCounters: cute.Tensor,
        mKNew: cute.Tensor,
        mVNew: cute.Tensor,
        mCos: cute.Tensor,
        mSin: cute.Tensor,
        mAlibi: cute.Tensor,
        mLeftpad: cute.Tensor,
        scale_log2: Float32,
        window_left: Int32,
        num_sink_tokens: Int32,
        cache_capacity: Int32,
    ):
        d = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        split_chunk, head_kv, batch = cute.arch.block_idx()

        # --8<-- [start:heads]
        # GQA packing: the CTA's query heads are up to 16 x row_tiles consecutive heads of one KV
        # head's group, the rows of the MMAs.
        group_size = cute.size(mQ, mode=[1]) // mK.shape[2]  # rows per KV head: n x G with drafts
        chunks = (group_size + self.rows - 1) // self.rows
        split, head_chunk = split_chunk // chunks, split_chunk % chunks
        num_splits = cute.arch.grid_dim()[0] // chunks
        kv_chunk, kv_ctas = head_kv * chunks + head_chunk, mK.shape[2] * chunks
        first_head = head_kv * group_size + head_chunk * self.rows
        heads_here = cutlass.min(group_size - head_chunk * self.rows, Int32(self.rows))
        # --8<-- [end:heads]

        # --8<-- [start:threads]
        warp_idx = tidx // 32
        lane = tidx % 32
        g = lane // 4   # the thread's MMA rows g, g + 8 and B column g
        kq = lane % 4   # its MMA columns 2kq, 2kq + 1 (+ 8)
        tile = warp_idx // self.key_groups       # the warp's row tile: heads 16 tile .. 16 tile + 15 of the CTA's
        key_group = warp_idx % self.key_groups   # its share of each iteration's keys: 16-key slices
        # --8<-- [end:threads]

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # [stage, warp, row, chunk, 16 bytes]: each warp's K and V tiles of 16 rows per stage.
        ring = cute.make_ordered_layout((STAGES, self.num_warps, KEYS_PER_WARP, self.chunks, self.k_elems),
                                        order=(4, 3, 2, 1, 0))
        sK = storage.work.get_tensor(ring, dtype=self.cache_dtype)
        k_ring_words = STAGES * self.keys_per_iteration * d * self.cache_dtype.width // 32
        sV = cute.make_tensor(cute.recast_ptr(storage.work.data_ptr() + k_ring_words, dtype=self.cache_dtype), ring)
        # After the main loop the ring is free: the merge reuses its bytes.
        work = storage.work.data_ptr()
        # [key group, head of the CTA]: every warp's state for its 16 heads (16 rows per warp in all).
        s_max = cute.make_tensor(work, cute.make_layout((self.key_groups, self.rows), stride=(self.rows, 1)))
        s_sum = cute.make_tensor(work + self.num_warps * ROWS,
                                 cute.make_layout((self.key_groups, self.rows), stride=(self.rows, 1)))
        s_acc = cute.make_tensor(work + 2 * self.num_warps * ROWS,
                                 cute.make_layout((self.key_groups, self.rows, d), stride=(self.rows * d, d, 1)))
        s_flag = storage.flag.get_tensor(cute.make_layout(1))
        # The appended token's K and V rows as the cache stores them, and as given (appends only).
        s_new = cute.make_tensor(cute.recast_ptr(storage.new_token.data_ptr(), dtype=self.cache_dtype),
                                 cute.make_layout((2, d), stride=(d, 1)))
        s_new_raw = cute.make_tensor(cute.recast_ptr(storage.new_token.data_ptr() + d * self.cache_dtype.width // 16,
                                                     dtype=self.q_dtype), cute.make_layout((2, d), stride=(d, 1)))

        # --8<-- [start:split]
        # The split's slice [v_begin, v_end) of the sequence's visible keys in the cache. With an append
        # the query is the new token at position `cached` (the cache's length before it) and sees
        # seqlen = cached + 1 keys; the last one, the new token itself, comes from k_new, not the cache.
        appends = 1 if cutlass.const_expr(self.appends) else 0
        if cutlass.const_expr(not self.paged):
            capacity = mK.shape[1]
        else:
            capacity = mBlockTable.shape[1] * mK.shape[1]
        cached = cutlass.max(mSeqlens[batch], Int32(0))
        if cutlass.const_expr(not self.rolling):
            cached = cutlass.min(cached, capacity - appends)  # never outside the cache
        seqlen = cached + appends
        # A left-padded sequence is rows [first_key, cached + appends) of its cache: positions (seqlen,
        # windows, RoPE, ALiBi) count from first_key, and key_row adds it back to find a key's row.
        first_key = Int32(0)
        if cutlass.const_expr(self.leftpad):
            first_key = cutlass.min(cutlass.max(mLeftpad[batch], Int32(0)), cached)
            seqlen = seqlen - first_key
        window = window_left
        if cutlass.const_expr(self.drafts):
            # The keys of the first draft token's window too: n - 1 further back than the last one's.
            window = cutlass.select_(window_left < 0, window_left, window_left + mQ.shape[1][1] - 1)
        lo, n_sink, num_visible = visible_key_range(seqlen, window, num_sink_tokens)
        num_cached = num_visible - appends
        step = self.keys_per_iteration
        chunk = (num_cached + num_splits - 1) // num_splits
        chunk = (chunk + step - 1) // step * step
        v_begin = cutlass.min(split * chunk, num_cached)
        v_end = cutlass.min(v_begin + chunk, num_cached)
        num_iters = (v_end - v_begin + step - 1) // step
        rows = (first_key, num_sink_tokens, cache_capacity)  # where the keys live: key_row
        # --8<-- [end:split]

        # --8<-- [start:scales]
        # A quantized cache holds K / k_scale: q . k = k_scale * (q . k8), so k_scale joins the softmax scale.
        score_scale = scale_log2
        k_scale, v_scale = Float32(1.0), Float32(1.0)
        if cutlass.const_expr(self.quantized):
            k_scale = mKScale[cutlass.min(head_kv, mKScale.shape[0] - 1)]
            v_scale = mVScale[cutlass.min(head_kv, mVScale.shape[0] - 1)]
            score_scale = scale_log2 * k_scale
        # --8<-- [end:scales]

        # --8<-- [start:fragments_setup]
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(self.mma_dtype, Float32, (16, 8, 16)))
        # Q as the A operand of S = Q K^T, loaded once, ((2, 2, 2), 1, D / 16) in the MMA's value order
        # (column + 1, row + 8, column + 8): rows g, g + 8 (heads), the columns of this thread's K pieces.
        r_q = cute.make_rmem_tensor(((2, 2, 2), 1, d // 16), self.mma_dtype)
        # [row tile, lane, 16-byte piece, 8 values]: consecutive lanes read consecutive 16 bytes.
        s_q = cute.make_tensor(cute.recast_ptr(storage.q_fragment.data_ptr(), dtype=self.mma_dtype),
                               cute.make_ordered_layout((self.row_tiles, 32, d // 16, 8), order=(3, 1, 2, 0)))
        r_q_pieces = cute.make_tensor(r_q.iterator, cute.make_layout((d // 16, 8), stride=(8, 1)))
        angles = self.angles(mCos, mSin, seqlen - appends)  # RoPE at the new token's position
        # With RoPE the CTA's query rows (spare rows repeat a real head) and the position's cos and sin
        # rows are staged in shared memory and the rows rotated there, once per CTA (below).
        s_q_rows = cute.make_tensor(cute.recast_ptr(storage.q_rows.data_ptr(), dtype=self.q_dtype),
                                    cute.make_layout((self.rows, d), stride=(d, 1)))
        s_angles_ptr = cute.recast_ptr(storage.q_rows.data_ptr(), dtype=self.q_dtype) + self.rows * d
        s_angles = tuple(cute.make_tensor(s_angles_ptr + i * (d // 2), cute.make_layout((mCos.shape[1],)))
                         for i in range(2))  # cos, sin: rotary_dim / 2 values each
        q_row_index = tuple(ROWS * tile + g + 8 * r for r in range(2))
        if cutlass.const_expr(not self.rotary):
            self.q_fragments(tuple(mQ[batch, first_head + cutlass.min(i, heads_here - 1), None] for i in q_row_index),
                             kq, r_q)
            if cutlass.const_expr(self.q_in_shared):
                self.share_q(r_q_pieces, s_q, tile, lane, key_group)
        # Q K^T and P V in parts of the head dim: at D = 256 half of Q's, K's and V's fragments at a
        # time (registers).
        parts = 2 if self.q_in_shared else 1
        r_q_part = r_q
        if cutlass.const_expr(parts > 1):
            r_q_part = cute.make_rmem_tensor(((2, 2, 2), 1, d // 16 // parts), self.mma_dtype)
        r_q_part_pieces = cute.make_tensor(r_q_part.iterator, cute.make_layout((d // 16 // parts, 8), stride=(8, 1)))
        r_k = cute.make_rmem_tensor(((2, 2), 2, d // 16 // parts), self.mma_dtype)
        r_v = cute.make_rmem_tensor(((2, 2), d // 8 // parts, 1), self.mma_dtype)
        # S (16 heads x 16 keys) and O (16 heads x D) accumulators, and P, S's values as P V's A operand.
        r_s = cute.make_rmem_tensor(((2, 2), 1, 2), Float32)
        r_p = cute.make_rmem_tensor(((2, 2, 2), 1, 1), self.mma_dtype)
        acc_o = cute.make_rmem_tensor(((2, 2), 1, d // 8), Float32)
        # --8<-- [end:fragments_setup]

        # --8<-- [start:main_loop]
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc_o.fill(0.0)
        alibi_log2 = cute.make_rmem_tensor((2,), Float32)  # the thread's rows' slopes, in log2 units
        if cutlass.const_expr(self.alibi):
            for r in cutlass.range_constexpr(2):
                alibi_log2[r] = mAlibi[first_head + cutlass.min(ROWS * tile + g + 8 * r, heads_here - 1)] * LOG2_E
        # Draft tokens: the thread's rows' query positions (row token x G + head of the KV head's rows is
        # at seqlen - n + token) and the first key each one's window sees.
        q_pos = cute.make_rmem_tensor((2,), Int32)
        q_first = cute.make_rmem_tensor((2,), Int32)
        if cutlass.const_expr(self.drafts):
            for r in cutlass.range_constexpr(2):
                token = (head_chunk * self.rows + ROWS * tile + g + 8 * r) // mQ.shape[1][0]
                q_pos[r] = seqlen - mQ.shape[1][1] + token
                q_first[r] = Int32(cutlass.select_(window_left < 0, Int32(0), q_pos[r] - window_left))
        # Paged cache: entry st < STAGES - 1 holds this lane's page of prologue iteration st's copies,
        # the last one that of the next copies the loop issues.
        r_pages = cute.make_rmem_tensor((STAGES,), Int32)
        issue_loads, lookup_page = self.issue_loads, self.lookup_page
        page_shift = Int32(0)
        if cutlass.const_expr(self.paged):
            page_shift = cute.arch.log2_of_pow2_int(Int32(mK.shape[1]))  # row // page_size = row >> page_shift
        # The warp copies one of the slices its key group reads, so that a key group's warps wait only
        # for each other (ring_barrier).
        copy_slice = key_group * self.row_tiles + tile
        warp_first = v_begin + copy_slice * KEYS_PER_WARP  # the warp's first key of iteration 0
        sK_warp, sV_warp = sK[None, copy_slice, None, None, None], sV[None, copy_slice, None, None, None]
        if cutlass.const_expr(self.appends):  # the oldest cp.async group: what the appends work on
            self.issue_staging(mQ, mKNew, mVNew, angles, batch, head_kv, first_head, heads_here, split == 0, tidx,
                               s_q_rows, s_angles, s_new_raw)
            cute.arch.cp_async_commit_group()
        for st in cutlass.range_constexpr(STAGES):
            if st < num_iters:
                r_pages[st] = lookup_page(mBlockTable, page_shift, batch, warp_first + st * step, v_end, n_sink, lo,
                                          rows, lane)
        for st in cutlass.range_constexpr(STAGES - 1):
            if st < num_iters:
                issue_loads(sK_warp[st, None, None, None], sV_warp[st, None, None, None], mK, mV, r_pages[st],
                            batch, head_kv, warp_first + st * step, v_end, n_sink, lo, rows, lane)
            cute.arch.cp_async_commit_group()  # one group per iteration, empty or not, so the count below holds
        if cutlass.const_expr(self.appends):
            # The new token is one more key of split 0. Its K and V rows, as the cache stores them, go to
            # shared memory, made from the staged rows by one thread per 16-byte piece; head chunk 0's CTA
            # also writes them to the cache. No CTA of the launch reads that row from the cache: the first
            # warp of each row tile starts its running state from the new token (fold_new_token), the
            # keys it reads end before it. Two barriers where something was staged: the staged rows are
            # every thread's, then what they became is.
            if cutlass.const_expr(self.rotary):
                cute.arch.cp_async_wait_group(STAGES - 1)  # the staging group has landed
                cute.arch.sync_threads()
                self.rotate_q_rows(s_q_rows, s_angles, tidx)
            elif split == 0:
                cute.arch.cp_async_wait_group(STAGES - 1)
                cute.arch.sync_threads()
            if split == 0:
                self.stage_new_token(mK, mV, s_new_raw, s_angles, mBlockTable, batch, head_kv, cached, rows, tidx,
                                     k_scale, v_scale, s_new, head_chunk == 0)
            if cutlass.const_expr(self.rotary):
                cute.arch.sync_threads()
            elif split == 0:
                cute.arch.sync_threads()
            if cutlass.const_expr(self.rotary):
                self.q_fragments(tuple(s_q_rows[i, None] for i in q_row_index), kq, r_q)
                if cutlass.const_expr(self.q_in_shared):
                    self.share_q(r_q_pieces, s_q, tile, lane, key_group)
            if split == 0 and key_group == 0:
                self.fold_new_token(s_new, kq, s_q[tile, lane, None, None] if self.q_in_shared else r_q_pieces,
                                    score_scale, row_max, row_sum, acc_o)
        for it in cutlass.range(num_iters, unroll=1):
            ahead = it + STAGES - 1
            cute.arch.cp_async_wait_group(STAGES - 2)  # this lane's copies of iteration it have landed...
            # ...and every lane's (the fragments read rows other lanes copied); and every lane has read
            # iteration it - 1's stage, the one refilled next: one barrier per iteration.
            self.ring_barrier(key_group)
            if ahead < num_iters:
                issue_loads(sK_warp[ahead % STAGES, None, None, None], sV_warp[ahead % STAGES, None, None, None],
                            mK, mV, r_pages[STAGES - 1], batch, head_kv, warp_first + ahead * step, v_end,
                            n_sink, lo, rows, lane)
            if ahead + 1 < num_iters:  # the next iteration's pages: the load has a whole iteration to land
                r_pages[STAGES - 1] = lookup_page(mBlockTable, page_shift, batch, warp_first + (ahead + 1) * step, v_end,
                                                  n_sink, lo, rows, lane)
            cute.arch.cp_async_commit_group()
            stage = it % STAGES
            # The warp's 16-key slices of this iteration: its own (one row tile), or those of its key group.
            for j in cutlass.range(self.row_tiles, unroll=1):
                key_slice = key_group * self.row_tiles + j
                first = v_begin + it * step + key_slice * KEYS_PER_WARP
                sK_slice = sK[stage, key_slice, None, None, None]
                sV_slice = sV[stage, key_slice, None, None, None]
                r_s.fill(0.0)
                for part in cutlass.range_constexpr(parts):
                    self.k_fragment(sK_slice, r_k, g, kq, part * self.k_pieces // parts)
                    if cutlass.const_expr(self.q_in_shared):
                        cute.autovec_copy(cute.local_tile(s_q[tile, lane, None, None], (d // 16 // parts, 8), (part, 0)),
                                          r_q_part_pieces)
                    cute.gemm(tiled_mma, r_s, r_q_part, r_k, r_s)
                for v in cutlass.range_constexpr(cute.size(r_s)):
                    valid = first + score_key(v, kq) < v_end
                    score = r_s[v] * score_scale
                    if cutlass.const_expr(self.alibi or self.drafts):
                        key = cache_row(first + score_key(v, kq), v_end, n_sink, lo)
                    query = seqlen - 1
                    if cutlass.const_expr(self.drafts):
                        query = q_pos[score_row(v)]
                        valid = valid & sees(key, query, q_first[score_row(v)], num_sink_tokens)
                    if cutlass.const_expr(self.alibi):  # - slope x (query position - key position)
                        score = score + alibi_log2[score_row(v)] * Float32(key - query)
                    r_s[v] = Float32(cutlass.select_(valid, score, -Float32.inf))
                online_softmax_update(r_s, acc_o, row_max, row_sum)
                # S's accumulator layout is P V's A layout: the same 8 values in the same order.
                flat(r_p).store(flat(r_s).load().to(self.mma_dtype))
                for part in cutlass.range_constexpr(parts):
                    self.v_fragment(sV_slice, r_v, g, kq, part * self.v_pieces // parts)
                    acc_part = cute.make_tensor(acc_o.iterator + part * cute.size(acc_o) // parts,
                                                cute.make_layout(((2, 2), 1, d // 8 // parts)))
                    cute.gemm(tiled_mma, acc_part, r_p, r_v, acc_part)
        # --8<-- [end:main_loop]

        # --8<-- [start:merge_warps]
        # Every warp's (max, sum, O rows) into shared memory, then one (O, LSE) per head for the split,
        # written to the fp32 workspace. The states go where the ring was: wait until no copy is in
        # flight and every thread has read its last slots.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(2):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)  # the quad's parts of the row
            if kq == 0:
                s_max[key_group, ROWS * tile + g + 8 * r] = row_max[r]
                s_sum[key_group, ROWS * tile + g + 8 * r] = total
        for nb in cutlass.range_constexpr(cute.size(acc_o, mode=[2])):  # per 8-column block, its 4 values
            for v in cutlass.range_constexpr(4 * nb, 4 * nb + 4):
                s_acc[key_group, ROWS * tile + g + 8 * score_row(v), o_column(v, kq, self.v_elems)] = acc_o[v]
        cute.arch.sync_threads()
        # A quantized cache holds V / v_scale: the split's O is v_scale * (its O on the cache's values).
        out_scale = Float32(1.0)
        if cutlass.const_expr(self.quantized):
            out_scale = mVScale[cutlass.min(head_kv, mVScale.shape[0] - 1)]
        # One thread per (head, 4 columns): the warps' weights once per head, 16-byte stores.
        head_quads = d // 4  # 4-column pieces of one head's row
        per_thread = (self.rows * head_quads + self.num_threads - 1) // self.num_threads
        o_part = cute.make_rmem_tensor((4,), Float32)
        for k in cutlass.range_constexpr(per_thread):
            h, quad, real = self.combine_item(k, heads_here)
            lse = split_partial(s_max, s_sum, s_acc, h, quad, o_part)
            if cutlass.const_expr(self.quantized):
                for i in cutlass.range_constexpr(4):
                    o_part[i] = o_part[i] * out_scale
            if real:
                cute.autovec_copy(o_part, cute.local_tile(mPartO[batch, first_head + h, split, None], (4,), (quad,)))
                if quad == 0:
                    mPartLSE[batch, first_head + h, split] = lse
        # --8<-- [end:merge_warps]

        # --8<-- [start:last_block]
        # Two levels of last CTAs: the splits form groups of SPLITS_PER_GROUP. The last CTA of a group
        # folds the group's partials; with more than one group it writes the group's (O, LSE) into
        # workspace slot num_splits + group, and the last of the groups' last CTAs folds those into O.
        # The CTA that finishes the sequence reads SPLITS_PER_GROUP + num_groups partials, not
        # num_splits: 24 instead of 128 for 128 splits.
        num_groups = (num_splits + SPLITS_PER_GROUP - 1) // SPLITS_PER_GROUP
        group = split // SPLITS_PER_GROUP
        group_first = group * SPLITS_PER_GROUP
        splits_in_group = cutlass.min(num_splits - group_first, Int32(SPLITS_PER_GROUP))
        # num_groups + 1 counters per (sequence, head chunk): one per group, then the one of the groups.
        counters = mCounters.iterator + (batch * kv_ctas + kv_chunk) * (num_groups + 1)
        last = arrive_and_elect_last(counters + group, splits_in_group, s_flag)
        first, count = group_first, splits_in_group
        if num_groups > 1:
            if last == 1:  # this CTA finished its group: fold the group into its slot
                self.combine(mPartO, mPartLSE, mO, mLSE, mSink, batch, first_head, heads_here, first, count,
                             num_splits + group, final=False)
                last = arrive_and_elect_last(counters + num_groups, num_groups, s_flag)
            first, count = num_splits, num_groups
        if last == 1:  # this CTA finished the sequence: every partial it folds is in the workspace
            self.combine(mPartO, mPartLSE, mO, mLSE, mSink, batch, first_head, heads_here, first, count,
                         Int32(0), final=True)
        # --8<-- [end:last_block]


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


# --8<-- [start:configs]
@dataclass(frozen=True)
class DecodeConfig:
    """What one compiled decode kernel is specialized for; batch, lengths, head counts, the page
    count and the split count are runtime values."""

    dtype: str = "float16"     # q and O
    head_dim: int = 128
    paged: bool = False        # a paged cache (any page size of PAGE_SIZES: a runtime extent), else contiguous
    cache_dtype: str = ""      # "" = dtype (a 16-bit cache); "float8_e4m3fn" or "int8": a quantized cache with scales
    has_sink: bool = False     # sink logits
    write_lse: bool = False    # also write the LSE
    row_tiles: int = 1         # 16-head row tiles per CTA: row_tiles(G) for a group of G query heads
    warps: int = 4             # warps per CTA (pick_warps)
    appends: bool = False      # k_new, v_new: the new token is written to the cache and attended to
    rotary: str = ""           # one of ROTARY: RoPE on q and k_new (with appends)
    alibi: bool = False        # ALiBi slopes
    rolling: bool = False      # a rolling cache (cache_capacity rows)
    leftpad: bool = False      # cache_leftpad: each sequence's keys start at its own row
    drafts: bool = False       # q [B, n, H_q, D]: n query tokens per sequence (speculative decoding's drafts)
    head_dim_v: int = 0        # V's and O's head dim, 0 for head_dim (a split pair of HEAD_DIMS)

    def __post_init__(self):
        if not self.cache_dtype:
            object.__setattr__(self, "cache_dtype", self.dtype)

    @property
    def cute_dtype(self):
        return cute_dtype(_torch_dtype(self.dtype))

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def name(self) -> str:
        layout = "paged" if self.paged else "contiguous"
        cache = {"float8_e4m3fn": "_fp8", "int8": "_int8"}.get(self.cache_dtype, "")
        rows = f"_rows{ROWS * self.row_tiles}" if self.row_tiles > 1 else ""
        warps = f"_warps{self.warps}" if self.warps != 4 else ""
        extras = (f"{'_append' if self.appends else ''}{'_rope-' + self.rotary if self.rotary else ''}"
                  f"{'_alibi' if self.alibi else ''}{'_rolling' if self.rolling else ''}"
                  f"{'_leftpad' if self.leftpad else ''}{'_drafts' if self.drafts else ''}")
        dims = f"d{self.head_dim}" + (f"v{self.dv}" if self.dv != self.head_dim else "")
        return (f"{self.dtype}{cache}_{dims}_{layout}{rows}{warps}"
                f"{'_sink' if self.has_sink else ''}{'_lse' if self.write_lse else ''}{extras}")


def fake_decode_tensors(config: DecodeConfig):
    import torch
    from cutlass.cute.runtime import make_fake_tensor

    symbols: dict = {}

    def small(dtype, shape):  # int32/fp32 tensors with a contiguous last mode and any row stride
        extents = tuple(symbols.setdefault(e, cute.sym_int(symbol=e)) if isinstance(e, str) else e for e in shape)
        stride = tuple(cute.sym_int64() for _ in shape[:-1]) + (1,)
        return make_fake_tensor(dtype, extents, stride, assumed_align=4)

    q_dtype, cache_dtype = _torch_dtype(config.dtype), _torch_dtype(config.cache_dtype)
    d, dv = config.head_dim, config.dv
    # Draft tokens: q and O [B, n, H_q, D], the LSE [B, H_q, n], the workspace's rows one per (token, head).
    queries = ("B", "n", "H_q") if config.drafts else ("B", "H_q")
    rows = "rows" if config.drafts else "H_q"
    q = symbolic_tensor(q_dtype, (*queries, d), symbols=symbols)
    slots = ("pages", "page_size") if config.paged else ("B_kv", "S_max")
    per_16_bytes = 16 // cache_dtype.itemsize  # 16-byte copies: rows start on 16-byte boundaries
    k = symbolic_tensor(cache_dtype, (*slots, "H_kv", d), symbols=symbols, stride_divisibility=per_16_bytes)
    v = symbolic_tensor(cache_dtype, (*slots, "H_kv", dv), symbols=symbols, stride_divisibility=per_16_bytes)
    o = symbolic_tensor(q_dtype, (*queries, dv), symbols=symbols)
    part_o = symbolic_tensor(torch.float32, ("B", rows, "slots", COMPUTED_HEAD_DIM[d]), symbols=symbols)
    seqlens = small(cutlass.Int32, ("B",))
    block_table = small(cutlass.Int32, ("B_table", "max_pages"))
    sink = small(cutlass.Float32, ("H_sink",))
    k_scale = small(cutlass.Float32, ("H_k_scale",))
    v_scale = small(cutlass.Float32, ("H_v_scale",))
    lse = small(cutlass.Float32, ("B_lse", "H_lse", "n_lse") if config.drafts else ("B_lse", "H_lse"))
    part_lse = small(cutlass.Float32, ("B", rows, "slots"))
    counters = small(cutlass.Int32, ("counters",))
    # The new token's K and V, [B_new, H_kv_new, D] (1 x 1 x D placeholders without appends), and the
    # rotary angles [positions, rotary_dim / 2] (rows of 16 bytes: rotary_dim is a multiple of 16).
    k_new = symbolic_tensor(q_dtype, ("B_new", "H_kv_new", d), symbols=symbols)
    v_new = symbolic_tensor(q_dtype, ("B_new", "H_kv_new", dv), symbols=symbols)
    cos = symbolic_tensor(q_dtype, ("positions", "half_rotary"), symbols=symbols)
    sin = symbolic_tensor(q_dtype, ("positions", "half_rotary"), symbols=symbols)
    alibi = small(cutlass.Float32, ("H_alibi",))
    leftpad = small(cutlass.Int32, ("B_leftpad",))
    return (q, k, v, seqlens, block_table, sink, k_scale, v_scale, o, lse, part_o, part_lse, counters,
            k_new, v_new, cos, sin, alibi, leftpad)


def kernel_and_args(config: DecodeConfig):
    """The kernel and the symbolic arguments it is compiled with (for every batch, length and head count)."""
    return TensorCoreDecode(config), (*fake_decode_tensors(config), Float32(1.0), Int32(-1), Int32(0), Int32(1),
                                      Int32(0))


# The serving extras a compiled configuration carries, in turn: (appends, rotary, alibi, rolling, leftpad,
# drafts); draft tokens never come with an append (one new token).
EXTRAS = [(False, "", False, False, False, False), (True, "halves", False, False, True, False),
          (False, "", True, False, True, True), (True, "interleaved", False, True, False, False),
          (True, "", True, False, False, False), (False, "", False, True, False, True)]


def compile_matrix() -> list[DecodeConfig]:
    """Every query dtype x cache dtype x head dim x cache layout (contiguous, paged: one kernel for every
    page size) x row tiles x warps (8 at D <= 128: pick_warps); the compiled-out features (sinks, LSE,
    and the serving extras) rotate so that each value meets every head dim and cache dtype."""
    flags = [(False, False), (True, False), (False, True), (True, True)]
    configs = []
    for d, dv in HEAD_DIMS:  # the rotation counts each head dim's layouts from 0: each meets every value
        layouts = [(dtype, cache, paged, tiles, warps) for dtype in ("float16", "bfloat16")
                   for cache in (dtype, *QUANTIZED) for paged in (False, True)
                   for tiles in ROW_TILES if tiles <= row_tiles(64, d)
                   for warps in WARPS if warps == 4 or d <= 128]
        configs += [DecodeConfig(dtype, d, paged, cache, *flags[i % len(flags)], tiles, warps, *EXTRAS[i % len(EXTRAS)],
                                 head_dim_v=validation.distinct_head_dim_v(d, dv))
                    for i, (dtype, cache, paged, tiles, warps) in enumerate(layouts)]
    return configs


KERNEL_CONFIGS = compile_matrix()


def cross_compile_config(config: DecodeConfig, keep: bool = False):
    """Compile for sm_90a on any machine (no GPU needed) and report registers, smem, spills."""
    kernel, args = kernel_and_args(config)
    return cross_compile(kernel, *args, name=f"stage{STAGE:02d}_{config.name}", keep=keep)
# --8<-- [end:configs]


# --8<-- [start:num_splits]
def new_token_bytes(head_dim: int, cache_dtype: str, appends: bool) -> int:
    """Shared memory for the appended token's K and V rows as the cache stores them and as given (16-bit;
    appends only)."""
    return 2 * head_dim * (cache_bytes(cache_dtype) + 2) if appends else 0


def rotated_q_bytes(head_dim: int, tiles: int, rotary: str) -> int:
    """Shared memory for the CTA's query rows, rotated in place, and the position's cos and sin rows (16-bit;
    with rotary only)."""
    return (ROWS * tiles + 1) * head_dim * 2 if rotary else 0


def shared_bytes(head_dim: int, cache_dtype: str, tiles: int = 1, warps: int = 4, appends: bool = False,
                 rotary: str = "") -> int:
    """Bytes of the kernel's SharedStorage: the work area, Q's fragments (D = 256), the appended token's rows,
    the rotated query rows and the last-block flag (at the head dim the kernel computes with)."""
    head_dim = COMPUTED_HEAD_DIM[head_dim]
    return -(-(work_bytes(head_dim, cache_dtype, warps) + q_fragment_bytes(head_dim, tiles)
               + new_token_bytes(head_dim, cache_dtype, appends) + rotated_q_bytes(head_dim, tiles, rotary) + 4)
             // 128) * 128


def ctas_per_sm(head_dim: int, cache_dtype: str = "float16", tiles: int = 1, warps: int = 4) -> int:
    """CTAs of this kernel that fit on one SM at once, by registers and by shared memory.

    64K registers / (registers per thread x 32 x warps), with the register
    counts ptxas reports for the sm_90a build (the cross-compile tests check
    them), and 228 KB of shared memory per SM / (SharedStorage + the 1 KB the
    system reserves per CTA).
    """
    head_dim = COMPUTED_HEAD_DIM[head_dim]
    registers = -(-REGISTERS_PER_THREAD[head_dim, cache_bytes(cache_dtype)] // 8) * 8  # allocated per warp in blocks of 256 = 8 per thread
    by_registers = 65536 // (registers * 32 * warps)
    by_shared = SHARED_BYTES_PER_SM // (shared_bytes(head_dim, cache_dtype, tiles, warps) + 1024)
    return max(1, min(16, by_registers, by_shared))


def auto_num_splits(batch: int, heads_kv: int, group_size: int, max_keys: int, num_sms: int, head_dim: int = 128,
                    cache_dtype: str = "float16", tiles: int = 1, warps: int = 4) -> int:
    """The split count for num_splits=0: ``course.runtime.launch.pick_num_splits`` with this kernel's CTAs per
    SM, at least MIN_KEYS_PER_SPLIT keys per split (SHORT_SPLIT_KEYS for sequences shorter than
    SHORT_SPLITS such splits) and, for few sequences, SPLIT_CTAS_PER_SM (sequence, KV head) streams
    per SM.

    The CTAs before splitting are B x H_kv x head_chunks(G, tiles): MQA with
    few sequences still fills the GPU. With one row tile, the ceil(G / 16)
    CTAs of a group read the same K and V (the second reads hit L2), so they
    count as one stream. With more (``pick_row_tiles``), every CTA slot of the
    GPU gets a CTA: a CTA's 4 warps then do up to 4 times the math per key.
    """
    chunks = head_chunks(group_size, tiles)
    fits = ctas_per_sm(head_dim, cache_dtype, tiles, warps)
    short = max_keys < SHORT_SPLITS * MIN_KEYS_PER_SPLIT
    return launch.pick_num_splits(batch * heads_kv * chunks, max_keys, num_sms, fits,
                                  split_ctas_per_sm=SPLIT_CTAS_PER_SM * chunks if tiles == 1 else fits,
                                  min_keys_per_split=SHORT_SPLIT_KEYS if short else MIN_KEYS_PER_SPLIT)


def pick_warps(batch: int, heads_kv: int, group_size: int, max_keys: int, num_sms: int, head_dim: int = 128,
               cache_dtype: str = "float16", tiles: int = 1) -> int:
    """8 warps per CTA when a launch of 8-warp CTAs (with its own split count) has at most one CTA per
    SM, else 4: few or short sequences, where a CTA's 4 warps, one per scheduler, each wait on
    their own latencies and nothing else runs on the SM; where 4-warp CTAs fill two per SM, 8 warps
    lose ("Eight warps when the GPU is not full" on the page measures both). Row tiles take 8 warps
    too, as their split count fills one 8-warp CTA per SM: two key groups of 4 warps, each on its own
    barrier. D = 256 keeps 4: 8 warps' ring does not fit in shared memory."""
    if head_dim > 128:
        return 4
    ctas = batch * heads_kv * head_chunks(group_size, tiles)
    splits = auto_num_splits(batch, heads_kv, group_size, max_keys, num_sms, head_dim, cache_dtype, tiles, warps=8)
    return 8 if ctas * splits <= num_sms else 4


@dataclass(frozen=True)
class DecodePlan:
    """How one launch is cut: row tiles per CTA, warps per CTA and splits per sequence. The result does
    not depend on it beyond rounding; ``decode_attention(..., plan=...)`` takes one (tests force each
    variant so), ``choose_plan`` makes the one the rules above pick. ``num_splits = 0``: the split rule's
    count for these tiles and warps."""

    row_tiles: int = 1
    warps: int = 4
    num_splits: int = 0


def choose_plan(batch: int, heads_kv: int, group_size: int, max_keys: int, num_sms: int, head_dim: int,
                cache_dtype: str, plan: DecodePlan | None = None, num_splits: int = 0) -> DecodePlan:
    """The plan of a launch: ``plan`` where the caller gave one, else pick_row_tiles and pick_warps; the
    split count from ``num_splits`` when positive, else the plan's, else auto_num_splits."""
    if plan is None:
        tiles = pick_row_tiles(batch, heads_kv, group_size, max_keys, num_sms, head_dim, cache_dtype)
        plan = DecodePlan(tiles, pick_warps(batch, heads_kv, group_size, max_keys, num_sms, head_dim, cache_dtype,
                                            tiles))
    splits = num_splits or plan.num_splits or auto_num_splits(batch, heads_kv, group_size, max_keys, num_sms,
                                                              head_dim, cache_dtype, plan.row_tiles, plan.warps)
    return DecodePlan(plan.row_tiles, plan.warps, splits)
# --8<-- [end:num_splits]


def check_plan(plan, group_size: int, head_dim: int) -> None:
    """A plan a caller passes: a DecodePlan whose row tiles and warps a kernel of this stage compiles."""
    if plan is None:
        return
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a DecodePlan or None; got {type(plan).__name__}")
    most = row_tiles(group_size, head_dim)
    if plan.row_tiles not in ROW_TILES or plan.row_tiles > most:
        raise ValueError(f"plan.row_tiles = {plan.row_tiles!r}; a group of {group_size} heads at D = {head_dim} "
                         f"takes 1 to {most} row tiles, one of {ROW_TILES}")
    warps = WARPS if head_dim <= 128 else (4,)
    if plan.warps not in warps:
        raise ValueError(f"plan.warps = {plan.warps!r}; D = {head_dim} takes one of {warps}")
    validation.check_int32("plan.num_splits", plan.num_splits, minimum=0)


# --8<-- [start:api]
_PLANS: dict = {}


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                     window_size_left=-1, sink_logits=None, num_sink_tokens=0, num_splits=0,
                     return_lse=False, out=None, check_lengths=None, k_scale=None, v_scale=None, plan=None,
                     k_new=None, v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                     alibi_slopes=None, cache_capacity=None, cache_leftpad=None):
    """One query token per sequence (or a few: draft tokens) against its KV cache; the contract is
    docs/contract.md.

    q [B, H_q, D]; k_cache, v_cache [B, S_max, H_kv, D], or paged [num_pages,
    page_size, H_kv, D] with block_table [B, max_pages] int32, v_cache's D
    being D_v where a pair of HEAD_DIMS splits them (O then has D_v columns);
    cache_seqlens [B] int32. The cache is q's dtype, or float8_e4m3fn or int8 with ``k_scale``,
    ``v_scale`` (float32, [H_kv] or scalar tensors; the cache holds K / k_scale
    and V / v_scale: ``course.runtime.kv_cache.quantize_kv_cache`` makes one). Returns
    o [B, H_q, D] (and lse [B, H_q] float32 with return_lse). ``out``
    (optional) receives O. ``check_lengths=True`` reads cache_seqlens, the
    block table and the scales on the host (a synchronization) to reject
    lengths beyond the cache, pages outside the pool and scales that are not
    finite and > 0; ``None`` follows ``COURSE_CHECK_LENGTHS``
    (``launch.check_device_values``). Unchecked, the kernel clamps lengths and
    pages to the cache, so it never reads outside it. ``plan`` (a DecodePlan)
    replaces the rules' row tiles, warps and split count.

    The serving step's extras, each compiled out when unused:
    ``k_new``, ``v_new`` [B, H_kv, D] and [B, H_kv, D_v] (q's dtype): the new token, at position
    cache_seqlens[b] (the tokens before it), is written to the cache there
    (quantized for a quantized cache) and attended to with the cache_seqlens[b]
    before it; ``cache_seqlens`` is not changed (the caller adds 1).
    ``rotary_cos``, ``rotary_sin`` [positions, rotary_dim / 2] (q's dtype,
    with k_new): q and k_new rotated at that position, pairs (i, i + rotary_dim / 2),
    or (2i, 2i + 1) with ``rotary_interleaved``. ``alibi_slopes`` [H_q] float32:
    scores get - slope x (query position - key position). ``cache_capacity``:
    a rolling cache of that many rows per sequence: the num_sink_tokens first
    tokens keep their rows, token t >= num_sink_tokens lives in row
    num_sink_tokens + (t - num_sink_tokens) mod (cache_capacity - num_sink_tokens);
    it needs a window that fits (window_size_left < cache_capacity - num_sink_tokens).
    ``cache_leftpad`` [B] int32: left-padded sequences, as a padded batch's
    cache holds them: sequence b is rows cache_leftpad[b] .. of its cache, the
    rows before it are padding, never read; positions (windows, sink tokens,
    RoPE, ALiBi) count from its first real row. Not with a rolling cache.

    Draft tokens (speculative decoding's verification step): q [B, n, H_q, D]
    holds n query tokens per sequence, the last n of its cache_seqlens[b] keys
    (their K and V already in the cache); token i sees the keys up to its own
    position cache_seqlens[b] - n + i, as causal attention aligned bottom-right
    does, each its own window. O has q's shape, the LSE is [B, H_q, n]. Not
    with k_new (one new token).
    """
    key = launch.signature(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits, k_scale, v_scale, out,
                           softmax_scale, window_size_left, num_sink_tokens, num_splits, return_lse, plan,
                           k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes, cache_capacity,
                           cache_leftpad)
    check = launch.check_device_values(check_lengths)
    run = launch.cached_plan(_PLANS, key, lambda: plan_launch(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
        window_size_left=window_size_left, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
        num_splits=num_splits, return_lse=return_lse, out=out, k_scale=k_scale, v_scale=v_scale, plan=plan,
        check_lengths=check, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, cache_capacity=cache_capacity,
        cache_leftpad=cache_leftpad))
    if check:
        validation.check_decode_values(cache_seqlens, block_table, run.shape, k_scale, v_scale, cache_leftpad)
    return run(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits, k_scale, v_scale, out,
               k_new, v_new, rotary_cos, rotary_sin, alibi_slopes, cache_leftpad)


def plan_launch(q, k_cache, v_cache, cache_seqlens, *, block_table, softmax_scale, window_size_left, sink_logits,
                num_sink_tokens, num_splits, return_lse, out, k_scale, v_scale, plan, check_lengths, k_new=None,
                v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False, alibi_slopes=None,
                cache_capacity=None, cache_leftpad=None):
    """Everything ``decode_attention`` does that depends only on the call's signature: validation, the
    plan (tiles, warps, splits), the kernel and its compile, placeholders, workspace sizes.

    Returns ``run(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits,
    k_scale, v_scale, out, k_new, v_new, rotary_cos, rotary_sin, alibi_slopes, cache_leftpad)``,
    which allocates the outputs and workspace and launches.
    """
    import torch

    shape = validation.check_decode_inputs(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
        window_size_left=window_size_left, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
        num_splits=num_splits, return_lse=return_lse, out=out, head_dims=HEAD_DIMS, page_sizes=PAGE_SIZES,
        k_scale=k_scale, v_scale=v_scale, stage=STAGE, max_token_stride=MAX_TOKEN_STRIDE, k_new=k_new,
        v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes, cache_capacity=cache_capacity, cache_leftpad=cache_leftpad,
    )
    # Draft tokens are more rows of each KV head's group: n x G of them (draft_rows).
    group_size = shape.queries * shape.heads_q // shape.heads_kv
    drafts = shape.queries > 1
    check_plan(plan, group_size, shape.head_dim)
    if check_lengths:  # values before devices, so that a CPU test reaches them (decode_attention checks again)
        validation.check_decode_values(cache_seqlens, block_table, shape, k_scale, v_scale, cache_leftpad)
    validation.check_on_gpu(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                            block_table=block_table, sink_logits=sink_logits, k_scale=k_scale, v_scale=v_scale,
                            out=out, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                            alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad)
    device = q.device
    cache_dtype = str(k_cache.dtype).removeprefix("torch.")
    max_keys = (shape.capacity if window_size_left < 0
                else min(shape.capacity, window_size_left + shape.queries + num_sink_tokens))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = choose_plan(shape.batch, shape.heads_kv, group_size, max_keys, num_sms, shape.head_dim, cache_dtype,
                       plan, num_splits)
    kv_ctas = shape.heads_kv * head_chunks(group_size, plan.row_tiles)
    rotary = "" if rotary_cos is None else "interleaved" if rotary_interleaved else "halves"
    config = DecodeConfig(str(q.dtype).removeprefix("torch."), shape.head_dim,
                          block_table is not None, cache_dtype, sink_logits is not None,
                          bool(return_lse), plan.row_tiles, plan.warps, shape.appends, rotary,
                          alibi_slopes is not None, shape.rolling > 0, cache_leftpad is not None, drafts,
                          shape.head_dim_v)
    kernel = launch.compiled((TensorCoreDecode, config), lambda: kernel_and_args(config))
    scale_log2 = validation.resolve_scale(softmax_scale, shape.head_dim) * LOG2_E
    no_scale, no_lse = launch.placeholder(device, (1,)), launch.placeholder(device, (1, 1, 1) if drafts else (1, 1))
    no_table = launch.placeholder(device, (1, 1), torch.int32)
    no_leftpad = launch.placeholder(device, (1,), torch.int32)
    no_k_row = launch.placeholder(device, (1, 1, shape.head_dim), q.dtype)      # k_new
    no_v_row = launch.placeholder(device, (1, 1, shape.dv), q.dtype)            # v_new
    no_angles = launch.placeholder(device, (1, ROTARY_CHUNK), q.dtype)          # rotary_cos, rotary_sin
    scalar_scales = k_scale is not None and k_scale.dim() == 0, v_scale is not None and v_scale.dim() == 0
    slots = workspace_slots(plan.num_splits)
    part_o_shape = (shape.batch, shape.queries * shape.heads_q, slots, COMPUTED_HEAD_DIM[shape.head_dim])
    part_lse_shape = (shape.batch, shape.queries * shape.heads_q, slots)
    lse_shape = (shape.batch, shape.heads_q) + ((shape.queries,) if q.dim() == 4 else ())
    # q [B, 1, H_q, D] is one token per sequence: [B, H_q, D] to the kernel.
    one_token = q.dim() == 4 and not drafts
    partials = launch.DecodePartials(device, part_o_shape, part_lse_shape)
    num_counters = shape.batch * kv_ctas * (split_groups(plan.num_splits) + 1)

    def run(q, k_cache, v_cache, cache_seqlens, block_table, sink_logits, k_scale, v_scale, out, k_new=None,
            v_new=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None, cache_leftpad=None):
        if out is None:
            out = q.new_empty((*q.shape[:-1], shape.dv))
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device) if return_lse else no_lse
        part_o, part_lse = partials.views()
        q_, out_, lse_ = q, out, lse
        if one_token:
            q_, out_, lse_ = q[:, 0], out[:, 0], lse[..., 0] if return_lse else no_lse
        kernel(q_, k_cache, v_cache, cache_seqlens, no_table if block_table is None else block_table,
               no_scale if sink_logits is None else sink_logits,
               no_scale if k_scale is None else k_scale.reshape(1) if scalar_scales[0] else k_scale,
               no_scale if v_scale is None else v_scale.reshape(1) if scalar_scales[1] else v_scale,
               out_, lse_, part_o, part_lse, launch.decode_counters(device, num_counters),
               no_k_row if k_new is None else k_new, no_v_row if v_new is None else v_new,
               no_angles if rotary_cos is None else rotary_cos, no_angles if rotary_sin is None else rotary_sin,
               no_scale if alibi_slopes is None else alibi_slopes,
               no_leftpad if cache_leftpad is None else cache_leftpad, scale_log2,
               window_size_left, num_sink_tokens, plan.num_splits, shape.rolling)
        return (out, lse) if return_lse else out

    run.shape, run.plan = shape, plan
    return run
# --8<-- [end:api]


if __name__ == "__main__":
    from course.testing import demo

    demo.decode(decode_attention, lengths=[1, 300, 5000, 70000], page_size=64, heads_q=64, heads_kv=8)
