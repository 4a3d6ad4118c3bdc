"""Stage 1 checks: validation, cross-compile (CPU) and numerics on a Hopper GPU."""

import pytest
import torch

from course import stages, testing

STAGE = stages.get(1)
DTYPES, HEAD_DIMS = testing.DTYPES, testing.HEAD_DIMS


@pytest.fixture(scope="module")
def stage(impl):
    return STAGE.load(impl)


def cpu_qkv(s_q=16, s_k=16, h_q=4, h_kv=4, d=64, dtype=torch.float16, b=1):
    return testing.random_qkv(b, s_q, s_k, h_q, h_kv, d, dtype, device="cpu")


# ---------------------------------------------------------------- validation (CPU)

@pytest.mark.parametrize("make, error, message", [
    (lambda: cpu_qkv(), ValueError, "CUDA"),
    (lambda: (cpu_qkv()[0], cpu_qkv()[1].float(), cpu_qkv()[2]), TypeError, "dtype"),
    (lambda: tuple(t.float() for t in cpu_qkv()), TypeError, "float16"),
    (lambda: (cpu_qkv()[0][0], cpu_qkv()[1], cpu_qkv()[2]), ValueError, "rank"),
    (lambda: cpu_qkv(h_q=6, h_kv=4), ValueError, "multiple of H_kv"),
    (lambda: cpu_qkv(d=96), ValueError, "head_dim 96"),
    (lambda: cpu_qkv(s_k=0), ValueError, "empty"),
    (lambda: (cpu_qkv()[0], cpu_qkv(d=128)[1][..., ::2], cpu_qkv()[2]), ValueError, "contiguous"),
    (lambda: (cpu_qkv()[0], cpu_qkv()[1], cpu_qkv(s_k=8)[2]), ValueError, "must match"),
], ids=["cpu-device", "dtype-mismatch", "fp32", "rank-3", "gqa-ratio", "head-dim", "s_k-0",
        "last-dim-stride", "k-v-shapes"])
def test_bad_input_is_rejected_before_launch(stage, make, error, message):
    q, k, v = make()
    with pytest.raises(error, match=message):
        stage.attention(q, k, v)


@pytest.mark.parametrize("feature, later_stage", [
    ({"causal": True}, 4), ({"window_size": (16, 0)}, 4),
    ({"sink_logits": torch.zeros(4)}, 5), ({"num_sink_tokens": 4}, 5), ({"return_lse": True}, 6),
])
def test_later_features_name_their_stage(stage, feature, later_stage):
    with pytest.raises(NotImplementedError, match=f"stage {later_stage}"):
        stage.attention(*cpu_qkv(), **feature)


def test_long_kv_points_to_stage_2(stage):
    with pytest.raises(NotImplementedError, match="Stage 2"):
        stage.attention(*cpu_qkv(s_k=129))


# ---------------------------------------------------------------- cross-compile (CPU)

@pytest.mark.parametrize("dtype, head_dim", [(d, h) for d in ("float16", "bfloat16") for h in HEAD_DIMS])
def test_cross_compiles_for_sm90a(stage, dtype, head_dim):
    report = stage.cross_compile_config(dtype, head_dim)
    # The Hopper data path must really be there: WGMMA, TMA, mbarriers.
    assert report.ptx_instructions["wgmma.mma_async"] > 0
    assert report.ptx_instructions["cp.async.bulk.tensor"] > 0
    assert report.ptx_instructions["mbarrier"] > 0
    if report.spill_bytes is not None:
        assert report.spill_bytes == 0, f"{report.name} spills {report.spill_bytes} bytes of registers"


# ---------------------------------------------------------------- numerics (Hopper GPU)

SHAPES, HEADS = testing.SINGLE_TILE_LENGTHS, testing.GQA_HEADS


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=["d64", "d128"])
@pytest.mark.parametrize("s_q, s_k", SHAPES, ids=[f"sq{a}-sk{b}" for a, b in SHAPES])
@pytest.mark.parametrize("h_q, h_kv", HEADS, ids=[f"h{a}-kv{b}" for a, b in HEADS])
def test_matches_reference(stage, dtype, head_dim, s_q, s_k, h_q, h_kv):
    q, k, v = testing.random_qkv(2, s_q, s_k, h_q, h_kv, head_dim, dtype, seed=s_q * 1000 + s_k)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q))
    testing.assert_attention_matches(out, q, k, v, where=f"stage 1, {dtype}, D={head_dim}, "
                                     f"S_q={s_q}, S_k={s_k}, H_q={h_q}, H_kv={h_kv}")


@pytest.mark.gpu
def test_softmax_scale_and_fresh_output(stage):
    q, k, v = testing.random_qkv(1, 200, 90, 2, 2, 128, torch.bfloat16, seed=7)
    out = stage.attention(q, k, v, softmax_scale=0.3)
    testing.assert_attention_matches(out, q, k, v, where="softmax_scale=0.3", softmax_scale=0.3)


@pytest.mark.gpu
def test_non_contiguous_heads(stage):
    """q, k, v sliced out of one packed qkv tensor: strides are not those of a fresh tensor."""
    qkv = torch.randn(2, 120, 3, 4, 64, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(dim=2)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q))
    testing.assert_attention_matches(out, q, k, v, where="packed qkv")
