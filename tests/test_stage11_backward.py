"""Stage 11 checks: dQ, dK, dV (and dsink) against the float64 reference's autograd, within twice the error
of PyTorch's own backward in the same precision: fp16 and bf16, every head dim of the forward, MHA, GQA and MQA, lengths that
are not tile multiples with S_q != S_k both ways, every mask (causal, windows, sink tokens) and sink logits;
rows that see no key (exactly zero gradients), NaN-poisoned gradient buffers, and the validation of the
backward's own arguments.
"""

from types import SimpleNamespace

import cpu_numerics
import pytest
import torch

from course import testing
from course.runtime import backward, prefill, stages
from prefill_checks import pytest_generate_tests, test_cross_compiles_for_sm90a  # noqa: F401

STAGE = stages.get(11)


@pytest.fixture(scope="module")
def stage(impl):
    return STAGE.load(impl)

# (S_q, S_k): one row, tails on both sides of a 64-row Q tile and a 128-key KV tile, S_q != S_k both ways.
LENGTHS = ((1, 1), (65, 129), (300, 100), (200, 1000), (1000, 1000))
MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window_size": (100, 30)},
    "window-sink-tokens": {"window_size": (64, 0), "num_sink_tokens": 5},
    "sink-logits": {"causal": True, "sink_logits": "linspace"},
}


HEAD_DIMS = list(backward.HEAD_DIMS)  # (D, D_v)
# (D, D_v, H_q, H_kv): every grouping at 64 and 128; at the others (their own swizzles, row passes of several
# pieces per thread; from 192 on, the warpgroups split dK's and dV's columns) GQA 4:1.
DIMS_HEADS = [(d, d_v, h_q, h_kv) for d, d_v in HEAD_DIMS for h_q, h_kv in testing.GQA_HEADS
              if d in testing.HEAD_DIMS or (h_q, h_kv) == (8, 2)]


def dims_id(d: int, d_v: int) -> str:
    return f"d{d}" + (f"v{d_v}" if d_v != d else "")


def features_of(mask: str, heads_q: int) -> dict:
    features = dict(MASKS[mask])
    if features.get("sink_logits") == "linspace":
        features["sink_logits"] = torch.linspace(-3, 3, heads_q, device="cuda")
    return features


# ---------------------------------------------------------------- validation (CPU)

def cpu_inputs(s_q=16, s_k=16, h_q=4, h_kv=2, d=64, dtype=torch.float16, d_v=None):
    q, k, v = testing.random_qkv(1, s_q, s_k, h_q, h_kv, d, dtype, device="cpu", head_dim_v=d_v)
    return {"do": torch.randn_like(q), "q": q, "k": k, "v": v, "o": torch.randn_like(q),
            "lse": torch.zeros(1, h_q, s_q)}


BAD_BACKWARD = {
    "cpu-device": (lambda: cpu_inputs(), ValueError, "CUDA"),
    "do-shape": (lambda: {**cpu_inputs(), "do": torch.zeros(1, 8, 4, 64, dtype=torch.float16)}, ValueError,
                 "do has shape"),
    "o-dtype": (lambda: {**cpu_inputs(), "o": torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16)}, TypeError, "o has dtype"),
    "lse-shape": (lambda: {**cpu_inputs(), "lse": torch.zeros(1, 16, 4)}, ValueError, r"\[B, H_q, S_q\] float32"),
    "lse-dtype": (lambda: {**cpu_inputs(), "lse": torch.zeros(1, 4, 16, dtype=torch.float16)}, ValueError, "float32"),
    "dk-shape": (lambda: {**cpu_inputs(), "dk": torch.zeros(1, 16, 4, 64, dtype=torch.float16)}, ValueError,
                 "dk has shape"),
    "head-dim-32": (lambda: cpu_inputs(d=32), ValueError, r"head_dim 32.*64, 80, 96, 128, 192, 256"),
    "deterministic-not-bool": (lambda: {**cpu_inputs(), "deterministic": 1}, TypeError, "deterministic must be"),
    "q-fp32": (lambda: {k: (v.float() if k in "qkv" else v) for k, v in cpu_inputs().items()}, TypeError, "float16"),
}


@pytest.mark.parametrize("name", list(BAD_BACKWARD))
def test_bad_backward_input_is_rejected_before_launch(stage, name):
    """Each wrong argument of attention_backward fails on the CPU with a message that names it."""
    make, error, message = BAD_BACKWARD[name]
    with pytest.raises(error, match=message):
        stage.attention_backward(**make())


@pytest.mark.compiles
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda dims: dims_id(*dims))
def test_row_passes_cross_compile(stage, dims):
    """The preprocess and postprocess kernels compile for sm_90a (fp16 one, bf16 the other), without spilling;
    the postprocess for each Q tile the head dim's kernels use (80 rows at D = 128 without a mask, else 64)."""
    from course.runtime.compile import cross_compile

    head_dim, head_dim_v = dims
    tiles = sorted({stage.q_tile_rows(c) for c in stage.KERNEL_CONFIGS if c.head_dim == head_dim})
    for kernel, args in (backward.preprocess_kernel_and_args(stage.AttentionBackward, torch.float16, *dims),
                         *(backward.postprocess_kernel_and_args(stage.AttentionBackward, torch.bfloat16, head_dim,
                                                                tile_m) for tile_m in tiles)):
        report = cross_compile(kernel, *args, name=f"stage11_{type(kernel).__name__}_{dims_id(*dims)}")
        assert report.spill_bytes in (0, None), f"{report.name} spills {report.spill_bytes} bytes"


@pytest.mark.compiles
@pytest.mark.parametrize("name", ["float16_d64_full", "bfloat16_d64_LRT", "float16_d64_L", "bfloat16_d128_full",
                                  "float16_d128_R",
                                  "bfloat16_d128_LRT", "float16_d80_full", "bfloat16_d96_LRT", "float16_d192_R",
                                  "bfloat16_d192v128_LRT", "float16_d256_full", "bfloat16_d256_LRT"])
def test_deterministic_mode_cross_compiles(stage, name):
    """The deterministic mode's turn-taking around each dQ reduce-add compiles for sm_90a without spilling."""
    config = next(c for c in stage.KERNEL_CONFIGS if c.name == name)
    report = stage.cross_compile_config(config, deterministic=True)
    assert report.spill_bytes in (0, None), f"{report.name} spills {report.spill_bytes} bytes"
    assert report.wgmma_serialized is None, f"{report.name}: {report.wgmma_serialized}"


@pytest.mark.gpu
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda dims: dims_id(*dims))
def test_preprocess_pads_rows_that_see_nothing(stage, dims):
    """The preprocess: D = rowsum(dO * O) in float32, the LSE in log2 units with +inf for an empty row (-inf) and
    for the padding up to whole Q tiles (so P = 0 there), D = 0 on the padding, the dQ sum (padding too) zeroed."""
    from course.runtime import launch

    head_dim, head_dim_v = dims
    do, o = (torch.randn(1, 3, 2, head_dim_v, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.tensor([[[0.5, -float("inf"), 1.0], [2.0, 0.0, -float("inf")]]], device="cuda")
    lse2, d = (torch.full((1, 2, 64), float("nan"), device="cuda") for _ in range(2))
    dq_accum = torch.full((1, 2, 64 * head_dim), float("nan"), device="cuda")  # [B, H, S_pad * D]
    pre = launch.compiled((stage.AttentionBackward.preprocess, do.dtype, *dims), lambda: (
        backward.preprocess_kernel_and_args(stage.AttentionBackward, do.dtype, *dims)))
    pre(do, o, lse, lse2, d, dq_accum)
    expected = torch.where(torch.isinf(lse), float("inf"), lse * backward.LOG2_E)
    torch.testing.assert_close(lse2[..., :3], expected)
    assert torch.isposinf(lse2[..., 3:]).all() and (d[..., 3:] == 0).all(), "the padding must be LSE +inf, D 0"
    torch.testing.assert_close(d[..., :3], (do.float() * o.float()).sum(-1).transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert (dq_accum == 0).all(), "the float32 dQ sum must start at zero"


def test_sink_gradient_matches_autograd():
    """dsink's closed form, -sum exp(sink - LSE) * rowsum(dO * O), equals autograd of the reference (CPU)."""
    q, k, v = testing.random_qkv(2, 37, 50, 4, 2, 16, torch.float64, device="cpu")
    do = torch.randn_like(q)
    sink = torch.linspace(-1, 2, 4, dtype=torch.float64)
    features = {"window_size": (10, 0), "num_sink_tokens": 2}
    grads = testing.reference_gradients(q, k, v, do, sink_logits=sink, **features)
    from course.testing import reference
    o, lse = reference.attention(q, k, v, sink_logits=sink, return_lse=True, **features)
    d = torch.einsum("bshd,bshd->bhs", do, o)
    assert torch.allclose(backward.sink_gradient(sink, lse.double(), d), grads[3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window_size": (5, 2), "num_sink_tokens": 3},
                                      {"causal": True, "sink_logits": "linspace"}], ids=["none", "causal", "window",
                                                                                        "sink-logits"])
def test_reference_backward_formulas_match_autograd(features):
    """reference.attention_backward (the formulas the kernel computes) equals autograd of the reference,
    with S_q > S_k (rows without keys) and GQA (CPU, float64)."""
    from course.testing import reference

    q, k, v = testing.random_qkv(2, 40, 25, 6, 2, 16, torch.float64, device="cpu")
    do = torch.randn_like(q)
    if features.get("sink_logits") == "linspace":
        features = {**features, "sink_logits": torch.linspace(-2, 2, 6, dtype=torch.float64)}
    formulas = reference.attention_backward(do, q, k, v, **features)
    autograd = testing.reference_gradients(q, k, v, do, **features)
    for name, got, want in zip(testing.GRADIENT_NAMES, formulas, autograd):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=name)


# ---------------------------------------------------------------- gradients (Hopper GPU)

def run_backward(stage, q, k, v, do, features, poisoned=True):
    """(the gradients, the forward's O they were computed from)."""
    out, lse = stage.attention(q, k, v, return_lse=True, **features)
    buffers = {name: testing.poisoned_like(t) for name, t in (("dq", q), ("dk", k), ("dv", v))} if poisoned else {}
    return stage.attention_backward(do, q, k, v, out, lse, **features, **buffers), out


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim, head_dim_v, h_q, h_kv", DIMS_HEADS,
                         ids=[f"{dims_id(d, d_v)}-h{a}-kv{b}" for d, d_v, a, b in DIMS_HEADS])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
def test_gradients_match_reference(stage, dtype, head_dim, head_dim_v, h_q, h_kv, lengths, mask):
    s_q, s_k = lengths
    q, k, v = testing.random_qkv(2, s_q, s_k, h_q, h_kv, head_dim, dtype, seed=s_q * 7 + s_k, head_dim_v=head_dim_v)
    do = torch.randn(*q.shape[:3], head_dim_v, device=q.device, dtype=dtype)
    features = features_of(mask, h_q)
    grads, out = run_backward(stage, q, k, v, do, features)
    testing.assert_gradients_match(grads, q, k, v, do,
                                   f"stage 11 {dtype} {dims_id(head_dim, head_dim_v)} h{h_q}/{h_kv} {lengths} {mask}",
                                   out=out, **features)


@pytest.mark.gpu
def test_rows_without_keys_have_zero_gradients(stage):
    """Under a causal mask with S_q > S_k the first S_q - S_k rows see no key: their dq is exactly 0, and they
    add nothing to dk and dv (a P of exp(-inf - -inf) = NaN would poison both)."""
    q, k, v = testing.random_qkv(1, 300, 100, 4, 4, 128, torch.bfloat16)
    do = torch.randn_like(q)
    (dq, dk, dv), out = run_backward(stage, q, k, v, do, {"causal": True})
    assert (dq[:, :200] == 0).all(), "dq of rows that see no key must be exactly 0"
    testing.assert_gradients_match((dq, dk, dv), q, k, v, do, "rows without keys", out=out, causal=True)


@pytest.mark.gpu
def test_keys_no_row_sees_get_zero_gradients(stage):
    """A window that leaves the last KV tiles unseen: their dk and dv are written, as zeros (the buffers were NaN)."""
    q, k, v = testing.random_qkv(1, 64, 1000, 2, 2, 64, torch.float16)
    do = torch.randn_like(q)
    (dq, dk, dv), _ = run_backward(stage, q, k, v, do, {"window_size": (10, -1)})
    seen_from = 1000 - 64 - 10
    assert (dk[:, :seen_from - 128] == 0).all() and (dv[:, :seen_from - 128] == 0).all()


@pytest.mark.gpu
def test_softmax_scale_and_large_logits(stage):
    q, k, v = testing.random_qkv(2, 200, 300, 4, 2, 64, torch.bfloat16)
    do = torch.randn_like(q)
    for scale in (0.3, 2.0):
        grads, out = run_backward(stage, q, k, v, do, {"softmax_scale": scale})
        testing.assert_gradients_match(grads, q, k, v, do, f"softmax_scale {scale}", out=out, softmax_scale=scale)


@pytest.mark.gpu
def test_gradients_of_the_sum_over_the_group(stage):
    """MQA with 16 query heads: dk and dv sum 16 heads' contributions, in the CTA's registers."""
    q, k, v = testing.random_qkv(1, 129, 257, 16, 1, 128, torch.float16)
    do = torch.randn_like(q)
    grads, out = run_backward(stage, q, k, v, do, {"causal": True}, poisoned=False)
    testing.assert_gradients_match(grads, q, k, v, do, "MQA 16:1", out=out, causal=True)


def test_launch_groups_divide_the_pairs():
    """The grid is (pairs per group, KV tiles, groups): a group divides B x H_kv, fits on the GPU under a mask,
    is one pair without a mask or in deterministic mode, and keeps the groups within the grid's z dimension."""
    causal = prefill.KernelConfig("bfloat16", 128, has_right=True)
    unmasked = prefill.KernelConfig("bfloat16", 128)

    def group(config, batch, heads_kv, n_blocks, deterministic=False):
        shape = SimpleNamespace(batch=batch, heads_kv=heads_kv)
        return backward.pairs_per_group(config, shape, n_blocks, deterministic, sms=132)

    assert group(causal, 2, 16, 64) == 2  # two pairs' 64 tiles fill 132 SMs
    assert group(causal, 8, 16, 16) == 8
    assert group(causal, 3, 2, 21) == 2  # 6 pairs: the largest power of two that divides them
    assert group(causal, 1, 25, 16) == 1
    assert group(causal, 2, 16, 200) == 1  # a pair's tiles fill the GPU by themselves
    assert group(unmasked, 8, 16, 16) == 1
    assert group(causal, 8, 16, 16, deterministic=True) == 1
    assert group(unmasked, 4096, 32, 2) == 4  # 131072 pairs: 32768 groups of 4 (at most 65535)


@pytest.mark.gpu
def test_launch_groups_map_back_to_heads_and_batches(stage):
    """Causal, 21 KV tiles of 128 keys per (KV head, batch) pair: the 6 pairs of 3 batches x 2 KV heads launch
    in 3 groups of 2 (``pairs_per_group``). Every tile of every pair must be computed once, at its own head and
    batch (dk and dv start as NaN)."""
    q, k, v = testing.random_qkv(3, 2600, 2600, 4, 2, 128, torch.bfloat16)
    do = torch.randn_like(q)
    grads, out = run_backward(stage, q, k, v, do, {"causal": True})
    testing.assert_gradients_match(grads, q, k, v, do, "3 launch groups of 2 pairs", out=out, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 192, 256], ids=["d128", "d192", "d256"])
@pytest.mark.parametrize("mask", ["none", "causal", "window-sink-tokens"])
def test_deterministic_gradients_are_bit_identical(stage, mask, head_dim):
    """deterministic=True: 100 backward passes on the same inputs give the same bits (Q tiles that 8 KV tiles
    add into, 11 at D = 192's 96-key tiles with one dS buffer, 16 at D = 256's 64-key tiles, each in two rounds;
    GQA 4:1 so each CTA adds four heads' shares), and the gradients are right."""
    q, k, v = testing.random_qkv(2, 700, 1000, 8, 2, head_dim, torch.bfloat16)
    do = torch.randn_like(q)
    features = features_of(mask, 8)
    out, lse = stage.attention(q, k, v, return_lse=True, **features)
    first = stage.attention_backward(do, q, k, v, out, lse, deterministic=True, **features)
    testing.assert_gradients_match(first, q, k, v, do, f"deterministic, {mask}", out=out, **features)
    buffers = {name: testing.poisoned_like(t) for name, t in (("dq", q), ("dk", k), ("dv", v))}
    for run in range(100):
        again = stage.attention_backward(do, q, k, v, out, lse, deterministic=True, **features, **buffers)
        for name, a, b in zip(testing.GRADIENT_NAMES, first, again):
            assert torch.equal(a, b), f"run {run}: {name} differs from the first run's in deterministic mode"


# ---------------------------------------------------------------- the exercises on the CPU

CPU_MASKS = {
    "none": {}, "causal": {"causal": True}, "window": {"window_size": (100, 30)},
    "left-only": {"window_size": (70, -1)}, "window-sink-tokens": {"window_size": (64, 0), "num_sink_tokens": 130},
}
# Tails on both sides of both tiles, a Q tile that only the last key of a KV tile sees ((64, 129), causal), and
# a window whose first row to see a KV tile is the last of a Q tile ((3, 200), left-only), and windows that
# start past the sink tokens' tiles ((200, 700): the deterministic order skips the tiles between).
CPU_LENGTHS = [(1, 1), (200, 300), (300, 129), (130, 64), (64, 129), (3, 200), (400, 400), (200, 700)]


TILINGS = {128: "q-tiles-64-or-80", 64: "q-tiles-128", 192: "kv-tiles-96", 256: "kv-tiles-64"}


@pytest.mark.compiles
@pytest.mark.parametrize("head_dim", list(TILINGS), ids=list(TILINGS.values()))
@pytest.mark.parametrize("mask", list(CPU_MASKS))
def test_on_cpu_m_block_range(stage, mask, head_dim):
    """KeyTileMask (exercise 11): the Q tiles a KV tile visits, and its mask, against the reference's visibility,
    with the tiles of D = 128's kernel (64 rows with a mask, 80 without; 128 keys), of D = 64's (128 rows) and of
    D = 192's and 256's (96 and 64 keys, S with the keys as N)."""
    cpu_numerics.check_key_tile_masks(stage, CPU_MASKS[mask], CPU_LENGTHS, head_dim)


@pytest.mark.compiles
@pytest.mark.parametrize("head_dim", list(TILINGS), ids=list(TILINGS.values()))
@pytest.mark.parametrize("rotate", [0, 1], ids=["descending", "rotated"])
@pytest.mark.parametrize("mask", list(CPU_MASKS))
def test_on_cpu_deterministic_turns(stage, mask, rotate, head_dim):
    """The deterministic mode's order: every Q tile's adders take distinct turns 0, 1, ..., and the CTAs,
    each waiting for its turn at every step, never wait forever (rotation applies to the unmasked kernel)."""
    cpu_numerics.check_deterministic_turns(stage, CPU_MASKS[mask], CPU_LENGTHS + [(64, 1000), (1000, 300)], rotate,
                                           head_dim)


@pytest.mark.compiles
@pytest.mark.parametrize("causal", [False, True], ids=["no-mask", "causal"])
@pytest.mark.parametrize("head_dim", sorted({d for d, _ in HEAD_DIMS}))
def test_on_cpu_dq_stores_cover_the_tile_once_without_bank_conflicts(stage, head_dim, causal):
    """dQ's registers go to their part of the buffer, 16 bytes each, a quarter warp's in one wavefront, and
    hold every (row, column) of the tile once: what ConvertDQ reads back (dQ^T where the Q tile's rows are not a
    multiple of 64: 80 at D = 128 without a mask)."""
    cpu_numerics.check_dq_stores(stage, head_dim, causal)


@pytest.mark.compiles
@pytest.mark.parametrize("head_dim", [64, 192], ids=["keys-as-m", "keys-as-n"])
def test_on_cpu_probabilities_and_score_gradients(stage, head_dim):
    cpu_numerics.check_score_gradients(stage, head_dim)
