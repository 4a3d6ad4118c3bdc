"""Checks every prefill stage must pass; each tests/test_stageNN_*.py imports them.

A test module sets ``STAGE`` (from course.runtime.stages) and ``LENGTHS`` (the
(S_q, S_k) pairs its kernel supports) and does ``from prefill_checks import *``;
pytest then collects these tests in that module, against ``--impl``'s code.
"""

import pytest
import torch

from course.runtime import stages, validation
from course import testing

__all__ = [
    "stage", "pytest_generate_tests", "test_bad_input_is_rejected_before_launch", "test_later_features_name_their_stage",
    "test_cross_compiles_for_sm90a", "test_matches_reference", "test_softmax_scale",
    "test_packed_qkv_strides", "test_distinct_kv_tiles", "test_large_logits",
]


@pytest.fixture(scope="module")
def stage(request, impl):
    return request.module.STAGE.load(impl)


def pytest_generate_tests(metafunc):
    """Parametrize over the stage's own kernel configurations and lengths."""
    module = metafunc.module
    if "config" in metafunc.fixturenames:
        configs = module.STAGE.load("solutions").KERNEL_CONFIGS
        metafunc.parametrize("config", configs, ids=[c.name for c in configs])
    if "lengths" in metafunc.fixturenames:
        metafunc.parametrize("lengths", module.LENGTHS, ids=[f"sq{a}-sk{b}" for a, b in module.LENGTHS])


def cpu_qkv(s_q=16, s_k=16, h_q=4, h_kv=4, d=64, dtype=torch.float16, b=1):
    return testing.random_qkv(b, s_q, s_k, h_q, h_kv, d, dtype, device="cpu")


# ---------------------------------------------------------------- validation (CPU)

@pytest.mark.parametrize("make, error, message", [
    (lambda: cpu_qkv(), ValueError, "CUDA"),
    (lambda: (cpu_qkv()[0], cpu_qkv()[1].float(), cpu_qkv()[2]), TypeError, "dtype"),
    (lambda: tuple(t.float() for t in cpu_qkv()), TypeError, "float16"),
    (lambda: (cpu_qkv()[0][0], cpu_qkv()[1], cpu_qkv()[2]), ValueError, "rank"),
    (lambda: cpu_qkv(h_q=6, h_kv=4), ValueError, "multiple of H_kv"),
    (lambda: cpu_qkv(d=72), ValueError, "head_dim 72 is not supported"),
    (lambda: cpu_qkv(s_k=0), ValueError, "empty"),
    (lambda: (cpu_qkv()[0], cpu_qkv(d=128)[1][..., ::2], cpu_qkv()[2]), ValueError, "contiguous"),
    (lambda: (cpu_qkv()[0], cpu_qkv()[1], cpu_qkv(s_k=8)[2]), ValueError, "must match"),
], ids=["cpu-device", "dtype-mismatch", "fp32", "rank-3", "gqa-ratio", "head-dim", "s_k-0",
        "last-dim-stride", "k-v-shapes"])
def test_bad_input_is_rejected_before_launch(stage, make, error, message):
    q, k, v = make()
    with pytest.raises(error, match=message):
        stage.attention(q, k, v)


FEATURES = {  # feature: (the inputs' sizes, the keyword arguments) of a call that uses it
    "causal": ({}, {"causal": True}), "window_size": ({}, {"window_size": (16, 0)}),
    "sink_logits": ({}, {"sink_logits": torch.zeros(4)}), "num_sink_tokens": ({}, {"num_sink_tokens": 4}),
    "return_lse": ({}, {"return_lse": True}), "seqlen_k": ({"s_k": 129}, {}), "head_dim": ({"d": 96}, {}),
}


def test_later_features_name_their_stage(stage, request):
    number = request.module.STAGE.number
    for feature, (added_in, _) in validation.FEATURE_STAGE.items():
        if added_in > number:
            sizes, options = FEATURES[feature]
            with pytest.raises(NotImplementedError, match=f"(?i)stage {added_in}"):
                stage.attention(*cpu_qkv(**sizes), **options)


# ---------------------------------------------------------------- cross-compile (CPU)

@pytest.mark.compiles
def test_cross_compiles_for_sm90a(stage, config):
    report = stage.cross_compile_config(config)
    # The Hopper data path must really be there: WGMMA, TMA, mbarriers.
    assert report.ptx_instructions["wgmma.mma_async"] > 0
    assert report.ptx_instructions["cp.async.bulk.tensor"] > 0
    assert report.ptx_instructions["mbarrier"] > 0
    assert report.wgmma_serialized is None, (
        f"{report.name}: ptxas made each WGMMA wait for the one before ({report.wgmma_serialized}). The kernel is "
        "correct and several times slower. The usual cause: an accumulator read, or a wait_group, on a path that "
        "skips the MMAs it waits for (a wait inside an `if` whose MMAs were issued outside it); each branch must "
        "issue and wait for its own.")
    # Stage 8 on: what the tiling allows (three MMA warpgroups keep a few per-tile values in local memory).
    allowed = stage.spill_bytes_allowed(config) if hasattr(stage, "spill_bytes_allowed") else 0
    if report.spill_bytes is not None:
        assert report.spill_bytes <= allowed, spill_message(stage.STAGE, report.name, config.name,
                                                             report.spill_bytes, allowed)


def spill_message(number: int, name: str, config_name: str, spill_bytes: int, allowed: int) -> str:
    """What a learner reads when a configuration spills: the usual causes, and how to find the TODO."""
    exercises = stages.get(number).cpu_numerics + stages.get(number).cpu_sync
    one_config = f"python -m course check {number} -k 'cross_compiles and {config_name.split('_', 1)[1]}'"
    return (
        f"{name} spills {spill_bytes} bytes of registers to local memory"
        f"{f' (its tiling allows {allowed})' if allowed else ''}. The kernel runs at its register limit: a TODO "
        "that keeps more values live than it needs (a value read per element where one per row or column does, a "
        "branch per element, a slow-path function, a loop unrolled at trace time (range_constexpr) where a runtime "
        "loop does) spills. Scalar code can tip it too: a clamp or a test that the rest already implies (a "
        "configuration this close to the limit has no register to spare). Any of this stage's functions may be "
        f"the one ({', '.join(exercises)}): undo one function's change at a time and cross-compile this "
        f"configuration alone (`{one_config}`, seconds: both dtypes). If the test_on_cpu_* checks pass, the "
        f"numbers are right and this is the cost: see the stage page's exercise and `python -m course hint {number}`.")


# ---------------------------------------------------------------- numerics (Hopper GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", testing.HEAD_DIMS, ids=["d64", "d128"])
@pytest.mark.parametrize("h_q, h_kv", testing.GQA_HEADS, ids=[f"h{a}-kv{b}" for a, b in testing.GQA_HEADS])
def test_matches_reference(stage, request, dtype, head_dim, lengths, h_q, h_kv):
    s_q, s_k = lengths
    q, k, v = testing.random_qkv(2, s_q, s_k, h_q, h_kv, head_dim, dtype, seed=s_q * 1000 + s_k)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q))
    testing.assert_attention_matches(out, q, k, v, where=f"stage {request.module.STAGE.number}, {dtype}, "
                                     f"D={head_dim}, S_q={s_q}, S_k={s_k}, H_q={h_q}, H_kv={h_kv}")


@pytest.mark.gpu
def test_softmax_scale(stage, request):
    s_k = request.module.LENGTHS[-1][1]
    q, k, v = testing.random_qkv(1, 200, s_k, 2, 2, 128, torch.bfloat16, seed=7)
    out = stage.attention(q, k, v, softmax_scale=0.3)
    testing.assert_attention_matches(out, q, k, v, where="softmax_scale=0.3", softmax_scale=0.3)


@pytest.mark.gpu
def test_packed_qkv_strides(stage):
    """q, k, v sliced out of one packed qkv tensor: strides are not those of a fresh tensor."""
    qkv = torch.randn(2, 120, 3, 4, 64, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(dim=2)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q))
    testing.assert_attention_matches(out, q, k, v, where="packed qkv")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
def test_distinct_kv_tiles(stage, request, dtype):
    """Every KV tile shifted by a different amount: reading the wrong tile fails loudly."""
    s_k = max(b for _, b in request.module.LENGTHS)
    q, k, v = testing.random_qkv(2, 150, s_k, 4, 2, 128, dtype, seed=11, kv_tile_offsets=128)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q))
    testing.assert_attention_matches(out, q, k, v, where=f"KV tiles with distinct offsets, S_k={s_k}")


@pytest.mark.gpu
@pytest.mark.parametrize("magnitude", [30.0, 1e-3], ids=["large", "tiny"])
def test_large_logits(stage, request, magnitude):
    """Logits in the hundreds (exp overflows without the max subtraction) and near zero."""
    s_k = max(b for _, b in request.module.LENGTHS)
    q, k, v = testing.random_qkv(1, 130, s_k, 2, 2, 64, torch.float16, seed=5)
    q = (q.float() * magnitude).half()
    out = stage.attention(q, k, v, out=testing.poisoned_like(q))
    testing.assert_attention_matches(out, q, k, v, where=f"logits scaled by {magnitude}")
