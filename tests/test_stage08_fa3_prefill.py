"""Stage 8 checks: every prefill check of stages 1-6 on the FA3-class kernel, and what its scheduling adds.

The mask, sink and LSE checks of stages 4-6 run here again, unchanged, against stage 8; then the
cases the new scheduling could get wrong: many tiles per CTA (the persistent scheduler), tiles
whose Q rows see no key, long sequences, one query row, every step of the ablation, and identical
bits over 200 launches (a race between the warpgroups would show as differences).
"""

import cpu_numerics
import cpu_sync
import pytest
import torch

from course.runtime import prefill, stages, validation
from course import testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)
from test_stage04_masking import test_masks_match_reference, test_masks_with_gqa  # noqa: F401
from test_stage04_masking import MASK_LENGTHS, MASKS
from test_stage05_sinks import SINK_TOKEN_MASKS
from test_stage04_masking import test_rows_without_visible_keys_are_zero  # noqa: F401
from test_stage05_sinks import test_extreme_sink_logits, test_only_sink_token_visible  # noqa: F401
from test_stage05_sinks import test_sinks_match_reference  # noqa: F401
from test_stage06_lse import test_lse_matches_reference, test_split_merge_equals_one_call  # noqa: F401
from test_stage06_lse import test_merge_kernel_matches_pytorch_and_guards  # noqa: F401
from test_stage06_lse import assert_lse_matches

STAGE = stages.get(8)
LENGTHS = testing.MULTI_TILE_LENGTHS


# ---------------------------------------------------------------- the ablation (CPU)

@pytest.mark.parametrize("head_dim", [128, 96], ids=["d128", "d96-p-in-smem"])
def test_ablation_compiles_each_step(stage, head_dim):
    """Every step of the ablation is a kernel of its own; each must compile without spilling (beyond what the
    head dim's warpgroup count allows: D = 96 runs three, with P in shared memory in every loop)."""
    assert list(stage.ABLATION) == [f"+{step.name.lower()}" for step in stage.Step]
    for label, kernel_class in stage.ABLATION.items():
        config = prefill.KernelConfig("float16", head_dim, has_right=True)
        report = prefill.cross_compile_config(kernel_class, config, stage=8)
        assert (report.spill_bytes or 0) <= stage.spill_bytes_allowed(config), (
            f"{label} spills {report.spill_bytes} bytes")
        assert report.wgmma_serialized is None, f"{label}: {report.wgmma_serialized}"


def test_tiles_cover_the_contract_and_fit(stage):
    """TILES has a tiling for each (D, D_v) the contract names from stage 8 on, and its buffers fit in shared memory."""
    assert tuple(stage.TILES) == validation.HEAD_DIMS_FROM_STAGE_8, (
        f"TILES covers {list(stage.TILES)}; the contract (validation.HEAD_DIMS_FROM_STAGE_8) names "
        f"{list(validation.HEAD_DIMS_FROM_STAGE_8)}")
    for dims, tiles in stage.TILES.items():
        assert stage.shared_bytes(*dims, tiles) <= stage.SMEM_BYTES, (
            f"TILES[{dims}] = {tiles} needs {stage.shared_bytes(*dims, tiles)} bytes of shared memory; a CTA may "
            f"have {stage.SMEM_BYTES}")


# ---------------------------------------------------------------- the tile order (CPU)

MiB = 1024 * 1024


@pytest.mark.compiles
@pytest.mark.parametrize("problem", [
    # 60 pairs, 7 KV tiles each: groups of 32 fit in 50 MiB, and the last group has 28 pairs
    dict(seqlen_q=1000, num_heads=20, num_batch=3, seqlen_k=777, head_dim=128, dtype_bytes=2, l2_bytes=50 * MiB),
    # a small L2: groups of 2 pairs
    dict(seqlen_q=300, num_heads=3, num_batch=2, seqlen_k=900, head_dim=64, dtype_bytes=2, l2_bytes=1 * MiB),
    # one pair's K and V alone overflow L2: groups of 1
    dict(seqlen_q=129, num_heads=5, num_batch=1, seqlen_k=70000, head_dim=128, dtype_bytes=2, l2_bytes=8 * MiB),
], ids=["short-last-group", "groups-of-2", "groups-of-1"])
@pytest.mark.parametrize("longest_first", [False, True], ids=["in-order", "longest-first"])
def test_on_cpu_tile_order(stage, problem, longest_first):
    """Your l2_group and coords: every (Q tile, head, batch) exactly once, in the grouped order."""
    cpu_numerics.check_schedule(stage, longest_first=longest_first, **problem)


STAGE8_MASKS = {**{name: (case, MASK_LENGTHS) for name, case in MASKS.items()}, **SINK_TOKEN_MASKS}


@pytest.mark.compiles
@pytest.mark.parametrize("name", list(STAGE8_MASKS))
def test_on_cpu_window_and_visit_order(stage, name):
    """Stage 8's WindowMask on the CPU: apply on every register, the tiles visited (window range from its last
    tile down, then the sink tiles), and which steps may skip the mask (tile_is_partial, unmasked_steps)."""
    case, lengths = STAGE8_MASKS[name]
    cpu_numerics.check_masks(stage, case, lengths)


# KV tiles narrower than the Q tile (the wide head dims) and 192-row Q tiles (three MMA warpgroups): the diagonal
# crosses several KV tiles, and a Q tile's window edges fall inside tiles at other places.
NARROW_TILE_MASKS = ["causal", "window-asymmetric", "tokens-swa-far"]
OTHER_TILINGS = sorted({(64 * t.mma_warpgroups, t.tile_n) for t in STAGE.load("solutions").TILES.values()} - {(128, 128)})


@pytest.mark.compiles
@pytest.mark.parametrize("name", NARROW_TILE_MASKS)
@pytest.mark.parametrize("tiling", OTHER_TILINGS, ids=[f"{m}x{n}" for m, n in OTHER_TILINGS])
def test_on_cpu_window_with_other_tiles(stage, name, tiling):
    """The same checks with the Q and KV tiles of the other head dims (TILES)."""
    case, lengths = STAGE8_MASKS[name]
    tile_m, tile_n = tiling
    cpu_numerics.check_masks(stage, case, lengths, tile_n=tile_n, tile_m=tile_m)


@pytest.mark.parametrize("num_wgs", sorted({t.mma_warpgroups for t in STAGE.load("solutions").TILES.values()}),
                         ids=lambda n: f"{n}-warpgroups")
@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped-loop", "pingpong-loop"])
def test_on_cpu_synchronization(stage, overlapped, num_wgs):
    """Your ping-pong and overlapped step, every MMA warpgroup recorded on the CPU and replayed in a model of the
    hardware's rules: no hang, one turn at a time, no register race with an in-flight WGMMA, buffers released after
    the GEMMs that read them, the softmax under the P V (tests/cpu_sync.py)."""
    cpu_sync.check_stage8(stage, overlapped=overlapped, num_wgs=num_wgs)


# ---------------------------------------------------------------- numerics (Hopper GPU)

HEAD_DIM_FEATURES = {  # every feature's code, at every head dim
    "none": {},
    "causal": dict(causal=True),
    "window-sinks-lse": dict(window_size=(300, 17), num_sink_tokens=5, sinks=True, return_lse=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("features", list(HEAD_DIM_FEATURES))
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dims", list(validation.HEAD_DIMS_FROM_STAGE_8),
                         ids=[f"d{d}" + (f"v{d_v}" if d_v != d else "") for d, d_v in validation.HEAD_DIMS_FROM_STAGE_8])
@pytest.mark.parametrize("sizes", [(300, 1000), (1000, 777), (1, 129)], ids=["sq300-sk1000", "sq1000-sk777",
                                                                              "sq1-sk129"])
def test_every_head_dim(stage, dims, dtype, features, sizes):
    """Each (D, D_v) of the contract with GQA, lengths that are not tile multiples, and the masks, sinks and LSE:
    the tile shapes differ per head dim (TILES), so every head dim runs every feature."""
    (d, d_v), (s_q, s_k) = dims, sizes
    q, k, v = testing.random_qkv(2, s_q, s_k, 8, 2, d, dtype, seed=d + d_v + s_q, head_dim_v=d_v)
    options = dict(HEAD_DIM_FEATURES[features])
    return_lse = options.pop("return_lse", False)
    if options.pop("sinks", False):
        options["sink_logits"] = torch.linspace(-1.0, 2.0, 8, device="cuda")
    out = torch.full((2, s_q, 8, d_v), float("nan"), device="cuda", dtype=q.dtype)
    result = stage.attention(q, k, v, out=out, return_lse=return_lse, **options)
    where = f"stage 8, D={d}, D_v={d_v}, {dtype}, S_q={s_q}, S_k={s_k}, {features}"
    testing.assert_attention_matches(result[0] if return_lse else result, q, k, v, where=where, **options)
    if return_lse:
        assert_lse_matches(result[1], q, k, v, f"{where}: LSE", **options)

@pytest.mark.gpu
@pytest.mark.parametrize("label", ["+pingpong", "+overlap", "+softmax", "+persistent", "+epilogue"])
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window_size": (200, 30), "num_sink_tokens": 5}],
                         ids=["full", "causal", "window-sinks"])
@pytest.mark.parametrize("head_dim", [128, 96], ids=["d128", "d96-p-in-smem"])
def test_every_ablation_step_is_correct(stage, label, features, head_dim):
    """The benchmark times each step's kernel: each must compute attention, not just run (at D = 96 with P read
    from shared memory by every step's loop)."""
    q, k, v = testing.random_qkv(2, 700, 900, 8, 2, head_dim, torch.float16, seed=len(label))
    out = prefill.attention(8, stage.ABLATION[label], q, k, v, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where=f"stage 8 {label}, D={head_dim}, {features}", **features)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dims", list(validation.HEAD_DIMS_FROM_STAGE_8),
                         ids=[f"d{d}" + (f"v{d_v}" if d_v != d else "") for d, d_v in validation.HEAD_DIMS_FROM_STAGE_8])
def test_many_tiles_per_cta(stage, dtype, dims):
    """More (Q tile, head, batch) tiles than SMs, ragged last Q tiles and a short last group of heads:
    each persistent CTA computes several tiles, and every tile exactly once. From D = 192 up O's buffers
    are Q's bytes (TILES' o_in_q), so a CTA's next Q must wait for its O stores."""
    d, d_v = dims
    q, k, v = testing.random_qkv(3, 1000, 777, 20, 4, d, dtype, seed=d + d_v, head_dim_v=d_v)  # 480 tiles or more
    for features in ({}, {"causal": True}):
        out = torch.full((3, 1000, 20, d_v), float("nan"), device="cuda", dtype=dtype)
        out = stage.attention(q, k, v, out=out, **features)
        testing.assert_attention_matches(out, q, k, v, where=f"D={d}, D_v={d_v}, 480+ tiles, {features}", **features)


@pytest.mark.gpu
@pytest.mark.parametrize("features", [{"causal": True}, {"window_size": (1024, 0), "num_sink_tokens": 4,
                                                          "sinks": True}], ids=["causal", "window-sinks"])
def test_long_sequences(stage, features):
    features = dict(features)
    if features.pop("sinks", False):
        features["sink_logits"] = torch.linspace(-2.0, 2.0, 4, device="cuda")
    q, k, v = testing.random_qkv(1, 16384, 16384, 4, 2, 128, torch.bfloat16, seed=16)
    out, lse = stage.attention(q, k, v, out=testing.poisoned_like(q), return_lse=True, **features)
    testing.assert_no_nan(out, "16k", "[b, s, h, d]", "every output must be written")
    assert torch.isfinite(lse).all()
    # The float64 reference of all 16k x 16k scores would need tens of GB: check the first and the
    # last 2048 rows, each as the problem it is. Under a causal or windowed mask (right bound 0) the
    # first rows see only the first keys; the last rows keep the bottom-right alignment with all keys.
    rows = 2048
    testing.assert_attention_matches(out[:, :rows], q[:, :rows], k[:, :rows], v[:, :rows],
                                     where=f"16k, first {rows} rows, {features}", **features)
    testing.assert_attention_matches(out[:, -rows:], q[:, -rows:], k, v, where=f"16k, last {rows} rows, {features}",
                                     **features)


@pytest.mark.gpu
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window_size": (3, 0)}], ids=["full", "causal", "window"])
def test_one_query_row(stage, features):
    q, k, v = testing.random_qkv(3, 1, 1000, 8, 8, 64, torch.float16, seed=1)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where=f"S_q = 1, {features}", **features)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256], ids=["d128", "d256-o-in-q"])
def test_back_to_back_launches_give_identical_bits(stage, head_dim):
    """200 launches of the same inputs: the warpgroups' barriers and the persistent loop leave no race
    (at D = 256 also none between a tile's O stores and the next Q, which share bytes)."""
    q, k, v = testing.random_qkv(2, 1500, 1500, 16, 4, head_dim, torch.float16, seed=5)
    first = stage.attention(q, k, v, causal=True)
    for launch in range(200):
        out = stage.attention(q, k, v, causal=True, out=testing.poisoned_like(q))
        assert torch.equal(out, first), f"launch {launch + 2} of 200 differs from the first"
    testing.assert_attention_matches(first, q, k, v, where="200 launches", causal=True)
