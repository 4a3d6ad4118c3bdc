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

from course.runtime import prefill, stages
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

STAGE = stages.get(8)
LENGTHS = testing.MULTI_TILE_LENGTHS


# ---------------------------------------------------------------- the ablation (CPU)

def test_ablation_compiles_each_step(stage):
    """Every step of the ablation is a kernel of its own; each must compile without spilling."""
    assert list(stage.ABLATION) == [f"+{step.name.lower()}" for step in stage.Step]
    for label, kernel_class in stage.ABLATION.items():
        config = prefill.KernelConfig("float16", 128, has_right=True)
        report = prefill.cross_compile_config(kernel_class, config, stage=8)
        assert report.spill_bytes in (0, None), f"{label} spills {report.spill_bytes} bytes"


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


@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped-loop", "pingpong-loop"])
def test_on_cpu_synchronization(stage, overlapped):
    """Your ping-pong and overlapped step, both MMA warpgroups recorded on the CPU and replayed in a model of the
    hardware's rules: no hang, one turn at a time, no register race with an in-flight WGMMA, buffers released after
    the GEMMs that read them, the softmax under the P V (tests/cpu_sync.py)."""
    cpu_sync.check_stage8(stage, overlapped=overlapped)


# ---------------------------------------------------------------- numerics (Hopper GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("label", ["+pingpong", "+overlap", "+softmax", "+persistent", "+epilogue"])
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window_size": (200, 30), "num_sink_tokens": 5}],
                         ids=["full", "causal", "window-sinks"])
def test_every_ablation_step_is_correct(stage, label, features):
    """The benchmark times each step's kernel: each must compute attention, not just run."""
    q, k, v = testing.random_qkv(2, 700, 900, 8, 2, 128, torch.float16, seed=len(label))
    out = prefill.attention(8, stage.ABLATION[label], q, k, v, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where=f"stage 8 {label}, {features}", **features)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", testing.HEAD_DIMS, ids=["d64", "d128"])
def test_many_tiles_per_cta(stage, dtype, head_dim):
    """More (Q tile, head, batch) tiles than SMs, ragged last Q tiles and a short last group of heads:
    each persistent CTA computes several tiles, and every tile exactly once."""
    q, k, v = testing.random_qkv(3, 1000, 777, 20, 4, head_dim, dtype, seed=head_dim)  # 8 * 60 = 480 tiles
    for features in ({}, {"causal": True}):
        out = stage.attention(q, k, v, out=testing.poisoned_like(q), **features)
        testing.assert_attention_matches(out, q, k, v, where=f"480 tiles, {features}", **features)


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
def test_back_to_back_launches_give_identical_bits(stage):
    """200 launches of the same inputs: the warpgroups' barriers and the persistent loop leave no race."""
    q, k, v = testing.random_qkv(2, 1500, 1500, 16, 4, 128, torch.float16, seed=5)
    first = stage.attention(q, k, v, causal=True)
    for launch in range(200):
        out = stage.attention(q, k, v, causal=True, out=testing.poisoned_like(q))
        assert torch.equal(out, first), f"launch {launch + 2} of 200 differs from the first"
    testing.assert_attention_matches(first, q, k, v, where="200 launches", causal=True)
