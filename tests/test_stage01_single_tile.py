"""Stage 1 checks: the shared prefill checks at S_k <= 128, and the limit that stage 2 lifts."""

import pytest

from course import stages, testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)
from prefill_checks import cpu_qkv

STAGE = stages.get(1)
LENGTHS = testing.SINGLE_TILE_LENGTHS


def test_long_kv_points_to_stage_2(stage):
    with pytest.raises(NotImplementedError, match="Stage 2"):
        stage.attention(*cpu_qkv(s_k=129))
