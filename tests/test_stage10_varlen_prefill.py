"""Stage 10 checks: every prefill check of stages 1-8 on the variable-length kernel (``attention`` runs
[B, S, H, D] as B packed sequences), then what packing and paging add: ragged batches with sequences of
0, 1 and tile multiples +- 1 rows, packed, with seqused_k and paged K/V (cache slots past a sequence
NaN), every head dim, the masks, sinks and LSE per sequence, the validation of the new arguments,
identical bits over 200 launches and CUDA-graph replay with other lengths.
"""

import cpu_numerics
import cpu_sync
import pytest
import torch

from course import testing
from course.runtime import stages, validation, varlen
from prefill_checks import *  # noqa: F401,F403  (the shared checks, collected here)
from test_stage04_masking import test_masks_match_reference, test_masks_with_gqa  # noqa: F401
from test_stage04_masking import test_rows_without_visible_keys_are_zero  # noqa: F401
from test_stage05_sinks import test_extreme_sink_logits, test_only_sink_token_visible  # noqa: F401
from test_stage05_sinks import test_sinks_match_reference  # noqa: F401
from test_stage06_lse import test_lse_matches_reference  # noqa: F401
from test_stage08_fa3_prefill import test_every_head_dim, test_many_tiles_per_cta  # noqa: F401

STAGE = stages.get(10)
LENGTHS = testing.MULTI_TILE_LENGTHS


# ---------------------------------------------------------------- validation (CPU)

def cpu_varlen(lengths_q=(5, 3), lengths_k=(7, 2), page_size=None, **changes):
    inputs = testing.random_varlen_inputs(lengths_q, lengths_k, 4, 2, 64, torch.float16, page_size=page_size,
                                          device="cpu")
    return {**inputs, **changes}


def offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


BAD_VARLEN = {
    "cpu-device": (lambda: cpu_varlen(), ValueError, "CUDA"),
    "q-rank": (lambda: cpu_varlen(q=torch.zeros(1, 8, 4, 64, dtype=torch.float16)), ValueError, "rank 3"),
    "cu-dtype": (lambda: cpu_varlen(cu_seqlens_q=offsets(0, 5, 8).long()), TypeError, "int32"),
    "cu-batch": (lambda: cpu_varlen(cu_seqlens_k=offsets(0, 9)), ValueError, r"batch \+ 1"),
    "cu-one-entry": (lambda: cpu_varlen(cu_seqlens_q=offsets(0)), ValueError, "batch >= 1"),
    "no-cu-k": (lambda: cpu_varlen(cu_seqlens_k=None), ValueError, "cu_seqlens_k"),
    "paged-with-cu-k": (lambda: cpu_varlen(page_size=16, cu_seqlens_k=offsets(0, 7, 9)), ValueError, "must be None"),
    "paged-no-seqused": (lambda: cpu_varlen(page_size=16, seqused_k=None), ValueError, "seqused_k"),
    "page-size": (lambda: cpu_varlen(page_size=24), ValueError, "multiple of 16"),
    "table-rows": (lambda: cpu_varlen(page_size=16, block_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
                   r"\[batch, max_pages\]"),
    "seqused-size": (lambda: cpu_varlen(seqused_k=torch.zeros(3, dtype=torch.int32)), ValueError, "one per sequence"),
    "max-seqlen": (lambda: cpu_varlen(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    "head-dim": (lambda: cpu_varlen(q=torch.zeros(8, 4, 72, dtype=torch.float16)), ValueError, "head_dim 72"),
    "out-shape": (lambda: cpu_varlen(out=torch.zeros(8, 4, 32, dtype=torch.float16)), ValueError, "out has shape"),
    "alibi-dtype": (lambda: cpu_varlen(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "float32"),
    "alibi-shape": (lambda: cpu_varlen(alibi_slopes=torch.ones(2)), ValueError, r"alibi_slopes has shape \(2,\)"),
    "alibi-valid-reaches-the-device-check": (lambda: cpu_varlen(alibi_slopes=torch.ones(4)), ValueError, "CUDA"),
}


@pytest.mark.parametrize("name", list(BAD_VARLEN))
def test_bad_varlen_input_is_rejected_before_launch(stage, name):
    """Each wrong argument of attention_varlen fails on the CPU with a message that names it."""
    make, error, message = BAD_VARLEN[name]
    with pytest.raises(error, match=message):
        stage.attention_varlen(**make())


def test_page_rows_divide_tile_and_page(stage):
    """A paged copy never crosses a page or a KV tile, and is whole 16-row pieces (the swizzle's 8-row atoms)."""
    for tile_n in {tiles.tile_n for tiles in stage.TILES.values()}:
        for page_size in range(16, 513, 16):
            rows = varlen.page_rows(tile_n, page_size)
            assert tile_n % rows == 0 and page_size % rows == 0 and rows % 16 == 0, (tile_n, page_size)


def test_check_varlen_values(stage):
    """What check_lengths=True checks on the host: offsets from 0, never decreasing, within the tensor and
    max_seqlen; pages within the pool."""
    inputs = cpu_varlen()
    for bad, message in [(dict(cu_seqlens_q=offsets(0, 6, 5)), "decreases"),
                         (dict(cu_seqlens_q=offsets(1, 5, 8)), "start at 0"),
                         (dict(cu_seqlens_k=offsets(0, 7, 10)), "tensor has 9 rows"),
                         (dict(max_seqlen_q=4), "more than max_seqlen_q"),
                         (dict(page_size=16), None)]:
        case = cpu_varlen(page_size=16) if "page_size" in bad else {**inputs, **bad}
        if message is None:  # a page outside the pool
            case["block_table"] = case["block_table"].clone()
            case["block_table"][0, 0] = 99
            message = "not a page of the cache"
        with pytest.raises(ValueError, match=message):
            validation.check_varlen_values(case["q"], case["k"], case["cu_seqlens_q"], case["cu_seqlens_k"],
                                           case["max_seqlen_q"], case["max_seqlen_k"], seqused_k=case["seqused_k"],
                                           block_table=case["block_table"])


# ---------------------------------------------------------------- numerics (Hopper GPU)

# Ragged batches: empty sequences, one row, tile multiples +- 1 (both Q tiles of 128 rows and KV tiles),
# S_q > S_k and S_q < S_k, one long sequence among short ones.
RAGGED = {
    "mixed": ([300, 1, 128, 0, 77, 129], [300, 5, 128, 10, 1000, 127]),
    "tile-edges": ([127, 128, 129, 255, 256, 257], [129, 128, 127, 257, 256, 255]),
    "one-long": ([2000, 3, 1, 40], [3000, 3, 700, 0]),
    "chunked-prefill": ([512, 100, 7], [4000, 1100, 300]),    # a chunk against its sequence's whole prefix
    "speculative": ([4, 4, 2, 8, 1], [1000, 37, 2, 4096, 129]),  # 1-8 query tokens against the cache
}
LAYOUTS = {"packed": {}, "seqused": {"seqused": True}, "paged16": {"page_size": 16}, "paged64": {"page_size": 64},
           "paged256": {"page_size": 256}}
VARLEN_FEATURES = {
    "none": {},
    "causal": dict(causal=True),
    "window-sinks-lse": dict(window_size=(100, 3), num_sink_tokens=4, sinks=True, return_lse=True),
}


def run_varlen(stage, inputs, features, where, heads_q=8):
    """One attention_varlen call with a NaN-poisoned out, checked sequence by sequence against the reference."""
    options = dict(features)
    return_lse = options.pop("return_lse", False)
    if options.pop("sinks", False):
        options["sink_logits"] = torch.linspace(-1.0, 2.0, heads_q, device="cuda")
    if options.pop("alibi", False):
        options["alibi_slopes"] = testing.alibi_slopes(heads_q)
    out = torch.full((*inputs["q"].shape[:2], inputs["v"].shape[-1]), float("nan"), device="cuda",
                     dtype=inputs["q"].dtype)
    result = stage.attention_varlen(**inputs, out=out, return_lse=return_lse, check_lengths=True, **options)
    torch.cuda.synchronize()
    assert (result[0] if return_lse else result) is out
    return testing.assert_varlen_matches(out, inputs, where, lse=result[1] if return_lse else None, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("features", list(VARLEN_FEATURES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("batch", list(RAGGED))
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
def test_varlen_matches_reference(stage, batch, layout, features, dtype):
    """Each ragged batch, packed, with seqused_k and paged: every sequence as if it were alone (GQA 8/2)."""
    lengths_q, lengths_k = RAGGED[batch]
    inputs = testing.random_varlen_inputs(lengths_q, lengths_k, 8, 2, 128, dtype, seed=len(batch),
                                          **LAYOUTS[layout])
    run_varlen(stage, inputs, VARLEN_FEATURES[features], f"stage 10, {batch}, {layout}, {features}, {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["packed", "paged16", "paged64"])
@pytest.mark.parametrize("dims", list(validation.HEAD_DIMS_FROM_STAGE_8),
                         ids=[f"d{d}" + (f"v{d_v}" if d_v != d else "") for d, d_v in validation.HEAD_DIMS_FROM_STAGE_8])
def test_varlen_every_head_dim(stage, dims, layout):
    """Every (D, D_v) with its own KV tile width (stage 8's TILES): paged copies of gcd(tile, page) rows, MQA."""
    d, d_v = dims
    for features in ({"causal": True}, VARLEN_FEATURES["window-sinks-lse"]):
        inputs = testing.random_varlen_inputs([300, 1, 129], [1000, 47, 129], 8, 1, d, torch.bfloat16, seed=d,
                                              head_dim_v=d_v, **LAYOUTS[layout])
        run_varlen(stage, inputs, features, f"stage 10, D={d}, D_v={d_v}, {layout}, {features}")


ALIBI_FEATURES = {
    "alibi": dict(alibi=True),
    "alibi-causal": dict(alibi=True, causal=True),
    "alibi-window-sinks-lse": dict(alibi=True, window_size=(100, 3), num_sink_tokens=4, sinks=True, return_lse=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("features", list(ALIBI_FEATURES))
@pytest.mark.parametrize("layout", ["packed", "paged16", "paged64"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128)], ids=["d64", "d128", "d192v128"])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
def test_alibi(stage, dtype, dims, layout, features):
    """ALiBi on ragged batches (S_q != S_k, chunked prefill, one-row sequences): the bias on every tile, the
    paper's slopes, GQA 8/2, with masks, sinks and the LSE."""
    d, d_v = dims
    lengths_q, lengths_k = RAGGED["chunked-prefill"]
    inputs = testing.random_varlen_inputs([*lengths_q, 1, 130], [*lengths_k, 1, 129], 8, 2, d, dtype, seed=d,
                                          head_dim_v=d_v, **LAYOUTS[layout])
    run_varlen(stage, inputs, ALIBI_FEATURES[features], f"stage 10 ALiBi, D={d}, {layout}, {features}, {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_dense_attention(stage, causal):
    """attention on [B, S, H, D] with ALiBi (S_q != S_k): the reference's bias, bottom-right aligned."""
    q, k, v = testing.random_qkv(2, 300, 700, 8, 2, 128, torch.bfloat16, seed=5)
    slopes = testing.alibi_slopes(8)
    out = stage.attention(q, k, v, causal=causal, alibi_slopes=slopes, out=testing.poisoned_like(q))
    testing.assert_attention_matches(out, q, k, v, f"stage 10 dense ALiBi causal={causal}", causal=causal,
                                     alibi_slopes=slopes)


def varlen_shape(tokens=4, batch=3, heads_q=32, heads_kv=8, head_dim=128, page_size=64, total_q=None, head_dim_v=None):
    return validation.VarlenShape(batch, batch * tokens if total_q is None else total_q, 4096, heads_q, heads_kv,
                                  head_dim, head_dim if head_dim_v is None else head_dim_v, page_size,
                                  100 if page_size else 0)


DRAFT_ROUTES = {  # name: (shape, max_seqlen_q, causal, window_size, stage 9 takes it)
    "4-tokens-causal-paged": (varlen_shape(), 4, True, (-1, -1), True),
    "window-right-0": (varlen_shape(), 4, False, (100, 0), True),
    "one-token-not-causal": (varlen_shape(tokens=1), 1, False, (-1, -1), True),
    "64-rows": (varlen_shape(tokens=8, heads_q=64), 8, True, (-1, -1), True),
    "72-rows": (varlen_shape(tokens=9, heads_q=64), 9, True, (-1, -1), False),
    "not-causal": (varlen_shape(), 4, False, (-1, -1), False),
    "unequal-lengths": (varlen_shape(total_q=10), 4, True, (-1, -1), False),
    "packed-keys": (varlen_shape(page_size=0), 4, True, (-1, -1), False),
    "page-48": (varlen_shape(page_size=48), 4, True, (-1, -1), False),
    "head-dim-96": (varlen_shape(head_dim=96), 4, True, (-1, -1), True),
    "head-dims-192-128": (varlen_shape(head_dim=192, head_dim_v=128), 4, True, (-1, -1), True),
    "head-dims-128-64": (varlen_shape(head_dim=128, head_dim_v=64), 4, True, (-1, -1), False),
}


@pytest.mark.parametrize("shape, max_seqlen_q, causal, window_size, routed", DRAFT_ROUTES.values(),
                         ids=DRAFT_ROUTES.keys())
def test_which_calls_stage_9_takes(shape, max_seqlen_q, causal, window_size, routed):
    """A few query tokens per sequence, all sequences alike, each seeing the keys up to its own position, against
    a paged cache stage 9 reads, at most DRAFT_ROWS rows per KV head: stage 9's decode kernel; else this stage's."""
    decode = stages.get(9).load("solutions")
    assert varlen.takes_draft_tokens(decode, shape, max_seqlen_q, causal, window_size) == routed


DRAFT_FEATURES = {
    "causal": dict(causal=True),
    "window-sinks-alibi-lse": dict(window_size=(40, 0), num_sink_tokens=3, sinks=True, alibi=True, return_lse=True),
}


DRAFT_SHAPES = {"4x4": (4, 32, 8, 128, 128), "1x8": (1, 16, 2, 128, 128), "8x8": (8, 64, 8, 128, 128),
                "4x1-d192v128": (4, 8, 8, 192, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("features", list(DRAFT_FEATURES))
@pytest.mark.parametrize("tokens, heads_q, heads_kv, head_dim, head_dim_v", DRAFT_SHAPES.values(),
                         ids=DRAFT_SHAPES.keys())
def test_draft_tokens_through_stage_9(stage, tokens, heads_q, heads_kv, head_dim, head_dim_v, features):
    """Equal query counts against a paged cache (stage 9's decode kernel computes them): lengths below, at and past
    the token count, O and the LSE [H_q, total_q] per sequence as the reference's."""
    lengths_k = [1, 3, 4, 5, 129, 4097]
    inputs = testing.random_varlen_inputs([tokens] * len(lengths_k), lengths_k, heads_q, heads_kv, head_dim,
                                          torch.bfloat16, page_size=64, head_dim_v=head_dim_v, seed=tokens)
    run_varlen(stage, inputs, DRAFT_FEATURES[features], f"draft tokens {tokens}, {heads_q}/{heads_kv}, "
               f"D={head_dim}/{head_dim_v}, {features}", heads_q=heads_q)


@pytest.mark.gpu
def test_many_sequences(stage):
    """More than 32 sequences (the scheduler's search takes 32 per step), most of them short, causal."""
    gen = torch.Generator().manual_seed(3)
    lengths_q = torch.randint(0, 300, (100,), generator=gen).tolist()
    lengths_k = [n + int(extra) for n, extra in zip(lengths_q, torch.randint(0, 200, (100,), generator=gen))]
    for layout in ("packed", "paged64"):
        inputs = testing.random_varlen_inputs(lengths_q, lengths_k, 4, 4, 64, torch.float16, seed=4,
                                              **LAYOUTS[layout])
        for features in ({}, {"causal": True}):
            run_varlen(stage, inputs, features, f"stage 10, 100 sequences, {layout}, {features}", heads_q=4)


@pytest.mark.gpu
def test_back_to_back_launches_give_identical_bits(stage):
    """200 launches of a ragged paged batch: the scheduler, the paged loads and the bounded stores leave no race."""
    inputs = testing.random_varlen_inputs([700, 1, 300, 129], [1500, 800, 300, 2000], 16, 4, 128, torch.float16,
                                          page_size=64, seed=5)
    first = stage.attention_varlen(**inputs, causal=True)
    for launch in range(200):
        out = stage.attention_varlen(**inputs, causal=True, out=testing.poisoned_like(first))
        assert torch.equal(out, first), f"launch {launch + 2} of 200 differs from the first"
    testing.assert_varlen_matches(first, inputs, "200 launches", causal=True)


@pytest.mark.gpu
def test_cuda_graph_replays_with_other_lengths(stage):
    """One captured launch, replayed after the offsets and lengths change in place (same tensor sizes): the kernel
    reads them on the GPU, so each replay computes the new batch."""
    lengths = [([300, 200, 12], [600, 250, 1000]), ([1, 500, 11], [1, 1000, 49]), ([512, 0, 0], [512, 0, 1024])]
    inputs = testing.random_varlen_inputs(*lengths[0], 8, 2, 128, torch.bfloat16, page_size=64, seed=6)
    inputs["block_table"] = torch.arange(inputs["block_table"].numel(), dtype=torch.int32,
                                         device="cuda").view_as(inputs["block_table"]) % inputs["k"].shape[0]
    inputs["k"], inputs["v"] = (torch.randn_like(t) for t in (inputs["k"], inputs["v"]))  # every page owned: finite
    out = torch.empty_like(inputs["q"])
    stage.attention_varlen(**inputs, causal=True, out=out)  # compile and plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stage.attention_varlen(**inputs, causal=True, out=out)
    for lengths_q, lengths_k in lengths[1:]:
        inputs["cu_seqlens_q"].copy_(torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()]))
        inputs["seqused_k"].copy_(torch.tensor(lengths_k))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = sum(lengths_q)
        check = dict(inputs, q=inputs["q"][:rows], cu_seqlens_q=inputs["cu_seqlens_q"].clone())
        testing.assert_varlen_matches(out[:rows], check, f"graph replay with {lengths_q}, {lengths_k}", causal=True)


@pytest.mark.gpu
def test_bad_lengths_fail_when_checked(stage):
    """check_lengths=True reads the offsets on the host: a decreasing offset is a ValueError before the launch."""
    inputs = testing.random_varlen_inputs([5, 3], [7, 2], 4, 2, 64, torch.float16)
    inputs["cu_seqlens_q"] = torch.tensor([0, 6, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="decreases"):
        stage.attention_varlen(**inputs, check_lengths=True)


# ---------------------------------------------------------------- the scheduler's search (CPU)

LOCATE_BATCHES = {
    "mixed": [300, 1, 128, 0, 77, 129],
    "empty-first-and-last": [0, 0, 500, 0],
    "all-empty": [0, 0, 0],
    "over-32-sequences": [(i * 37) % 300 for i in range(75)],
    "one-tile-each": [1] * 40,
}


# (page_size, seqlen_k): pages smaller than a KV tile (8 copies of 16 rows), as large (1 copy), larger (a
# copy of a page's part), a last tile cut by S_k mid-page, and copies wholly past S_k.
PAGED_LOADS = [(16, 300), (128, 129), (256, 300), (64, 1000), (32, 40)]


@pytest.mark.parametrize("page_rows, gather, warp", [(0, False, 0), (16, False, 0), (16, True, 0), (16, True, 1)],
                         ids=["packed", "tma-per-page", "gather-warp0", "gather-warp1"])
def test_on_cpu_producer_loads(stage, page_rows, gather, warp):
    """The producer's loop as Python on the CPU (tests/cpu_sync.py): per work tile K of its first KV tile, Q
    (warp 0 only), then K of tile i and V of tile i - 1, then V of the last, each on its pipeline's next state,
    and the tails after the last; work tiles of 0, 1 and several KV tiles, and one past the last sequence."""
    cpu_sync.check_varlen_producer(stage, page_rows=page_rows, gather=gather, warp=warp)


@pytest.mark.parametrize("page_size, seqlen_k", PAGED_LOADS, ids=[f"page{p}-sk{s}" for p, s in PAGED_LOADS])
def test_on_cpu_load_paged_tile(stage, page_size, seqlen_k):
    """Your load_paged_tile, 32 lanes as 32 threads on the CPU (tests/cpu_numerics.py): the same copies in every
    lane, the tile's rows in order from the right pages (page num_pages past S_k), after one producer_acquire
    and on the buffer's full barrier; no block-table entry past the sequence's pages read."""
    cpu_numerics.check_load_paged_tile(stage, page_size, seqlen_k)


# (page_size, seqlen_k, D, tile_n): 16-row pages at D = 128, 32-row ones at 64, D = 80 and 96 (rows of 10 and 12
# pieces, not a multiple of the 8 threads per row), a 48-row page under an 80-key tile (copies of 16 rows), D = 256.
GATHERS = [(16, 300, 128, 128), (32, 40, 64, 128), (16, 129, 80, 80), (48, 170, 80, 80), (32, 200, 96, 96),
           (16, 100, 256, 80), (16, 250, 192, 112)]


@pytest.mark.parametrize("page_size, seqlen_k, head_dim, tile_n", GATHERS,
                         ids=[f"page{p}-sk{s}-d{d}" for p, s, d, _ in GATHERS])
def test_on_cpu_gather_paged_tile(stage, page_size, seqlen_k, head_dim, tile_n):
    """gather_paged_tile, the producer warpgroup as 128 threads on the CPU (tests/cpu_numerics.py): each 16-byte
    piece of the tile copied once from its key's page and row, zeros past S_k, between each thread's one
    producer_acquire and one producer_commit; no block-table entry past the sequence's pages read."""
    cpu_numerics.check_gather_paged_tile(stage, page_size, seqlen_k, head_dim, tile_n)


@pytest.mark.parametrize("name", list(LOCATE_BATCHES))
def test_on_cpu_locate(stage, name):
    """Your locate, one warp in lockstep on the CPU (tests/cpu_numerics.py): every linear tile's sequence and
    first tile, from the start and from the last answer; past the last tile, no sequence."""
    cpu_numerics.check_locate(stage, LOCATE_BATCHES[name])
