"""Stage 4 checks: the shared prefill checks, then causal and sliding-window masks."""

import cpu_numerics
import pytest
import torch

from course.runtime import stages
from course.testing import reference, tile_models
from course import testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)

STAGE = stages.get(4)
LENGTHS = testing.MULTI_TILE_LENGTHS

MASKS = {  # every case the contract's mask semantics must get right, by name
    "causal": dict(causal=True),
    "window-0-0": dict(window_size=(0, 0)),
    "window-1-0": dict(window_size=(1, 0)),
    "window-0-1": dict(window_size=(0, 1)),
    "window-127-0": dict(window_size=(127, 0)),
    "window-128-128": dict(window_size=(128, 128)),
    "window-left-beyond-sk": dict(window_size=(5000, 0)),
    "window-asymmetric": dict(window_size=(300, 17)),
    "window-right-only": dict(window_size=(-1, 64)),
    "window-left-only": dict(window_size=(200, -1)),
    "causal-and-window": dict(causal=True, window_size=(150, -1)),
}
MASK_LENGTHS = [(200, 700), (513, 513), (700, 200), (1, 300)]  # S_q <, =, > S_k; one query row


@pytest.mark.compiles
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_on_cpu_kv_block_range_and_apply(stage, mask):
    """Your WindowMask on the CPU: apply on every register of every thread, and the tiles the kernel visits."""
    cpu_numerics.check_masks(stage, MASKS[mask], MASK_LENGTHS)


@pytest.mark.parametrize("s_q, s_k", [(130, 300), (300, 130), (256, 256), (5, 700)])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_block_range_covers_exactly_the_visible_tiles(mask, s_q, s_k):
    """Every visible key lies in its Q tile's KV block range, and both end tiles hold one."""
    visible = reference.visible_keys(s_q, s_k, **MASKS[mask])
    for m_block in range(-(-s_q // 128)):
        rows = visible[m_block * 128:(m_block + 1) * 128]
        n_min, n_max = tile_models.kv_block_range(m_block, s_q, s_k, **MASKS[mask])
        tiles = [n for n in range(-(-s_k // 128)) if rows[:, n * 128:(n + 1) * 128].any()]
        assert tiles == list(range(n_min, n_max)) or (not tiles and n_min >= n_max), (
            f"Q tile {m_block}: block range [{n_min}, {n_max}) but tiles {tiles} hold visible keys")


@pytest.mark.parametrize("s_q, s_k", MASK_LENGTHS)
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_masked_tile_model_matches_reference(mask, s_q, s_k):
    q, k, v = testing.random_qkv(1, s_q, s_k, 2, 1, 64, torch.float16, device="cpu", seed=s_q + s_k)
    out = tile_models.masked_online(q, k, v, **MASKS[mask])
    testing.assert_attention_matches(out, q, k, v, where=f"masked tile model, {mask}", **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", testing.HEAD_DIMS, ids=["d64", "d128"])
@pytest.mark.parametrize("s_q, s_k", MASK_LENGTHS, ids=[f"sq{a}-sk{b}" for a, b in MASK_LENGTHS])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_masks_match_reference(stage, request, mask, s_q, s_k, dtype, head_dim):
    q, k, v = testing.random_qkv(2, s_q, s_k, 8, 2, head_dim, dtype, seed=s_q * 7 + s_k)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q), **MASKS[mask])
    testing.assert_attention_matches(out, q, k, v, where=f"stage {request.module.STAGE.number}, {mask}, {dtype}, D={head_dim}, "
                                     f"S_q={s_q}, S_k={s_k}", **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.parametrize("h_q, h_kv", testing.GQA_HEADS, ids=[f"h{a}-kv{b}" for a, b in testing.GQA_HEADS])
@pytest.mark.parametrize("mask", ["causal", "window-asymmetric"])
def test_masks_with_gqa(stage, request, mask, h_q, h_kv):
    q, k, v = testing.random_qkv(2, 333, 1000, h_q, h_kv, 128, torch.bfloat16, seed=h_q)
    out = stage.attention(q, k, v, out=testing.poisoned_like(q), **MASKS[mask])
    testing.assert_attention_matches(out, q, k, v, where=f"stage {request.module.STAGE.number}, {mask}, H_q={h_q}, H_kv={h_kv}", **MASKS[mask])


@pytest.mark.gpu
def test_rows_without_visible_keys_are_zero(stage):
    """Causal with S_q > S_k: the first S_q - S_k rows see nothing and must be exactly 0, not NaN."""
    q, k, v = testing.random_qkv(1, 600, 100, 4, 4, 64, torch.float16, seed=1)
    out = stage.attention(q, k, v, causal=True, out=testing.poisoned_like(q))
    assert torch.isfinite(out).all()
    assert (out[:, :500] == 0).all()
    testing.assert_attention_matches(out, q, k, v, where="empty rows", causal=True)
