"""CPU numerics: a stage's device helpers run on the CPU, on every thread's registers, against course.testing.reference.

A ``@cute.jit`` function that launches no kernel is compiled for the host and runs
there, on CPU tensors wrapped with ``cutlass.cute.runtime.from_dlpack``. The helpers a
learner writes for masks, softmax statistics, LSE and merging are register arithmetic,
so the host functions below call them unchanged (from ``--impl``'s module) on the
fragments every thread of a CTA would hold, and the tests compare what they compute
with course.testing.reference. No GPU is involved.

The GPU instructions those helpers use have no host lowering. While a host function is
traced, ``host_stand_ins`` puts host code in their place that computes the same value:

- ``cute.arch.fmax`` and ``rcp_approx``: max (NaN ignored, as FMNMX does) and 1 / x;
- ``cute.arch.warp_reduction_max`` / ``_sum`` over a quad (``threads_in_group=4``):
  the thread's own value, because the softmax checks give each thread whole rows. A
  missing quad reduction is therefore invisible here; the GPU tests see it;
- ``cute.arch.vote_any_sync``: the thread's own predicate (stage 9's check runs one
  thread of the warp, whose rows then see only its own keys);
- stage 8's tile scheduler reads ``block_idx`` before it knows whether the order is
  linear; the linear order never uses it, so block (0, 0, 0) stands in;
- for the decode kernel's last-CTA election, ``thread_idx`` (thread 0 of each CTA),
  ``sync_threads`` (one thread: nothing to wait for), ``atomic_add`` and ``store`` on
  the counter (plain loads and stores: the CTAs run one after another).

Any other GPU-only instruction in the traced code stops the check with its file and line
(``GpuOnlyInstruction``) instead of crashing the host compiler. Pipelines, TMA and WGMMA
cannot run on a CPU: the TODOs that use them are checked by the GPU tests only.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cute.runtime import from_dlpack

from course.runtime import prefill, validation
from course.testing import reference
from course.runtime.stages import ROOT

GPU_ONLY_OPS = ("nvvm.", "nvgpu.", "gpu.", "llvm.inline_asm")
MMA_THREADS = 256  # the two consumer warpgroups of a prefill CTA
Q_TILE_ROWS = 128  # a prefill CTA's Q tile: 64 rows per MMA warpgroup (stage 8 names it per kernel, tile_m)
ROW_TILE = 32      # keys per tile in the whole-row softmax checks (the kernels use 128; the math is the same)
O_COLUMNS = 8      # columns of O in the whole-row softmax checks
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
O_TOLERANCE = 1e-4     # fp32 helpers against a float64 reference, outputs of magnitude ~3
LSE_TOLERANCE = 1e-5


class GpuOnlyInstruction(Exception):
    """The traced helper uses a GPU instruction that has no host stand-in."""


# ---------------------------------------------------------------- host stand-ins

def _max(a, b, **_):
    return cutlass.max(Float32(a), Float32(b))  # arith.maxnumf ignores NaN, as nvvm.fmax does


def _reciprocal(a, **_):
    return Float32(1.0) / Float32(a)


def _quad_of_one(value, *, threads_in_group=32, **_):
    if threads_in_group != 4:
        raise GpuOnlyInstruction(f"a warp reduction over {threads_in_group} threads: the CPU checks can only stand in "
                                 "for quad reductions (threads_in_group=4)")
    return value


def _own_vote(predicate, **_):
    return predicate


def _index_zero(**_):
    return Int32(0), Int32(0), Int32(0)


def _nothing_to_wait_for(**_):
    return None


def _cell(ptr):
    return cute.make_tensor(ptr, cute.make_layout(1))


def _add_and_return_old(ptr, value, **_):
    old = _cell(ptr)[0]
    _cell(ptr)[0] = old + value
    return old


def _store(ptr, value, **_):
    _cell(ptr)[0] = value


STAND_INS = {
    "fmax": _max, "rcp_approx": _reciprocal,
    "warp_reduction_max": _quad_of_one, "warp_reduction_sum": _quad_of_one, "vote_any_sync": _own_vote,
    "thread_idx": _index_zero, "block_idx": _index_zero, "sync_threads": _nothing_to_wait_for,
    "atomic_add": _add_and_return_old, "store": _store,
}


@contextmanager
def host_stand_ins():
    """Swap the GPU instructions of STAND_INS for host code while a host function is traced."""
    saved = {name: getattr(cute.arch, name) for name in STAND_INS}
    for name, stand_in in STAND_INS.items():
        setattr(cute.arch, name, stand_in)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(cute.arch, name, original)


def _source_line(location: ir.Location) -> str:
    found = re.findall(r'"([^"]+\.py)":(\d+)', str(location))
    if not found:
        return "an unknown line"
    path, line = found[-1]
    try:
        path = str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        pass
    return f"{path}:{line}"


def _reject_gpu_only_ops(dsl, module, function_name):
    """Trace-finalize hook: name the GPU-only operations before the host compiler aborts on them."""
    found = []

    def visit(op):
        if op.name.startswith(GPU_ONLY_OPS):
            found.append(f"{op.name} at {_source_line(op.location)}")
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if found:
        raise GpuOnlyInstruction(
            "this helper uses GPU instructions the CPU check has no stand-in for: " + "; ".join(sorted(set(found)))
            + ". Write the arithmetic with cute.math / cutlass functions (host stand-ins exist for "
            + ", ".join(f"cute.arch.{name}" for name in STAND_INS) + "), or check it on a Hopper GPU.")


def _runtime(value):
    """A host function's argument: a CuTe view of a torch CPU tensor, or a Python int or float as Int32 / Float32."""
    if isinstance(value, torch.Tensor):
        return from_dlpack(value)
    return Int32(value) if isinstance(value, int) else Float32(value)


class CpuFunction:
    """A host function compiled for this machine; call it with torch CPU tensors and Python numbers."""

    def __init__(self, compiled):
        self._compiled = compiled

    def __call__(self, *args):
        self._compiled(*(_runtime(a) for a in args))


_CACHE: dict = {}  # (host function, static arguments, argument shapes) -> CpuFunction


def compile_on_cpu(host_fn, static: tuple, args: tuple) -> CpuFunction:
    """``cute.compile`` a host function for the CPU; ``static`` are its compile-time (Constexpr) arguments.

    Compiled once per static arguments and argument shapes, then reused. The target arch
    is sm_90a because the Hopper MMA partitioners check it while tracing; nothing here
    runs on a GPU.
    """
    key = (host_fn, static, tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else type(a) for a in args))
    if key not in _CACHE:
        with host_stand_ins():
            try:
                compiled = cute.compile(host_fn, *static, *(_runtime(a) for a in args),
                                        options="--gpu-arch sm_90a --generate-line-info",
                                        trace_finalize_hooks=_reject_gpu_only_ops)
            except Exception as error:  # the DSL wraps a hook's exception: show ours as it is
                if isinstance(error.__cause__, GpuOnlyInstruction):
                    raise error.__cause__ from None
                raise
        _CACHE[key] = CpuFunction(compiled)
    return _CACHE[key]


# ---------------------------------------------------------------- prefill: masks and tile ranges (stages 4+)

def kv_tile_keys(module) -> int:
    """The keys of a KV tile: the stage's TILE_N; from stage 8 on, per head dim (TILES), 128 at D = 128."""
    return module.TILES[128, 128].tile_n if module.STAGE >= 8 else module.TILE_N


def qk_tiled_mma(module, tile_n: int, tile_m: int = Q_TILE_ROWS):
    """S = Q K^T partitioned as the kernel does it (qk_mma in Attention.__call__): the (row, key) of each register."""
    return sm90_utils.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K, OperandMajorMode.K,
                                             Float32, (tile_m // 64, 1, 1), (64, tile_n))


def window_mask(module, config, m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, tile_n: int,
                tile_m: int = Q_TILE_ROWS):
    """The stage's WindowMask of Q tile ``m_block``; num_sink_tokens is one of its arguments from stage 5 on,
    the Q tile's rows (64 per MMA warpgroup) and keys from stage 8 on."""
    if module.STAGE >= 8:
        return module.WindowMask(m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config, tile_m, tile_n)
    if module.STAGE >= 5:
        return module.WindowMask(m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config)
    return module.WindowMask(m_block, seqlen_q, seqlen_k, left, right, config)


@cute.jit
def mask_q_tile(module: cutlass.Constexpr, config: cutlass.Constexpr, n_blocks: cutlass.Constexpr,
                tile_n: cutlass.Constexpr, tile_m: cutlass.Constexpr, scores: cute.Tensor, tiles: cute.Tensor, visits: cute.Tensor, m_block: Int32, seqlen_q: Int32,
                seqlen_k: Int32, left: Int32, right: Int32, num_sink_tokens: Int32):
    """WindowMask of Q tile ``m_block`` on every register of every consumer thread, for each KV tile.

    ``scores`` [TILE_M, n_blocks * TILE_N], zeros, gets -inf where ``apply`` masks a key;
    ``tiles`` gets [n_block_min, n_block_max, sink tiles] (``kv_block_range``, ``sink_block_count``),
    and from stage 8 on the loop's [first, end) of unmasked steps (``unmasked_steps``); ``visits``
    [2, n_blocks] gets, per step, its KV tile (``kv_block``), and per KV tile ``tile_is_partial``.
    """
    qk_mma = qk_tiled_mma(module, tile_n, tile_m)
    mask = window_mask(module, config, m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, tile_n, tile_m)
    n_block_min, n_block_max = mask.kv_block_range()
    tiles[0] = n_block_min
    tiles[1] = n_block_max
    if cutlass.const_expr(module.STAGE >= 5):
        tiles[2] = mask.sink_block_count(n_block_min)
    if cutlass.const_expr(module.STAGE >= 8):
        tiles[3], tiles[4] = mask.unmasked_steps(n_block_min, n_block_max)
        n_steps = tiles[2] + n_block_max - n_block_min
        kv_block, tile_is_partial = mask.kv_block, mask.tile_is_partial  # (bound: the branch may not carry mask)
        for i in cutlass.range_constexpr(n_blocks):
            visits[0, i] = -1
            if i < n_steps:
                visits[0, i] = kv_block(i, n_block_min, n_block_max)
            visits[1, i] = Int32(tile_is_partial(i))
    apply = mask.apply  # (a runtime loop may not carry the mask object; its bound method is fine)
    for n_block in range(n_blocks):
        for thread in range(2 * tile_m):  # 128 threads per 64-row MMA warpgroup
            thr = qk_mma.get_slice(thread)
            acc_S = thr.make_fragment_C(thr.partition_shape_C((tile_m, tile_n)))
            tScS = thr.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
            acc_S.fill(0.0)
            apply(acc_S, tScS, n_block)
            for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                row, key = tScS[i]
                scores[row, n_block * tile_n + key] = acc_S[i]


# ---------------------------------------------------------------- prefill: each thread's softmax path (stages 1-6)

def whole_rows(columns: int):
    """A fragment shaped like a WGMMA accumulator ((2, 2, N/8), MMA_M, MMA_N) that holds 2 whole rows of ``columns``.

    In the kernel 4 threads (a quad) share a row; here one thread has all of it, so its quad
    reductions have nothing to add (``host_stand_ins``) and the row statistics are exact.
    """
    return cute.make_rmem_tensor(((2, 2, columns // 2), 1, 1), Float32)


@cute.jit
def load_rows(rows: cute.Tensor, source: cute.Tensor, row0: Int32, col0: Int32):
    for r in cutlass.range_constexpr(cute.size(rows, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(rows, mode=[1])):
            rows[r, c] = source[row0 + r, col0 + c]


@cute.jit
def add_pv(p: cute.Tensor, o: cute.Tensor, v: cute.Tensor, key0: Int32):
    """O += P V for one tile of keys: the second WGMMA's job, in fp32."""
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for d in cutlass.range_constexpr(cute.size(o, mode=[1])):
            total = o[r, d]
            for c in cutlass.range_constexpr(cute.size(p, mode=[1])):
                total = total + p[r, c] * v[key0 + c, d]
            o[r, d] = total


@cute.jit
def attend_rows(module: cutlass.Constexpr, n_tiles: cutlass.Constexpr,
                scores: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
                scale_log2: cutlass.Float32, sink_log2: cutlass.Float32):
    """The stage's softmax path of a consumer thread, 2 whole rows per thread, over ``n_tiles`` tiles of keys.

    ``scores`` [rows, n_tiles * ROW_TILE]: raw Q K^T, -inf where a mask hides a key. As the
    kernel does: stage 1 softmax_rows; stage 2 update_row_max over every tile, then
    exponentiate_rows; stage 3 on online_softmax; then O += P V (here), the quad
    reductions, normalize_rows. ``o`` [rows, O_COLUMNS] gets O; ``lse`` the LSE (stage 6).
    """
    for thread in range(cute.size(o, mode=[0]) // 2):
        attend_two_rows(module, n_tiles, scores, v, o, lse, scale_log2, sink_log2, 2 * thread)


@cute.jit
def attend_two_rows(module: cutlass.Constexpr, n_tiles: cutlass.Constexpr,
                    scores: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
                    scale_log2: cutlass.Float32, sink_log2: cutlass.Float32, row0: Int32):
    """One thread of attend_rows: rows row0 and row0 + 1. (A function of its own: a runtime loop
    may not carry the module object, whose helpers this body calls.)"""
    acc_S, acc_O = whole_rows(ROW_TILE), whole_rows(O_COLUMNS)
    s, out = module.rows_cols_view(acc_S), module.rows_cols_view(acc_O)
    row_max = cute.make_rmem_tensor(2, Float32)
    row_sum = cute.make_rmem_tensor(2, Float32)
    row_lse = cute.make_rmem_tensor(2, Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    row_lse.fill(0.0)
    acc_O.fill(0.0)
    if cutlass.const_expr(module.STAGE == 1):
        load_rows(s, scores, row0, 0)
        sums = module.softmax_rows(acc_S, scale_log2)
        for r in cutlass.range_constexpr(2):
            row_sum[r] = sums[r]
        add_pv(s, out, v, 0)
    if cutlass.const_expr(module.STAGE == 2):
        for tile in cutlass.range_constexpr(n_tiles):
            load_rows(s, scores, row0, tile * ROW_TILE)
            module.update_row_max(acc_S, row_max)
        module.quad_allreduce(row_max, cute.arch.warp_reduction_max)
        for tile in cutlass.range_constexpr(n_tiles):
            load_rows(s, scores, row0, tile * ROW_TILE)
            module.exponentiate_rows(acc_S, row_max, scale_log2, row_sum)
            add_pv(s, out, v, tile * ROW_TILE)
    if cutlass.const_expr(module.STAGE >= 3):
        for tile in cutlass.range_constexpr(n_tiles):
            load_rows(s, scores, row0, tile * ROW_TILE)
            module.online_softmax(acc_S, acc_O, row_max, row_sum, scale_log2)
            add_pv(s, out, v, tile * ROW_TILE)
    if cutlass.const_expr(module.STAGE >= 2):
        module.quad_allreduce(row_sum, cute.arch.warp_reduction_sum)
    if cutlass.const_expr(module.STAGE >= 6):
        module.normalize_rows(acc_O, row_sum, row_max, scale_log2, sink_log2, row_lse)
    if cutlass.const_expr(module.STAGE == 5):
        module.normalize_rows(acc_O, row_sum, row_max, scale_log2, sink_log2)
    if cutlass.const_expr(module.STAGE <= 4):
        module.normalize_rows(acc_O, row_sum)
    for r in cutlass.range_constexpr(2):
        lse[row0 + r] = row_lse[r]
        for d in cutlass.range_constexpr(O_COLUMNS):
            o[row0 + r, d] = out[r, d]


# ---------------------------------------------------------------- prefill: LSE store and merge (stage 6)

@cute.jit
def store_lse_of_q_tile(module: cutlass.Constexpr, mLSE: cute.Tensor, m_block: Int32, seqlen_q: Int32):
    """Every consumer thread calls store_lse with its rows' LSE set to row + 0.5, into mLSE [1, 1, S_q]."""
    qk_mma = qk_tiled_mma(module, module.TILE_N)
    row0 = m_block * module.TILE_M
    rows_cols_view, store_lse = module.rows_cols_view, module.store_lse  # (not the module object: see fold_keys)
    for thread in range(MMA_THREADS):
        tScS = qk_mma.get_slice(thread).partition_C(cute.make_identity_tensor((module.TILE_M, module.TILE_N)))
        coord = rows_cols_view(tScS)
        row_lse = cute.make_rmem_tensor(cute.size(coord, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(coord, mode=[0])):
            row_lse[r] = Float32(row0 + coord[r, 0][0]) + 0.5
        store_lse(row_lse, mLSE, tScS, row0, seqlen_q, Int32(0), Int32(0), thread)


@cute.jit
def merge_pairs(module: cutlass.Constexpr, lse_a: cute.Tensor, lse_b: cute.Tensor, out: cute.Tensor):
    """out[i] = merge_weights(lse_a[i], lse_b[i]) as (w_a, w_b, lse)."""
    merge_weights = module.merge_weights  # (not the module object: see fold_keys)
    for i in range(cute.size(lse_a)):
        w_a, w_b, lse = merge_weights(lse_a[i], lse_b[i])
        out[i, 0] = w_a
        out[i, 1] = w_b
        out[i, 2] = lse


# ---------------------------------------------------------------- decode (stage 7)

@cute.jit
def fold_keys(module: cutlass.Constexpr, scores: cute.Tensor, v: cute.Tensor, state: cute.Tensor):
    """One key group's running softmax over ``scores`` [steps, H, U] (log2 units, -inf past the end) and
    ``v`` [steps, U, VEC]: online_softmax_update once per step. ``state`` [H, 2 + VEC] gets
    (max, sum, unnormalized O) of every head."""
    steps, heads, unroll = cute.size(scores, mode=[0]), cute.size(scores, mode=[1]), cute.size(scores, mode=[2])
    row_max = cute.make_rmem_tensor((heads,), Float32)
    row_sum = cute.make_rmem_tensor((heads,), Float32)
    acc = cute.make_rmem_tensor(cute.make_ordered_layout((heads, module.VEC), order=(1, 0)), Float32)
    r_scores = cute.make_rmem_tensor((heads, unroll), Float32)
    r_v = cute.make_rmem_tensor(cute.make_ordered_layout((unroll, module.VEC), order=(1, 0)), v.element_type)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    acc.fill(0.0)
    online_softmax_update = module.online_softmax_update  # (a runtime loop may not carry the module object)
    for step in range(steps):
        for u in cutlass.range_constexpr(unroll):
            for h in cutlass.range_constexpr(heads):
                r_scores[h, u] = scores[step, h, u]
            for i in cutlass.range_constexpr(module.VEC):
                r_v[u, i] = v[step, u, i]
        online_softmax_update(r_scores, r_v, row_max, row_sum, acc)
    for h in cutlass.range_constexpr(heads):
        state[h, 0] = row_max[h]
        state[h, 1] = row_sum[h]
        for i in cutlass.range_constexpr(module.VEC):
            state[h, 2 + i] = acc[h, i]


@cute.jit
def merge_groups(module: cutlass.Constexpr, maxes: cute.Tensor, sums: cute.Tensor, accs: cute.Tensor,
                 o: cute.Tensor, lse: cute.Tensor):
    """split_partial for every (head, 4 columns) of the key groups' states maxes/sums [G, H], accs [G, H, D]."""
    heads, head_dim = cute.size(accs, mode=[1]), cute.size(accs, mode=[2])
    part = cute.make_rmem_tensor((4,), Float32)
    split_partial = module.split_partial  # (a runtime loop may not carry the module object)
    for h in range(heads):
        for quad in cutlass.range_constexpr(head_dim // 4):
            lse[h] = split_partial(maxes, sums, accs, h, quad, part)
            for i in cutlass.range_constexpr(4):
                o[h, 4 * quad + i] = part[i]


@cute.jit
def combine_splits(module: cutlass.Constexpr, has_sink: cutlass.Constexpr, part_lse: cute.Tensor,
                   part_o: cute.Tensor, sink_log2: cute.Tensor, o: cute.Tensor, lse: cute.Tensor):
    """The last CTA's combine for every (head, 4 columns): fold_in_split per split, then finish_combine."""
    splits, heads, head_dim = cute.size(part_o, mode=[0]), cute.size(part_o, mode=[1]), cute.size(part_o, mode=[2])
    state = cute.make_rmem_tensor((2,), Float32)
    acc = cute.make_rmem_tensor((4,), Float32)
    part = cute.make_rmem_tensor((4,), Float32)
    fold_in_split, finish_combine = module.fold_in_split, module.finish_combine  # (not the module object: see fold_keys)
    for h in range(heads):
        for quad in cutlass.range_constexpr(head_dim // 4):
            state[0] = -Float32.inf
            state[1] = Float32(0.0)
            acc.fill(0.0)
            for split in range(splits):
                for i in cutlass.range_constexpr(4):
                    part[i] = part_o[split, h, 4 * quad + i]
                fold_in_split(part_lse[split, h], part, state, acc)
            lse[h] = finish_combine(state, acc, sink_log2[h], has_sink)
            for i in cutlass.range_constexpr(4):
                o[h, 4 * quad + i] = acc[i]


@cute.jit
def elect_last(module: cutlass.Constexpr, counter: cute.Tensor, flag: cute.Tensor, elected: cute.Tensor):
    """``elected`` [launches, num_splits]: what arrive_and_elect_last returns to each CTA of each launch,
    the CTAs of a launch arriving one after another on the same counter."""
    launches, num_splits = cute.size(elected, mode=[0]), cute.size(elected, mode=[1])
    arrive_and_elect_last = module.arrive_and_elect_last  # (not the module object: see fold_keys)
    for launch in range(launches):
        for cta in range(num_splits):
            elected[launch, cta] = arrive_and_elect_last(counter.iterator, Int32(num_splits), flag)


# ---------------------------------------------------------------- prefill: the tile scheduler (stage 8)

@cute.jit
def schedule_tiles(module: cutlass.Constexpr, kv_tile_bytes: cutlass.Constexpr, longest_first: cutlass.Constexpr,
                   l2_bytes: cutlass.Constexpr, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, seqlen_q: Int32, num_heads: Int32, num_batch: Int32, seqlen_k: Int32,
                   coords: cute.Tensor, group: cute.Tensor):
    """``coords`` [tiles, 3]: the (m_block, head, batch) of every linear tile index, as the persistent
    scheduler of Step.PERSISTENT maps it; ``group`` [1]: its l2_group()."""
    scheduler = module.TileScheduler(seqlen_q, num_heads, num_batch, seqlen_k, kv_tile_bytes, True, longest_first,
                                     l2_bytes, tile_m, tile_n)
    pairs = scheduler.l2_group()
    group[0] = pairs
    tile_coords = scheduler.coords  # (as in the kernel: a runtime loop may not carry the scheduler object)
    for tile in cutlass.range(scheduler.num_tiles(), unroll=1):
        m_block, head, batch = tile_coords(tile, pairs)
        coords[tile, 0] = m_block
        coords[tile, 1] = head
        coords[tile, 2] = batch


# ---------------------------------------------------------------- the checks the stage tests run

def _tiles(n: int, size: int) -> int:
    return -(-n // size)


def mask_description(features: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in features.items()) or "no mask"


def check_masks(module, features: dict, lengths: list[tuple[int, int]], tile_n: int | None = None,
                tile_m: int = Q_TILE_ROWS) -> None:
    """WindowMask.kv_block_range (and sink_block_count) and apply, for every Q tile, against reference.visible_keys.

    ``features``: causal, window_size and num_sink_tokens as the API takes them. ``apply`` must
    mask exactly the invisible keys (and every key past S_k) on every KV tile; the tiles the
    kernel visits must be exactly those that hold a visible key: a missing one loses keys, an
    extra one costs time, which is what the stage saves.
    """
    left, right = validation.resolve_window(features.get("causal", False), features.get("window_size", (-1, -1)))
    sinks = features.get("num_sink_tokens", 0)
    config = prefill.KernelConfig(has_left=left >= 0, has_right=right >= 0, has_sink_tokens=left >= 0 and sinks > 0)
    tile_n = tile_n or kv_tile_keys(module)
    n_blocks = max(_tiles(s_k, tile_n) for _, s_k in lengths)
    scores = torch.zeros(tile_m, n_blocks * tile_n)
    tiles = torch.zeros(5, dtype=torch.int32)
    visits = torch.zeros(2, n_blocks, dtype=torch.int32)
    for s_q, s_k in lengths:
        visible = reference.visible_keys(s_q, s_k, **features)
        for m_block in range(_tiles(s_q, tile_m)):
            scores.zero_()
            tiles.zero_()
            args = (scores, tiles, visits, m_block, s_q, s_k, left, right, sinks)
            compile_on_cpu(mask_q_tile, (module, config, n_blocks, tile_n, tile_m), args)(*args)
            rows = visible[m_block * tile_m:(m_block + 1) * tile_m]
            where = f"{mask_description(features)}, S_q={s_q}, S_k={s_k}, Q tile {m_block} of {tile_m} rows, " \
                    f"KV tiles of {tile_n} keys"
            _assert_masked_exactly(scores[:len(rows)] == 0, rows, m_block * tile_m, where)
            _assert_visits_exactly(tiles.tolist()[:3], rows, n_blocks, tile_n, where)
            if module.STAGE >= 8:
                _assert_masked_steps(tiles.tolist(), visits, rows, tile_n, s_k, where)


def _visited_tiles(n_min: int, n_max: int, n_sink: int) -> list[int]:
    """The KV tiles a Q tile's loop must visit: the sink tiles below its range, then the range."""
    return list(range(n_sink)) + list(range(n_min, n_max))


def _assert_masked_steps(tiles: list[int], visits: torch.Tensor, rows: torch.Tensor, tile_n: int, seqlen_k: int,
                         where: str) -> None:
    """Stage 8: the loop's steps visit the needed tiles once each, and every step that runs without the mask
    (tile_is_partial False, or a step of unmasked_steps' range) is on a tile where every real row sees every key."""
    n_min, n_max, n_sink, first, end = tiles
    steps = [n for n in visits[0].tolist() if n >= 0]
    needed = _visited_tiles(n_min, n_max, n_sink)
    if sorted(steps) != sorted(needed):
        raise AssertionError(f"WindowMask.kv_block, {where}: the loop's steps visit KV tiles {steps}; they must visit "
                             f"{sorted(needed)}, each once")

    def needs_mask(n: int) -> bool:
        return (n + 1) * tile_n > seqlen_k or not bool(rows[:, n * tile_n:(n + 1) * tile_n].all())

    for n in needed:
        if needs_mask(n) and not visits[1, n]:
            raise AssertionError(f"WindowMask.tile_is_partial, {where}: KV tile {n} is called full, but some row of "
                                 "this Q tile may not see one of its keys (or it runs past S_k): the mask would be "
                                 "skipped there")
    for i in range(max(first, 1), end):
        if i < len(steps) and needs_mask(steps[i]):
            raise AssertionError(f"WindowMask.unmasked_steps, {where}: step {i} (KV tile {steps[i]}) is in the "
                                 f"unmasked range [{first}, {end}), but some row of this Q tile may not see one of "
                                 "its keys: the loop without a mask would let it through")


def _assert_masked_exactly(kept: torch.Tensor, rows: torch.Tensor, row0: int, where: str) -> None:
    expected = torch.zeros_like(kept)
    expected[:, :rows.shape[1]] = rows
    wrong = (kept != expected).nonzero()
    if len(wrong):
        row, key = wrong[0].tolist()
        should, did = ("visible", "set it to -inf") if expected[row, key] else ("masked (-inf)", "left it")
        raise AssertionError(
            f"WindowMask.apply, {where}: key {key} should be {should} for query row {row0 + row}, but apply {did} "
            f"({len(wrong)} wrong registers in this Q tile). Visible means row + offset - left <= key <= "
            "row + offset + right and key < S_k, offset = S_k - S_q (docs/contract.md).")


def _assert_visits_exactly(tiles: list[int], rows: torch.Tensor, n_blocks: int, tile_n: int, where: str) -> None:
    n_min, n_max, n_sink = tiles
    needed = [n for n in range(n_blocks) if rows[:, n * tile_n:(n + 1) * tile_n].any()]
    visited = _visited_tiles(n_min, n_max, n_sink)
    if sorted(visited) != needed or len(set(visited)) != len(visited):
        sink_part = f"sink tiles [0, {n_sink}) then " if n_sink else ""
        raise AssertionError(
            f"kv_block_range, {where}: the kernel visits {sink_part}tiles [{n_min}, {n_max}) = {visited}, "
            f"but the tiles that hold a visible key are {needed}. A missing tile drops keys; an extra one is "
            "correct but costs a tile of work, which is what the stage saves.")


SOFTMAX_PATHS = {
    1: "softmax_rows on one tile of keys, then normalize_rows",
    2: "update_row_max over every tile, then exponentiate_rows per tile, then normalize_rows",
    3: "online_softmax per tile of keys, then normalize_rows",
}


# Cases of the multi-tile softmax paths (stages 2 and 3), three tiles of keys each:
# {id: (seqlen_k, logit_scale)}.
MULTI_TILE_ROW_CASES = {"three-tiles": (96, 1.0), "keys-past-sk": (77, 1.0), "large-logits": (96, 30.0)}


def check_attend_rows(module, *, n_tiles: int, seqlen_k: int, features: dict | None = None,
                      sink_logit: float | None = None, logit_scale: float = 1.0, seed: int = 0) -> None:
    """The stage's softmax path (attend_rows) on 16 query rows against reference.attention: O, and the LSE from stage 6.

    The scores are Q K^T of random inputs (times ``logit_scale``), -inf where ``features``'
    mask hides a key and past ``seqlen_k`` up to n_tiles * ROW_TILE keys.
    """
    features = dict(features or {})
    rows, width, head_dim = 16, n_tiles * ROW_TILE, 16
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, rows, 1, head_dim, generator=gen) * logit_scale
    k = torch.randn(1, seqlen_k, 1, head_dim, generator=gen)
    v = torch.randn(1, seqlen_k, 1, O_COLUMNS, generator=gen) + 1.0  # a mean: a wrong weight shows in O
    sink = None if sink_logit is None else torch.tensor([sink_logit])
    o_ref, lse_ref = reference.attention(q, k, v, softmax_scale=head_dim ** -0.5, sink_logits=sink, return_lse=True,
                                         **features)
    scores = torch.full((rows, width), -math.inf)
    scores[:, :seqlen_k] = (q[0, :, 0] @ k[0, :, 0].T).masked_fill(~reference.visible_keys(rows, seqlen_k, **features),
                                                                     -math.inf)
    v_tiles = torch.zeros(width, O_COLUMNS)
    v_tiles[:seqlen_k] = v[0, :, 0]
    o, lse = torch.full((rows, O_COLUMNS), math.nan), torch.full((rows,), math.nan)
    # No sink logits: the kernels pass -inf, whose term exp2(-inf) = 0 is no term.
    args = (scores, v_tiles, o, lse, head_dim ** -0.5 * LOG2_E, -math.inf if sink_logit is None else sink_logit * LOG2_E)
    compile_on_cpu(attend_rows, (module, n_tiles), args)(*args)
    where = (f"{SOFTMAX_PATHS[min(module.STAGE, 3)]}, {mask_description(features)}, S_k={seqlen_k}"
             + (f", sink logit {sink_logit}" if sink is not None else "")
             + (f", logits x{logit_scale}" if logit_scale != 1 else ""))
    assert_rows_match(o, o_ref[0, :, 0], where)
    if module.STAGE >= 6:
        assert_lse_matches(lse, lse_ref[0, 0], where)


def assert_rows_match(got: torch.Tensor, expected: torch.Tensor, where: str, unit: str = "row") -> None:
    """O, got/expected [rows (or heads), columns]: fail with the first wrong one, or the first NaN, and what NaN means."""
    nan = torch.isnan(got).any(dim=-1)
    if nan.any():
        row = int(nan.nonzero()[0])
        raise AssertionError(f"{where}: O of {unit} {row} is NaN: inf - inf or 0 / 0 in the softmax (a row whose "
                             "max is still -inf needs the guard), or a value was never written.")
    error = (got.double() - expected.double()).abs().amax(dim=-1)
    if (error > O_TOLERANCE).any():
        row = int((error > O_TOLERANCE).nonzero()[0])
        raise AssertionError(
            f"{where}: O of {unit} {row} differs from course.testing.reference by {error[row]:.2e} "
            f"(tolerance {O_TOLERANCE}): got {[round(x, 4) for x in got[row].tolist()[:4]]}..., "
            f"expected {[round(x, 4) for x in expected[row].tolist()[:4]]}...")


def assert_lse_matches(got: torch.Tensor, expected: torch.Tensor, where: str, unit: str = "row") -> None:
    """Natural-log LSE: -inf exactly where course.testing.reference has it (no key, no sink), else within LSE_TOLERANCE."""
    if torch.isnan(got).any():
        raise AssertionError(f"{where}: LSE of {unit} {int(torch.isnan(got).nonzero()[0])} is NaN")
    inf_wrong = torch.isneginf(got) != torch.isneginf(expected)
    if inf_wrong.any():
        row = int(inf_wrong.nonzero()[0])
        raise AssertionError(f"{where}: LSE of {unit} {row} is {got[row].item()}, course.testing.reference {expected[row].item()} "
                             "(-inf exactly for a row with no visible key and no sink)")
    finite = torch.isfinite(expected)
    error = (got[finite].double() - expected[finite].double()).abs()
    if len(error) and error.max() > LSE_TOLERANCE:
        row = int(finite.nonzero()[int(error.argmax())])
        raise AssertionError(f"{where}: LSE of {unit} {row} is {got[row].item():.6f}, course.testing.reference "
                             f"{expected[row].item():.6f} (natural log, sink included)")


def check_store_lse(module, seqlen_q: int) -> None:
    """store_lse from every consumer thread of every Q tile: each row < S_q gets its own LSE, nothing past S_q."""
    lse = torch.full((1, 1, _tiles(seqlen_q, module.TILE_M) * module.TILE_M), math.nan)
    for m_block in range(_tiles(seqlen_q, module.TILE_M)):
        args = (lse, m_block, seqlen_q)
        compile_on_cpu(store_lse_of_q_tile, (module,), args)(*args)
    got = lse[0, 0]
    missing = torch.isnan(got[:seqlen_q]).nonzero().flatten().tolist()
    if missing:
        raise AssertionError(f"store_lse, S_q={seqlen_q}: no LSE was written for rows {missing[:8]}... "
                             f"({len(missing)} of {seqlen_q}). Every query row needs its LSE: the first thread of "
                             "each quad writes its rows.")
    wrong = (got[:seqlen_q] != torch.arange(seqlen_q) + 0.5).nonzero().flatten().tolist()
    if wrong:
        raise AssertionError(f"store_lse, S_q={seqlen_q}: row {wrong[0]} holds {got[wrong[0]].item()}, the LSE of "
                             f"row {got[wrong[0]].item() - 0.5:.0f}: lse[r] belongs at row row0 + coord[r, 0][0]")
    if not torch.isnan(got[seqlen_q:]).all():
        raise AssertionError(f"store_lse, S_q={seqlen_q}: it wrote past the last query row (rows >= S_q are "
                             "another batch's or outside the tensor)")


def check_merge_weights(module) -> None:
    """merge_weights on pairs of LSEs, empty parts (-inf) included, against reference.merge_attention_states."""
    inf = math.inf
    lse_a = torch.tensor([0.3, -inf, 2.0, -inf, 50.0, 100.0, -3.0])
    lse_b = torch.tensor([1.2, 0.5, -inf, -inf, -50.0, 99.0, -3.0])
    out = torch.full((len(lse_a), 3), math.nan)
    compile_on_cpu(merge_pairs, (module,), (lse_a, lse_b, out))(lse_a, lse_b, out)
    one, zero = torch.ones(1, len(lse_a), 1, 1), torch.zeros(1, len(lse_a), 1, 1)
    w_a, lse = reference.merge_attention_states(one, lse_a.view(1, 1, -1), zero, lse_b.view(1, 1, -1))
    w_b, _ = reference.merge_attention_states(zero, lse_a.view(1, 1, -1), one, lse_b.view(1, 1, -1))
    expected = torch.stack([w_a.flatten(), w_b.flatten(), lse.flatten().double()], dim=1)
    for i in range(len(lse_a)):
        got = out[i].double()
        same = torch.isclose(got, expected[i], rtol=1e-5, atol=1e-6) | (torch.isneginf(got) & torch.isneginf(expected[i]))
        if not same.all():
            raise AssertionError(
                f"merge_weights({lse_a[i].item():g}, {lse_b[i].item():g}) returns (w_a, w_b, lse) = "
                f"{tuple(round(x, 6) for x in got.tolist())}; course.testing.reference gives "
                f"{tuple(round(x, 6) for x in expected[i].tolist())}. The weights are exp(lse - M) / total "
                "(they add up to 1, or are both 0 when both parts are empty).")


# ---------------------------------------------------------------- decode checks (stage 7)

DECODE_HEADS, DECODE_UNROLL = 4, 4  # a CTA of 4 query heads loads 4 keys per key group and iteration


def decode_problem(length: int, *, seed: int = 0, logit_scale: float = 1.0):
    """One sequence of ``length`` keys seen by DECODE_HEADS query heads of one KV head, head dim VEC (8):
    (q, k_cache, v_cache, cache_seqlens) for course.testing.reference, V in fp16 as the kernel reads it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, DECODE_HEADS, 8, generator=gen) * logit_scale
    k = torch.randn(1, length, 1, 8, generator=gen)
    v = (torch.randn(1, length, 1, 8, generator=gen) + 1.0).half().float()
    return q, k, v, torch.tensor([length], dtype=torch.int32)


def scores_log2(q, k) -> torch.Tensor:
    """[H, L]: q . k * softmax_scale * log2(e), the kernel's scores (exp2 gives the softmax numerators)."""
    return (q[0] @ k[0, :, 0].T) * 8 ** -0.5 * LOG2_E


def check_fold_keys(module, length: int, *, logit_scale: float = 1.0) -> None:
    """online_softmax_update over one key group's keys against reference.decode_attention (O and LSE)."""
    q, k, v, seqlens = decode_problem(length, seed=length, logit_scale=logit_scale)
    steps = max(1, _tiles(length, DECODE_UNROLL)) + 1  # one more step of keys past the end: scores -inf
    scores = torch.full((DECODE_HEADS, steps * DECODE_UNROLL), -math.inf)
    scores[:, :length] = scores_log2(q, k)
    values = torch.zeros(steps * DECODE_UNROLL, 8)
    values[:length] = v[0, :, 0]
    scores = scores.view(DECODE_HEADS, steps, DECODE_UNROLL).permute(1, 0, 2).contiguous()
    values = values.view(steps, DECODE_UNROLL, 8).half()
    state = torch.full((DECODE_HEADS, 10), math.nan)
    compile_on_cpu(fold_keys, (module,), (scores, values, state))(scores, values, state)
    o_ref, lse_ref = reference.decode_attention(q, k, v, seqlens, return_lse=True)
    where = f"online_softmax_update over {length} keys" + (f", logits x{logit_scale}" if logit_scale != 1 else "")
    total = state[:, 1:2]
    o = torch.where(total > 0, state[:, 2:] / total.clamp_min(1e-30), 0.0)
    assert_rows_match(o, o_ref[0], where + " (O = acc / row_sum)", unit="head")
    lse = (state[:, 0] + torch.log2(state[:, 1])) * LN_2
    assert_lse_matches(lse, lse_ref[0], where + " (LSE = row_max + log2(row_sum))", unit="head")


def check_split_partial(module, length: int, groups: int = 3) -> None:
    """split_partial over key groups that share a split's keys (some empty) against reference.decode_attention."""
    q, k, v, seqlens = decode_problem(length, seed=100 + length)
    scores = scores_log2(q, k).double()
    maxes = torch.full((groups, DECODE_HEADS), -math.inf)
    sums = torch.zeros(groups, DECODE_HEADS)
    accs = torch.zeros(groups, DECODE_HEADS, 8)
    for g in range(groups):  # key j belongs to group j % groups, as in the kernel's loop
        keys = list(range(g, length, groups))
        if keys:
            group_max = scores[:, keys].amax(dim=-1)
            p = torch.exp2(scores[:, keys] - group_max[:, None])
            maxes[g], sums[g] = group_max.float(), p.sum(-1).float()
            accs[g] = (p @ v[0, keys, 0].double()).float()
    o, lse = torch.full((DECODE_HEADS, 8), math.nan), torch.full((DECODE_HEADS,), math.nan)
    compile_on_cpu(merge_groups, (module,), (maxes, sums, accs, o, lse))(maxes, sums, accs, o, lse)
    o_ref, lse_ref = reference.decode_attention(q, k, v, seqlens, return_lse=True)
    where = f"split_partial, {groups} key groups over {length} keys"
    assert_rows_match(o, o_ref[0], where, unit="head")
    assert_lse_matches(lse * LN_2, lse_ref[0], where + " (the LSE it returns, in log2 units)", unit="head")


def check_combine(module, length: int, splits: int, sink: bool) -> None:
    """fold_in_split per split, then finish_combine (with the sink logit), against reference.decode_attention.

    Each split's partial is the reference's own answer for its slice of the keys; slices past
    the end are empty (LSE -inf, O = 0), as in the kernel.
    """
    q, k, v, seqlens = decode_problem(length, seed=200 + length)
    sink_logits = torch.linspace(-2.0, 3.0, DECODE_HEADS) if sink else None
    chunk = max(1, _tiles(length, splits))
    part_o = torch.zeros(splits, DECODE_HEADS, 8)
    part_lse = torch.full((splits, DECODE_HEADS), -math.inf)
    for s in range(splits):
        begin, end = min(s * chunk, length), min((s + 1) * chunk, length)
        if end > begin:
            o_s, lse_s = reference.decode_attention(q, k[:, begin:end], v[:, begin:end],
                                                    torch.tensor([end - begin], dtype=torch.int32), return_lse=True)
            part_o[s], part_lse[s] = o_s[0].float(), lse_s[0] * LOG2_E
    sink_log2 = (sink_logits if sink else torch.zeros(DECODE_HEADS)) * LOG2_E
    o, lse = torch.full((DECODE_HEADS, 8), math.nan), torch.full((DECODE_HEADS,), math.nan)
    args = (part_lse, part_o, sink_log2, o, lse)
    compile_on_cpu(combine_splits, (module, sink), args)(*args)
    o_ref, lse_ref = reference.decode_attention(q, k, v, seqlens, sink_logits=sink_logits, return_lse=True)
    where = f"fold_in_split + finish_combine, {splits} splits over {length} keys" + (", sink logits" if sink else "")
    assert_rows_match(o, o_ref[0], where, unit="head")
    assert_lse_matches(lse * LN_2, lse_ref[0], where + " (the LSE finish_combine returns, in log2 units)", unit="head")


def check_elect_last(module, num_splits: int = 5, launches: int = 3) -> None:
    """arrive_and_elect_last: in every launch exactly the last CTA to arrive is elected, and the counter is 0 again."""
    counter, flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    elected = torch.full((launches, num_splits), -1, dtype=torch.int32)
    compile_on_cpu(elect_last, (module,), (counter, flag, elected))(counter, flag, elected)
    expected = [0] * (num_splits - 1) + [1]
    for launch, flags in enumerate(elected.tolist()):
        if flags != expected:
            raise AssertionError(
                f"arrive_and_elect_last, launch {launch + 1} ({num_splits} CTAs arriving one after another): "
                f"returned {flags}, expected {expected} (only the last CTA combines). "
                + ("The counter is not back at 0 after a launch: the last CTA must reset it." if launch else
                   "The CTA whose atomic add returns num_splits - 1 is the last."))
    if counter.item() != 0:
        raise AssertionError(f"arrive_and_elect_last: the counter is {counter.item()} after {launches} launches; the "
                             "last CTA must reset it to 0 for the next launch (and every CUDA graph replay).")


# ---------------------------------------------------------------- tile scheduler checks (stage 8)

def expected_schedule(seqlen_q, num_heads, num_batch, seqlen_k, head_dim, dtype_bytes, longest_first, l2_bytes,
                      tile_m, tile_n):
    """The linear tile order in plain Python: (group, [(m_block, head, batch) per tile])."""
    m_blocks, pairs, kv_blocks = _tiles(seqlen_q, tile_m), num_heads * num_batch, _tiles(seqlen_k, tile_n)
    l2_kv_blocks = l2_bytes // (2 * tile_n * head_dim * dtype_bytes)
    group = 1
    while group * 2 <= pairs and group * 2 * kv_blocks <= l2_kv_blocks:
        group *= 2
    order = []
    for first_pair in range(0, pairs, group):
        here = list(range(first_pair, min(first_pair + group, pairs)))
        m_order = range(m_blocks - 1, -1, -1) if longest_first else range(m_blocks)
        order += [(m, pair % num_heads, pair // num_heads) for m in m_order for pair in here]
    return group, order


def check_schedule(module, *, seqlen_q: int, num_heads: int, num_batch: int, seqlen_k: int, head_dim: int,
                   dtype_bytes: int, longest_first: bool, l2_bytes: int) -> None:
    """TileScheduler.l2_group and coords: every (Q tile, head, batch) exactly once, in the grouped order."""
    tile_m = 128  # two MMA warpgroups of 64 rows
    tile_n = module.TILES[head_dim, head_dim].tile_n
    group_ref, order_ref = expected_schedule(seqlen_q, num_heads, num_batch, seqlen_k, head_dim, dtype_bytes,
                                             longest_first, l2_bytes, tile_m, tile_n)
    coords = torch.full((len(order_ref), 3), -1, dtype=torch.int32)
    group = torch.full((1,), -1, dtype=torch.int32)
    static = (module, 2 * tile_n * head_dim * dtype_bytes, longest_first, l2_bytes, tile_m, tile_n)
    args = (seqlen_q, num_heads, num_batch, seqlen_k, coords, group)
    compile_on_cpu(schedule_tiles, static, args)(*args)
    where = (f"TileScheduler, {_tiles(seqlen_q, tile_m)} Q tiles x {num_heads} heads x {num_batch} batch, "
             f"{_tiles(seqlen_k, tile_n)} KV tiles of {head_dim}-wide {8 * dtype_bytes}-bit K and V, "
             f"L2 budget {l2_bytes >> 20} MiB" + (", longest first" if longest_first else ""))
    if group.item() != group_ref:
        raise AssertionError(f"{where}: l2_group() is {group.item()}, expected {group_ref}: the largest power of two "
                             "of (batch, head) pairs, at most all of them, whose K and V tiles all fit in l2_kv_blocks.")
    got = [tuple(row) for row in coords.tolist()]
    valid = set(order_ref)
    outside = [(t, c) for t, c in enumerate(got) if c not in valid]
    if outside:
        tile, c = outside[0]
        raise AssertionError(f"{where}: tile {tile} maps to (m_block, head, batch) = {c}, which is not a tile of this "
                             f"problem ({len(outside)} such tiles). Check the ranges of m_block, head and batch.")
    if len(set(got)) != len(got):
        repeated = sorted({c for c in got if got.count(c) > 1})
        raise AssertionError(f"{where}: {len(got) - len(set(got))} tiles are computed twice and as many never, "
                             f"e.g. {repeated[0]} (a short last group of pairs: heads_here = min(group, pairs left)).")
    for tile, (c, c_ref) in enumerate(zip(got, order_ref)):
        if c != c_ref:
            raise AssertionError(
                f"{where}: tile {tile} is {c}, expected {c_ref}. Every tile is computed once, but not in the "
                "grouped order: inside a group, all its pairs at one Q tile before the next Q tile"
                + (" (the last Q tile first)" if longest_first else "") + ", groups one after another.")



# ---------------------------------------------------------------- tensor-core decode (stage 9)

FRAGMENT_O_BLOCKS = 2  # a thread's O fragment ((2, 2), 1, blocks): per 8-column block 2 columns of each of its rows


@cute.jit
def fold_fragment_keys(module: cutlass.Constexpr, scores: cute.Tensor, values: cute.Tensor, state: cute.Tensor):
    """One thread's two rows through online_softmax_update, step by step.

    ``scores`` [steps, 8]: the thread's S fragment of each step (exp2 units, -inf for a key past the
    end); ``values`` [steps, 8, 2 * FRAGMENT_O_BLOCKS]: what the key of each score adds to each of its
    row's O columns. After each update the host adds P V from this thread's keys, as the MMA would
    (with the quad stand-ins a thread's rows are its own: its max covers its keys only).
    ``state`` [2, 2 + 2 * FRAGMENT_O_BLOCKS] gets each row's (max, sum, unnormalized O).
    """
    steps = cute.size(scores, mode=[0])
    r_s = cute.make_rmem_tensor(((2, 2), 1, 2), Float32)
    acc_o = cute.make_rmem_tensor(((2, 2), 1, FRAGMENT_O_BLOCKS), Float32)
    row_max = cute.make_rmem_tensor((2,), Float32)
    row_sum = cute.make_rmem_tensor((2,), Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    acc_o.fill(0.0)
    flat_s = cute.make_tensor(r_s.iterator, cute.make_layout(8))
    online_softmax_update, score_row = module.online_softmax_update, module.score_row  # (not the module: fold_keys)
    for step in range(steps):
        for v in cutlass.range_constexpr(8):
            flat_s[v] = scores[step, v]
        online_softmax_update(r_s, acc_o, row_max, row_sum)
        for v in cutlass.range_constexpr(8):
            for nb in cutlass.range_constexpr(FRAGMENT_O_BLOCKS):
                for c in cutlass.range_constexpr(2):
                    acc_o[(c, score_row(v)), 0, nb] += flat_s[v] * values[step, v, c + 2 * nb]
    for r in cutlass.range_constexpr(2):
        state[r, 0] = row_max[r]
        state[r, 1] = row_sum[r]
        for nb in cutlass.range_constexpr(FRAGMENT_O_BLOCKS):
            for c in cutlass.range_constexpr(2):
                state[r, 2 + c + 2 * nb] = acc_o[(c, r), 0, nb]


def check_fragment_softmax(module, lengths: tuple[int, int], *, logit_scale: float = 1.0) -> None:
    """Stage 9's online_softmax_update on one thread's fragment over ``lengths`` keys of its two rows (4 keys of each
    row per step, -inf past the end), against a float64 softmax of the same scores (O and LSE). Large logits move
    the max by more than RESCALE_THRESHOLD: the lazy rescale must then happen."""
    gen = torch.Generator().manual_seed(sum(lengths) + int(logit_scale))
    steps = max(1, _tiles(max(lengths), 4)) + 1  # one more step past the end: every score -inf
    columns = 2 * FRAGMENT_O_BLOCKS
    scores = torch.full((steps, 8), -math.inf)
    values = torch.randn(steps, 8, columns, generator=gen)
    slots = [[v for v in range(8) if module.score_row(v) == r] for r in range(2)]  # each row's 4 values
    row_scores = [torch.randn(lengths[r], generator=gen, dtype=torch.float64) * logit_scale for r in range(2)]
    for r in range(2):
        for key in range(lengths[r]):
            scores[key // 4, slots[r][key % 4]] = row_scores[r][key]
    state = torch.full((2, 2 + columns), math.nan)
    compile_on_cpu(fold_fragment_keys, (module,), (scores, values, state))(scores, values, state)
    o_ref, lse_ref = torch.zeros(2, columns, dtype=torch.float64), torch.full((2,), -math.inf, dtype=torch.float64)
    for r in range(2):
        if lengths[r]:
            s = row_scores[r]
            v = torch.stack([values[key // 4, slots[r][key % 4]] for key in range(lengths[r])]).double()
            p = torch.softmax(s * LN_2, dim=0)  # exp2 units
            o_ref[r] = p @ v
            lse_ref[r] = torch.logsumexp(s * LN_2, dim=0)
    where = (f"online_softmax_update on one thread's fragment, {lengths[0]} and {lengths[1]} keys in its two rows"
             + (f", logits x{logit_scale}" if logit_scale != 1 else ""))
    total = state[:, 1:2]
    o = torch.where(total > 0, state[:, 2:] / total.clamp_min(1e-30), 0.0)
    assert_rows_match(o, o_ref, where + " (O = acc_o / row_sum)")
    lse = (state[:, 0] + torch.log2(state[:, 1])) * LN_2
    assert_lse_matches(lse, lse_ref, where + " (LSE = row_max + log2(row_sum))")


# ---------------------------------------------------------------- stage 10: locate, one warp in lockstep

WARP = 32


def plain_python_method(module, class_name: str, name: str):
    """``class_name.name`` of ``module`` as a plain Python function, made afresh from the module's source
    (decorators dropped), with its own copy of the module's globals: the DSL rewrites a jit function once it
    has compiled it, and that rewrite only runs inside a trace."""
    import ast

    source = Path(module.__file__).read_text()
    owner = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == class_name)
    function = next(node for node in owner.body if isinstance(node, ast.FunctionDef) and node.name == name)
    function.decorator_list = []
    namespace = dict(vars(module))
    code = compile(ast.Module(body=[ast.fix_missing_locations(function)], type_ignores=[]), module.__file__, "exec")
    exec(code, namespace)
    return namespace[name], namespace


@contextmanager
def warp_in_lockstep(namespace: dict):
    """Run a device function of one warp in plain Python (``plain_python_method``), all 32 lanes at once: a
    per-lane value is a numpy vector of 32 entries, a warp-uniform one a Python int. The warp instructions
    get stand-ins that compute the same over the vectors (``shuffle_sync_up``, ``shuffle_sync``,
    ``vote_ballot_sync``, ``popc``, ``lane_idx``), the runtime loop helpers become Python's, and the
    function's ``warp_inclusive_sum`` a prefix sum. Only warp-uniform values may decide an ``if`` or a ``while``."""
    import numpy as np

    def vector(value):
        return np.broadcast_to(np.asarray(value, dtype=np.int64), (WARP,))

    def shuffle_up(value, offset, **_):
        lanes = vector(value)
        return np.concatenate([lanes[:offset], lanes[:WARP - offset]])

    def ballot(predicate, **_):
        bits = np.broadcast_to(np.asarray(predicate, dtype=bool), (WARP,))
        return sum(1 << lane for lane in range(WARP) if bits[lane])

    def python_range(*bounds, **_):
        return range(*(int(b) for b in bounds))

    stand_ins = [
        (cute.arch, "lane_idx", lambda **_: np.arange(WARP)),
        (cute.arch, "shuffle_sync_up", shuffle_up),
        (cute.arch, "shuffle_sync", lambda value, lane, **_: int(vector(value)[int(lane)])),
        (cute.arch, "vote_ballot_sync", ballot),
        (cute.arch, "popc", lambda value, **_: bin(int(value) & 0xFFFFFFFF).count("1")),
        (cutlass, "Boolean", bool), (cutlass, "Int32", int), (cutlass, "min", min), (cutlass, "max", max),
        (cutlass, "range", python_range), (cutlass, "range_constexpr", python_range),
    ]
    namespace["warp_inclusive_sum"] = lambda value: np.cumsum(vector(value))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in stand_ins]
    try:
        for owner, name, stand_in in stand_ins:
            setattr(owner, name, stand_in)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class LaneScheduler:
    """What ``locate`` reads of a ``VarlenTileScheduler``: the sequence count and each sequence's tiles
    (its Q tiles times the heads), for a vector of sequences (0 past the last one)."""

    def __init__(self, lengths_q, heads: int, tile_m: int):
        import numpy as np

        self.num_batch = len(lengths_q)
        self.counts = np.array([-(-n // tile_m) * heads for n in lengths_q] + [0], dtype=np.int64)
        self.reads = 0  # calls of tiles_of: the warp's search steps

    def tiles_of(self, batch):
        import numpy as np

        self.reads += 1
        batch = np.asarray(batch)
        return self.counts[np.clip(batch, 0, self.num_batch)] * (batch < self.num_batch)


def check_locate(module, lengths_q, heads: int = 3, tile_m: int = Q_TILE_ROWS) -> None:
    """Your locate, one warp in lockstep on the CPU: for every linear tile (and a few past the last), the
    sequence that holds it and that sequence's first tile, searched from the start (a CTA per tile) and
    from the previous answer (a persistent CTA, whose tiles only grow)."""
    scheduler = LaneScheduler(lengths_q, heads, tile_m)
    starts, expected = 0, []
    for b, count in enumerate(scheduler.counts[:-1]):
        expected += [(b, starts)] * int(count)
        starts += int(count)
    locate, namespace = plain_python_method(module, "VarlenTileScheduler", "locate")
    where = f"{len(lengths_q)} sequences of {list(lengths_q)[:8]}{'...' if len(lengths_q) > 8 else ''} rows, {heads} heads"
    with warp_in_lockstep(namespace):
        for step in (0, 1, 5):  # 0: every tile searched from the start; else a persistent CTA's tiles
            batch, batch_start = 0, 0
            for tile in range(0, starts + 3, max(step, 1)):
                if step == 0:
                    batch, batch_start = 0, 0
                first, scheduler.reads = batch, 0
                batch, batch_start = (int(x) for x in locate(scheduler, tile, batch, batch_start))
                steps = (min(batch, scheduler.num_batch - 1) - first) // WARP + 1  # 32 sequences per step
                assert scheduler.reads <= steps, (
                    f"{where}: locate(tile {tile}) from sequence {first} read tiles_of {scheduler.reads} times to "
                    f"reach sequence {batch}; one warp step reads 32 sequences (one per lane), so {steps} "
                    f"step{'s' if steps > 1 else ''} suffice. A loop that advances one sequence at a time is right "
                    "but walks every sequence of a long batch for each tile.")
                if tile < starts:
                    assert (batch, batch_start) == expected[tile], (
                        f"{where}: locate(tile {tile}) gives sequence {batch} starting at tile {batch_start}; tile "
                        f"{tile} is sequence {expected[tile][0]}'s, whose tiles start at {expected[tile][1]}")
                else:
                    assert batch == scheduler.num_batch, (
                        f"{where}: tile {tile} is past the last tile ({starts - 1}); locate must give sequence "
                        f"{scheduler.num_batch} (none), got {batch}")


# ---------------------------------------------------------------- producer steps: a KV tile into the ring (2, 10)

class _Ring:
    """A pipeline state of a ring of ``stages`` buffers: its buffer and the phase of that buffer's barriers."""

    def __init__(self, count: int, stages: int = 2):
        self.index, self.phase = count % stages, (count // stages) % 2

    def __repr__(self):
        return f"state(buffer {self.index}, phase {self.phase})"


class _RecordingPipe:
    """A PipelineTmaAsync's producer side: what a producer step asks of it, in order."""

    def __init__(self, log: list):
        self.log = log

    def producer_acquire(self, state):
        self.log.append(("acquire", state.index, state.phase))

    def producer_get_barrier(self, state):
        return ("the full barrier of buffer", state.index, "phase", state.phase)

    def producer_commit(self, state):
        self.log.append(("commit", state.index, state.phase))


class _Tiles:
    """tXgX / tXsX: indexing gives a name for the tile it selects, ("global", n_block) or ("ring", index)."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, key):
        return (self.name, *(int(k) for k in (key if isinstance(key, tuple) else (key,)) if k is not None))


def _python_range(*bounds, **_):
    return range(*(int(b) for b in bounds))


def _as_python(module, name: str, stand_ins: dict):
    """Module-level function ``name`` as plain Python over ``stand_ins`` (tests/cpu_sync.py's ``as_python``,
    imported here: notebooks load this file alone, by path)."""
    from cpu_sync import as_python

    return as_python(module, (name,), stand_ins)[name]


def _dsl_stand_ins(copy, arch) -> dict:
    from types import SimpleNamespace

    return dict(cute=SimpleNamespace(copy=copy, arch=arch),
                cutlass=SimpleNamespace(range=_python_range, range_constexpr=_python_range, Int32=int, Boolean=bool,
                                        min=min, max=max, const_expr=lambda x: x, Constexpr=object))


def _place(where: tuple) -> str:
    """A _Tiles name in words: ("global K/V tile", 3) -> "global K/V tile 3", ("pool", 1, 26) -> "page 26, rows
    piece 1", ("ring buffer", 2, 0) -> "ring buffer 0, rows piece 2"."""
    name, *index = where
    if name == "pool":
        return f"page {index[1]}, rows piece {index[0]}" if len(index) == 2 else str(where)
    if name == "ring buffer" and len(index) == 2:
        return f"ring buffer {index[1]}, rows piece {index[0]}"
    return " ".join([name, *map(str, index)])


def _check_producer_log(log: list, state, expected: dict, where: str) -> None:
    """One producer step's log: acquire(state) before any copy, then one copy per expected destination, each
    from the expected source and completing on the state's full barrier. ``expected``: {dst: src or None}
    (None: any source, the copy reads nothing that matters)."""
    acquires = [i for i, event in enumerate(log) if event[0] == "acquire"]
    copies = [(i, event) for i, event in enumerate(log) if event[0] == "copy"]
    if len(acquires) != 1 or log[acquires[0]][1:] != (state.index, state.phase):
        raise AssertionError(f"{where}: producer_acquire ran {len(acquires)} time(s), with "
                             f"{[log[i][1:] for i in acquires]}; expected once, with this step's {state}: the copy "
                             "may start only once the consumers have released that buffer")
    if copies and copies[0][0] < acquires[0]:
        raise AssertionError(f"{where}: a TMA copy is issued before producer_acquire: it may overwrite the buffer "
                             "while the consumers still read the tile it held")
    barrier = ("the full barrier of buffer", state.index, "phase", state.phase)
    seen = {}
    for _, (_, src, dst, bar) in copies:
        if bar is None:
            raise AssertionError(f"{where}: the copy into {_place(dst)} has no tma_bar_ptr: it completes on no barrier, "
                                 f"so the consumers, who wait on the full barrier of buffer {state.index}, wait forever")
        if bar != barrier:
            raise AssertionError(f"{where}: a copy into {_place(dst)} completes on {bar}; expected {barrier} "
                                 "(pipe.producer_get_barrier(state)): the consumers wait on that barrier, and a copy "
                                 "that signals another one leaves them waiting forever, or reading too early")
        if dst in seen:
            raise AssertionError(f"{where}: two copies write {_place(dst)}")
        seen[dst] = src
    if set(seen) != set(expected):
        raise AssertionError(f"{where}: the copies write {[_place(d) for d in sorted(seen)]}; expected "
                             f"{[_place(d) for d in sorted(expected)]}: the tile goes "
                             f"to the buffer {state} points at (state.index), all of it")
    for dst, src in expected.items():
        if src is not None and seen[dst] != src:
            raise AssertionError(f"{where}: the copy into {_place(dst)} reads {_place(seen[dst])}; expected "
                                 f"{_place(src)}, the rows this step is asked for")


def check_load_tile(module) -> None:
    """Your load_tile as plain Python with a recording pipeline and TMA copy: for ring states of both phases
    and KV tiles in any order, one producer_acquire of the step's state, then the tile ``n_block`` copied into
    that state's buffer, completing on that buffer's full barrier."""
    log: list = []
    copy = lambda _atom, src, dst, tma_bar_ptr=None: log.append(("copy", src, dst, tma_bar_ptr))  # noqa: E731
    load_tile = _as_python(module, "load_tile", _dsl_stand_ins(copy, None))
    for count, n_block in enumerate((3, 0, 5, 1, 4)):
        state = _Ring(count)
        log.clear()
        load_tile(_RecordingPipe(log), state, None, _Tiles("global K/V tile"), _Tiles("ring buffer"), n_block)
        _check_producer_log(log, state, {("ring buffer", state.index): ("global K/V tile", n_block)},
                            f"load_tile(KV tile {n_block}, {state})")


class _BlockTableRow:
    """One sequence's row of a shuffled block table over ``num_pages`` pages: its first ``used`` entries, then
    garbage; reading an entry past them raises (in a cache they may be anything). ``who()`` names the reader."""

    def __init__(self, page_size: int, seqlen_k: int, num_pages: int, seed: int, who, past_the_end: str = ""):
        import random

        self.page_size, self.seqlen_k, self.who, self.past_the_end = page_size, seqlen_k, who, past_the_end
        self.used = -(-seqlen_k // page_size)
        self.table = random.Random(seed).sample(range(num_pages), self.used) + [10**6 + i for i in range(3)]

    def __getitem__(self, index):
        index = int(index)
        if index >= self.used:
            raise AssertionError(f"{self.who()} reads block-table entry {index}, past the sequence's {self.used} "
                                 f"pages (keys {index * self.page_size} on, at or past seqlen_k = {self.seqlen_k}): "
                                 f"those entries may be anything{self.past_the_end}")
        return self.table[index]


class _WarpShuffles:
    """``shuffle_sync`` for ``threads`` Python threads, ``tid()`` each, exchanging values within each warp of 32."""

    def __init__(self, threads: int, tid):
        import threading

        self.tid, self.shared = tid, [0] * threads
        self.barriers = [threading.Barrier(WARP, timeout=10) for _ in range(threads // WARP)]

    def shuffle_sync(self, value, lane, mask_and_clamp=WARP - 1, **_):
        """Lane ``lane`` of the caller's segment (``mask_and_clamp``'s segment mask: 24 << 8 is groups of 8)."""
        me = self.tid()
        barrier = self.barriers[me // WARP]
        self.shared[me] = int(value)
        barrier.wait()
        segment = (mask_and_clamp >> 8) & (WARP - 1)
        result = self.shared[me // WARP * WARP + ((me % WARP) & segment | int(lane) & ~segment & (WARP - 1))]
        barrier.wait()
        return result

    def run(self, body, where: str) -> None:
        """``body(tid)`` in each of the threads at once; then the first failure, raised in the caller's thread
        (an exception before a warp that never met at a shuffle)."""
        import threading

        errors, stuck = [], []

        def thread(tid):
            try:
                body(tid)
            except threading.BrokenBarrierError:
                stuck.append(f"{where}: the lanes of a warp did not all reach the same shuffle_sync: every lane must "
                             "run each shuffle (a shuffle inside a branch that some lanes skip hangs the warp)")
            except Exception as failure:  # noqa: BLE001 (raised below, in the caller's thread)
                errors.append(failure)
                for barrier in self.barriers:
                    barrier.abort()

        workers = [threading.Thread(target=thread, args=(tid,)) for tid in range(len(self.shared))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if errors:
            raise errors[0]
        if stuck:
            raise AssertionError(stuck[0])


def check_load_paged_tile(module, page_size: int, seqlen_k: int, tile_n: int = 128, num_pages: int = 40,
                          seed: int = 0) -> None:
    """Your page_lookup and load_paged_tile run by 32 threads, one per lane, with a recording pipeline and TMA
    copy and ``shuffle_sync`` exchanging the lanes' values: for every KV tile of a sequence of ``seqlen_k`` keys in
    pages of ``page_size`` rows (a shuffled block table), the lanes issue the same copies, and these cover
    the tile's rows in order from the right page (page ``num_pages``, outside the pool, past ``seqlen_k``),
    after one producer_acquire, completing on the buffer's full barrier; no block-table entry at or past
    the sequence's pages is read."""
    import threading
    from types import SimpleNamespace

    from course.runtime import varlen

    page_rows = varlen.page_rows(tile_n, page_size)
    lane_of = threading.local()
    pages = _BlockTableRow(page_size, seqlen_k, num_pages, seed, lambda: f"lane {lane_of.lane}",
                           ". A copy past seqlen_k reads page num_pages")
    table = pages.table
    logs = [[] for _ in range(WARP)]
    warp = _WarpShuffles(WARP, lambda: lane_of.lane)
    arch = SimpleNamespace(lane_idx=lambda: lane_of.lane, shuffle_sync=warp.shuffle_sync)
    copy = lambda _atom, src, dst, tma_bar_ptr=None: logs[lane_of.lane].append(("copy", src, dst, tma_bar_ptr))  # noqa: E731
    page_lookup = _as_python(module, "page_lookup", _dsl_stand_ins(copy, arch))
    load_paged_tile = _as_python(module, "load_paged_tile", _dsl_stand_ins(copy, arch))
    def lane(number, state, n_block):
        lane_of.lane = number
        lane_page = page_lookup(n_block, seqlen_k, page_size, pages, num_pages, tile_n, page_rows)
        load_paged_tile(_RecordingPipe(logs[number]), state, None, _Tiles("pool"), _Tiles("ring buffer"), n_block,
                        page_size, lane_page, tile_n, page_rows)

    for count, n_block in enumerate(range(-(-seqlen_k // tile_n))):
        state = _Ring(count)
        where = (f"page_lookup and load_paged_tile(KV tile {n_block}, {state}), seqlen_k {seqlen_k}, pages of "
                 f"{page_size} rows")
        for log in logs:
            log.clear()
        warp.run(partial(lane, state=state, n_block=n_block), where)
        if any(log != logs[0] for log in logs):
            first = next(n for n, log in enumerate(logs) if log != logs[0])
            raise AssertionError(f"{where}: lane {first} issues other copies than lane 0: a TMA copy is issued once "
                                 "for the warp, so its coordinates must be the same in every lane (shuffle_sync gives "
                                 "every lane one lane's value)")
        expected = {}
        for c in range(tile_n // page_rows):
            key = n_block * tile_n + c * page_rows
            src = ("pool", (key % page_size) // page_rows, table[key // page_size]) if key < seqlen_k else None
            expected[("ring buffer", c, state.index)] = src
        _check_producer_log(logs[0], state, expected, where)
        past = [dst for dst, src in expected.items() if src is None]
        for _, src, dst, _ in (event for event in logs[0] if event[0] == "copy"):
            if dst in past and src[-1] != num_pages:
                raise AssertionError(f"{where}: the copy into {_place(dst)} holds only keys at or past seqlen_k but "
                                     f"reads page {src[-1]}; it must read page num_pages = {num_pages}, outside the pool, "
                                     "which TMA fills with zeros")



def check_gather_paged_tile(module, page_size: int, seqlen_k: int, head_dim: int = 128, tile_n: int = 128,
                            num_pages: int = 40, seed: int = 0) -> None:
    """gather_paged_tile run by the producer warpgroup's 128 threads (a Python thread each, ``shuffle_sync``
    exchanging values within each warp of 32): for every KV tile of a sequence of ``seqlen_k`` keys in
    pages of ``page_size`` rows (a shuffled block table), every 16-byte piece of the tile's rows is copied
    exactly once, from the key's page and row (or, at and past ``seqlen_k``, filled with zeros), between
    each thread's one producer_acquire and its one producer_commit; no block-table entry past the
    sequence's pages is read. Addresses are bytes of a row-major pool (page_size, D, pages) and ring
    (tile_n, D, stages), unswizzled (the kernel's assert checks that its constant offsets keep the swizzle)."""
    import threading
    from types import SimpleNamespace

    threads = module.GATHER_THREADS
    me = threading.local()
    pages = _BlockTableRow(page_size, seqlen_k, num_pages, seed, lambda: f"thread {me.tid}")
    table = pages.table
    warps = _WarpShuffles(threads, lambda: me.tid)
    row_bytes = head_dim * 2
    page_bytes, tile_bytes = page_size * row_bytes, tile_n * row_bytes
    log: dict = {}

    def zero_filled_copy(_atom, src, dst, valid):
        log[me.tid].append(("copy", src, dst, bool(valid)))

    ring = SimpleNamespace(element_type=SimpleNamespace(width=16), layout="ring")
    arch = SimpleNamespace(thread_idx=lambda: (me.tid, 0, 0), lane_idx=lambda: me.tid % WARP,
                           shuffle_sync=warps.shuffle_sync)
    cute = SimpleNamespace(arch=arch, size=lambda t, mode: head_dim, make_copy_atom=lambda *a, **k: None,
                           crd2idx=lambda coord, layout: coord[0] * head_dim + coord[1] + coord[2] * tile_n * head_dim,
                           make_ptr=lambda dtype, value, space, **_: (space, value), make_tensor=lambda ptr, _: ptr,
                           make_layout=lambda *_: None, AddressSpace=SimpleNamespace(gmem="pool", smem="ring buffer"))
    cpasync = SimpleNamespace(CopyG2SOp=lambda **_: None, LoadCacheMode=SimpleNamespace(GLOBAL=None))
    stand_ins = _dsl_stand_ins(None, arch)
    stand_ins.update(cute=cute, cpasync=cpasync, zero_filled_copy=zero_filled_copy,
                     row_address=lambda _pool, row, page: int(page) * page_bytes + int(row) * row_bytes,
                     swizzled_address=lambda _ring, _swizzle, coord: cute.crd2idx(coord, ring.layout) * 2)
    gather = _as_python(module, "gather_paged_tile", stand_ins)
    no_swizzle = SimpleNamespace(num_bits=0, num_base=4, num_shift=3)

    def thread(tid, state, n_block):
        me.tid = tid
        log[tid] = []
        gather(_RecordingPipe(log[tid]), state, None, ring, no_swizzle, n_block, seqlen_k, page_size, pages, tile_n)

    for count, n_block in enumerate(range(-(-seqlen_k // tile_n))):
        state = _Ring(count)
        where = (f"gather_paged_tile(KV tile {n_block}, {state}), seqlen_k {seqlen_k}, pages of {page_size} rows, "
                 f"D = {head_dim}, tile_n = {tile_n}")
        warps.run(partial(thread, state=state, n_block=n_block), where)
        written = {}
        for tid, events in log.items():
            kinds = [event[0] for event in events]
            if kinds.count("acquire") != 1 or kinds[0] != "acquire" or kinds.count("commit") != 1 or \
                    kinds[-1] != "commit" or events[0][1:] != (state.index, state.phase):
                raise AssertionError(f"{where}: thread {tid} does {kinds[:3]}...{kinds[-2:]}; every producer thread "
                                     f"acquires the buffer of {state} once before its copies and commits once after "
                                     "them (the full barrier counts one arrival per thread)")
            for _, src, dst, valid in (event for event in events if event[0] == "copy"):
                if src[0] != "pool" or dst[0] != "ring buffer" or dst[1] // tile_bytes != state.index:
                    raise AssertionError(f"{where}: thread {tid} copies {src} to {dst}; expected pool bytes into "
                                         f"ring buffer {state.index} (bytes {state.index * tile_bytes}..)")
                row, col = dst[1] % tile_bytes // row_bytes, dst[1] % row_bytes // 2
                if (row, col) in written:
                    raise AssertionError(f"{where}: row {row}, columns {col}.. of the tile written twice "
                                         f"(threads {written[row, col][0]} and {tid})")
                written[row, col] = (tid, src[1], valid)
        expected = {(row, col) for row in range(tile_n) for col in range(0, head_dim, 8)}
        if set(written) != expected:
            missing = sorted(expected - set(written))[:3]
            raise AssertionError(f"{where}: {len(expected - set(written))} pieces of the tile are never written "
                                 f"(e.g. (row, first column) {missing}); {len(set(written) - expected)} outside it")
        for (row, col), (tid, src, valid) in written.items():
            key = n_block * tile_n + row
            if key >= seqlen_k:
                if valid:
                    raise AssertionError(f"{where}: row {row} holds key {key}, past seqlen_k: it must be filled with "
                                         "zeros (valid false), not copied")
                continue
            got = (src // page_bytes, src % page_bytes // row_bytes, src % row_bytes // 2)
            want = (table[key // page_size], key % page_size, col)
            if not valid or got != want:
                raise AssertionError(f"{where}: row {row}, columns {col}.. (key {key}), thread {tid}: copied from "
                                     f"page {got[0]}, row {got[1]}, columns {got[2]}.. (valid {valid}); expected "
                                     f"page {want[0]}, row {want[1]}, columns {col}..")


# ---------------------------------------------------------------- stage 11: a KV tile's Q tiles, P and dS

def backward_kernel(module, head_dim: int, config=None):
    """Stage 11's kernel for ``config``, or for ``head_dim`` with no mask (its tiles, tiled MMAs and layouts)."""
    return module.AttentionBackward(config or prefill.KernelConfig(head_dim=head_dim))


@cute.jit
def mask_kv_tile(module: cutlass.Constexpr, config: cutlass.Constexpr, m_blocks: cutlass.Constexpr,
                 scores: cute.Tensor, tiles: cute.Tensor, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                 left: Int32, right: Int32, num_sink_tokens: Int32):
    """KeyTileMask of KV tile ``n_block`` on every register of every MMA thread, for each Q tile.

    ``scores`` [the config's KV tile, m_blocks * its Q tile], zeros, gets -inf where ``apply_by_key`` masks;
    ``tiles`` gets [m_block_min, m_block_max] (``m_block_range``), then ``tile_is_partial`` of each Q tile,
    then ``dq_turn`` of each Q tile (the deterministic dQ order).
    """
    kernel = backward_kernel(module, config.head_dim, config)
    tile_m, tile_n, sdp_mma = kernel.tile_m, kernel.tile_n, kernel.tiled_mmas()[0]
    mask = module.KeyTileMask(n_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config)
    m_block_min, m_block_max = mask.m_block_range()
    tiles[0] = m_block_min
    tiles[1] = m_block_max
    tile_is_partial = mask.tile_is_partial
    for m in cutlass.range_constexpr(m_blocks):
        tiles[2 + m] = Int32(tile_is_partial(m))
    dq_turn = mask.dq_turn
    for m in cutlass.range_constexpr(m_blocks):
        tiles[2 + m_blocks + m] = dq_turn(m)
    apply = mask.apply_by_key
    keys_by_rows, score_coordinates = module.keys_by_rows, module.score_coordinates
    shape, keys_as_m = kernel.score_shape, kernel.keys_as_m
    for m_block in range(m_blocks):
        for thread in range(MMA_THREADS):
            thr = sdp_mma.get_slice(thread)
            acc = thr.make_fragment_C(thr.partition_shape_C(shape))
            coord = score_coordinates(thr, tile_n, tile_m, keys_as_m)
            acc.fill(0.0)
            apply(keys_by_rows(acc, keys_as_m), keys_by_rows(coord, keys_as_m), m_block)
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                key, row = coord[i]
                scores[key, m_block * tile_m + row] = acc[i]


def check_key_tile_masks(module, features: dict, lengths: list[tuple[int, int]], head_dim: int = 128) -> None:
    """KeyTileMask.m_block_range and apply_by_key for every KV tile against reference.visible_keys: the
    Q tiles a KV tile visits are exactly those with a row that sees one of its keys, a tile that skips the
    mask sees all of them, and the mask hides exactly the invisible (row, key) pairs. The Q tiles are those of
    ``head_dim``'s kernel with this mask (``q_tile_rows``)."""
    left, right = validation.resolve_window(features.get("causal", False), features.get("window_size", (-1, -1)))
    sinks = features.get("num_sink_tokens", 0)
    config = prefill.KernelConfig(head_dim=head_dim, has_left=left >= 0, has_right=right >= 0,
                                  has_sink_tokens=left >= 0 and sinks > 0)
    tile_m, tile_n = module.q_tile_rows(config), module.kv_tile_keys(head_dim)
    m_blocks = max(_tiles(s_q, tile_m) for s_q, _ in lengths)
    scores = torch.zeros(tile_n, m_blocks * tile_m)
    tiles = torch.zeros(2 + 2 * m_blocks, dtype=torch.int32)
    for s_q, s_k in lengths:
        visible = reference.visible_keys(s_q, s_k, **features)
        for n_block in range(_tiles(s_k, tile_n)):
            scores.zero_()
            args = (scores, tiles, n_block, s_q, s_k, left, right, sinks)
            compile_on_cpu(mask_kv_tile, (module, config, m_blocks), args)(*args)
            keys = visible[:, n_block * tile_n:(n_block + 1) * tile_n]  # [S_q, keys of this tile]
            where = f"{mask_description(features)}, S_q={s_q}, S_k={s_k}, KV tile {n_block} of {tile_n} keys, " \
                    f"Q tiles of {tile_m} rows"
            seen = [m for m in range(_tiles(s_q, tile_m)) if keys[m * tile_m:(m + 1) * tile_m].any()]
            m_min, m_max = tiles[0].item(), tiles[1].item()
            expected = (seen[0], seen[-1] + 1) if seen else None
            if (expected is None and m_min < m_max) or (expected is not None and (m_min, m_max) != expected):
                raise AssertionError(f"m_block_range, {where}: the kernel visits Q tiles [{m_min}, {m_max}); the "
                                     f"tiles with a row that sees a key of this KV tile are "
                                     f"{'none' if expected is None else f'[{expected[0]}, {expected[1]})'}")
            for m in range(m_min, m_max):
                rows = keys[m * tile_m:(m + 1) * tile_m]
                if not tiles[2 + m].item() and not rows.all():
                    hidden = (~rows).nonzero()[0].tolist()
                    raise AssertionError(f"tile_is_partial, {where}: Q tile {m} skips the mask, but row "
                                         f"{m * tile_m + hidden[0]} may not see key {n_block * tile_n + hidden[1]}")
                earlier = [n for n in range(n_block + 1, _tiles(s_k, tile_n))
                           if visible[m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n].any()]
                if tiles[2 + m_blocks + m].item() != len(earlier):
                    raise AssertionError(f"dq_turn, {where}: Q tile {m} gets dQ shares first from KV tiles {earlier} "
                                         f"(those above this one: {len(earlier)}); dq_turn says "
                                         f"{tiles[2 + m_blocks + m].item()}, so the deterministic order would hang")
                past = (n_block + 1) * tile_n > s_k
                if past and not tiles[2 + m].item():
                    raise AssertionError(f"tile_is_partial, {where}: Q tile {m} skips the mask, but the KV tile runs past "
                                         f"S_k = {s_k}: its keys from {s_k} on are not the sequence's")
                if past and (scores[keys.shape[1]:, m * tile_m:m * tile_m + rows.shape[0]] == 0).any():
                    raise AssertionError(f"apply_by_key, {where}: a key at or past S_k = {s_k} is kept for a row of "
                                         f"Q tile {m}; every key past S_k is masked for every row")
                kept = scores[:keys.shape[1], m * tile_m:m * tile_m + rows.shape[0]].t() == 0
                if tiles[2 + m].item() and not torch.equal(kept, rows):
                    wrong = (kept != rows).nonzero()[0].tolist()
                    row, key = m * tile_m + wrong[0], n_block * tile_n + wrong[1]
                    raise AssertionError(f"apply_by_key, {where}: (row {row}, key {key}) is "
                                         f"{'kept' if kept[tuple(wrong)] else 'masked'}; it should be "
                                         f"{'visible' if rows[tuple(wrong)] else 'masked'}")


@cute.jit
def deterministic_visits(module: cutlass.Constexpr, config: cutlass.Constexpr, out: cute.Tensor, n_block: Int32,
                         seqlen_q: Int32, seqlen_k: Int32, left: Int32, right: Int32, num_sink_tokens: Int32,
                         rotate: Int32):
    """The deterministic kernel's KeyTileMask of KV tile ``n_block``: ``out[0, s]`` the Q tile of step s
    (``q_tile``), ``out[1, s]`` its ``dq_turn``; ``out[2, 0]`` the number of steps."""
    mask = module.KeyTileMask(n_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config, True, rotate)
    m_block_min, m_block_max = mask.m_block_range()
    n_m = m_block_max - m_block_min
    out[2, 0] = n_m
    q_tile, dq_turn = mask.q_tile, mask.dq_turn
    for step in range(n_m):
        m_block = q_tile(step, m_block_min, n_m)
        out[0, step] = m_block
        out[1, step] = dq_turn(m_block)


def check_deterministic_turns(module, features: dict, lengths: list[tuple[int, int]], rotate: int,
                              head_dim: int = 128) -> None:
    """The deterministic dQ order, KV tile by KV tile (``q_tile`` and ``dq_turn``): every tile visits each Q tile
    it sees once, the turns of a Q tile's visitors are 0, 1, 2, ... (one each), and the CTAs, all resident and
    each waiting at every step for its turn, finish: no wait that never ends. Q tiles of ``head_dim``'s kernel."""
    left, right = validation.resolve_window(features.get("causal", False), features.get("window_size", (-1, -1)))
    sinks = features.get("num_sink_tokens", 0)
    config = prefill.KernelConfig(head_dim=head_dim, has_left=left >= 0, has_right=right >= 0,
                                  has_sink_tokens=left >= 0 and sinks > 0)
    tile_m, tile_n = module.q_tile_rows(config), module.kv_tile_keys(head_dim)
    m_blocks = max(_tiles(s_q, tile_m) for s_q, _ in lengths)
    out = torch.zeros(3, m_blocks, dtype=torch.int32)
    for s_q, s_k in lengths:
        where = f"deterministic, {mask_description(features)}, S_q={s_q}, S_k={s_k}, rotate={rotate}"
        visible = reference.visible_keys(s_q, s_k, **features)
        visits = {}
        for n_block in range(_tiles(s_k, tile_n)):
            args = (out, n_block, s_q, s_k, left, right, sinks, rotate)
            compile_on_cpu(deterministic_visits, (module, config), args)(*args)
            steps = out[2, 0].item()
            visits[n_block] = [(out[0, i].item(), out[1, i].item()) for i in range(steps)]
            seen = {m for m in range(_tiles(s_q, tile_m))
                    if visible[m * tile_m:(m + 1) * tile_m, n_block * tile_n:(n_block + 1) * tile_n].any()}
            if sorted(m for m, _ in visits[n_block]) != sorted(seen):
                raise AssertionError(f"q_tile, {where}: KV tile {n_block} visits Q tiles "
                                     f"{[m for m, _ in visits[n_block]]}; it should visit each of {sorted(seen)} once")
        for m in range(_tiles(s_q, tile_m)):
            turns = sorted(turn for tile in visits.values() for q, turn in tile if q == m)
            if turns != list(range(len(turns))):
                raise AssertionError(f"dq_turn, {where}: the KV tiles that add into Q tile {m} take turns {turns}; "
                                     f"each of 0..{len(turns) - 1} must be taken once")
        counters, position = {}, dict.fromkeys(visits, 0)
        while any(position[n] < len(visits[n]) for n in visits):
            moved = False
            for n, tile in visits.items():
                if position[n] < len(tile) and counters.get(tile[position[n]][0], 0) == tile[position[n]][1]:
                    counters[tile[position[n]][0]] = tile[position[n]][1] + 1
                    position[n] += 1
                    moved = True
            if not moved:
                stuck = {n: visits[n][position[n]] for n in visits if position[n] < len(visits[n])}
                raise AssertionError(f"dq_turn, {where}: the CTAs wait forever: (KV tile: (Q tile, its turn)) {stuck}, "
                                     f"while the Q tiles' counters are {counters}")


@cute.jit
def score_gradients(module: cutlass.Constexpr, head_dim: cutlass.Constexpr, s: cute.Tensor, dp: cute.Tensor,
                    lse: cute.Tensor, d: cute.Tensor, scale_log2: Float32):
    """probabilities_and_score_gradients on every MMA thread's registers of ``head_dim``'s kernel: s [KV tile,
    Q tile] becomes P^T, dp dS^T."""
    kernel = backward_kernel(module, head_dim)
    sdp_mma, shape, keys_as_m = kernel.tiled_mmas()[0], kernel.score_shape, kernel.keys_as_m
    tile_n, tile_m = kernel.tile_n, kernel.tile_m
    # (a runtime loop may not carry the module or the kernel)
    gradients, keys_by_rows, score_coordinates = (module.probabilities_and_score_gradients, module.keys_by_rows,
                                                  module.score_coordinates)
    for thread in range(MMA_THREADS):
        thr = sdp_mma.get_slice(thread)
        acc_s = thr.make_fragment_C(thr.partition_shape_C(shape))
        acc_dp = thr.make_fragment_C(thr.partition_shape_C(shape))
        coord = score_coordinates(thr, tile_n, tile_m, keys_as_m)
        for i in cutlass.range(cute.size(acc_s), unroll_full=True):
            key, row = coord[i]
            acc_s[i] = s[key, row]
            acc_dp[i] = dp[key, row]
        gradients(keys_by_rows(acc_s, keys_as_m), keys_by_rows(acc_dp, keys_as_m), keys_by_rows(coord, keys_as_m),
                  lse, d, scale_log2)
        for i in cutlass.range(cute.size(acc_s), unroll_full=True):
            key, row = coord[i]
            s[key, row] = acc_s[i]
            dp[key, row] = acc_dp[i]


def check_score_gradients(module, head_dim: int = 64) -> None:
    """P^T = exp2(S^T scale log2(e) - LSE) and dS^T = P^T (dP^T - D) for each (key, row) of ``head_dim``'s tiles,
    against float64, with masked scores (-inf) and a row that sees nothing (LSE +inf)."""
    gen = torch.Generator().manual_seed(11)
    kernel = backward_kernel(module, head_dim)
    tile_n, tile_m = kernel.tile_n, kernel.tile_m
    s = torch.randn(tile_n, tile_m, generator=gen) * 3
    s[:, 5] = -math.inf
    s[7, :] = -math.inf
    dp = torch.randn(tile_n, tile_m, generator=gen)
    scale_log2 = 0.125 * math.log2(math.e)
    lse = torch.logsumexp(s.double() * 0.125, dim=0).float() * math.log2(math.e)  # log2 units, per row (column)
    lse[5] = math.inf  # the preprocess's value for a row without keys
    d = torch.randn(tile_m, generator=gen)
    p_expected = torch.exp2(s.double() * scale_log2 - lse.double())
    ds_expected = p_expected * (dp.double() - d.double())
    s_out, dp_out = s.clone(), dp.clone()
    args = (s_out, dp_out, lse, d, scale_log2)
    compile_on_cpu(score_gradients, (module, head_dim), args)(*args)
    for name, got, expected in (("P^T", s_out, p_expected), ("dS^T", dp_out, ds_expected)):
        if torch.isnan(got).any():
            key, row = torch.isnan(got).nonzero()[0].tolist()
            raise AssertionError(f"probabilities_and_score_gradients: {name} is NaN at (key {key}, row {row}) "
                                 "(a masked score or a row without keys must give P = 0)")
        err = (got.double() - expected).abs()
        if err.max().item() > O_TOLERANCE:
            key, row = [int(i) for i in torch.unravel_index(err.argmax(), err.shape)]
            raise AssertionError(f"probabilities_and_score_gradients: {name} at (key {key}, row {row}) is "
                                 f"{got[key, row].item():.6g}; expected {expected[key, row].item():.6g}")


@cute.jit
def dq_store_positions(module: cutlass.Constexpr, config: cutlass.Constexpr, threads: cutlass.Constexpr,
                       positions: cute.Tensor, coords: cute.Tensor):
    """For every thread of the dQ warpgroups and each of its dQ registers (the order it holds them): the float
    of a round's buffer the register goes to (``DQTile.store_copy`` on ``DQTile.layout``), and the (row,
    column) of the tile it holds (the dQ tiled MMA), which ``ConvertDQ`` writes it to."""
    kernel = backward_kernel(module, config.head_dim, config)
    dq_mma, store_copy, layout = kernel.tiled_mmas()[-1], kernel.dq.store_copy(), kernel.dq.layout()
    tile = cute.make_identity_tensor(kernel.dq.shape)
    buffer = cute.make_identity_tensor(layout.shape)
    for thread in range(threads):
        held = dq_mma.get_slice(thread).partition_C(tile)
        stored = store_copy.get_slice(thread % 128).partition_D(buffer[None, thread // 128])
        for i in range(cute.size(held)):
            positions[thread, i] = layout(stored[i])
            coords[thread, i, 0], coords[thread, i, 1] = held[i]  # (row, column), or (column, row) transposed


def check_dq_stores(module, head_dim: int, causal: bool = False) -> None:
    """Stage 11's dQ stores, in the order the registers hold the values: every float of a round's buffer gets
    exactly one register and every (row, column) of the tile exactly one; a thread's stores are 16-byte
    vectors of its registers in order, each warpgroup's inside its part (the piece its reduce-add copies);
    and a quarter warp's vectors fill 128 contiguous bytes (one wavefront, no bank conflict)."""
    config = prefill.KernelConfig(head_dim=head_dim, has_right=causal)
    dq = backward_kernel(module, head_dim, config).dq
    threads = 128 * dq.wgs
    per_thread = dq.part_floats // 128
    positions = torch.zeros(threads, per_thread, dtype=torch.int32)
    coords = torch.zeros(threads, per_thread, 2, dtype=torch.int32)
    args = (positions, coords)
    compile_on_cpu(dq_store_positions, (module, config, threads), args)(*args)
    where = f"D = {head_dim}, Q tiles of {dq.tile_m} rows, {dq.columns} columns a round" + (", dQ^T" if dq.transposed
                                                                                          else "")
    assert sorted(positions.flatten().tolist()) == list(range(dq.tile_m * dq.columns)), \
        f"{where}: the stores do not cover the buffer once each"
    cells = {(int(m), int(n)) for m, n in coords.reshape(-1, 2).tolist()}
    assert len(cells) == positions.numel() and all(0 <= m < dq.shape[0] and 0 <= n < dq.shape[1] for m, n in cells), \
        f"{where}: the registers do not hold each (row, column) of the tile once"
    for thread in range(threads):
        part = range(thread // 128 * dq.part_floats, (thread // 128 + 1) * dq.part_floats)
        for i in range(0, per_thread, 4):
            vector = positions[thread, i:i + 4].tolist()
            assert vector[0] % 4 == 0 and vector == list(range(vector[0], vector[0] + 4)), \
                f"{where}: thread {thread}'s registers {i}..{i + 3} are not one aligned 16-byte vector"
            assert vector[0] in part, f"{where}: thread {thread} stores outside its warpgroup's part"
    for quarter in range(threads // 8):
        for i in range(0, per_thread, 4):
            starts = sorted(int(positions[quarter * 8 + lane, i]) for lane in range(8))
            assert starts == list(range(starts[0], starts[0] + 32, 4)), \
                f"{where}: lanes {quarter * 8}..{quarter * 8 + 7}'s vector {i // 4} is not 128 contiguous bytes"


# ---------------------------------------------------------------- stage 9: the fragments, one warp emulated

class Fragment:
    """A thread's compact register fragment in plain Python: its mode sizes (what ``cute.size(t, mode=[i])``
    reports) and its values by slot. A slot written twice, past the end or never is the learner's index bug."""

    def __init__(self, modes: tuple, name: str, where: str):
        self.modes, self.name, self.where = modes, name, where
        self.values = [None] * math.prod(math.prod(m) if isinstance(m, tuple) else m for m in modes)

    def __setitem__(self, slot, value):
        if not isinstance(slot, int) or not 0 <= slot < len(self.values):
            raise AssertionError(f"{self.where}: slot {slot} of {self.name}, which has {len(self.values)} values "
                                 f"({self.modes}): an index past the fragment writes another register or none")
        if self.values[slot] is not None:
            raise AssertionError(f"{self.where}: slot {slot} of {self.name} is written twice: two elements land in "
                                 "one place, and some other slot keeps nothing")
        self.values[slot] = float(value)

    def filled(self) -> list:
        empty = [i for i, v in enumerate(self.values) if v is None]
        if empty:
            raise AssertionError(f"{self.where}: slots {empty[:8]} of {self.name} are never written: the MMA would "
                                 "read whatever those registers held")
        return self.values


class _Tile:
    """A warp's K or V tile [16 rows, chunks, k_elems] of one ring stage: ``tile[row, chunk, None]`` is a list."""

    def __init__(self, values):
        self.values = values

    def __getitem__(self, index):
        row, chunk, _ = index
        return list(self.values[row, chunk])


def _fragment_methods(module):
    """q_fragment, k_fragment and v_fragment as plain Python (``plain_python_method``), with stand-ins for what they
    call: the constexpr loops, ``cute.size`` of a ``Fragment``, ``cute.local_tile`` of a list."""
    import types

    def local_tile(values, shape, coord):
        (n,), (i,) = shape, coord
        return values[i * n:(i + 1) * n]

    def size(t, mode=None):
        sizes = [math.prod(m) if isinstance(m, tuple) else m for m in t.modes]
        return math.prod(sizes) if mode is None else math.prod(sizes[m] for m in mode)

    methods = {}
    for name in ("q_fragment", "k_fragment", "v_fragment"):
        fn, namespace = plain_python_method(module, "TensorCoreDecode", name)
        namespace["cutlass"] = types.SimpleNamespace(range_constexpr=range, const_expr=bool)
        namespace["cute"] = types.SimpleNamespace(size=size, local_tile=local_tile)
        methods[name] = fn
    return methods


def check_fragments(module, head_dim: int, cache_dtype: str = "float16") -> None:
    """Your q_fragment, k_fragment and v_fragment for every lane of one warp, then S = Q K^T and O = P V on the
    fragments as mma.sync.m16n8k16 reads them (PTX's fragment layouts), against q @ k^T and p @ v in float64:
    16 heads, 16 keys, the ring's swizzled tile, D split in two parts at D = 256 as the kernel splits it."""
    import types

    gen = torch.Generator().manual_seed(head_dim)
    k_elems, v_elems = module.k_piece(cache_dtype), module.v_piece(cache_dtype, head_dim)
    chunks, k_pieces = head_dim // k_elems, head_dim // 4 // k_elems
    thread = types.SimpleNamespace(k_elems=k_elems, v_elems=v_elems, chunks=chunks, k_pieces=k_pieces,
                                   piece_to_registers=lambda piece: piece)
    q, k, v = (torch.randn(16, head_dim, generator=gen, dtype=torch.float64) for _ in range(3))
    p = torch.rand(16, 16, generator=gen, dtype=torch.float64)

    def ring_tile(rows):  # chunk c of row r at c ^ swizzle(r), as the copies place it
        tile = torch.empty(16, chunks, k_elems, dtype=torch.float64)
        for r in range(16):
            for c in range(chunks):
                tile[r, c ^ module.swizzle(r, chunks)] = rows[r, c * k_elems:(c + 1) * k_elems]
        return _Tile(tile)

    sK, sV = ring_tile(k), ring_tile(v)
    methods = _fragment_methods(module)
    parts = 2 if head_dim > 128 else 1
    where = f"the fragments on the CPU (D = {head_dim}, {cache_dtype} cache, one warp)"
    s = torch.zeros(16, 16, dtype=torch.float64)
    o = torch.full((16, head_dim), math.nan, dtype=torch.float64)
    for part in range(parts):
        a = torch.zeros(head_dim // 16 // parts, 16, 16, dtype=torch.float64)
        b_k = torch.zeros(head_dim // 16 // parts, 2, 16, 8, dtype=torch.float64)
        b_v = torch.zeros(head_dim // 8 // parts, 16, 8, dtype=torch.float64)
        for lane in range(32):
            g, kq = lane // 4, lane % 4
            at = f"{where}, lane {lane} (g = {g}, kq = {kq})"
            r_q = Fragment(((2, 2, 2), 1, head_dim // 16), "r_q", at + ", q_fragment")
            for r in range(2):
                for piece in range(k_pieces):
                    chunk = 4 * piece + kq
                    methods["q_fragment"](thread, r_q, list(q[g + 8 * r, chunk * k_elems:(chunk + 1) * k_elems]), r, piece)
            r_k = Fragment(((2, 2), 2, head_dim // 16 // parts), "r_k", at + ", k_fragment")
            methods["k_fragment"](thread, sK, r_k, g, kq, part * k_pieces // parts)
            r_v = Fragment(((2, 2), head_dim // 8 // parts, 1), "r_v", at + ", v_fragment")
            methods["v_fragment"](thread, sV, r_v, g, kq, part * (head_dim // 8 // v_elems) // parts)
            q_values = r_q.filled()[part * len(r_q.values) // parts:(part + 1) * len(r_q.values) // parts]
            k_values, v_values = r_k.filled(), r_v.filled()
            for kb in range(head_dim // 16 // parts):  # PTX: A value i at row g + 8 (i // 2 % 2), column 2kq + i % 2 + 8 (i // 4)
                for i in range(8):
                    a[kb, g + 8 * (i // 2 % 2), 2 * kq + i % 2 + 8 * (i // 4)] = q_values[8 * kb + i]
                for j in range(2):  # B value i at row (k) 2kq + i % 2 + 8 (i // 2), column (n) g
                    for i in range(4):
                        b_k[kb, j, 2 * kq + i % 2 + 8 * (i // 2), g] = k_values[i + 4 * j + 8 * kb]
            for nb in range(head_dim // 8 // parts):
                for i in range(4):
                    b_v[nb, 2 * kq + i % 2 + 8 * (i // 2), g] = v_values[i + 4 * nb]
        for kb in range(head_dim // 16 // parts):
            for j in range(2):
                s[:, 8 * j:8 * j + 8] += a[kb] @ b_k[kb, j]
        for nb in range(head_dim // 8 // parts):  # C value i at row g + 8 (i // 2), column 2kq + i % 2: o_column maps it
            block = p @ b_v[nb]
            for lane in range(32):
                g, kq = lane // 4, lane % 4
                for i in range(4):
                    column = module.o_column(4 * (nb + part * head_dim // 8 // parts) + i, kq, v_elems)
                    o[g + 8 * (i // 2), column] = block[g + 8 * (i // 2), 2 * kq + i % 2]
    assert_close(s, q @ k.T, where + ": S = Q K^T from r_q and r_k", "Q's and K's fragments disagree on a column, or a "
                 "value sits in another slot than the MMA reads it from (page: The m16n8k16 fragments)")
    assert_close(o, p @ v, where + ": O = P V from r_v", "V's keys are not P's (v_slot_key), or an element sits in "
                 "another column block (page: V's B fragment)")


def assert_close(got: torch.Tensor, expected: torch.Tensor, where: str, look: str) -> None:
    bad = ~torch.isclose(got, expected, rtol=1e-9, atol=1e-9)
    if bad.any():
        row, col = (int(x) for x in bad.nonzero()[0])
        raise AssertionError(f"{where}: {int(bad.sum())} of {bad.numel()} values differ, first at [{row}, {col}]: got "
                             f"{float(got[row, col]):.4f}, expected {float(expected[row, col]):.4f}. {look}")
