"""The CPU synchronization checks catch the classic barrier, wait-group and pipeline bugs.

Each bug is planted in a copy of a solution, and the check that exists for it must fail
there with the message a learner would read (the solutions pass: the stage tests run the
same checks). docs/workshop/troubleshooting.md lists this catalogue.
"""

import cpu_sync
import pytest
from mutations import Delete, MoveBefore, SetArgument, SetValue, Unwrap, mutate

from course.runtime import stages

WAIT, STORE_P, RESCALE_O = "warpgroup.wait_group", "rP.store", "rescale_rows"
WAIT_K, RELEASE_K = "pipeline_k.consumer_wait", "pipeline_k.consumer_release"
WAIT_V, RELEASE_V = "pipeline_v.consumer_wait", "pipeline_v.consumer_release"
ARRIVE = "cute.arch.barrier_arrive"

# name: (the function, the mutations that plant the bug in it, what the message must say). The bugs are
# described by the calls they touch, so that no test quotes a solution (tests/mutations.py).
STAGE8_BUGS = {
    # the four a learner planted in a trial of stage 8, which only a GPU caught before
    "softmax-waits-for-p-v-too": ("overlapped_step", [SetArgument(WAIT, 0, "0")], "nothing overlaps it"),
    "p-written-under-its-p-v": ("overlapped_step", [MoveBefore(STORE_P, WAIT, anchor_nth=1)], "writes P while the WGMMA"),
    "turn-passed-to-itself": ("pingpong_pass", [SetArgument(ARRIVE, "barrier_id", "int(NamedBarrier.SCHEDULER_WG1) + mma_wg")],
                              "deadlock"),
    "every-warpgroup-pre-arms": ("pingpong_start", [Unwrap(), SetArgument(ARRIVE, "barrier_id",
                                                                          "int(NamedBarrier.SCHEDULER_WG1) + mma_wg")],
                                 "nobody waiting"),
    # more classics
    "o-rescaled-under-its-p-v": ("overlapped_step", [MoveBefore(RESCALE_O, WAIT, anchor_nth=1)], "writes O while the WGMMA"),
    "k-released-before-s-is-done": ("overlapped_step", [MoveBefore(RELEASE_K, WAIT)], "may still read it"),
    "v-released-before-p-v-is-done": ("overlapped_step", [MoveBefore(RELEASE_V, WAIT, anchor_nth=1)], "may still read it"),
    "turn-never-passed": ("overlapped_step", [Delete("pingpong_pass")], "deadlock"),
    "gemms-before-the-turn": ("overlapped_step", [MoveBefore("pingpong_wait", "pingpong_pass")],
                              "outside the warpgroup's turn"),
    "turn-passed-back-and-forth": ("pingpong_pass", [SetArgument(ARRIVE, "barrier_id",
                                                                  "int(NamedBarrier.SCHEDULER_WG1) + 1 - mma_wg")],
                                   "deadlock"),  # right for two warpgroups only: D = 64 to 96 run three
    "scheduler-barrier-counts-half": ("pingpong_start", [SetArgument(ARRIVE, "number_of_threads", "128")], "threads here"),
    "v-never-waited-for": ("overlapped_step", [Delete(WAIT_V)], "without waiting"),
}

STAGE2_BUGS = {
    "k-released-before-its-gemm-is-done": ("tile_scores", [MoveBefore(RELEASE_K, WAIT)], "may still read it"),
    "no-wait-for-the-gemm": ("tile_scores", [Delete(WAIT)], "may still read it"),
    "v-released-before-p-v-is-done": ("second_pass_accumulate", [MoveBefore(RELEASE_V, WAIT)], "may still read it"),
    "k-used-before-the-tma-landed": ("tile_scores", [Delete(WAIT_K)], "without waiting"),
    "k-state-not-advanced": ("first_pass_row_max", [Delete("k_state.advance")], "not advanced once per tile"),
    "v-state-not-advanced": ("second_pass_accumulate", [Delete("v_state.advance")], "not advanced once per tile"),
}


STAGE10_BUGS = {
    "first-k-tile-never-loaded": ("load", [Delete("load_kv_tile")], "waiting forever"),
    "last-v-tile-never-loaded": ("load", [Delete("load_kv_tile", nth=3)], "waiting forever"),
    "k-state-not-advanced-in-the-loop": ("load", [Delete("k_state.advance", nth=1)], "next state"),
    "q-loaded-by-every-producer-warp": ("load", [SetValue("loads_q", "True", nth=1)], "only warp 0 may"),
    "v-loaded-from-the-next-tiles-pages": ("load", [SetArgument("load_kv_tile", 7, "k_page", nth=2)],
                                           "live in its own pages"),
}


def check_varlen_producer_every_way(module):
    """Stage 10's producer with packed K/V, TMA copies per page, and the gather (warps 0 and 1: Q by warp 0)."""
    for page_rows, gather, warp in ((0, False, 0), (16, False, 0), (16, True, 0), (16, True, 1)):
        cpu_sync.check_varlen_producer(module, page_rows=page_rows, gather=gather, warp=warp)


def check_stage8_every_warpgroup_count(module):
    for num_wgs in (2, 3):  # TILES uses both
        cpu_sync.check_stage8(module, num_wgs=num_wgs)


CHECKS = {8: check_stage8_every_warpgroup_count, 2: cpu_sync.check_stage2, 10: check_varlen_producer_every_way}
BUGS = [(8, name, *bug) for name, bug in STAGE8_BUGS.items()] + [(2, name, *bug) for name, bug in STAGE2_BUGS.items()] + \
    [(10, name, *bug) for name, bug in STAGE10_BUGS.items()]


@pytest.mark.parametrize("number, name, function, bug, message", BUGS, ids=[f"stage{b[0]}-{b[1]}" for b in BUGS])
def test_cpu_sync_catches_a_planted_bug(number, name, function, bug, message, module_from_source):
    source = mutate(stages.get(number).path("solutions").read_text(), function, *bug)
    module = module_from_source(f"planted_sync_{name.replace('-', '_')}", source)
    with pytest.raises(cpu_sync.SyncError, match=message) as caught:
        CHECKS[number](module)
    assert f"planted_sync_{name.replace('-', '_')}.py:" in str(caught.value), "the message names the line"




def test_the_troubleshooting_page_lists_every_planted_bug():
    page = (stages.ROOT / "docs" / "workshop" / "troubleshooting.md").read_text()
    missing = [name for _, name, *_ in BUGS if f"`{name}`" not in page]
    assert not missing, f"docs/workshop/troubleshooting.md does not list {missing} in its catalogue of synchronization bugs"
