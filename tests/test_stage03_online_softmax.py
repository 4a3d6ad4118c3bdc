"""Stage 3 checks: the shared prefill checks at any S_k, and the online-softmax tile model."""

import cpu_numerics
import pytest
import torch

from course.runtime import stages
from course.testing import tile_models
from course import testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)

STAGE = stages.get(3)
LENGTHS = testing.MULTI_TILE_LENGTHS


@pytest.mark.parametrize("s_q, s_k", [(64, 1), (100, 128), (70, 129), (33, 300)])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
def test_online_tile_model_matches_reference(s_q, s_k, dtype):
    q, k, v = testing.random_qkv(1, s_q, s_k, 4, 2, 64, dtype, device="cpu", seed=s_k)
    testing.assert_attention_matches(tile_models.online(q, k, v), q, k, v, where="online tile model")


def test_online_equals_two_pass():
    """Same tiles, same rounding of P: the two algorithms agree to float32 rounding."""
    q, k, v = testing.random_qkv(2, 90, 700, 4, 4, 64, torch.float32, device="cpu", seed=3)
    torch.testing.assert_close(tile_models.online(q, k, v), tile_models.two_pass(q, k, v), rtol=1e-5, atol=1e-5)


def test_double_scaling_is_caught():
    """Multiplying the max difference by scale_log2 twice is wrong, and these inputs show it."""
    q, k, v = testing.random_qkv(1, 64, 300, 2, 2, 64, torch.float16, device="cpu", seed=9)
    assert testing.compare_with_reference(tile_models.online(q, k, v), q, k, v).ok
    assert not testing.compare_with_reference(tile_models.online(q, k, v, bug="double_scale"), q, k, v).ok


@pytest.mark.compiles
@pytest.mark.parametrize("case", list(cpu_numerics.MULTI_TILE_ROW_CASES))
def test_on_cpu_online_softmax(stage, case):
    """Your online_softmax on the CPU over 3 tiles of keys, each thread with whole rows, against the reference."""
    seqlen_k, logit_scale = cpu_numerics.MULTI_TILE_ROW_CASES[case]
    cpu_numerics.check_attend_rows(stage, n_tiles=3, seqlen_k=seqlen_k, logit_scale=logit_scale)
