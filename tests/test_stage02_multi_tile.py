"""Stage 2 checks: the shared prefill checks at any S_k, and the two-pass tile model."""

import cpu_numerics
import cpu_sync
import pytest
import torch

from course.runtime import stages
from course.testing import tile_models
from course import testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)

STAGE = stages.get(2)
LENGTHS = testing.MULTI_TILE_LENGTHS


@pytest.mark.parametrize("s_q, s_k", [(64, 1), (100, 128), (70, 129), (33, 300)])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
def test_two_pass_tile_model_matches_reference(s_q, s_k, dtype):
    q, k, v = testing.random_qkv(1, s_q, s_k, 4, 2, 64, dtype, device="cpu", seed=s_k)
    testing.assert_attention_matches(tile_models.two_pass(q, k, v), q, k, v, where="two-pass tile model")


def test_distinct_tiles_catch_a_pinned_tile_index():
    """The inputs of test_distinct_kv_tiles expose a loader that always reads KV tile 0."""
    q, k, v = testing.random_qkv(1, 64, 300, 2, 2, 64, torch.float16, device="cpu", kv_tile_offsets=128)
    assert testing.compare_with_reference(tile_models.two_pass(q, k, v), q, k, v).ok
    assert not testing.compare_with_reference(tile_models.two_pass(q, k, v, bug="tile0"), q, k, v).ok


@pytest.mark.compiles
@pytest.mark.parametrize("case", list(cpu_numerics.MULTI_TILE_ROW_CASES))
def test_on_cpu_update_row_max_and_exponentiate_rows(stage, case):
    """Your two passes on the CPU over 3 tiles of keys, each thread with whole rows, against the reference."""
    seqlen_k, logit_scale = cpu_numerics.MULTI_TILE_ROW_CASES[case]
    cpu_numerics.check_attend_rows(stage, n_tiles=3, seqlen_k=seqlen_k, logit_scale=logit_scale)


def test_on_cpu_load_tile(stage):
    """Your load_tile as plain Python with a recording pipeline and TMA copy (tests/cpu_numerics.py): one
    producer_acquire of the step's state, then KV tile n_block into that state's buffer, on its full barrier."""
    cpu_numerics.check_load_tile(stage)


def test_on_cpu_synchronization(stage):
    """Your tile_scores and passes, recorded on the CPU and replayed in a model of the hardware's rules: each K
    and V buffer read only after its wait and released once, after the WGMMAs reading it (tests/cpu_sync.py)."""
    cpu_sync.check_stage2(stage)
