"""Stage 5 checks: the shared prefill checks, then sink logits and sink tokens."""

import cpu_numerics
import pytest
import torch

from course.runtime import stages
from course.testing import reference, tile_models
from course import testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)

STAGE = stages.get(5)
LENGTHS = testing.MULTI_TILE_LENGTHS

# (name, features, lengths): sink logits and/or sink tokens, alone and with masks.
CASES = [
    ("logits", dict(sinks=True), (300, 700)),
    ("logits-causal-sq-gt-sk", dict(sinks=True, causal=True), (700, 200)),  # empty rows: O = 0
    ("logits-swa", dict(sinks=True, window_size=(128, 0)), (513, 1000)),
    ("tokens-swa", dict(num_sink_tokens=4, window_size=(128, 0)), (513, 1000)),
    ("tokens-swa-far", dict(num_sink_tokens=130, window_size=(200, 0)), (1000, 1000)),  # two sink tiles
    ("tokens-causal-window", dict(num_sink_tokens=1, causal=True, window_size=(0, -1)), (300, 300)),
    ("both-swa", dict(sinks=True, num_sink_tokens=16, window_size=(256, 0)), (777, 1500)),
    ("both-asymmetric", dict(sinks=True, num_sink_tokens=3, window_size=(100, 20)), (400, 400)),
]


def features_for(case_features, heads_q, scale=2.0, device="cuda"):
    features = dict(case_features)
    if features.pop("sinks", False):
        gen = torch.Generator().manual_seed(heads_q)
        features["sink_logits"] = (torch.randn(heads_q, generator=gen) * scale).to(device)
    return features


@pytest.mark.parametrize("name, case, sizes", CASES, ids=[c[0] for c in CASES])
def test_sink_tile_model_matches_reference(name, case, sizes):
    s_q, s_k = sizes
    q, k, v = testing.random_qkv(1, s_q, s_k, 4, 2, 64, torch.float16, device="cpu", seed=s_q)
    features = features_for(case, 4, device="cpu")
    out = tile_models.masked_online(q, k, v, **features)
    testing.assert_attention_matches(out, q, k, v, where=f"sink tile model, {name}", **features)


SINK_TOKEN_MASKS = {name: ({k: v for k, v in case.items() if k != "sinks"}, [sizes])  # the masks of CASES
                    for name, case, sizes in CASES if "num_sink_tokens" in case}


@pytest.mark.compiles
@pytest.mark.parametrize("name", list(SINK_TOKEN_MASKS))
def test_on_cpu_sink_block_count_and_outside_left_bound(stage, name):
    """Your WindowMask with sink tokens on the CPU: every register of every thread, and the tiles the kernel visits."""
    case, lengths = SINK_TOKEN_MASKS[name]
    cpu_numerics.check_masks(stage, case, lengths)


SINK_ROWS = {  # (S_k, mask, sink logit) for 16 query rows over 3 tiles of 32 keys
    "sink": (96, {}, 1.5),
    "sink-causal-empty-rows": (10, dict(causal=True), -2.0),
    "huge-sink": (96, dict(window_size=(5, 3)), 60.0),
}


@pytest.mark.compiles
@pytest.mark.parametrize("name", list(SINK_ROWS))
def test_on_cpu_normalize_rows_with_a_sink(stage, name):
    """Your normalize_rows with a sink logit on the CPU (after the online softmax), against the reference."""
    seqlen_k, mask, sink = SINK_ROWS[name]
    cpu_numerics.check_attend_rows(stage, n_tiles=3, seqlen_k=seqlen_k, features=mask, sink_logit=sink)


def test_sink_tokens_survive_tile_skipping():
    """With a window, late Q tiles skip the first KV tiles; the sink tokens' tile must still be visited."""
    n_min, _ = tile_models.kv_block_range(7, 1000, 1000, window_size=(128, 0))
    assert n_min > 0
    visible = reference.visible_keys(1000, 1000, window_size=(128, 0), num_sink_tokens=4)
    assert visible[7 * 128:, :4].all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", testing.HEAD_DIMS, ids=["d64", "d128"])
@pytest.mark.parametrize("name, case, sizes", CASES, ids=[c[0] for c in CASES])
def test_sinks_match_reference(stage, request, name, case, sizes, dtype, head_dim):
    s_q, s_k = sizes
    q, k, v = testing.random_qkv(2, s_q, s_k, 8, 2, head_dim, dtype, seed=s_q + s_k)
    features = features_for(case, 8)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where=f"stage {request.module.STAGE.number}, {name}, {dtype}, D={head_dim}", **features)


@pytest.mark.gpu
@pytest.mark.parametrize("sink", [60.0, -60.0, 0.0], ids=["huge", "tiny", "zero"])
def test_extreme_sink_logits(stage, sink):
    """A sink of e^60 takes (almost) all the weight: O ~ 0, never inf/NaN; e^-60 changes nothing."""
    q, k, v = testing.random_qkv(1, 300, 500, 4, 4, 128, torch.float16, seed=3)
    features = dict(sink_logits=torch.full((4,), sink, device="cuda"), window_size=(64, 0))
    out = stage.attention(q, k, v, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where=f"sink logit {sink}", **features)


@pytest.mark.gpu
def test_only_sink_token_visible(stage):
    """Causal with window (0, -1)... row 0 sees only key 0, a sink token; other rows see it and their diagonal."""
    q, k, v = testing.random_qkv(1, 200, 200, 2, 2, 64, torch.bfloat16, seed=4)
    features = dict(causal=True, window_size=(0, 0), num_sink_tokens=1)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where="sink token + diagonal", **features)
