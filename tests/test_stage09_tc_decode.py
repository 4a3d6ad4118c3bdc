"""Stage 9 checks: validation (FP8 scales too), cross-compile (CPU) and numerics on a Hopper GPU, for every grouping."""

import math
from pathlib import Path

import cpu_numerics
import pytest
import torch
from test_stage07_decode import BAD_INPUTS as STAGE7_BAD_INPUTS
from test_stage07_decode import (
    VISIBLE_KEY_CASES,
    check_split_ranges,
    check_visible_keys,
    cpu_inputs,
    replaced,
)

from course.runtime import kv_cache, stages, validation
from course import testing

STAGE = stages.get(9)


@pytest.fixture(scope="module")
def stage(impl):
    return STAGE.load(impl)


@pytest.fixture(scope="module")
def solution():
    return STAGE.load("solutions")


# ---------------------------------------------------------------- the split arithmetic (CPU)

@pytest.mark.parametrize("warps", [4, 8])
def test_split_ranges_cover_the_visible_keys_once(stage, warps):
    check_split_ranges(lambda n, splits, s: stage.split_range(n, splits, s, warps), stage.keys_per_iteration(warps),
                       split_counts=(1, 2, 7, 33, 64))


@pytest.mark.parametrize("seqlen, window, sinks", VISIBLE_KEY_CASES)
def test_enumerated_keys_are_the_visible_keys(stage, seqlen, window, sinks):
    check_visible_keys(stage.visible_keys_of, seqlen, window, sinks)


def test_auto_split_count_fills_the_gpu_from_b_times_h_kv(stage):
    sms = 132
    target = sms * stage.SPLIT_CTAS_PER_SM
    # MQA with few sequences: 16 sequences x 1 KV head are 16 CTAs before splitting.
    mqa = stage.auto_num_splits(16, 1, 8, 16384, sms)
    assert mqa * 16 <= target < (mqa + 1) * 16
    assert stage.auto_num_splits(8, 8, 4, stage.SHORT_SPLIT_KEYS, sms) == 1    # short sequences: one split
    # Below SHORT_SPLITS splits of MIN_KEYS_PER_SPLIT keys, splits of SHORT_SPLIT_KEYS keys.
    assert stage.auto_num_splits(1, 1, 8, 1024, sms) == 1024 // stage.SHORT_SPLIT_KEYS
    assert stage.auto_num_splits(1, 1, 8, 256, sms) == 2
    assert stage.auto_num_splits(1, 1, 8, 2048, sms) == 2048 // stage.MIN_KEYS_PER_SPLIT
    big = stage.auto_num_splits(64, 8, 4, 4096, sms)                          # a big batch: a well-filled last wave
    waves = 64 * 8 * big / (sms * stage.ctas_per_sm(128))
    assert big <= 4 and waves / math.ceil(waves) > 0.9
    # One MQA sequence of 32k keys: a CTA on (almost) every SM, splits of MIN_KEYS_PER_SPLIT keys.
    assert stage.auto_num_splits(1, 1, 8, 32768, sms) == 32768 // stage.MIN_KEYS_PER_SPLIT
    # 64 heads on one KV head are 4 CTAs reading the same K and V: as many splits as for one CTA,
    # up to the CTAs that fit on an SM.
    wide = stage.auto_num_splits(8, 1, 64, 32768, sms)
    assert wide * 8 * 4 <= sms * stage.ctas_per_sm(128) < (wide + 1) * 8 * 4


def test_eight_warps_where_a_launch_has_one_cta_per_sm(stage):
    """8-warp CTAs for launches of at most one CTA per SM (few or short sequences, or row tiles, whose
    split count fills one CTA per SM), 4 otherwise; D = 256 keeps 4."""
    sms = 132
    for batch, heads_kv, group, keys in ((1, 1, 8, 32768), (1, 1, 64, 32768), (1, 2, 16, 4096), (8, 1, 64, 32768)):
        assert stage.pick_warps(batch, heads_kv, group, keys, sms) == 8
        splits = stage.auto_num_splits(batch, heads_kv, group, keys, sms, warps=8)
        assert batch * heads_kv * stage.head_chunks(group, 1) * splits <= sms
    assert stage.pick_warps(64, 1, 64, 4096, sms) == 4     # 256 CTAs: two 4-warp CTAs per SM do better
    assert stage.pick_warps(64, 8, 4, 32768, sms) == 4
    assert stage.pick_warps(1, 1, 8, 32768, sms, head_dim=256) == 4
    for batch, heads_kv, group, keys, tiles in ((8, 1, 64, 131072, 4), (64, 1, 64, 32768, 4), (8, 2, 32, 32768, 2)):
        assert stage.pick_warps(batch, heads_kv, group, keys, sms, tiles=tiles) == 8
        splits = stage.auto_num_splits(batch, heads_kv, group, keys, sms, tiles=tiles, warps=8)
        assert batch * heads_kv * splits <= sms
    assert stage.ctas_per_sm(128, warps=8) == 1 and stage.keys_per_iteration(8) == 2 * stage.keys_per_iteration(4)


def test_row_tiles_keep_a_group_of_up_to_64_heads_in_one_cta(stage):
    """One CTA can compute 16, 32 or 64 heads (1, 2 or 4 row tiles of the MMA), so that K and V are
    read once per group of up to 64 heads; a larger group takes ceil(G / 64) CTAs. D = 256: 1 tile."""
    tiles = {g: stage.row_tiles(g) for g in (1, 8, 16, 17, 24, 32, 33, 40, 64, 65, 128)}
    assert tiles == {1: 1, 8: 1, 16: 1, 17: 2, 24: 2, 32: 2, 33: 4, 40: 4, 64: 4, 65: 4, 128: 4}
    assert set(stage.ROW_TILES) == set(tiles.values()) and stage.row_tiles(64, 256) == 1
    chunks = {(g, t): stage.head_chunks(g, t) for g, t in ((8, 1), (64, 1), (24, 2), (64, 4), (65, 4), (128, 4))}
    assert chunks == {(8, 1): 1, (64, 1): 4, (24, 2): 1, (64, 4): 1, (65, 4): 2, (128, 4): 2}


def test_row_tiles_only_where_they_pay(stage):
    """A launch uses row tiles when its work fills the GPU with long splits; few or short sequences
    keep one tile per CTA (more warps on the same keys)."""
    sms = 132
    assert stage.pick_row_tiles(64, 1, 64, 32768, sms) == 4
    assert stage.pick_row_tiles(8, 1, 64, 131072, sms) == 4
    assert stage.pick_row_tiles(64, 2, 32, 32768, sms) == 2
    assert stage.pick_row_tiles(1, 1, 64, 131072, sms) == 1   # one sequence: splits too short to fill the GPU
    assert stage.pick_row_tiles(8, 1, 64, 65536, sms) == 1    # 4 CTAs of one tile side by side: L2 keeps up
    assert stage.pick_row_tiles(4, 1, 64, 131072, sms) == 1
    assert stage.pick_row_tiles(8, 1, 64, 4096, sms) == 1
    assert stage.pick_row_tiles(64, 8, 8, 32768, sms) == 1    # groups of up to 16 heads: one tile anyway
    assert stage.pick_row_tiles(64, 1, 64, 32768, sms, head_dim=256) == 1
    assert stage.pick_row_tiles(64, 1, 64, 32768, sms, cache_dtype="float8_e4m3fn") == 4  # FP8: the same rule
    # With row tiles the split count fills every CTA slot.
    splits = stage.auto_num_splits(8, 1, 64, 131072, sms, tiles=4)
    assert splits * 8 <= sms * stage.ctas_per_sm(128, tiles=4) < (splits + 1) * 8


def test_two_levels_of_last_ctas(stage):
    """Up to SPLITS_PER_GROUP splits: one group, whose last CTA writes O. More: a workspace slot per
    group after the splits' slots, and the final combine reads a group's splits plus the groups."""
    per_group = stage.SPLITS_PER_GROUP
    assert stage.workspace_slots(1) == 1 and stage.workspace_slots(per_group) == per_group
    assert stage.split_groups(per_group + 1) == 2 and stage.workspace_slots(per_group + 1) == per_group + 3
    assert stage.workspace_slots(128) == 128 + 128 // per_group


# ---------------------------------------------------------------- validation (CPU)

def test_head_dims_are_the_contracts(solution):
    """The decode head dims the contract names for stage 9, each computed at 64, 128 or 256."""
    assert solution.HEAD_DIMS == validation.DECODE_HEAD_DIMS_FROM_STAGE_9, (
        f"HEAD_DIMS is {solution.HEAD_DIMS}; the contract (validation.DECODE_HEAD_DIMS_FROM_STAGE_9) names "
        f"{validation.DECODE_HEAD_DIMS_FROM_STAGE_9}")
    assert set(solution.COMPUTED_HEAD_DIM) == {d for d, _ in solution.HEAD_DIMS}
    assert all(d_v <= d for d, d_v in solution.HEAD_DIMS), "V is computed at Q's and K's padded head dim"
    for d, computed in solution.COMPUTED_HEAD_DIM.items():
        assert computed in (64, 128, 256) and computed >= d and d % 16 == 0, (d, computed)


def split_cpu_inputs():
    """Decode inputs at (D, D_v) = (192, 128) on the CPU."""
    return testing.random_decode_inputs([5, 9], 4, 2, 192, torch.float16, head_dim_v=128, device="cpu")


def fp8_cpu_inputs(**sizes):
    return kv_cache.fp8_decode_inputs(cpu_inputs(**sizes))


BAD_INPUTS = {
    **{name: case for name, case in STAGE7_BAD_INPUTS.items()
       if name not in ("draft-tokens-are-stage-9", "head-dim-96-is-stage-9", "split-head-dims-are-stage-9")},
    "split-head-dims-pair": (lambda: (i := cpu_inputs(d=128)) and replaced(i, v_cache=i["v_cache"][..., :64]), {},
                             ValueError, "head_dim 128 for q and k with 64 for v is not supported; supported: .*"
                                         "or 192 for q and k with 128 for v"),
    "split-head-dims-out": (lambda: split_cpu_inputs(), {"out": torch.empty(2, 4, 192, dtype=torch.float16)},
                            ValueError, r"out has shape \(2, 4, 192\); expected \(2, 4, 128\) like q with v's"),
    "split-head-dims-v-new": (lambda: split_cpu_inputs(), {"k_new": torch.zeros(2, 2, 192, dtype=torch.float16),
                                                          "v_new": torch.zeros(2, 2, 192, dtype=torch.float16)},
                              ValueError, r"v_new has shape \(2, 2, 192\).*\[2, 2, 128\]"),
    "split-head-dims-valid-reaches-the-device-check": (lambda: split_cpu_inputs(), {}, ValueError, "CUDA"),
    "fp8-without-scales": (lambda: {k: v for k, v in fp8_cpu_inputs().items() if k != "v_scale"}, {},
                           ValueError, "v_scale"),
    "fp8-scale-zero": (lambda: replaced(fp8_cpu_inputs(), k_scale=torch.tensor([1.0, 0.0])),
                       {"check_lengths": True}, ValueError, r"k_scale\[1\] = 0.0"),
    "fp8-scale-nan": (lambda: replaced(fp8_cpu_inputs(), v_scale=torch.tensor(float("nan"))),
                      {"check_lengths": True}, ValueError, "v_scale"),
    "fp8-scale-inf": (lambda: replaced(fp8_cpu_inputs(), v_scale=torch.tensor([1.0, float("inf")])),
                      {"check_lengths": True}, ValueError, "finite"),
    "fp8-scale-shape": (lambda: replaced(fp8_cpu_inputs(), k_scale=torch.ones(3)), {}, ValueError, r"\[H_kv\]"),
    "fp8-scale-dtype": (lambda: replaced(fp8_cpu_inputs(), k_scale=torch.ones(2, dtype=torch.float16)), {},
                        TypeError, "float32"),
    "scales-on-16-bit-cache": (lambda: cpu_inputs(), {"k_scale": torch.ones(2), "v_scale": torch.ones(2)},
                               ValueError, "pass neither"),
    "fp8-k-only": (lambda: replaced(fp8_cpu_inputs(), v_cache=fp8_cpu_inputs()["v_cache"].half()), {}, TypeError,
                   "share one dtype"),
    "fp8-valid-reaches-the-device-check": (lambda: fp8_cpu_inputs(), {}, ValueError, "CUDA"),
    "token-stride-2**27": (lambda: strided_tokens(STAGE.load("solutions").MAX_TOKEN_STRIDE), {}, ValueError,
                           r"k_cache has strides .* accepts token strides below 134217728 elements"),
    # A plan's options are made by the stage under test (its own DecodePlan class).
    "plan-type": (lambda: cpu_inputs(), {"plan": lambda stage: (1, 4)}, TypeError, "DecodePlan"),
    "plan-row-tiles": (lambda: cpu_inputs(), {"plan": lambda stage: stage.DecodePlan(row_tiles=2)}, ValueError,
                       "row tiles"),
    "plan-warps": (lambda: cpu_inputs(), {"plan": lambda stage: stage.DecodePlan(warps=6)}, ValueError, "warps"),
    "plan-splits": (lambda: cpu_inputs(), {"plan": lambda stage: stage.DecodePlan(num_splits=-1)}, ValueError,
                    "plan.num_splits"),
    "plan-valid-reaches-the-device-check": (lambda: cpu_inputs(), {"plan": lambda stage: stage.DecodePlan(1, 8, 3)},
                                            ValueError, "CUDA"),
    "token-stride-below-2**27-reaches-the-device-check": (
        lambda: strided_tokens(STAGE.load("solutions").MAX_TOKEN_STRIDE - 64), {}, ValueError, "CUDA"),
    # The serving extras.
    "int8-without-scales": (lambda: {k: v for k, v in int8_cpu_inputs().items() if k != "k_scale"}, {},
                            ValueError, "k_scale"),
    "int8-valid-reaches-the-device-check": (lambda: int8_cpu_inputs(), {}, ValueError, "CUDA"),
    "k-new-without-v-new": (lambda: cpu_inputs(), {"k_new": torch.zeros(2, 2, 64, dtype=torch.float16)},
                            ValueError, "k_new and v_new together"),
    "k-new-shape": (lambda: cpu_inputs(), {"k_new": torch.zeros(2, 4, 64, dtype=torch.float16),
                                           "v_new": torch.zeros(2, 4, 64, dtype=torch.float16)}, ValueError,
                    r"k_new has shape \(2, 4, 64\).*\[2, 2, 64\]"),
    "k-new-dtype": (lambda: cpu_inputs(), {"k_new": torch.zeros(2, 2, 64, dtype=torch.bfloat16),
                                           "v_new": torch.zeros(2, 2, 64, dtype=torch.bfloat16)}, ValueError,
                    "q's dtype"),
    "rope-without-k-new": (lambda: cpu_inputs(), {"rotary_cos": torch.ones(8, 32, dtype=torch.float16),
                                                  "rotary_sin": torch.ones(8, 32, dtype=torch.float16)},
                           ValueError, "pass k_new and v_new too"),
    "rope-cos-only": (lambda: append_cpu_inputs(), {"rotary_cos": torch.ones(8, 32, dtype=torch.float16)},
                      ValueError, "rotary_cos and rotary_sin together"),
    "rope-dtype": (lambda: append_cpu_inputs(), {"rotary_cos": torch.ones(8, 32), "rotary_sin": torch.ones(8, 32)},
                   TypeError, "q's dtype"),
    "rope-dim-not-16": (lambda: append_cpu_inputs(), {"rotary_cos": torch.ones(8, 12, dtype=torch.float16),
                                                      "rotary_sin": torch.ones(8, 12, dtype=torch.float16)},
                        ValueError, "rotary_dim = 2 x 12 = 24"),
    "rope-dim-over-head-dim": (lambda: append_cpu_inputs(), {"rotary_cos": torch.ones(8, 40, dtype=torch.float16),
                                                             "rotary_sin": torch.ones(8, 40, dtype=torch.float16)},
                               ValueError, "to head_dim"),
    "rope-shapes-differ": (lambda: append_cpu_inputs(), {"rotary_cos": torch.ones(8, 32, dtype=torch.float16),
                                                         "rotary_sin": torch.ones(9, 32, dtype=torch.float16)},
                           ValueError, "must match"),
    "rope-interleaved-not-bool": (lambda: append_cpu_inputs(), {"rotary_interleaved": 1}, TypeError,
                                  "rotary_interleaved must be True or False"),
    "rope-interleaved-without-tables": (lambda: append_cpu_inputs(), {"rotary_interleaved": True}, ValueError,
                                        "needs them"),
    "rope-position-past-the-table": (lambda: append_cpu_inputs(),
                                     {"rotary_cos": torch.ones(9, 32, dtype=torch.float16),
                                      "rotary_sin": torch.ones(9, 32, dtype=torch.float16), "check_lengths": True},
                                     ValueError, r"cache_seqlens\[1\] = 9 is the new token's position"),
    "append-past-the-cache": (lambda: replaced(append_cpu_inputs(), cache_seqlens=torch.tensor([5, 14],
                                                                                              dtype=torch.int32)),
                              {"check_lengths": True}, ValueError, "plus the appended token is larger than the cache"),
    "append-valid-reaches-the-device-check": (lambda: append_cpu_inputs(),
                                              {"rotary_cos": torch.ones(10, 32, dtype=torch.float16),
                                               "rotary_sin": torch.ones(10, 32, dtype=torch.float16),
                                               "check_lengths": True}, ValueError, "CUDA"),
    "alibi-dtype": (lambda: cpu_inputs(), {"alibi_slopes": torch.ones(4, dtype=torch.float16)}, TypeError,
                    "float32"),
    "alibi-shape": (lambda: cpu_inputs(), {"alibi_slopes": torch.ones(2)}, ValueError, r"\[4\] float32"),
    "alibi-valid-reaches-the-device-check": (lambda: cpu_inputs(), {"alibi_slopes": torch.ones(4)}, ValueError,
                                             "CUDA"),
    "rolling-without-window": (lambda: cpu_inputs(), {"cache_capacity": 8}, ValueError, "needs a window that fits"),
    "rolling-window-too-wide": (lambda: cpu_inputs(), {"cache_capacity": 8, "window_size_left": 6,
                                                       "num_sink_tokens": 2}, ValueError, "from 0 to 5; got 6"),
    "rolling-capacity-over-rows": (lambda: cpu_inputs(), {"cache_capacity": 99, "window_size_left": 3}, ValueError,
                                   "more than the cache's 14 rows"),
    "rolling-capacity-zero": (lambda: cpu_inputs(), {"cache_capacity": 0, "window_size_left": 0}, ValueError,
                              "cache_capacity must be an int from 1"),
    "rolling-lengths-past-capacity-reach-the-device-check": (
        lambda: replaced(cpu_inputs(), cache_seqlens=torch.tensor([500, 7], dtype=torch.int32)),
        {"cache_capacity": 8, "window_size_left": 5, "check_lengths": True}, ValueError, "CUDA"),
    "leftpad-dtype": (lambda: cpu_inputs(), {"cache_leftpad": torch.zeros(2, dtype=torch.int64)}, TypeError,
                      r"cache_leftpad has dtype torch.int64; expected torch.int32 \(\[batch\] int32\)"),
    "leftpad-shape": (lambda: cpu_inputs(), {"cache_leftpad": torch.zeros(3, dtype=torch.int32)}, ValueError,
                      r"cache_leftpad has 3 entries; expected one per sequence \(2\)"),
    "leftpad-with-rolling": (lambda: cpu_inputs(), {"cache_leftpad": torch.zeros(2, dtype=torch.int32),
                                                    "cache_capacity": 8, "window_size_left": 3},
                             ValueError, "do not go together"),
    "leftpad-past-the-length": (lambda: cpu_inputs(), {"cache_leftpad": torch.tensor([2, 10], dtype=torch.int32),
                                                       "check_lengths": True},
                                ValueError, r"cache_leftpad\[1\] = 10 is outside the sequence's rows 0 .. "
                                            r"cache_seqlens\[1\] = 9"),
    "leftpad-negative": (lambda: cpu_inputs(), {"cache_leftpad": torch.tensor([-1, 0], dtype=torch.int32),
                                                "check_lengths": True}, ValueError, r"cache_leftpad\[0\] = -1"),
    "leftpad-rotary-position-past-the-table": (
        lambda: append_cpu_inputs(), {"cache_leftpad": torch.tensor([0, 2], dtype=torch.int32),
                                      "rotary_cos": torch.ones(7, 32, dtype=torch.float16),
                                      "rotary_sin": torch.ones(7, 32, dtype=torch.float16), "check_lengths": True},
        ValueError, r"cache_seqlens\[1\] - cache_leftpad\[1\] = 7 is the new token's position"),
    "leftpad-valid-reaches-the-device-check": (
        lambda: append_cpu_inputs(), {"cache_leftpad": torch.tensor([0, 2], dtype=torch.int32),
                                      "rotary_cos": torch.ones(8, 32, dtype=torch.float16),
                                      "rotary_sin": torch.ones(8, 32, dtype=torch.float16), "check_lengths": True},
        ValueError, "CUDA"),
    "draft-tokens-valid-reach-the-device-check": (lambda: draft_cpu_inputs(), {}, ValueError, "CUDA"),
    "draft-tokens-with-k-new": (lambda: {**append_cpu_inputs(), "q": draft_cpu_inputs()["q"]}, {}, ValueError,
                                "append one token per sequence, but q has 3"),
    "draft-tokens-out-shape": (lambda: draft_cpu_inputs(), {"out": torch.empty(2, 4, 64, dtype=torch.float16)},
                               ValueError, "rank 3"),
    "draft-tokens-rolling-window-too-wide": (lambda: draft_cpu_inputs(), {"cache_capacity": 8, "window_size_left": 4,
                                                                         "num_sink_tokens": 2}, ValueError,
                                             "for each of the 3 query tokens: window_size_left from 0 to 3; got 4"),
}


def draft_cpu_inputs():
    """CPU inputs of lengths 5 and 9 with 3 query tokens per sequence, q [2, 3, 4, 64]."""
    inputs = cpu_inputs()
    return {**inputs, "q": torch.randn(2, 3, 4, 64).half()}


def int8_cpu_inputs(**sizes):
    return kv_cache.quantized_decode_inputs(cpu_inputs(**sizes), torch.int8)


def append_cpu_inputs():
    """CPU inputs of lengths 5 and 9 in a cache of 14 rows, with the new token's k_new, v_new."""
    inputs = cpu_inputs()
    return {**inputs, "k_new": torch.zeros(2, 2, 64, dtype=torch.float16),
            "v_new": torch.zeros(2, 2, 64, dtype=torch.float16)}


def strided_tokens(token_stride: int) -> dict:
    """CPU inputs whose caches step ``token_stride`` elements from one token to the next: meta tensors,
    so that no memory backs the huge span."""
    inputs = cpu_inputs()
    b, s, h, d = inputs["k_cache"].shape
    cache = torch.empty_strided((b, s, h, d), (s * token_stride, token_stride, d, 1), dtype=torch.float16,
                                device="meta")
    return replaced(inputs, k_cache=cache, v_cache=cache)


@pytest.mark.parametrize("make, options, error, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_rejected_before_launch(stage, make, options, error, message):
    options = {name: value(stage) if callable(value) else value for name, value in options.items()}
    with pytest.raises(error, match=message):
        stage.decode_attention(**make(), **options)


# ---------------------------------------------------------------- your online softmax on the CPU

@pytest.mark.compiles
@pytest.mark.parametrize("lengths, logit_scale", [((0, 0), 1.0), ((1, 0), 1.0), ((5, 13), 1.0), ((41, 40), 1.0),
                                                  ((41, 40), 30.0)],
                         ids=["no-keys", "one-row-empty", "short", "long", "long-large-logits"])
def test_on_cpu_online_softmax_update(stage, lengths, logit_scale):
    """Your online_softmax_update on one thread's S and O fragments, step by step (its two rows, -inf past the end),
    against a float64 softmax: O, LSE, the -inf guard, and the lazy rescale when a large logit moves the max."""
    cpu_numerics.check_fragment_softmax(stage, lengths, logit_scale=logit_scale)


@pytest.mark.parametrize("cache_dtype", ["float16", "float8_e4m3fn"], ids=["16-bit", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_on_cpu_fragments(stage, head_dim, cache_dtype):
    """Your q_fragment, k_fragment and v_fragment for all 32 lanes of a warp, then S = Q K^T and O = P V as
    mma.sync.m16n8k16 reads the fragments, against q @ k^T and p @ v: every slot written once, Q and K on the
    same columns, V's keys P's (tests/cpu_numerics.py)."""
    cpu_numerics.check_fragments(stage, head_dim, cache_dtype)


# ---------------------------------------------------------------- cross-compile (CPU)

CONFIGS = STAGE.load("solutions").KERNEL_CONFIGS


def test_compile_matrix_covers_every_option(solution):
    layouts = {(c.dtype, c.cache_dtype, (c.head_dim, c.dv), c.paged, c.row_tiles, c.warps) for c in CONFIGS}
    assert layouts == {(t, cache, (d, d_v), p, tiles, warps) for t in ("float16", "bfloat16")
                       for cache in (t, *solution.QUANTIZED) for d, d_v in solution.HEAD_DIMS for p in (False, True)
                       for tiles in solution.ROW_TILES if tiles <= solution.row_tiles(64, d)
                       for warps in solution.WARPS if warps == 4 or d <= 128}
    for d, d_v in solution.HEAD_DIMS:
        here = [c for c in CONFIGS if (c.head_dim, c.dv) == (d, d_v)]
        assert {(c.has_sink, c.write_lse) for c in here} == {(a, b) for a in (0, 1) for b in (0, 1)}
        assert {c.rotary for c in here if c.appends} == set(solution.ROTARY), f"D={d}: every RoPE variant"
        assert any(c.alibi for c in here) and any(c.rolling for c in here), f"D={d}: ALiBi and a rolling cache"
        assert any(c.leftpad and c.appends for c in here), f"D={d}: left padding (with an append)"
        assert any(c.drafts and c.alibi and c.leftpad for c in here), f"D={d}: draft tokens with ALiBi, left padding"
        assert not any(c.drafts and c.appends for c in here), "draft tokens never come with an append"
        for cache in ("16-bit", *solution.QUANTIZED):  # each quantized cache writes its appended rows itself
            assert any(c.appends for c in here if (c.cache_dtype in solution.QUANTIZED) == (cache != "16-bit")
                       and (cache == "16-bit" or c.cache_dtype == cache)), f"D={d}: an append to a {cache} cache"


@pytest.mark.compiles
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_cross_compiles_for_sm90a(stage, config):
    report = stage.cross_compile_config(config, keep=True)
    ptx = Path(report.artifacts["ptx"]).read_text()
    # The data path: whole-row cp.async copies, warp-level tensor cores, the last-block protocol.
    testing.assert_split_kv_decode_in_ptx(ptx)
    testing.assert_in_ptx(ptx, "mma.sync.aligned.m16n8k16", "Q K^T and P V must run on the warp-level tensor cores")
    if config.cache_dtype == "float8_e4m3fn":
        testing.assert_in_ptx(ptx, "cvt.rn.f16x2.e4m3x2",
                              "an FP8 cache is converted to fp16 in registers, two values at a time")
    if config.cache_dtype == "int8":
        assert "prmt.b32" in ptx and "cvt.rn.f16.s16" not in ptx, (
            "an int8 cache is converted to fp16 two values at a time (int8_pair_to_f16x2), not one by one")
    if config.appends:
        assert "div.rn.f32" in ptx or config.cache_dtype not in stage.QUANTIZED, (
            "the appended row is quantized with an IEEE division, as kv_cache.quantize_rows divides")
    bytes_per = stage.cache_bytes(config.cache_dtype)
    assert report.spill_bytes == 0, f"{report.name} spills {report.spill_bytes} bytes of registers to local memory"
    assert report.wgmma_serialized is None, f"{report.name}: {report.wgmma_serialized}"
    expected_shared = stage.shared_bytes(config.head_dim, config.cache_dtype, config.row_tiles, config.warps,
                                         config.appends, config.rotary)
    assert report.shared_bytes == expected_shared, (
        f"{report.name} uses {report.shared_bytes} bytes of shared memory; shared_bytes() says "
        f"{expected_shared}, and the automatic split count relies on it")
    budget = stage.REGISTERS_PER_THREAD[stage.COMPUTED_HEAD_DIM[config.head_dim], bytes_per]
    assert report.registers <= budget, (
        f"{report.name} uses {report.registers} registers per thread; the automatic split count assumes at "
        f"most {budget} (REGISTERS_PER_THREAD): update it")


# ---------------------------------------------------------------- numerics (Hopper GPU)

LAYOUTS = {"contiguous": None, "paged16": 16, "paged32": 32, "paged64": 64, "paged256": 256}
RAGGED = list(testing.DECODE_LENGTHS)  # 1, 2, 127, 128, 4097, 32768, 131072 in one batch


QUANTIZED = {"16-bit": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def quantized(inputs, cache):
    """(inputs on a ``cache`` cache, its scales as features): 16-bit, fp8 or int8. The scales travel apart,
    as features of the reference."""
    if QUANTIZED[cache] is None:
        return inputs, {}
    q = kv_cache.quantized_decode_inputs(inputs, QUANTIZED[cache])
    return ({k: v for k, v in q.items() if k not in ("k_scale", "v_scale")},
            {"k_scale": q["k_scale"], "v_scale": q["v_scale"]})


def run(stage, inputs, where, *, fp8=False, return_lse=False, **options):
    """One launch on poisoned output; with ``fp8`` the cache is quantized first. Returns (report, out)."""
    inputs, scales = quantized(inputs, "fp8" if fp8 else "16-bit")
    result = stage.decode_attention(**inputs, **options, **scales, return_lse=return_lse,
                                    out=testing.poisoned_decode_out(inputs["q"], inputs["v_cache"]))
    out, lse = result if return_lse else (result, None)
    features = {k: v for k, v in options.items() if k not in ("num_splits", "plan")}
    return testing.assert_decode_matches(out, inputs, where, lse=lse, **features, **scales), out


RAGGED_CASES = [("float16", 64, "contiguous"), ("float16", 128, "paged64"), ("float16", 256, "paged16"),
                ("bfloat16", 64, "paged256"), ("bfloat16", 128, "contiguous"), ("bfloat16", 256, "paged64")]
# (H_q, H_kv, variant): 1, 2 and 4 row tiles per CTA on 4 warps, groups of 8, 24 (the second tile
# half-full) and 64; one tile on 8 warps, groups of 8 and 64 (4 CTAs of 16 heads); 2 and 4 row tiles on
# 8 warps (two key groups, each on its own barrier).
ROW_TILE_HEADS = [(16, 2, "tiles"), (48, 2, "tiles"), (64, 1, "tiles"), (16, 2, "warps8"), (64, 1, "warps8"),
                  (48, 2, "tiles-warps8"), (64, 1, "tiles-warps8")]
# variant: (as many row tiles as the group allows, warps at D <= 128)
VARIANTS = {"tiles": (True, 4), "warps8": (False, 8), "tiles-warps8": (True, 8)}
HEADS_IDS = [f"h{a}-kv{b}-" + w.replace("tiles", f"tiles{STAGE.load('solutions').row_tiles(a // b)}")
             for a, b, w in ROW_TILE_HEADS]


def variant_plan(stage, variant, heads_q, heads_kv, head_dim=128):
    """The DecodePlan that forces ``variant``: as many row tiles as the group allows on 4 warps ("tiles")
    or on 8 ("tiles-warps8", D <= 128), or one tile on 8 warps ("warps8", D <= 128); the split count is
    the call's or the rule's for that plan. decode_attention picks tiles and warps from the launch's
    size (choose_plan), and the tests' small launches would mostly get one tile on 4 warps."""
    if variant is None:
        return None
    most_tiles, warps = VARIANTS[variant]
    tiles = stage.row_tiles(heads_q // heads_kv, head_dim) if most_tiles else 1
    return stage.DecodePlan(tiles, warps if head_dim <= 128 else 4)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-cache", "fp8-cache"])
@pytest.mark.parametrize("heads_q, heads_kv, variant", ROW_TILE_HEADS, ids=HEADS_IDS)
@pytest.mark.parametrize("dtype, head_dim, layout", RAGGED_CASES, ids=[f"{a}-d{b}-{c}" for a, b, c in RAGGED_CASES])
def test_ragged_batch_matches_reference(stage, dtype, head_dim, layout, heads_q, heads_kv, variant, fp8):
    """Lengths 1 ... 131072 in one batch (page boundaries, a full last page), auto split count, LSE too."""
    inputs = testing.random_decode_inputs(RAGGED, heads_q, heads_kv, head_dim, getattr(torch, dtype),
                                          page_size=LAYOUTS[layout], seed=head_dim + heads_q)
    run(stage, inputs, f"{dtype}, D={head_dim}, {layout}, H_q={heads_q}, H_kv={heads_kv}, {variant}, fp8={fp8}, "
        f"lengths {RAGGED}", fp8=fp8, return_lse=True, plan=variant_plan(stage, variant, heads_q, heads_kv, head_dim))


# (H_q, H_kv): MHA, groups 4, 8, 16, MQA 8 and 64; a group of 3; 24 (two row tiles, the second half-full);
# 40 (four row tiles, the third half-full, the fourth spare); 128 (two CTAs of 64 heads). Groups over 16
# heads run as the launch picks (one tile per CTA on 4 warps at these sizes) and with the most row tiles;
# every grouping also on 8 warps, those with row tiles on 8 warps too.
GROUPINGS = [(32, 32), (32, 8), (64, 8), (32, 2), (8, 1), (64, 1), (6, 2), (48, 2), (80, 2), (128, 1)]
GROUPING_CASES = [(a, b, forced) for a, b in GROUPINGS for forced in (None, *VARIANTS)
                  if forced is None or not VARIANTS[forced][0] or STAGE.load("solutions").row_tiles(a // b) > 1]
VARIANT_IDS = {None: "", "tiles": "-most-tiles", "warps8": "-warps8", "tiles-warps8": "-most-tiles-warps8"}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-cache", "fp8-cache"])
@pytest.mark.parametrize("layout", ["contiguous", "paged32"])
@pytest.mark.parametrize("h_q, h_kv, forced", GROUPING_CASES,
                         ids=[f"h{a}-kv{b}{VARIANT_IDS[f]}" for a, b, f in GROUPING_CASES])
def test_groupings(stage, h_q, h_kv, forced, layout, fp8):
    inputs = testing.random_decode_inputs([1, 31, 32, 33, 1000, 4097], h_q, h_kv, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=h_q * 10 + h_kv)
    run(stage, inputs, f"H_q={h_q}, H_kv={h_kv}, {layout}, fp8={fp8}", fp8=fp8, return_lse=True, num_splits=3,
        plan=variant_plan(stage, forced, h_q, h_kv))


@pytest.mark.gpu
@pytest.mark.parametrize("heads_q, heads_kv, variant", ROW_TILE_HEADS, ids=HEADS_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_every_split_count_gives_the_same_result(stage, layout, heads_q, heads_kv, variant):
    inputs = testing.random_decode_inputs([2, 128, 4097, 32768], heads_q, heads_kv, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=11)
    plan = variant_plan(stage, variant, heads_q, heads_kv)
    results = {}
    for num_splits in (*range(1, 9), 16, 17, 33, 64, 100, 300, 0):  # 17 and up: two levels of last CTAs
        _, results[num_splits] = run(stage, inputs, f"{layout}, num_splits={num_splits}", num_splits=num_splits,
                                     plan=plan)
    for num_splits, out in results.items():
        torch.testing.assert_close(out, results[1], rtol=2e-3, atol=2e-3,
                                   msg=f"num_splits={num_splits} differs from one split")


@pytest.mark.gpu
@pytest.mark.parametrize("heads_q, heads_kv, variant", ROW_TILE_HEADS, ids=HEADS_IDS)
@pytest.mark.parametrize("num_splits", [7, 37], ids=["one-level", "two-level"])
def test_back_to_back_launches_reset_the_counters(stage, num_splits, heads_q, heads_kv, variant):
    """200 launches in a row: a counter left non-zero would stop the next launch from combining."""
    inputs = testing.random_decode_inputs([4097, 300, 1], heads_q, heads_kv, 128, torch.float16, page_size=64,
                                          seed=3)
    plan = variant_plan(stage, variant, heads_q, heads_kv)
    outs = [stage.decode_attention(**inputs, num_splits=num_splits, plan=plan, out=testing.poisoned_like(inputs["q"]))
            for _ in range(200)]
    testing.assert_decode_matches(outs[0], inputs, "launch 1 of 200")
    for i, out in enumerate(outs):
        assert torch.equal(out, outs[0]), f"launch {i + 1} of 200 differs from the first (NaN: never combined)"


@pytest.mark.gpu
@pytest.mark.parametrize("heads_q, heads_kv, variant", ROW_TILE_HEADS, ids=HEADS_IDS)
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-cache", "fp8-cache"])
def test_cuda_graph_replay(stage, fp8, heads_q, heads_kv, variant):
    """200 replays of one captured launch, each on a new q: the same bits as an eager launch."""
    inputs = testing.random_decode_inputs([4097, 32768, 5], heads_q, heads_kv, 128, torch.float16, page_size=64,
                                          seed=4)
    inputs, scales = quantized(inputs, "fp8" if fp8 else "16-bit")
    scales["plan"] = variant_plan(stage, variant, heads_q, heads_kv)  # travels with the scales to every call
    out = testing.poisoned_like(inputs["q"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage.decode_attention(**inputs, **scales, num_splits=37, out=out)  # compile, allocate the counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        stage.decode_attention(**inputs, **scales, num_splits=37, out=out)  # two levels of last CTAs
    gen = torch.Generator(device="cuda").manual_seed(0)
    for replay in range(200):
        inputs["q"].copy_(torch.randn(inputs["q"].shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        if replay in (0, 1, 199):
            eager = stage.decode_attention(**inputs, **scales, num_splits=37)
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"CUDA graph replay {replay + 1} differs from an eager launch"
            testing.assert_decode_matches(out, inputs, f"CUDA graph replay {replay + 1}",
                                          **{k: v for k, v in scales.items() if k != "plan"})


FEATURE_CASES = {  # name: (layout, features)
    "window-100": ("contiguous", {"window_size_left": 100}),
    "window-0": ("paged64", {"window_size_left": 0}),
    "window-5000+4-sink-tokens": ("contiguous", {"window_size_left": 5000, "num_sink_tokens": 4}),
    "sink-logits": ("paged64", {"sink_logits": True}),
    "window+sink-tokens+sink-logits": ("paged16", {"window_size_left": 100, "num_sink_tokens": 2,
                                                   "sink_logits": True}),
    "softmax-scale": ("paged64", {"softmax_scale": 0.3}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-cache", "fp8-cache"])
@pytest.mark.parametrize("heads_q, heads_kv, variant", ROW_TILE_HEADS, ids=HEADS_IDS)
@pytest.mark.parametrize("layout, features", FEATURE_CASES.values(), ids=FEATURE_CASES.keys())
def test_windows_sinks_and_lse(stage, layout, features, heads_q, heads_kv, fp8, variant):
    inputs = testing.random_decode_inputs([0, 1, 127, 4097, 32768], heads_q, heads_kv, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=21)
    features = dict(features)
    if features.pop("sink_logits", False):
        features["sink_logits"] = torch.randn(heads_q, device="cuda") * 3
    run(stage, inputs, f"{layout}, {features}, fp8={fp8}", fp8=fp8, return_lse=True, num_splits=4,
        plan=variant_plan(stage, variant, heads_q, heads_kv), **features)


def dims_id(head_dim: int, head_dim_v: int) -> str:
    return f"d{head_dim}" + (f"v{head_dim_v}" if head_dim_v != head_dim else "")


# 80, 96, 192 and (192, 128) as the launch picks, and (D <= 128) with the most row tiles on 8 warps.
PADDED_DIMS = [(d, d_v, variant) for d, d_v in STAGE.load("solutions").HEAD_DIMS if d not in (64, 128, 256)
               for variant in (None, "tiles-warps8") if variant is None or d <= 128]


@pytest.mark.gpu
@pytest.mark.parametrize("cache", QUANTIZED)
@pytest.mark.parametrize("head_dim, head_dim_v, variant", PADDED_DIMS,
                         ids=[dims_id(d, d_v) + VARIANT_IDS[v] for d, d_v, v in PADDED_DIMS])
def test_head_dims_computed_padded(stage, head_dim, head_dim_v, variant, cache):
    """80, 96, 192 and (192, 128), which the kernel computes as 128 and 256 with zero columns
    (COMPUTED_HEAD_DIM): the cache's rows end at D, V's at D_v (the next head's columns, or the end of
    the pool, follow), O and the LSE are the real head dims', with every mask feature and split counts
    of one and two levels."""
    lengths = [0, 1, 127, 4097, 32768]
    dtype = torch.bfloat16 if head_dim == 96 else torch.float16
    for i, (layout, features) in enumerate(FEATURE_CASES.values()):
        inputs = testing.random_decode_inputs(lengths, 48, 2, head_dim, dtype, page_size=LAYOUTS[layout],
                                              head_dim_v=head_dim_v, seed=head_dim + i)
        inputs, scales = quantized(inputs, cache)
        features = dict(features)
        if features.pop("sink_logits", False):
            features["sink_logits"] = torch.randn(48, device="cuda") * 3
        for num_splits in (1, 37):
            run(stage, inputs, f"{dims_id(head_dim, head_dim_v)}, {cache} cache, {layout}, {features}, {variant}, splits {num_splits}",
                return_lse=True, num_splits=num_splits, plan=variant_plan(stage, variant, 48, 2, head_dim),
                **scales, **features)


@pytest.mark.gpu
def test_empty_sequences(stage):
    """Length 0: O = 0 and LSE = -inf, or the sink logit when there is one; never NaN."""
    inputs = testing.random_decode_inputs([0, 5, 0], 8, 2, 128, torch.float16, seed=8)
    out, lse = stage.decode_attention(**inputs, return_lse=True, num_splits=3, out=testing.poisoned_like(inputs["q"]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[[0, 2]]).all()
    sink = torch.linspace(-2.0, 2.0, 8, device="cuda")
    sink[::2] = -math.inf  # a sink that never takes weight, on an empty sequence: still 0 and -inf, not NaN
    out, lse = stage.decode_attention(**inputs, return_lse=True, sink_logits=sink,
                                      out=testing.poisoned_like(inputs["q"]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0, ::2]).all()
    testing.assert_decode_matches(out, inputs, "empty sequences with -inf sinks", lse=lse, sink_logits=sink)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-cache", "fp8-cache"])
def test_large_logits_do_not_overflow(stage, fp8):
    inputs = testing.random_decode_inputs([3000, 64], 16, 2, 128, torch.bfloat16, seed=9)
    inputs["q"].mul_(30)
    run(stage, inputs, "logits around 300", fp8=fp8, return_lse=True, num_splits=5)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-cache", "fp8-cache"])
@pytest.mark.parametrize("climb", [0.03, 1.0], ids=["below-threshold", "above-threshold"])
@pytest.mark.parametrize("heads_q, heads_kv, variant", ROW_TILE_HEADS, ids=HEADS_IDS)
def test_scores_that_keep_climbing(stage, climb, fp8, heads_q, heads_kv, variant):
    """Scores that rise along the sequence by ``climb`` (natural log units) per key move the running
    max again and again: by less than RESCALE_THRESHOLD per iteration, where a warp keeps its max and
    the numerators grow, and by more, where it rescales O every iteration. One split: long runs."""
    lengths = [1500, 333]
    inputs = testing.random_decode_inputs(lengths, heads_q, heads_kv, 128, torch.float16, seed=11)
    q = inputs["q"].abs_()  # every head's q . (1, ..., 1) > 0: a key's score grows with t (1, ..., 1)
    per_unit = q.float().sum(-1).mean().item() / 128 ** 0.5  # score change for t = 1
    for b, n in enumerate(lengths):
        t = climb / per_unit * torch.arange(n, device=q.device, dtype=torch.float32)
        inputs["k_cache"][b, :n] += t[:, None, None].to(inputs["k_cache"].dtype)
    run(stage, inputs, f"scores climbing {climb} per key", fp8=fp8, return_lse=True, num_splits=1,
        plan=variant_plan(stage, variant, heads_q, heads_kv))


# ---------------------------------------------------------------- the serving extras: append + RoPE, ALiBi,
# a rolling cache, an int8 cache (Hopper GPU)

def bits(t):
    """A tensor's bits, so that NaN compares equal to the same NaN."""
    return t.view(torch.int8) if t.element_size() == 1 else t.view(torch.int16)


def append_step(stage, inputs, features, where, **options):
    """One decode step with the new token appended, on poisoned output: the output against the reference,
    the caches against the reference's append bit for bit (the new rows, and every other row unchanged),
    cache_seqlens unchanged."""
    before = {name: inputs[name].clone() for name in ("k_cache", "v_cache", "cache_seqlens")}
    out = stage.decode_attention(**inputs, **features, **options,
                                 out=testing.poisoned_decode_out(inputs["q"], inputs["v_cache"]))
    expected = testing.reference.append_to_cache(before["k_cache"], before["v_cache"], before["cache_seqlens"],
                                                 block_table=inputs.get("block_table"),
                                                 **testing.reference.append_options(features))
    for name, want in zip(("k_cache", "v_cache"), expected):
        wrong = (bits(inputs[name]) != bits(want)).nonzero()
        assert not len(wrong), (f"{where}: {name} differs from the reference's append at {wrong[0].tolist()} "
                                f"({len(wrong)} elements): the new row is not what k_new/v_new rotated and "
                                "rounded give, or another row was written")
    assert torch.equal(inputs["cache_seqlens"], before["cache_seqlens"]), "cache_seqlens must not change"
    testing.assert_decode_matches(out, {**inputs, "k_cache": before["k_cache"], "v_cache": before["v_cache"]},
                                  where, **features)
    return out


APPEND_CASES = [  # (dtype, D or (D, D_v), layout, cache, rotary: (rotary_dim or 0, interleaved), H_q, H_kv)
    ("float16", 128, "contiguous", "16-bit", (128, False), 32, 8),
    ("bfloat16", 128, "paged16", "16-bit", (128, True), 8, 1),
    ("float16", 64, "paged64", "fp8", (64, False), 64, 8),
    ("bfloat16", 64, "contiguous", "int8", (32, True), 16, 2),
    ("float16", 256, "paged64", "16-bit", (64, False), 16, 2),
    ("bfloat16", 256, "contiguous", "fp8", (256, True), 8, 8),
    ("float16", 128, "paged256", "int8", (0, False), 48, 2),
    ("bfloat16", 128, "paged32", "fp8", (96, False), 64, 1),
    # rotary_dim = D in halves: the partner piece is the thread's own (rotate_in_registers), 2 pieces per row
    ("float16", 64, "paged32", "16-bit", (64, False), 8, 2),
    ("bfloat16", 128, "contiguous", "fp8", (128, False), 16, 4),
    # head dims computed padded (COMPUTED_HEAD_DIM): the staged rows' zero columns, the real pieces written
    ("bfloat16", 96, "paged16", "fp8", (96, False), 32, 8),
    ("float16", 80, "contiguous", "int8", (64, True), 16, 2),
    ("bfloat16", 192, "paged64", "16-bit", (192, False), 16, 2),
    # (192, 128): k_new's 192 columns and v_new's 128, each into its own cache (MLA expanded)
    ("float16", (192, 128), "paged16", "fp8", (64, False), 16, 2),
    ("bfloat16", (192, 128), "contiguous", "16-bit", (64, True), 8, 8),
    ("float16", (192, 128), "paged64", "int8", (0, False), 32, 2),
]


def pair(dims) -> tuple[int, int]:
    """(D, D_v) of a case's head dim column: an int D, or a pair."""
    return (dims, dims) if isinstance(dims, int) else dims


# Each case as the launch picks its plan, and (D <= 128) with the most row tiles on 8 warps.
APPEND_VARIANTS = [(*case, variant) for case in APPEND_CASES for variant in (None, "tiles-warps8")
                   if variant is None or pair(case[1])[0] <= 128]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, layout, cache, rotary, heads_q, heads_kv, variant", APPEND_VARIANTS,
                         ids=[f"{a}-{dims_id(*pair(b))}-{c}-{d}-rope{e[0]}{'i' if e[1] else ''}-h{f}-kv{g}"
                              f"{VARIANT_IDS[v]}" for a, b, c, d, e, f, g, v in APPEND_VARIANTS])
def test_fused_append_and_rope(stage, dtype, head_dim, layout, cache, rotary, heads_q, heads_kv, variant):
    """The new token appended (and rotated) in the launch: lengths 0 (the new token alone), page
    boundaries on both sides, long sequences split many ways."""
    lengths = [0, 1, 15, 16, 63, 64, 4096, 20000]
    head_dim, head_dim_v = pair(head_dim)
    inputs = testing.append_decode_inputs(lengths, heads_q, heads_kv, head_dim, getattr(torch, dtype),
                                          page_size=LAYOUTS[layout], head_dim_v=head_dim_v, seed=head_dim + heads_q)
    inputs, features = quantized(inputs, cache)
    features.update(k_new=inputs.pop("k_new"), v_new=inputs.pop("v_new"))
    rotary_dim, interleaved = rotary
    if rotary_dim:
        cos, sin = testing.rotary_tables(max(lengths) + 1, rotary_dim, getattr(torch, dtype))
        features.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    for num_splits in (1, 5, 0):
        step = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        append_step(stage, {**inputs, **step}, features, f"{dtype} {dims_id(head_dim, head_dim_v)} {layout} {cache} rope {rotary} "
                    f"H_q={heads_q} H_kv={heads_kv} {variant} num_splits={num_splits}", num_splits=num_splits,
                    plan=variant_plan(stage, variant, heads_q, heads_kv, head_dim), return_lse=False)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_append_with_window_sinks_and_alibi(stage, layout):
    """Every decode feature at once on the appended token: window, sink tokens and logits, ALiBi, LSE."""
    lengths = [0, 3, 130, 5000]
    inputs = testing.append_decode_inputs(lengths, 32, 8, 128, torch.bfloat16, page_size=LAYOUTS[layout], seed=5)
    cos, sin = testing.rotary_tables(max(lengths) + 1, 128, torch.bfloat16)
    features = dict(k_new=inputs.pop("k_new"), v_new=inputs.pop("v_new"), rotary_cos=cos, rotary_sin=sin,
                    window_size_left=100, num_sink_tokens=4, sink_logits=torch.randn(32, device="cuda"),
                    alibi_slopes=testing.alibi_slopes(32))
    before = {k: inputs[k].clone() for k in ("k_cache", "v_cache")}
    out, lse = stage.decode_attention(**inputs, **features, num_splits=3, return_lse=True,
                                      out=testing.poisoned_like(inputs["q"]))
    testing.assert_decode_matches(out, {**inputs, **before}, f"{layout}, all features", lse=lse, **features)


ALIBI_CASES = {  # name: (H_q, H_kv, layout, features)
    "mha": (16, 16, "contiguous", {}),
    "gqa-window": (32, 8, "paged64", {"window_size_left": 700}),
    "mqa-64-sinks": (64, 1, "paged16", {"window_size_left": 300, "num_sink_tokens": 3}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("cache", QUANTIZED)
@pytest.mark.parametrize("variant", [None, "tiles", "warps8"], ids=["auto", "most-tiles", "warps8"])
@pytest.mark.parametrize("heads_q, heads_kv, layout, features", ALIBI_CASES.values(), ids=ALIBI_CASES.keys())
def test_alibi(stage, heads_q, heads_kv, layout, features, variant, cache):
    """score - slope x (query position - key position), the paper's slopes, steep enough (2^-0.125 to
    2^-8 per key) that the nearest keys dominate; the key positions of sinks and windows."""
    inputs = testing.random_decode_inputs([1, 2, 100, 4097, 30000], heads_q, heads_kv, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=heads_q)
    inputs, scales = quantized(inputs, cache)
    out = stage.decode_attention(**inputs, **scales, **features, alibi_slopes=testing.alibi_slopes(heads_q),
                                 num_splits=6, return_lse=True, plan=variant_plan(stage, variant, heads_q, heads_kv),
                                 out=testing.poisoned_like(inputs["q"]))
    testing.assert_decode_matches(out[0], inputs, f"ALiBi H_q={heads_q} {layout} {features} {variant} {cache}",
                                  lse=out[1], alibi_slopes=testing.alibi_slopes(heads_q), **scales, **features)


ROLLING_CASES = {  # name: (capacity, window, sink tokens, layout)
    "ring-of-128": (128, 127, 0, "contiguous"),
    "4-sinks+124-ring-paged": (128, 100, 4, "paged16"),
    "ring-of-1000-paged": (1000, 999, 0, "paged64"),
    "window-smaller-than-ring": (300, 17, 2, "contiguous"),
}


def poison_padding(inputs, padding):
    """Each sequence's padding rows (the first ``padding[b]``) NaN (an int8 cache: its largest value): a
    kernel that reads one is wrong."""
    page_size = inputs["k_cache"].shape[1] if inputs.get("block_table") is not None else None
    for cache in (inputs["k_cache"], inputs["v_cache"]):
        bad = 127 if cache.dtype == torch.int8 else float("nan")
        for b, n in enumerate(padding):
            if page_size is None:
                cache[b, :n] = bad
            for p in range(-(-n // page_size) if page_size else 0):
                cache[int(inputs["block_table"][b, p]), :min(page_size, n - p * page_size)] = bad
    return inputs


def test_left_padding_is_the_sequence_moved_to_row_0():
    """The reference's cache_leftpad (float64, CPU): sequence b read from rows cache_leftpad[b] .. gives what
    the same tokens give from row 0, with a window, sink tokens and logits, ALiBi and an appended,
    rotated token (its RoPE position counts from the first real row)."""
    lengths, padding = [3, 40, 70], [0, 25, 9]
    gen = torch.Generator().manual_seed(0)
    q, k_new, v_new = (torch.randn(3, h, 64, generator=gen, dtype=torch.float64) for h in (8, 2, 2))
    k_cache, v_cache = (torch.randn(3, 90, 2, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    cos, sin = testing.rotary_tables(100, 64, torch.float64, device="cpu")
    features = dict(window_size_left=20, num_sink_tokens=2, sink_logits=torch.randn(8, generator=gen),
                    alibi_slopes=testing.alibi_slopes(8, device="cpu"), k_new=k_new, v_new=v_new,
                    rotary_cos=cos, rotary_sin=sin)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    padded, padded_lse = testing.reference.decode_attention(
        q, k_cache, v_cache, seqlens, cache_leftpad=torch.tensor(padding, dtype=torch.int32), return_lse=True,
        **features)
    moved = [torch.stack([torch.roll(c[b], -n, dims=0) for b, n in enumerate(padding)]) for c in (k_cache, v_cache)]
    expected, expected_lse = testing.reference.decode_attention(
        q, *moved, seqlens - torch.tensor(padding, dtype=torch.int32), return_lse=True, **features)
    torch.testing.assert_close(padded, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(padded_lse, expected_lse, rtol=0, atol=1e-6)


def feature_options(features: dict, heads_q: int) -> dict:
    """A case's decode options, with ALiBi slopes and sink logits made for its heads where it names them
    (``alibi``, ``sink_logits``; ``leftpad`` is the case's own)."""
    options = {k: v for k, v in features.items() if k not in ("alibi", "sink_logits", "leftpad")}
    if features.get("alibi"):
        options["alibi_slopes"] = testing.alibi_slopes(heads_q)
    if features.get("sink_logits"):
        options["sink_logits"] = torch.randn(heads_q, device="cuda")
    return options


LEFTPAD_CASES = {  # name: (H_q, H_kv, layout, cache, features)
    "gqa-contiguous": (32, 8, "contiguous", "16-bit", {}),
    "mqa-paged16-window-sinks": (16, 1, "paged16", "fp8", {"window_size_left": 90, "num_sink_tokens": 3}),
    "gqa-paged64-alibi-sink-logits": (64, 8, "paged64", "int8", {"alibi": True, "sink_logits": True}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, "tiles", "warps8"], ids=["auto", "most-tiles", "warps8"])
@pytest.mark.parametrize("heads_q, heads_kv, layout, cache, features", LEFTPAD_CASES.values(),
                         ids=LEFTPAD_CASES.keys())
def test_left_padded_sequences(stage, heads_q, heads_kv, layout, cache, features, variant):
    """cache_leftpad: each sequence's rows start after its padding (NaN, never read); no padding, a
    padding of all but one row, and paddings across page boundaries; split several ways; then one
    appended, rotated token (RoPE at its position in the sequence, not in the cache)."""
    lengths, padding = [1, 40, 300, 5000, 20000, 64], [0, 39, 17, 4000, 3, 64]
    inputs = testing.random_decode_inputs(lengths, heads_q, heads_kv, 128, torch.bfloat16,
                                          page_size=LAYOUTS[layout], seed=heads_q)
    inputs, scales = quantized(inputs, cache)
    poison_padding(inputs, padding)
    options = feature_options(features, heads_q)
    options.update(cache_leftpad=torch.tensor(padding, dtype=torch.int32, device="cuda"), **scales)
    plan = variant_plan(stage, variant, heads_q, heads_kv)
    where = f"left padding H_q={heads_q} H_kv={heads_kv} {layout} {cache} {features} {variant}"
    for num_splits in (1, 7, 0):
        out, lse = stage.decode_attention(**inputs, **options, num_splits=num_splits, return_lse=True, plan=plan,
                                          out=testing.poisoned_like(inputs["q"]))
        testing.assert_decode_matches(out, inputs, f"{where} num_splits={num_splits}", lse=lse, **options)
    cached = [n - 1 for n in lengths]
    appended = testing.append_decode_inputs(cached, heads_q, heads_kv, 128, torch.bfloat16,
                                            page_size=LAYOUTS[layout], seed=heads_q + 1)
    new = {name: appended.pop(name) for name in ("k_new", "v_new")}
    appended, scales = quantized(appended, cache)
    padding = [min(p, n) for p, n in zip(padding, cached)]
    poison_padding(appended, padding)
    options["cache_leftpad"] = torch.tensor(padding, dtype=torch.int32, device="cuda")
    cos, sin = testing.rotary_tables(max(lengths), 128, torch.bfloat16)
    append_step(stage, appended, {**options, **scales, **new, "rotary_cos": cos, "rotary_sin": sin},
                f"{where} + append", num_splits=3, plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", QUANTIZED)
@pytest.mark.parametrize("capacity, window, sinks, layout", ROLLING_CASES.values(), ids=ROLLING_CASES.keys())
def test_rolling_cache(stage, capacity, window, sinks, layout, cache):
    """Token t in row t mod capacity (after the sink rows): lengths below, at and far past the ring, a
    window that wraps; then one appended step, whose row overwrites the token that just left the window."""
    lengths = [1, capacity - 1, capacity, capacity + 1, 5 * capacity + 17, 70000]
    inputs = testing.rolling_decode_inputs(lengths, capacity, 32, 8, 128, torch.float16,
                                           page_size=LAYOUTS[layout], seed=capacity)
    inputs, scales = quantized(inputs, cache)
    features = dict(window_size_left=window, num_sink_tokens=sinks, cache_capacity=capacity, **scales)
    out = stage.decode_attention(**inputs, **features, num_splits=4, out=testing.poisoned_like(inputs["q"]))
    testing.assert_decode_matches(out, inputs, f"rolling {capacity} {layout} {cache}", **features)
    gen = torch.Generator(device="cuda").manual_seed(1)
    new = {name: torch.randn(len(lengths), 8, 128, generator=gen, device="cuda").half() for name in ("k_new", "v_new")}
    append_step(stage, inputs, {**features, **new}, f"rolling {capacity} {layout} {cache} + append", num_splits=4)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_q, heads_kv, variant", ROW_TILE_HEADS, ids=HEADS_IDS)
@pytest.mark.parametrize("dtype, head_dim, layout", RAGGED_CASES, ids=[f"{a}-d{b}-{c}" for a, b, c in RAGGED_CASES])
def test_int8_cache(stage, dtype, head_dim, layout, heads_q, heads_kv, variant):
    """The ragged batch on an int8 cache, against the values it stands for (its scales times its integers)."""
    inputs = testing.random_decode_inputs(RAGGED, heads_q, heads_kv, head_dim, getattr(torch, dtype),
                                          page_size=LAYOUTS[layout], seed=head_dim + heads_q)
    q_inputs, scales = quantized(inputs, "int8")
    out = stage.decode_attention(**q_inputs, **scales, return_lse=True, out=testing.poisoned_like(inputs["q"]),
                                 plan=variant_plan(stage, variant, heads_q, heads_kv, head_dim))
    testing.assert_decode_matches(out[0], q_inputs, f"{dtype} D={head_dim} {layout} int8 H_q={heads_q} "
                                  f"H_kv={heads_kv} {variant}", lse=out[1], **scales)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", QUANTIZED)
def test_append_graph_replay_and_repeated_launches(stage, cache):
    """Appends are not idempotent in general, so every launch starts from the same cache: 200 eager
    launches and 200 replays of one captured launch give the same bits, O and cache."""
    lengths = [5, 64, 4097]
    inputs = testing.append_decode_inputs(lengths, 32, 8, 128, torch.float16, page_size=64, seed=6)
    inputs, scales = quantized(inputs, cache)
    cos, sin = testing.rotary_tables(max(lengths) + 1, 128, torch.float16)
    features = dict(k_new=inputs.pop("k_new"), v_new=inputs.pop("v_new"), rotary_cos=cos, rotary_sin=sin,
                    num_splits=37, **scales)
    pristine = {k: inputs[k].clone() for k in ("k_cache", "v_cache")}

    def reset():
        inputs["k_cache"].copy_(pristine["k_cache"])
        inputs["v_cache"].copy_(pristine["v_cache"])

    first = append_step(stage, inputs, {k: v for k, v in features.items() if k != "num_splits"}, "launch 1",
                        num_splits=37)
    appended = {k: inputs[k].clone() for k in ("k_cache", "v_cache")}
    for i in range(200):
        reset()
        out = stage.decode_attention(**inputs, **features)
        assert torch.equal(out, first), f"eager launch {i + 2} differs from the first"
    assert all(torch.equal(bits(inputs[k]), bits(appended[k])) for k in appended)
    out = testing.poisoned_like(inputs["q"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage.decode_attention(**inputs, **features, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        stage.decode_attention(**inputs, **features, out=out)
    for replay in range(200):
        reset()
        out.fill_(float("nan"))
        graph.replay()
        if replay in (0, 199):
            torch.cuda.synchronize()
            assert torch.equal(out, first), f"CUDA graph replay {replay + 1} differs from an eager launch"
            assert all(torch.equal(bits(inputs[k]), bits(appended[k])) for k in appended)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", QUANTIZED)
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_consecutive_decode_steps(stage, layout, cache):
    """Twenty steps as a serving loop runs them: each appends its token, the caller adds 1 to the lengths,
    and the next step reads the rows the previous ones wrote from the cache (across a page boundary)."""
    lengths, steps = [0, 7, 1000], 20
    inputs = testing.random_decode_inputs([n + steps for n in lengths], 32, 8, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=12)
    inputs, scales = quantized(inputs, cache)
    inputs["cache_seqlens"] = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cos, sin = testing.rotary_tables(max(lengths) + steps, 128, torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for step in range(steps):
        new = {name: torch.randn(3, 8, 128, generator=gen, device="cuda").half() for name in ("k_new", "v_new")}
        features = dict(rotary_cos=cos, rotary_sin=sin, window_size_left=15, **scales, **new)
        append_step(stage, inputs, features, f"{layout} {cache} step {step + 1}", num_splits=3)
        inputs["q"] = torch.randn(inputs["q"].shape, generator=gen, device="cuda").half()
        inputs["cache_seqlens"] += 1


# ---------------------------------------------------------------- draft tokens (several query tokens per sequence)

def test_draft_tokens_are_causal_attention_over_the_cache():
    """The reference's draft tokens (float64, CPU): q [B, n, H_q, D] against the cache is the prefill
    reference's causal attention of the sequence's last n positions over its keys, aligned bottom-right,
    with a window, sink tokens and logits, ALiBi and left padding; a sequence shorter than n has rows that
    see no key (O = 0, LSE = the sink logit)."""
    lengths, padding, n, h_q, h_kv = [2, 40, 70], [0, 25, 9], 4, 8, 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, n, h_q, 64, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(3, 90, h_kv, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    features = dict(num_sink_tokens=2, sink_logits=torch.randn(h_q, generator=gen),
                    alibi_slopes=testing.alibi_slopes(h_q, device="cpu"))
    out, lse = testing.reference.decode_attention(
        q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), window_size_left=20, return_lse=True,
        cache_leftpad=torch.tensor(padding, dtype=torch.int32), **features)
    assert out.shape == q.shape and lse.shape == (3, h_q, n)
    for b, (length, pad) in enumerate(zip(lengths, padding)):
        keys, values = k_cache[b:b + 1, pad:length], v_cache[b:b + 1, pad:length]
        expected, expected_lse = testing.reference.attention(q[b:b + 1], keys, values, causal=True,
                                                             window_size=(20, 0), return_lse=True, **features)
        torch.testing.assert_close(out[b], expected[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[b], expected_lse[0], rtol=0, atol=1e-6)
    assert out[0, :2].abs().max() == 0, "the first two of 4 tokens of a 2-key sequence see no key"


DRAFT_LENGTHS = [1, 3, 4, 5, 127, 128, 129, 4097, 20000]  # below, at and past n = 4; page and tile edges
DRAFT_CASES = {  # name: (n, H_q, H_kv, D or (D, D_v), dtype, layout, cache, features)
    "4-gqa4-d128-paged64": (4, 32, 8, 128, "bfloat16", "paged64", "16-bit", {}),
    "2-gqa8-d128-window-sinks": (2, 64, 8, 128, "float16", "contiguous", "fp8",
                                 {"window_size_left": 100, "num_sink_tokens": 4, "sink_logits": True}),
    "8-mqa8-d64-paged16-alibi-leftpad": (8, 8, 1, 64, "bfloat16", "paged16", "int8", {"alibi": True, "leftpad": True}),
    "3-mha-d256-window-0": (3, 16, 16, 256, "float16", "contiguous", "16-bit", {"window_size_left": 0}),
    "5-gqa4-d128-paged32-leftpad-window": (5, 16, 4, 128, "float16", "paged32", "16-bit",
                                           {"leftpad": True, "window_size_left": 33, "num_sink_tokens": 1}),
    "2-gqa4-d96-paged64": (2, 16, 4, 96, "bfloat16", "paged64", "16-bit", {}),
    "4-mha-d192v128-paged16-window": (4, 8, 8, (192, 128), "bfloat16", "paged16", "fp8", {"window_size_left": 40}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, "tiles", "warps8"], ids=["auto", "most-tiles", "warps8"])
@pytest.mark.parametrize("n, heads_q, heads_kv, head_dim, dtype, layout, cache, features", DRAFT_CASES.values(),
                         ids=DRAFT_CASES.keys())
def test_draft_tokens(stage, n, heads_q, heads_kv, head_dim, dtype, layout, cache, features, variant):
    """q [B, n, H_q, D]: n query tokens per sequence, the last n positions of its keys, each seeing the keys
    up to its own (n x G rows per KV head); lengths below n (rows with no key), split several ways, with
    the LSE [B, H_q, n]; q [B, 1, H_q, D] gives [B, H_q, D]'s bits."""
    head_dim, head_dim_v = pair(head_dim)
    inputs = testing.random_decode_inputs(DRAFT_LENGTHS, heads_q, heads_kv, head_dim, getattr(torch, dtype),
                                          page_size=LAYOUTS[layout], head_dim_v=head_dim_v, seed=n + heads_q)
    inputs, scales = quantized(inputs, cache)
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(len(DRAFT_LENGTHS), n, heads_q, head_dim, generator=gen, device="cuda").to(inputs["q"].dtype)
    options = {**feature_options(features, heads_q), **scales}
    if features.get("leftpad"):
        padding = [n // 3 for n in DRAFT_LENGTHS]
        options["cache_leftpad"] = torch.tensor(padding, dtype=torch.int32, device="cuda")
        poison_padding(inputs, padding)
    plan = variant_plan(stage, variant, n * heads_q, heads_kv, head_dim)
    where = f"{n} draft tokens H_q={heads_q} H_kv={heads_kv} {dims_id(head_dim, head_dim_v)} {layout} {cache} {features} {variant}"
    for num_splits in (1, 5, 0):
        out, lse = stage.decode_attention(**{**inputs, "q": q}, **options, num_splits=num_splits, return_lse=True,
                                          plan=plan, out=testing.poisoned_decode_out(q, inputs["v_cache"]))
        assert lse.shape == (len(DRAFT_LENGTHS), heads_q, n), f"{where}: LSE has shape {tuple(lse.shape)}"
        testing.assert_decode_matches(out, {**inputs, "q": q}, f"{where} num_splits={num_splits}", lse=lse,
                                      **options)
    one, one_lse = stage.decode_attention(**{**inputs, "q": q[:, -1:]}, **options, return_lse=True)
    three, three_lse = stage.decode_attention(**{**inputs, "q": q[:, -1]}, **options, return_lse=True)
    assert torch.equal(one[:, 0], three) and torch.equal(one_lse[..., 0], three_lse), (
        f"{where}: q [B, 1, H_q, D] differs from q [B, H_q, D]")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", QUANTIZED)
def test_draft_tokens_on_a_rolling_cache(stage, cache):
    """A rolling cache keeps the keys of every draft token's window: lengths far past the ring, a window
    that wraps, n = 4 with window_size_left + n = capacity - sink tokens."""
    capacity, sinks, n = 260, 4, 4
    lengths = [1, 3, capacity, capacity + 1, 5 * capacity + 17, 70000]
    inputs = testing.rolling_decode_inputs(lengths, capacity, 32, 8, 128, torch.float16, page_size=64, seed=3)
    inputs, scales = quantized(inputs, cache)
    inputs["q"] = torch.randn(len(lengths), n, 32, 128, device="cuda").half()
    features = dict(window_size_left=capacity - sinks - n, num_sink_tokens=sinks, cache_capacity=capacity, **scales)
    out = stage.decode_attention(**inputs, **features, num_splits=4, out=testing.poisoned_like(inputs["q"]))
    testing.assert_decode_matches(out, inputs, f"draft tokens on a rolling cache {cache}", **features)


@pytest.mark.gpu
def test_draft_tokens_graph_replay_with_new_lengths(stage):
    """One captured launch of 4 draft tokens per sequence replayed after the lengths change (same cache):
    each replay matches an eager launch bit for bit."""
    inputs = testing.random_decode_inputs([700, 5000, 9000], 32, 8, 128, torch.bfloat16, page_size=64, seed=9)
    inputs["q"] = torch.randn(3, 4, 32, 128, device="cuda").bfloat16()
    out = testing.poisoned_like(inputs["q"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage.decode_attention(**inputs, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        stage.decode_attention(**inputs, out=out)
    for lengths in ([700, 5000, 9000], [3, 4097, 64], [1, 2, 8999]):
        inputs["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, stage.decode_attention(**inputs)), f"replay with lengths {lengths} differs from eager"
        testing.assert_decode_matches(out, inputs, f"replay with lengths {lengths}")
