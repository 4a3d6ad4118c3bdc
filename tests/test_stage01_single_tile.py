"""Stage 1 checks: the shared prefill checks at S_k <= 128, and the limit that stage 2 lifts."""

import cpu_numerics
import pytest

from course.runtime import stages
from course import testing
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)
from prefill_checks import cpu_qkv

STAGE = stages.get(1)
LENGTHS = testing.SINGLE_TILE_LENGTHS


def test_long_kv_points_to_stage_2(stage):
    with pytest.raises(NotImplementedError, match="Stage 2"):
        stage.attention(*cpu_qkv(s_k=129))


@pytest.mark.compiles
@pytest.mark.parametrize("seqlen_k, logit_scale", [(32, 1.0), (20, 1.0), (32, 30.0), (7, 1e-3)],
                         ids=["full-tile", "keys-past-sk", "large-logits", "tiny-logits"])
def test_on_cpu_softmax_rows(stage, seqlen_k, logit_scale):
    """Your softmax_rows on the CPU, each thread with whole rows, then P V and normalize_rows, against the reference."""
    cpu_numerics.check_attend_rows(stage, n_tiles=1, seqlen_k=seqlen_k, logit_scale=logit_scale)
