"""Stage 7 checks: the split-KV model, validation, cross-compile (CPU) and numerics on a Hopper GPU."""

import itertools
import math
from pathlib import Path

import cpu_numerics
import pytest
import torch

from course.runtime import stages
from course.testing import reference
from course import testing

STAGE = stages.get(7)


@pytest.fixture(scope="module")
def stage(impl):
    return STAGE.load(impl)


@pytest.fixture(scope="module")
def solution():
    return STAGE.load("solutions")


# ---------------------------------------------------------------- the algorithm in PyTorch (CPU)

MODEL_LENGTHS = [0, 1, 5, 63, 64, 65, 300]
MODEL_FEATURES = {
    "full": {},
    "window": {"window_size_left": 20},
    "window+sink-tokens": {"window_size_left": 20, "num_sink_tokens": 4},
    "window-0": {"window_size_left": 0},
    "sink-logits": {"sink_logits": True},
    "window-0+sink-logits": {"window_size_left": 0, "sink_logits": True},
}


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("features", MODEL_FEATURES.values(), ids=MODEL_FEATURES.keys())
def test_split_model_matches_reference_for_any_split_count(stage, page_size, features):
    """Splits, per-split partials (empty ones included) and the combine give the one-split answer."""
    inputs = testing.random_decode_inputs(MODEL_LENGTHS, 8, 2, 64, torch.float32, page_size=page_size,
                                          device="cpu", seed=5)
    features = dict(features)
    if features.pop("sink_logits", False):
        features["sink_logits"] = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 3
    ref_o, ref_lse = reference.decode_attention(**inputs, **features, return_lse=True)
    for num_splits in (1, 2, 3, 7, 50):
        o, lse = stage.split_kv_model(**inputs, **features, num_splits=num_splits)
        torch.testing.assert_close(o, ref_o, rtol=1e-6, atol=1e-6, msg=f"O with {num_splits} splits")
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"LSE -inf pattern, {num_splits} splits"
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite].float(), ref_lse[finite], rtol=1e-5, atol=1e-5)


def check_split_ranges(split_range, step: int, split_counts=(1, 2, 7, 33)):
    """``split_range(num_visible, num_splits, split)`` cuts the visible keys into consecutive ranges
    that start on whole iterations of ``step`` keys (shared with stage 9's test)."""
    for num_visible, num_splits in itertools.product([0, 1, step - 1, step, step + 1, 1000, 4097], split_counts):
        ranges = [split_range(num_visible, num_splits, s) for s in range(num_splits)]
        assert ranges[0][0] == 0 and ranges[-1][1] == num_visible
        for (b0, e0), (b1, e1) in zip(ranges, ranges[1:]):
            assert e0 == b1 and b0 <= e0 and b1 <= e1
        assert all(b % step == 0 or b == num_visible for b, _ in ranges), "splits start on whole iterations"


@pytest.mark.parametrize("heads", [4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_split_ranges_cover_the_visible_keys_once(stage, head_dim, heads):
    check_split_ranges(lambda n, splits, s: stage.split_range(n, splits, s, head_dim, heads),
                       stage.keys_per_iteration(head_dim, heads))


VISIBLE_KEY_CASES = [(10, -1, 0), (10, 3, 0), (10, 3, 2), (10, 3, 8), (10, 0, 0), (3, 5, 2), (0, 4, 2), (1, 0, 1)]


def check_visible_keys(visible_keys_of, seqlen: int, window: int, sinks: int):
    """The keys the kernel enumerates are exactly the reference mask's (shared with stage 9's test)."""
    mask = reference.decode_visible_keys(seqlen, window_size_left=window, num_sink_tokens=sinks)
    assert visible_keys_of(seqlen, window, sinks) == mask.nonzero().flatten().tolist()


@pytest.mark.parametrize("seqlen, window, sinks", VISIBLE_KEY_CASES)
def test_enumerated_keys_are_the_visible_keys(stage, seqlen, window, sinks):
    check_visible_keys(stage.visible_keys_of, seqlen, window, sinks)


def test_auto_split_count(stage):
    sms, heads = 132, 4
    resident = sms * stage.ctas_per_sm(heads)                       # CTAs that run at once
    assert stage.auto_num_splits(8, 8, stage.MIN_KEYS_PER_SPLIT, sms, heads) == 1  # short sequences: one split
    target = sms * stage.SPLIT_CTAS_PER_SM                          # few sequences: 2 CTAs on every SM
    one_long = stage.auto_num_splits(1, 8, 131072, sms, heads)
    assert one_long * 8 <= target < (one_long + 1) * 8
    assert stage.auto_num_splits(8, 8, 4096, sms, heads) * 64 <= target  # no SM gets 3 CTAs while others get 2
    big = stage.auto_num_splits(64, 8, 4096, sms, heads)            # a big batch: a well-filled last wave
    waves = 64 * 8 * big / resident
    assert big <= 4 and waves / math.ceil(waves) > 0.9
    assert stage.auto_num_splits(1, 8, 1024, sms, heads) <= 1024 // stage.MIN_KEYS_PER_SPLIT


# ---------------------------------------------------------------- your kernel's helpers on the CPU

@pytest.mark.compiles
@pytest.mark.parametrize("length, logit_scale", [(0, 1.0), (1, 1.0), (6, 1.0), (41, 1.0), (41, 30.0)])
def test_on_cpu_online_softmax_update(stage, length, logit_scale):
    """Your online_softmax_update over one key group's keys (and -inf past the end), against the reference."""
    cpu_numerics.check_fold_keys(stage, length, logit_scale=logit_scale)


@pytest.mark.compiles
@pytest.mark.parametrize("length", [0, 2, 41])
def test_on_cpu_split_partial(stage, length):
    """Your split_partial over 3 key groups (empty ones included), against the reference."""
    cpu_numerics.check_split_partial(stage, length)


@pytest.mark.compiles
@pytest.mark.parametrize("length, splits, sink", [(0, 3, False), (0, 3, True), (5, 4, True), (41, 3, False),
                                                   (41, 7, True)])
def test_on_cpu_fold_in_split_and_finish_combine(stage, length, splits, sink):
    """Your combine over the splits' partials (empty splits, the sink logit), against the reference."""
    cpu_numerics.check_combine(stage, length, splits, sink)


@pytest.mark.compiles
def test_on_cpu_arrive_and_elect_last(stage):
    """Your arrive_and_elect_last over 3 launches of 5 CTAs: one last CTA per launch, the counter back at 0."""
    cpu_numerics.check_elect_last(stage)


# ---------------------------------------------------------------- validation (CPU)

def cpu_inputs(lengths=(5, 9), h_q=4, h_kv=2, d=64, dtype=torch.float16, page_size=None):
    return testing.random_decode_inputs(list(lengths), h_q, h_kv, d, dtype, page_size=page_size, device="cpu")


def replaced(inputs, **changes):
    return {**inputs, **changes}


BAD_INPUTS = {
    "cpu-device": (lambda: cpu_inputs(), {}, ValueError, "CUDA"),
    "zero-length-is-valid": (lambda: cpu_inputs(lengths=(0, 3)), {}, ValueError, "CUDA"),
    "q-rank": (lambda: (i := cpu_inputs()) and replaced(i, q=i["q"][None, None]), {}, ValueError, "rank"),
    "draft-tokens-are-stage-9": (lambda: (i := cpu_inputs()) and replaced(i, q=i["q"][:, None].expand(2, 3, 4, 64)),
                                 {}, NotImplementedError, "stage 9"),
    "dtype-mismatch": (lambda: (i := cpu_inputs()) and replaced(i, q=i["q"].bfloat16()), {}, TypeError, "dtype"),
    "fp32": (lambda: cpu_inputs(dtype=torch.float32), {}, TypeError, "float16"),
    "head-dim": (lambda: cpu_inputs(d=72), {}, ValueError, "head_dim 72 is not supported"),
    "head-dim-96-is-stage-9": (lambda: cpu_inputs(d=96), {}, NotImplementedError, "head_dim 96 .* stage 9"),
    "split-head-dims-are-stage-9": (lambda: (i := cpu_inputs(d=192)) and replaced(i, v_cache=i["v_cache"][..., :128]),
                                    {}, NotImplementedError, "head_dim 192 for q and k with 128 for v .* stage 9"),
    "gqa-ratio": (lambda: cpu_inputs(h_q=6, h_kv=4), {}, ValueError, "multiple of H_kv"),
    "seqlens-int64": (lambda: (i := cpu_inputs()) and replaced(i, cache_seqlens=i["cache_seqlens"].long()), {},
                      TypeError, "int32"),
    "seqlens-count": (lambda: (i := cpu_inputs()) and replaced(i, cache_seqlens=i["cache_seqlens"][:1]), {},
                      ValueError, "one per sequence"),
    "seqlen-too-long": (lambda: (i := cpu_inputs()) and replaced(i, cache_seqlens=torch.tensor([5, 99], dtype=torch.int32)),
                        {"check_lengths": True}, ValueError, "larger than the cache"),
    "seqlen-negative": (lambda: (i := cpu_inputs()) and replaced(i, cache_seqlens=torch.tensor([5, -1], dtype=torch.int32)),
                        {"check_lengths": True}, ValueError, "negative"),
    "cache-batch": (lambda: (i := cpu_inputs()) and replaced(i, k_cache=i["k_cache"][:1], v_cache=i["v_cache"][:1]), {},
                    ValueError, "block_table"),
    "k-v-shapes": (lambda: (i := cpu_inputs()) and replaced(i, v_cache=i["v_cache"][:, :4]), {}, ValueError, "must match"),
    "block-table-dtype": (lambda: (i := cpu_inputs(page_size=16)) and replaced(i, block_table=i["block_table"].long()),
                          {}, TypeError, "int32"),
    "block-table-rows": (lambda: (i := cpu_inputs(page_size=16)) and replaced(i, block_table=i["block_table"][:1]),
                         {}, ValueError, "one per sequence"),
    "block-table-page": (lambda: (i := cpu_inputs(page_size=16)) and replaced(
        i, block_table=torch.full_like(i["block_table"], 1000)), {"check_lengths": True}, ValueError, "not a page"),
    "page-size": (lambda: cpu_inputs(page_size=48), {}, ValueError, "page size 48"),
    "window": (lambda: cpu_inputs(), {"window_size_left": -2}, ValueError, "window_size_left"),
    "sink-tokens": (lambda: cpu_inputs(), {"num_sink_tokens": -1}, ValueError, "num_sink_tokens"),
    "num-splits": (lambda: cpu_inputs(), {"num_splits": -1}, ValueError, "num_splits"),
    "num-splits-float": (lambda: cpu_inputs(), {"num_splits": 2.0}, ValueError, "num_splits"),
    "sink-logits": (lambda: cpu_inputs(), {"sink_logits": torch.zeros(3)}, ValueError, r"\[4\]"),
    "out-shape": (lambda: cpu_inputs(), {"out": torch.zeros(2, 4, 32, dtype=torch.float16)}, ValueError, "out"),
}


@pytest.mark.parametrize("make, options, error, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_rejected_before_launch(stage, make, options, error, message):
    with pytest.raises(error, match=message):
        stage.decode_attention(**make(), **options)


# ---------------------------------------------------------------- cross-compile (CPU)

CONFIGS = STAGE.load("solutions").KERNEL_CONFIGS


def test_compile_matrix_covers_every_option(solution):
    layouts = {(c.dtype, c.head_dim, c.page_size) for c in CONFIGS}
    assert layouts == {(t, d, p) for t in ("float16", "bfloat16") for d in solution.HEAD_DIMS
                       for p in (0, *solution.PAGE_SIZES)}
    for d in solution.HEAD_DIMS:
        assert {c.heads for c in CONFIGS if c.head_dim == d} == set(solution.HEADS_PER_CTA)
        assert {(c.has_sink, c.write_lse) for c in CONFIGS if c.head_dim == d} == {(a, b) for a in (0, 1) for b in (0, 1)}


@pytest.mark.compiles
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_cross_compiles_for_sm90a(stage, config):
    report = stage.cross_compile_config(config, keep=True)
    ptx = Path(report.artifacts["ptx"]).read_text()
    # The decode data path: 16-byte cp.async copies into the ring, shuffle reductions, the last-block protocol.
    testing.assert_split_kv_decode_in_ptx(ptx)
    testing.assert_in_ptx(ptx, "cp.async.wait_group", "the ring waits for its copies by group")
    testing.assert_in_ptx(ptx, "shfl.sync.bfly", "the row max and sum reduce with butterfly shuffles")
    testing.assert_in_ptx(ptx, "ld.global.v4", "the combine reads the partial O with 16-byte loads")
    assert report.spill_bytes == 0, f"{report.name} spills {report.spill_bytes} bytes of registers"
    assert report.shared_bytes == stage.shared_bytes(config.head_dim, config.heads), (
        f"{report.name} uses {report.shared_bytes} bytes of shared memory; shared_bytes() says "
        f"{stage.shared_bytes(config.head_dim, config.heads)}, and the automatic split count relies on it: update it")
    assert report.registers <= stage.REGISTERS_PER_THREAD[config.heads], (
        f"{report.name} uses {report.registers} registers per thread; the automatic split count assumes at "
        f"most {stage.REGISTERS_PER_THREAD[config.heads]} (REGISTERS_PER_THREAD): update it")


# ---------------------------------------------------------------- numerics (Hopper GPU)

LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64, "paged256": 256}
RAGGED = list(testing.DECODE_LENGTHS)  # 1, 2, 127, 128, 4097, 32768, 131072 in one batch


def check(stage, inputs, where, *, return_lse=False, **options):
    features = {k: v for k, v in options.items() if k not in ("num_splits",)}
    result = stage.decode_attention(**inputs, **options, return_lse=return_lse,
                                    out=testing.poisoned_like(inputs["q"]))
    out, lse = result if return_lse else (result, None)
    return testing.assert_decode_matches(out, inputs, where, lse=lse, **features), out


RAGGED_CASES = [("float16", 64, "contiguous"), ("float16", 128, "paged64"), ("float16", 256, "paged16"),
                ("bfloat16", 64, "paged256"), ("bfloat16", 128, "contiguous"), ("bfloat16", 256, "paged64")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, layout", RAGGED_CASES, ids=[f"{a}-d{b}-{c}" for a, b, c in RAGGED_CASES])
def test_ragged_batch_matches_reference(stage, dtype, head_dim, layout):
    """Lengths 1 ... 131072 in one batch, auto split count, LSE too."""
    inputs = testing.random_decode_inputs(RAGGED, 8, 2, head_dim, getattr(torch, dtype),
                                          page_size=LAYOUTS[layout], seed=head_dim)
    check(stage, inputs, f"{dtype}, D={head_dim}, {layout}, lengths {RAGGED}", return_lse=True)


# (H_q, H_kv, layout): ratios 1, 4, 8; a group of 3 (in a CTA of 4 heads); 16 (two CTAs of 8 heads).
GQA = [(4, 4, "contiguous"), (8, 2, "paged64"), (8, 1, "contiguous"), (6, 2, "contiguous"), (16, 1, "paged64")]


@pytest.mark.gpu
@pytest.mark.parametrize("h_q, h_kv, layout", GQA, ids=[f"h{a}-kv{b}-{c}" for a, b, c in GQA])
def test_gqa_groups(stage, h_q, h_kv, layout):
    inputs = testing.random_decode_inputs([1, 127, 128, 4097], h_q, h_kv, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=h_q * 10 + h_kv)
    check(stage, inputs, f"H_q={h_q}, H_kv={h_kv}, {layout}", num_splits=3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_every_split_count_gives_the_same_result(stage, layout):
    inputs = testing.random_decode_inputs([2, 128, 4097, 32768], 8, 2, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=11)
    results = {}
    for num_splits in (1, 2, 7, 0):
        _, results[num_splits] = check(stage, inputs, f"{layout}, num_splits={num_splits}", num_splits=num_splits)
    for num_splits, out in results.items():
        torch.testing.assert_close(out, results[1], rtol=2e-3, atol=2e-3,
                                   msg=f"num_splits={num_splits} differs from one split")


@pytest.mark.gpu
def test_back_to_back_launches_reset_the_counters(stage):
    """200 launches in a row: a counter left non-zero would stop the next launch from combining."""
    inputs = testing.random_decode_inputs([4097, 300, 1], 8, 2, 128, torch.float16, page_size=64, seed=3)
    outs = [stage.decode_attention(**inputs, num_splits=7, out=testing.poisoned_like(inputs["q"]))
            for _ in range(200)]
    testing.assert_decode_matches(outs[0], inputs, "launch 1 of 200")
    for i, out in enumerate(outs):
        assert torch.equal(out, outs[0]), f"launch {i + 1} of 200 differs from the first (NaN: never combined)"


@pytest.mark.gpu
def test_cuda_graph_replay(stage):
    inputs = testing.random_decode_inputs([4097, 32768, 5], 8, 2, 128, torch.float16, page_size=64, seed=4)
    out = testing.poisoned_like(inputs["q"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage.decode_attention(**inputs, num_splits=5, out=out)  # compile, allocate the counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        stage.decode_attention(**inputs, num_splits=5, out=out)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for replay in range(20):
        inputs["q"].copy_(torch.randn(inputs["q"].shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if replay in (0, 1, 19):
            testing.assert_decode_matches(out, inputs, f"CUDA graph replay {replay + 1}")
    assert not torch.isnan(out).any()


FEATURE_CASES = {  # name: (layout, features)
    "window-100": ("contiguous", {"window_size_left": 100}),
    "window-0": ("paged64", {"window_size_left": 0}),
    "window-5000+4-sink-tokens": ("contiguous", {"window_size_left": 5000, "num_sink_tokens": 4}),
    "sink-logits": ("paged64", {"sink_logits": True}),
    "window-100+sinks": ("contiguous", {"window_size_left": 100, "num_sink_tokens": 2, "sink_logits": True}),
    "softmax-scale": ("paged64", {"softmax_scale": 0.3}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout, features", FEATURE_CASES.values(), ids=FEATURE_CASES.keys())
def test_windows_sinks_and_lse(stage, layout, features):
    inputs = testing.random_decode_inputs([0, 1, 127, 4097, 32768], 8, 2, 128, torch.float16,
                                          page_size=LAYOUTS[layout], seed=21)
    features = dict(features)
    if features.pop("sink_logits", False):
        features["sink_logits"] = torch.randn(8, device="cuda") * 3
    check(stage, inputs, f"{layout}, {features}", return_lse=True, num_splits=4, **features)


@pytest.mark.gpu
def test_empty_sequences(stage):
    """Length 0: O = 0 and LSE = -inf, or the sink logit when there is one; never NaN."""
    inputs = testing.random_decode_inputs([0, 5, 0], 8, 2, 128, torch.float16, seed=8)
    out, lse = stage.decode_attention(**inputs, return_lse=True, num_splits=3, out=testing.poisoned_like(inputs["q"]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[[0, 2]]).all()
    sink = torch.linspace(-2.0, 2.0, 8, device="cuda")
    out, lse = stage.decode_attention(**inputs, return_lse=True, sink_logits=sink,
                                      out=testing.poisoned_like(inputs["q"]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(lse[0], sink)
    testing.assert_decode_matches(out, inputs, "empty sequences with sinks", lse=lse, sink_logits=sink)
    sink[::2] = -math.inf  # a sink that never takes weight, on an empty sequence: still 0 and -inf, not NaN
    out, lse = stage.decode_attention(**inputs, return_lse=True, sink_logits=sink,
                                      out=testing.poisoned_like(inputs["q"]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0, ::2]).all()
    testing.assert_decode_matches(out, inputs, "empty sequences with -inf sinks", lse=lse, sink_logits=sink)


@pytest.mark.gpu
def test_large_logits_do_not_overflow(stage):
    inputs = testing.random_decode_inputs([3000, 64], 4, 2, 128, torch.bfloat16, seed=9)
    inputs["q"].mul_(30)
    check(stage, inputs, "logits around 300", return_lse=True, num_splits=5)
