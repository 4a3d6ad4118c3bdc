"""Stage 6 checks: the shared prefill checks, the LSE output, and merging partial results."""

import math

import cpu_numerics
import pytest
import torch

from course.runtime import stages, validation
from course.testing import reference
from course import testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)

STAGE = stages.get(6)
LENGTHS = testing.MULTI_TILE_LENGTHS

LSE_CASES = {  # (features, (S_q, S_k)); sink logits are drawn per test
    "full": (dict(), (300, 1000)),
    "causal-sq-gt-sk": (dict(causal=True), (700, 200)),  # empty rows: LSE = -inf
    "window": (dict(window_size=(128, 0)), (513, 1000)),
    "sinks-causal-sq-gt-sk": (dict(causal=True, sinks=True), (700, 200)),  # empty rows: LSE = sink
    "all": (dict(window_size=(100, 20), num_sink_tokens=3, sinks=True), (400, 777)),
}


def make_features(case, heads, device="cuda"):
    features = dict(case)
    if features.pop("sinks", False):
        features["sink_logits"] = torch.linspace(-3.0, 3.0, heads, device=device)
    return features


def assert_lse_matches(lse, q, k, v, where, **features):
    _, ref = reference.attention(q, k, v, return_lse=True, **features)
    ref = ref.to(lse.device)
    assert lse.dtype == torch.float32 and lse.shape == ref.shape, (
        f"{where}: LSE has shape {tuple(lse.shape)} {lse.dtype}; expected [B, H_q, S_q] = {tuple(ref.shape)} float32")
    assert not torch.isnan(lse).any(), f"{where}: LSE has NaN (the output buffer was never written there?)"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), (
        f"{where}: LSE is -inf exactly where a row sees no key and there is no sink; here it differs")
    finite = torch.isfinite(ref)
    err = (lse[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    assert err < 1e-3, f"{where}: LSE differs from the reference by {err:.2e} (natural log, sink included?)"


# ---------------------------------------------------------------- your LSE code on the CPU

LSE_ROWS = {  # (S_k, mask, sink logit) for 16 query rows over 3 tiles of 32 keys
    "full": (96, {}, None),
    "causal-empty-rows": (10, dict(causal=True), None),  # LSE = -inf
    "sink-causal-empty-rows": (10, dict(causal=True), 1.5),  # LSE = the sink
    "window-and-sink": (96, dict(window_size=(5, 3)), -2.0),
}


@pytest.mark.compiles
@pytest.mark.parametrize("name", list(LSE_ROWS))
def test_on_cpu_normalize_rows_lse(stage, name):
    """Your normalize_rows (O and LSE) on the CPU after the online softmax, against the reference."""
    seqlen_k, mask, sink = LSE_ROWS[name]
    cpu_numerics.check_attend_rows(stage, n_tiles=3, seqlen_k=seqlen_k, features=mask, sink_logit=sink)


@pytest.mark.compiles
@pytest.mark.parametrize("seqlen_q", [1, 128, 300])
def test_on_cpu_store_lse(stage, seqlen_q):
    """Your store_lse from every consumer thread of every Q tile: every row's LSE, once, in its place."""
    cpu_numerics.check_store_lse(stage, seqlen_q)


@pytest.mark.compiles
def test_on_cpu_merge_weights(stage):
    """Your merge_weights on pairs of LSEs (empty parts included) against reference.merge_attention_states."""
    cpu_numerics.check_merge_weights(stage)


# ---------------------------------------------------------------- merging (CPU)

def split_at_sink_tokens(s_q, s_k, n, window_size, causal):
    """The window + sink-tokens attention as two disjoint key sets: keys [0, n) and [n, S_k).

    Part A (the sink tokens) keeps only the right bound, moved to A's own bottom-right
    alignment: A has S_k' = n, so its offset is n - S_q instead of S_k - S_q.
    """
    left, right = validation.resolve_window(causal, window_size)
    right_a = right + (s_k - n) if right >= 0 else -1
    return dict(window_size=(-1, right_a)), dict(window_size=(left, right))


@pytest.mark.parametrize("causal, window", [(True, (100, -1)), (False, (50, 10)), (True, (0, 0))])
def test_merging_sink_part_and_window_part_equals_one_call(causal, window):
    """The motivating use of LSE, on the reference: [sink tokens | the rest] merged == one call."""
    s_q, s_k, n = 300, 900, 8
    q, k, v = testing.random_qkv(1, s_q, s_k, 4, 2, 32, torch.float32, device="cpu", seed=2)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    features_a, features_b = split_at_sink_tokens(s_q, s_k, n, window, causal)
    o_a, lse_a = reference.attention(q, k[:, :n], v[:, :n], return_lse=True, sink_logits=sink, **features_a)
    o_b, lse_b = reference.attention(q, k[:, n:], v[:, n:], return_lse=True, **features_b)
    o, lse = reference.merge_attention_states(o_a, lse_a, o_b, lse_b)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, sink_logits=sink, num_sink_tokens=n,
                                         causal=causal, window_size=window)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)  # the LSEs are float32
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)


def test_merge_guards():
    o = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    lse = torch.tensor([[[0.3, -math.inf, 50.0]]])
    empty = torch.full_like(lse, -math.inf)
    merged, merged_lse = reference.merge_attention_states(o, lse, torch.randn_like(o), empty)
    torch.testing.assert_close(merged, torch.where(torch.isinf(lse).transpose(1, 2)[..., None], 0.0, o))
    torch.testing.assert_close(merged_lse, lse)  # merging an empty part is a no-op
    both, both_lse = reference.merge_attention_states(o, empty, o, empty)
    assert (both == 0).all() and torch.isneginf(both_lse).all()  # never NaN


@pytest.mark.compiles
@pytest.mark.parametrize("dtype, head_dim", STAGE.load("solutions").MERGE_CONFIGS)
def test_merge_kernel_cross_compiles(stage, dtype, head_dim):
    report = stage.cross_compile_merge(dtype, head_dim)
    if report.spill_bytes is not None:
        assert report.spill_bytes == 0


# ---------------------------------------------------------------- LSE and merging (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", testing.HEAD_DIMS, ids=["d64", "d128"])
@pytest.mark.parametrize("name", list(LSE_CASES))
def test_lse_matches_reference(stage, request, name, dtype, head_dim):
    case, (s_q, s_k) = LSE_CASES[name]
    q, k, v = testing.random_qkv(2, s_q, s_k, 8, 2, head_dim, dtype, seed=s_q)
    features = make_features(case, 8)
    out, lse = stage.attention(q, k, v, return_lse=True, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where=f"stage {request.module.STAGE.number} O, {name}", **features)
    assert_lse_matches(lse, q, k, v, f"stage {request.module.STAGE.number} LSE, {name}", **features)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal, window", [(True, (256, -1)), (False, (128, 32))], ids=["causal", "window"])
def test_split_merge_equals_one_call(stage, causal, window, dtype):
    """Sink tokens + window in one call == (sink tokens with the sink logit) merged with (the rest)."""
    s_q, s_k, n = 700, 2000, 16
    q, k, v = testing.random_qkv(2, s_q, s_k, 8, 2, 128, dtype, seed=13)
    sink = torch.linspace(-1.0, 1.5, 8, device="cuda")
    features_a, features_b = split_at_sink_tokens(s_q, s_k, n, window, causal)
    o_a, lse_a = stage.attention(q, k[:, :n], v[:, :n], return_lse=True, sink_logits=sink, **features_a)
    o_b, lse_b = stage.attention(q, k[:, n:], v[:, n:], return_lse=True, **features_b)
    o, lse = stage.merge_attention_states(o_a, lse_a, o_b, lse_b, out=testing.poisoned_like(q))
    features = dict(sink_logits=sink, num_sink_tokens=n, causal=causal, window_size=window)
    testing.assert_attention_matches(o, q, k, v, where="merged [sink tokens | window]", **features)
    assert_lse_matches(lse, q, k, v, "merged LSE", **features)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", STAGE.load("solutions").MERGE_HEAD_DIMS)
def test_merge_kernel_matches_pytorch_and_guards(stage, head_dim):
    """Every D_v of the contract: the rows a CTA takes (128 threads, 8 values each) need not fill it."""
    o_a, o_b = (torch.randn(2, 300, 4, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    lse_a = torch.randn(2, 4, 300, device="cuda") * 5
    lse_b = torch.randn(2, 4, 300, device="cuda") * 5
    lse_a[:, :, :50] = -math.inf  # part A empty on these rows
    lse_b[:, :, 25:75] = -math.inf  # both empty on rows 25..49
    o, lse = stage.merge_attention_states(o_a, lse_a, o_b, lse_b, out=torch.full_like(o_a, float("nan")))
    o_ref, lse_ref = reference.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.double(), o_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    assert (o[:, 25:50] == 0).all() and torch.isneginf(lse[:, :, 25:50]).all()
    torch.testing.assert_close(o[:, :25], o_b[:, :25])  # an empty part changes nothing
