"""The CPU numerics catch the classic bugs: each is planted in a copy of a solution, whose checks must then fail.

The stage tests run the same checks on the solutions (and with --impl stages on the
learner's code), where they pass; here each check meets one bug it exists to catch.
"""

import cpu_numerics
import pytest

from course.runtime import stages

# stage 8's tile order: 60 (batch, head) pairs in groups of 32, so the last group is short
SCHEDULE = dict(seqlen_q=1000, num_heads=20, num_batch=3, seqlen_k=777, head_dim=128, dtype_bytes=2, l2_bytes=50 << 20)

# name: (stage, solution text, the bug in its place, a check that must fail)
PLANTED = {
    "double-scaling": (
        3, "correction = cute.math.exp2((row_max[r] - new_max) * scale_log2, fastmath=True)",
        "correction = cute.math.exp2((row_max[r] - new_max) * scale_log2 * scale_log2, fastmath=True)",
        lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96)),
    "row-sum-not-rescaled": (
        3, "row_sum[r] = row_sum[r] * correction + thread_sum", "row_sum[r] = row_sum[r] + thread_sum",
        lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96)),
    "window-end-off-by-one": (
        4, "key_end = cutlass.min(key_end, row + self.offset + self.right + 1)",
        "key_end = cutlass.min(key_end, row + self.offset + self.right)",
        lambda m: cpu_numerics.check_masks(m, dict(window_size=(128, 128)), [(513, 513)])),
    "block-range-from-the-first-row": (
        4, "last_row = cutlass.min(self.row0 + TILE_M, self.seqlen_q) - 1", "last_row = self.row0",
        lambda m: cpu_numerics.check_masks(m, dict(causal=True), [(200, 700)])),
    "sink-tokens-not-exempt": (
        5, "outside = outside & (key >= self.num_sink_tokens)", "outside = outside",
        lambda m: cpu_numerics.check_masks(m, dict(window_size=(128, 0), num_sink_tokens=4), [(513, 1000)])),
    "sink-tiles-visited-twice": (
        5, "count = cutlass.min((self.num_sink_tokens + TILE_N - 1) // TILE_N, n_block_min)",
        "count = (self.num_sink_tokens + TILE_N - 1) // TILE_N",
        lambda m: cpu_numerics.check_masks(m, dict(causal=True, window_size=(0, -1), num_sink_tokens=1), [(300, 300)])),
    "sink-without-the-rescale": (
        5, "denominator = row_sum[r] * rescale + ", "denominator = row_sum[r] + ",
        lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96, sink_logit=1.5)),
    "merge-weights-not-normalized": (
        6, "return e_a * inv_total, e_b * inv_total, lse", "return e_a, e_b, lse",
        cpu_numerics.check_merge_weights),
    "lse-in-log2-units": (
        6, "lse[r] = (top + cute.math.log2(denominator, fastmath=False)) * LN_2",
        "lse[r] = top + cute.math.log2(denominator, fastmath=False)",
        lambda m: cpu_numerics.check_attend_rows(m, n_tiles=3, seqlen_k=96)),
    "one-thread-writes-lse": (
        6, "if mma_tidx % 4 == 0:", "if mma_tidx == 0:", lambda m: cpu_numerics.check_store_lse(m, 300)),
    "counter-not-reset": (
        7, 'cute.arch.store(counter, Int32(0), sem="relaxed", scope="gpu")', "pass", cpu_numerics.check_elect_last),
    "wrong-last-cta": (
        7, "is_last = arrived_before == num_splits - 1", "is_last = arrived_before == num_splits",
        cpu_numerics.check_elect_last),
    "acc-not-rescaled": (
        7, "acc[h, i] = acc[h, i] * correction", "acc[h, i] = acc[h, i]",
        lambda m: cpu_numerics.check_fold_keys(m, 41)),
    "split-not-normalized": (
        7, "    for i in cutlass.range_constexpr(4):\n        o[i] = o[i] * inv_total",
        "    for i in cutlass.range_constexpr(4):\n        o[i] = o[i]",
        lambda m: cpu_numerics.check_split_partial(m, 41)),
    "combine-without-the-minus-inf-guard": (
        7, "    new_max = cute.arch.fmax(state[0], lse)\n"
           "    safe_max = Float32(cutlass.select_(new_max == -Float32.inf, Float32(0.0), new_max))",
        "    new_max = cute.arch.fmax(state[0], lse)\n    safe_max = new_max",
        lambda m: cpu_numerics.check_combine(m, 0, 3, sink=False)),  # an empty sequence: every split empty
    "last-group-of-heads-not-short": (
        8, "heads_here = cutlass.min(group, self.num_pairs - section * group)", "heads_here = group",
        lambda m: cpu_numerics.check_schedule(m, **SCHEDULE, longest_first=False)),
    "group-ignores-l2": (
        8, "while group * 2 <= self.num_pairs and group * 2 * self.kv_blocks <= self.l2_kv_blocks:",
        "while group * 2 <= self.num_pairs:",
        lambda m: cpu_numerics.check_schedule(m, **dict(SCHEDULE, l2_bytes=1 << 20), longest_first=False)),
    "longest-first-forgotten": (
        8, "m_block = self.num_m_blocks - 1 - m_rank", "m_block = m_rank",
        lambda m: cpu_numerics.check_schedule(m, **SCHEDULE, longest_first=True)),
}


def plant(source: str, correct: str, bug: str) -> str:
    """``source`` with the one occurrence of ``correct`` in its code (not in a comment: hints quote code) replaced."""
    code = "\n".join(" " * len(line) if line.lstrip().startswith("#") else line for line in source.split("\n"))
    assert code.count(correct) == 1, (f"the code this bug replaces must appear once; it appears {code.count(correct)} "
                                      f"times: update PLANTED\n{correct}")
    at = code.index(correct)
    return source[:at] + bug + source[at + len(correct):]


@pytest.mark.compiles
@pytest.mark.parametrize("name", list(PLANTED))
def test_cpu_numerics_catch_a_planted_bug(name, module_from_source):
    number, correct, bug, check = PLANTED[name]
    source = plant(stages.get(number).path("solutions").read_text(), correct, bug)
    module = module_from_source(f"planted_{name.replace('-', '_')}", source)
    with pytest.raises(AssertionError):
        check(module)


def test_the_planted_bugs_cover_every_stage_with_cpu_numerics():
    covered = {number for number, *_ in PLANTED.values()}
    assert covered >= {s.number for s in stages.STAGES if s.cpu_numerics and s.number >= 3}, (
        "plant at least one classic bug for every stage from 3 on whose TODOs the CPU numerics check")


def test_a_gpu_only_instruction_is_named_not_a_crash(module_from_source):
    """An instruction without a host stand-in would abort the host compiler (and pytest): the check names it."""
    correct = "new_max = cute.arch.fmax(new_max, scores[h, u])"
    source = plant(stages.get(7).path("solutions").read_text(), correct, "new_max = -cute.arch.fmin(-new_max, -scores[h, u])")
    module = module_from_source("planted_fmin", source)
    with pytest.raises(cpu_numerics.GpuOnlyInstruction, match=r"nvvm\.fmin at .*planted_fmin\.py:\d+"):
        cpu_numerics.check_fold_keys(module, 5)
