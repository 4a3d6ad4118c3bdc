"""The CPU numerics catch the classic bugs: each is planted in a copy of a solution, whose checks must then fail.

The stage tests run the same checks on the solutions (and with --impl stages on the
learner's code), where they pass; here each check meets one bug it exists to catch.
"""

import cpu_numerics
import pytest
from mutations import (Delete, DropConjunct, DropFactor, DropIndexTerm, DropTerm, KeepArgument, MoveBefore, SetArgument,
                       SetTest, SetValue, Square, Unwrap, mutate)

from course.runtime import stages

# stage 8's tile order: 60 (batch, head) pairs in groups of 32, so the last group is short
SCHEDULE = dict(seqlen_q=1000, num_heads=20, num_batch=3, seqlen_k=777, head_dim=128, dtype_bytes=2, l2_bytes=50 << 20)

# stage 10's search: more sequences than one warp step takes, empty ones among them
LOCATE = [(i * 37) % 300 for i in range(75)]

# name: (stage, the function, the mutations that plant the bug in it, a check that must fail). The bugs are
# described by what they change, so that no test quotes a solution (tests/mutations.py).
PLANTED = {
    "double-scaling": (3, "online_softmax", [Square("correction", "scale_log2")],
                       lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96)),
    "row-sum-not-rescaled": (3, "online_softmax", [DropFactor("row_sum[r]", "correction")],
                             lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96)),
    "window-end-off-by-one": (4, "apply", [DropTerm("key_end", "1", nth=1)],
                              lambda m: cpu_numerics.check_masks(m, dict(window_size=(128, 128)), [(513, 513)])),
    "block-range-from-the-first-row": (4, "kv_block_range", [SetValue("last_row", "self.row0")],
                                       lambda m: cpu_numerics.check_masks(m, dict(causal=True), [(200, 700)])),
    "sink-tokens-not-exempt": (
        5, "outside_left_bound", [SetValue("outside", "outside", nth=1)],
        lambda m: cpu_numerics.check_masks(m, dict(window_size=(128, 0), num_sink_tokens=4), [(513, 1000)])),
    "sink-tiles-visited-twice": (
        5, "sink_block_count", [KeepArgument("count", "cutlass.min", 0, nth=1)],
        lambda m: cpu_numerics.check_masks(m, dict(causal=True, window_size=(0, -1), num_sink_tokens=1), [(300, 300)])),
    "sink-without-the-rescale": (5, "normalize_rows", [DropFactor("denominator", "rescale")],
                                 lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96, sink_logit=1.5)),
    "merge-weights-not-normalized": (6, "merge_weights", [DropFactor("return", "inv_total")],
                                     cpu_numerics.check_merge_weights),
    "lse-in-log2-units": (6, "normalize_rows", [DropFactor("lse[r]", "LN_2")],
                          lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96)),
    "one-thread-writes-lse": (6, "store_lse", [SetTest("mma_tidx == 0")], lambda m: cpu_numerics.check_store_lse(m, 300)),
    "counter-not-reset": (7, "arrive_and_elect_last", [Delete("cute.arch.store")], cpu_numerics.check_elect_last),
    "wrong-last-cta": (7, "arrive_and_elect_last", [DropTerm("is_last", "1")], cpu_numerics.check_elect_last),
    "acc-not-rescaled": (7, "online_softmax_update", [DropFactor("acc[h, i]", "correction")],
                         lambda m: cpu_numerics.check_fold_keys(m, 41)),
    "split-not-normalized": (7, "split_partial", [DropFactor("o[i]", "inv_total", nth=1)],
                             lambda m: cpu_numerics.check_split_partial(m, 41)),
    "combine-without-the-minus-inf-guard": (  # an empty sequence: every split empty
        7, "fold_in_split", [SetValue("safe_max", "new_max")], lambda m: cpu_numerics.check_combine(m, 0, 3, sink=False)),
    "fragment-acc-not-rescaled": (9, "online_softmax_update", [DropFactor("acc_o[(c, r), 0, nb]", "correction")],
                                  lambda m: cpu_numerics.check_fragment_softmax(m, (41, 40), logit_scale=30.0)),
    "fragment-sum-not-rescaled": (9, "online_softmax_update", [DropFactor("row_sum[r]", "correction")],
                                  lambda m: cpu_numerics.check_fragment_softmax(m, (41, 40), logit_scale=30.0)),
    "fragment-without-the-minus-inf-guard": (  # a row with no key yet: exp2(-inf - (-inf))
        9, "online_softmax_update", [SetValue("safe_max", "row_max[r]", nth=1)],
        lambda m: cpu_numerics.check_fragment_softmax(m, (0, 5))),
    "q-fragment-rows-collide": (9, "q_fragment", [DropIndexTerm(1)], lambda m: cpu_numerics.check_fragments(m, 128)),
    "k-fragment-key-blocks-collide": (9, "k_fragment", [DropIndexTerm(1)],
                                      lambda m: cpu_numerics.check_fragments(m, 64, "float8_e4m3fn")),
    "v-fragment-keys-collide": (9, "v_fragment", [DropIndexTerm(0)], lambda m: cpu_numerics.check_fragments(m, 256)),
    "last-group-of-heads-not-short": (8, "coords", [SetValue("heads_here", "group")],
                                      lambda m: cpu_numerics.check_schedule(m, **SCHEDULE, longest_first=False)),
    "group-ignores-l2": (8, "l2_group", [DropConjunct(1)],
                         lambda m: cpu_numerics.check_schedule(m, **dict(SCHEDULE, l2_bytes=1 << 20), longest_first=False)),
    "longest-first-forgotten": (8, "coords", [SetValue("m_block", "m_rank", nth=1)],
                                lambda m: cpu_numerics.check_schedule(m, **SCHEDULE, longest_first=True)),
    "diagonal-tiles-called-full": (8, "unmasked_steps", [SetValue("hi", "hi", nth=1)],  # S_k - S_q = 187: two cut
                                   lambda m: cpu_numerics.check_masks(m, dict(causal=True), [(513, 700)])),
    "left-cut-tiles-called-full": (8, "tile_is_partial", [SetValue("partial", "partial", nth=2)],
                                   lambda m: cpu_numerics.check_masks(m, dict(window_size=(300, 17)), [(513, 513)])),
    "keep-bits-count-one-column-per-pair": (8, "registers_before", [DropTerm("return", "cutlass.min(columns % 8, 2)")],
                                            lambda m: cpu_numerics.check_masks(m, dict(causal=True), [(300, 1000)])),
    "keep-bits-drop-the-sink-tokens": (
        8, "apply", [SetValue("outside", "outside", nth=1)],
        lambda m: cpu_numerics.check_masks(m, dict(window_size=(300, 17), num_sink_tokens=5), [(300, 1000)])),
    "locate-the-lane-before": (10, "locate", [SetValue("found", "31 - cute.arch.popc(past)")],
                               lambda m: cpu_numerics.check_locate(m, LOCATE)),
    "locate-start-is-the-end": (10, "locate", [DropTerm("batch_start", "count")],
                                lambda m: cpu_numerics.check_locate(m, LOCATE)),
    "locate-one-sequence-per-step": (10, "locate", [SetValue("batch", "batch + 1", nth=1)],
                                     lambda m: cpu_numerics.check_locate(m, LOCATE)),
    "q-tiles-from-the-last-key": (
        11, "m_block_range", [SetValue("first_row", "cutlass.max(self.key0 + self.tile_n - 1 - self.offset - self.right, 0)")],
        lambda m: cpu_numerics.check_key_tile_masks(m, dict(causal=True), [(300, 300)])),
    "q-tiles-start-one-row-late": (
        11, "m_block_range", [SetValue("first_row", "cutlass.max(self.key0 - self.offset - self.right + 1, 0)")],
        lambda m: cpu_numerics.check_key_tile_masks(m, dict(causal=True), [(64, 129)])),
    "q-tiles-end-one-row-short": (11, "m_block_range", [DropTerm("row_end", "1")],
                                  lambda m: cpu_numerics.check_key_tile_masks(m, dict(window_size=(70, -1)), [(3, 200)])),
    "sink-tile-not-seen-by-every-row": (
        11, "m_block_range", [SetValue("limit", "limit", nth=1)],
        lambda m: cpu_numerics.check_key_tile_masks(m, dict(window_size=(64, 0), num_sink_tokens=4), [(300, 300)])),
    "copy-before-the-buffer-is-empty": (2, "load_tile", [MoveBefore("cute.copy", "pipe.producer_acquire")],
                                        cpu_numerics.check_load_tile),
    "copy-on-no-barrier": (2, "load_tile", [SetArgument("cute.copy", "tma_bar_ptr", "None")],
                           cpu_numerics.check_load_tile),
    "tile-by-the-ring-index": (2, "load_tile", [SetArgument("cute.copy", 1, "tXgX[None, state.index]")],
                               cpu_numerics.check_load_tile),
    "always-buffer-zero": (2, "load_tile", [SetArgument("cute.copy", 2, "tXsX[None, 0]")],
                           cpu_numerics.check_load_tile),
    "block-table-read-past-the-keys": (10, "page_lookup", [Unwrap()],
                                       lambda m: cpu_numerics.check_load_paged_tile(m, 16, 300)),
    "page-by-the-lane-not-the-copy": (10, "load_paged_tile", [SetArgument("cute.arch.shuffle_sync", 1, "0")],
                                      lambda m: cpu_numerics.check_load_paged_tile(m, 16, 300)),
    "paged-copy-before-the-buffer-is-empty": (
        10, "load_paged_tile", [MoveBefore("pipe.producer_acquire", "pipe.producer_commit")],
        lambda m: cpu_numerics.check_load_paged_tile(m, 16, 300)),
    "gather-row-from-the-whole-warp": (
        10, "gather_paged_tile", [SetArgument("cute.arch.shuffle_sync", "mask_and_clamp", "31")],
        lambda m: cpu_numerics.check_gather_paged_tile(m, 16, 300)),
    "gather-block-table-read-past-the-keys": (10, "gather_paged_tile", [Unwrap()],
                                              lambda m: cpu_numerics.check_gather_paged_tile(m, 16, 300)),
    "gather-before-the-buffer-is-empty": (
        10, "gather_paged_tile", [MoveBefore("pipe.producer_acquire", "pipe.producer_commit")],
        lambda m: cpu_numerics.check_gather_paged_tile(m, 16, 300)),
    "gather-copies-the-key-past-the-end": (
        10, "gather_paged_tile", [SetArgument("zero_filled_copy", 3, "key <= seqlen_k")],
        lambda m: cpu_numerics.check_gather_paged_tile(m, 32, 200, head_dim=96, tile_n=96)),
    "score-gradient-without-d": (11, "probabilities_and_score_gradients", [DropTerm("dp[r, c]", "d")],
                                 cpu_numerics.check_score_gradients),
    "probabilities-without-the-lse": (11, "probabilities_and_score_gradients", [DropTerm("p[r, c]", "lse")],
                                      cpu_numerics.check_score_gradients),
}


@pytest.mark.compiles
@pytest.mark.parametrize("name", list(PLANTED))
def test_cpu_numerics_catch_a_planted_bug(name, module_from_source):
    number, function, bug, check = PLANTED[name]
    solution = stages.get(number).path("solutions").read_text()
    source = mutate(solution, function, *bug)
    assert source != solution
    module = module_from_source(f"planted_{name.replace('-', '_')}", source)
    with pytest.raises(AssertionError):
        check(module)


def test_the_planted_bugs_cover_every_stage_with_cpu_numerics():
    covered = {number for number, *_ in PLANTED.values()}
    assert covered >= {s.number for s in stages.STAGES if s.cpu_numerics and s.number >= 3}, (
        "plant at least one classic bug for every stage from 3 on whose TODOs the CPU numerics check")


def test_a_gpu_only_instruction_is_named_not_a_crash(module_from_source):
    """An instruction without a host stand-in would abort the host compiler (and pytest): the check names it."""
    source = mutate(stages.get(7).path("solutions").read_text(), "online_softmax_update",
                    SetValue("new_max", "-cute.arch.fmin(-new_max, -scores[h, u])", nth=1))
    module = module_from_source("planted_fmin", source)
    with pytest.raises(cpu_numerics.GpuOnlyInstruction, match=r"nvvm\.fmin at .*planted_fmin\.py:\d+"):
        cpu_numerics.check_fold_keys(module, 5)
