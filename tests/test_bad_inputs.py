"""Bad and edge-case inputs at every entry point: prefill ``attention`` (stages 1-6),
``merge_attention_states`` (stage 6) and ``decode_attention`` (stage 7).

Each class of bad input (scalar options, integer ranges, empty sizes, outputs that overlap
themselves, dtypes, devices) is rejected by the course's validation, before any compile or
launch, with the exception the contract names and a message that names the argument. The
edge cases that are valid (a -inf sink on a row with no key, the smallest scale, windows
near 2**31) compute the contract's answer, never NaN: those tests launch, on a Hopper GPU.
"""

import math

import pytest
import torch

from course.runtime import launch, prefill, stages, validation
from course.testing import reference, tile_models
from course import testing

PREFILL_STAGES = [s.number for s in stages.STAGES if s.ready and s.kind == "prefill"]
INT32_MAX = validation.INT32_MAX
SMALLEST_SCALE, LARGEST_SCALE = validation.SCALE_RANGE


@pytest.fixture(scope="module", params=PREFILL_STAGES, ids=lambda n: f"stage{n}")
def prefill_stage(request, impl):
    return stages.get(request.param).load(impl)


@pytest.fixture(scope="module")
def lse_stage(impl):
    return stages.get(6).load(impl)


@pytest.fixture(scope="module")
def decode_stage(impl):
    return stages.get(7).load(impl)


# ---------------------------------------------------------------- the classes of bad input

# (value, exception, what the message must say): every entry point takes softmax_scale.
BAD_SCALES = {
    "nan": (math.nan, ValueError, r"softmax_scale is nan; expected a positive finite float"),
    "inf": (math.inf, ValueError, r"softmax_scale is inf"),
    "-inf": (-math.inf, ValueError, r"softmax_scale is -inf"),
    "zero": (0.0, ValueError, r"softmax_scale is 0.0; expected a positive"),
    "negative": (-0.125, ValueError, r"softmax_scale is -0.125"),
    "below-float32": (1e-300, ValueError, r"softmax_scale is 1e-300"),  # 0 as a float32
    "above-float32": (1e300, ValueError, r"softmax_scale is 1e\+300"),  # inf as a float32
    "bool": (True, TypeError, r"softmax_scale must be a float or None; got bool"),
    "string": ("0.1", TypeError, r"softmax_scale must be a float or None; got str"),
    "tensor": (torch.tensor(0.1), TypeError, r"softmax_scale must be a float or None; got Tensor"),
}


def overlapping_views(shape, dtype=torch.float16):
    """Outputs whose writes would collide: expanded along each dimension but the last, and one
    with overlapping (non-zero) strides."""
    views = {}
    for dim in (d for d in range(len(shape) - 1) if shape[d] > 1):  # a dimension of size 1 has no overlap
        one = list(shape)
        one[dim] = 1
        views[f"expanded-dim{dim}"] = torch.empty(one, dtype=dtype).expand(shape)
    strides = list(torch.empty(shape).stride())
    strides[-2] = 8  # the rows of the last two dimensions start 8 elements apart but are D long
    views["overlapping-rows"] = torch.empty(math.prod(shape), dtype=dtype).as_strided(shape, strides)
    return views


# ---------------------------------------------------------------- prefill: attention (CPU)

def qkv(b=1, s_q=16, s_k=16, h_q=4, h_kv=2, d=64, dtype=torch.float16):
    return testing.random_qkv(b, s_q, s_k, h_q, h_kv, d, dtype, device="cpu")


PREFILL_SIZES = {  # an empty size: (q, k, v sizes, what the message names)
    "batch-0": (dict(b=0), r"q has shape \(0, 16, 4, 64\).* batch = 0"),
    "s_q-0": (dict(s_q=0), r"q has shape .* S_q = 0"),
    "s_k-0": (dict(s_k=0), r"k has shape .* S_k = 0"),
    "h_q-0": (dict(h_q=0), r"q has shape .* H_q = 0"),
    "h_kv-0": (dict(h_kv=0), r"k has shape .* H_kv = 0"),
    "head_dim-0": (dict(d=0), r"q has shape .* head_dim = 0"),
}


@pytest.mark.parametrize("sizes, message", PREFILL_SIZES.values(), ids=PREFILL_SIZES.keys())
def test_prefill_rejects_empty_sizes(prefill_stage, sizes, message):
    with pytest.raises(ValueError, match=f"empty input: {message}"):
        prefill_stage.attention(*qkv(**sizes))


@pytest.mark.parametrize("scale, error, message", BAD_SCALES.values(), ids=BAD_SCALES.keys())
def test_prefill_rejects_bad_softmax_scale(prefill_stage, scale, error, message):
    with pytest.raises(error, match=message):
        prefill_stage.attention(*qkv(), softmax_scale=scale)


PREFILL_OPTIONS = {  # name: (keyword arguments, exception, what the message must say)
    "causal-string": (dict(causal="yes"), TypeError, r"causal must be True or False; got 'yes'"),
    "causal-none": (dict(causal=None), TypeError, r"causal must be True or False"),
    "return_lse-int": (dict(return_lse=1), TypeError, r"return_lse must be True or False"),
    "window-beyond-int32": (dict(window_size=(INT32_MAX + 1, 0)), ValueError, r"window_size must be a pair .* 2147483647"),
    "window-below-minus-1": (dict(window_size=(0, -2)), ValueError, r"window_size must be a pair"),
    "window-bool": (dict(window_size=(True, 0)), ValueError, r"window_size must be a pair"),
    "window-float": (dict(window_size=(8.0, 0)), ValueError, r"window_size must be a pair"),
    "window-one-side": (dict(window_size=(8,)), ValueError, r"window_size must be a pair"),
    "sink-tokens-beyond-int32": (dict(num_sink_tokens=2**40), ValueError,
                                 r"num_sink_tokens must be an int from 0 to 2147483647"),
    "sink-tokens-negative": (dict(num_sink_tokens=-1), ValueError, r"num_sink_tokens must be an int from 0"),
    "sink-tokens-bool": (dict(num_sink_tokens=True), ValueError, r"num_sink_tokens"),
    "sink-logits-float16": (dict(sink_logits=torch.zeros(4, dtype=torch.float16)), TypeError,
                            r"sink_logits has dtype torch.float16; expected torch.float32"),
    "sink-logits-list": (dict(sink_logits=[0.0] * 4), TypeError, r"sink_logits must be a torch.Tensor"),
    "sink-logits-shape": (dict(sink_logits=torch.zeros(2)), ValueError, r"sink_logits has shape \(2,\).*\[4\]"),
    "sink-logits-strided": (dict(sink_logits=torch.zeros(8)[::2]), ValueError, r"sink_logits .* contiguous"),
}


@pytest.mark.parametrize("options, error, message", PREFILL_OPTIONS.values(), ids=PREFILL_OPTIONS.keys())
def test_prefill_rejects_bad_options(prefill_stage, options, error, message):
    with pytest.raises(error, match=message):
        prefill_stage.attention(*qkv(), **options)


PREFILL_TENSORS = {  # name: (q, k, v from qkv(), exception, what the message must say)
    "q-float32": (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, r"q has dtype torch.float32"),
    "k-dtype": (lambda q, k, v: (q, k.bfloat16(), v), TypeError, r"q, k, v must share one dtype"),
    "v-int": (lambda q, k, v: (q, k, v.to(torch.int16)), TypeError, r"v has dtype torch.int16"),
    "q-list": (lambda q, k, v: (q.tolist(), k, v), TypeError, r"q must be a torch.Tensor"),
    "on-cpu": (lambda q, k, v: (q, k, v), ValueError, r"q is on cpu; the kernels need CUDA tensors"),
}


@pytest.mark.parametrize("make, error, message", PREFILL_TENSORS.values(), ids=PREFILL_TENSORS.keys())
def test_prefill_checks_every_tensor(prefill_stage, make, error, message):
    with pytest.raises(error, match=message):
        prefill_stage.attention(*make(*qkv()))


@pytest.mark.parametrize("name", list(overlapping_views((1, 16, 4, 64))))
def test_prefill_rejects_an_out_that_overlaps_itself(prefill_stage, name):
    out = overlapping_views((1, 16, 4, 64))[name]
    with pytest.raises(ValueError, match=r"out has shape .* strides .*out must not overlap itself"):
        prefill_stage.attention(*qkv(), out=out)


def test_prefill_rejects_an_out_of_another_dtype_or_shape(prefill_stage):
    with pytest.raises(TypeError, match=r"out has dtype torch.bfloat16; expected torch.float16 like q"):
        prefill_stage.attention(*qkv(), out=torch.empty(1, 16, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out has shape \(1, 16, 2, 64\); expected \(1, 16, 4, 64\) like q"):
        prefill_stage.attention(*qkv(), out=torch.empty(1, 16, 2, 64, dtype=torch.float16))


OUTPUT_VIEWS = {  # outputs that are not one fresh tensor but write every element once
    "padded-head-dim": lambda: torch.empty(1, 16, 4, 128, dtype=torch.float16)[..., :64],
    "heads-major-storage": lambda: torch.empty(1, 4, 16, 64, dtype=torch.float16).transpose(1, 2),
    "one-of-packed-qkv": lambda: torch.empty(1, 16, 3, 4, 64, dtype=torch.float16)[:, :, 1],
}


@pytest.mark.parametrize("make", OUTPUT_VIEWS.values(), ids=OUTPUT_VIEWS.keys())
def test_prefill_accepts_non_overlapping_output_views(prefill_stage, make):
    """They pass every check but the device one, which comes last."""
    with pytest.raises(ValueError, match=r"q is on cpu"):
        prefill_stage.attention(*qkv(), out=make())


# ---------------------------------------------------------------- stage 6: merge_attention_states (CPU)

def partials(b=1, s=16, h=4, d=64, dtype=torch.float16):
    o_a, o_b = (torch.randn(b, s, h, d).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(b, h, s) for _ in range(2))
    return dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)


MERGE_CASES = {  # name: (partials, changes, exception, what the message must say)
    "batch-0": (dict(b=0), {}, ValueError, r"empty input: o_a has shape \(0, 16, 4, 64\) .* batch = 0"),
    "s-0": (dict(s=0), {}, ValueError, r"empty input: o_a .* S = 0"),
    "h-0": (dict(h=0), {}, ValueError, r"empty input: o_a .* H = 0"),
    "head_dim-0": (dict(d=0), {}, ValueError, r"empty input: o_a .* head_dim = 0"),
    "head_dim-72": (dict(d=72), {}, ValueError, r"head_dim 72 is not supported"),
    "o-float32": (dict(dtype=torch.float32), {}, TypeError, r"o_a has dtype torch.float32"),
    "o_b-dtype": (dict(), dict(o_b=torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16)), TypeError,
                  r"o_a has dtype torch.float16 but o_b has torch.bfloat16"),
    "o_b-shape": (dict(), dict(o_b=torch.zeros(1, 8, 4, 64, dtype=torch.float16)), ValueError,
                  r"o_a has shape \(1, 16, 4, 64\) but o_b has \(1, 8, 4, 64\)"),
    "lse-float64": (dict(), dict(lse_b=torch.zeros(1, 4, 16, dtype=torch.float64)), TypeError,
                    r"lse_b has dtype torch.float64; expected torch.float32"),
    "lse-list": (dict(), dict(lse_a=[0.0]), TypeError, r"lse_a must be a torch.Tensor"),
    "lse-shape": (dict(), dict(lse_a=torch.zeros(1, 16, 4)), ValueError, r"lse_a has shape \(1, 16, 4\)"),
    "out-dtype": (dict(), dict(out=torch.empty(1, 16, 4, 64, dtype=torch.bfloat16)), TypeError,
                  r"out has dtype torch.bfloat16; expected torch.float16 like o_a"),
    "on-cpu": (dict(), {}, ValueError, r"o_a is on cpu; the kernels need CUDA tensors"),
    **{f"out-{name}": (dict(), dict(out=view), ValueError, r"out must not overlap itself")
       for name, view in overlapping_views((1, 16, 4, 64)).items()},
}


@pytest.mark.parametrize("sizes, changes, error, message", MERGE_CASES.values(), ids=MERGE_CASES.keys())
def test_merge_rejects_bad_input(lse_stage, sizes, changes, error, message):
    with pytest.raises(error, match=message):
        lse_stage.merge_attention_states(**{**partials(**sizes), **changes})


# ---------------------------------------------------------------- stage 7: decode_attention (CPU)

def decode_inputs(lengths=(5, 9), h_q=4, h_kv=2, d=64, page_size=None, dtype=torch.float16):
    return testing.random_decode_inputs(list(lengths), h_q, h_kv, d, dtype, page_size=page_size, device="cpu")


def emptied(dim_of, size, **inputs):
    """The decode inputs with dimension ``dim_of[name]`` of each named tensor cut to ``size``."""
    inputs = decode_inputs(**inputs)
    for name, dim in dim_of.items():
        inputs[name] = inputs[name].narrow(dim, 0, size)
    return inputs


DECODE_SIZES = {  # name: (inputs, what the message names)
    "batch-0": (lambda: emptied({"q": 0, "k_cache": 0, "v_cache": 0, "cache_seqlens": 0}, 0),
                r"q has shape \(0, 4, 64\) .* batch = 0"),
    "h_q-0": (lambda: emptied({"q": 1}, 0), r"q has shape \(2, 0, 64\) .* H_q = 0"),
    "h_kv-0": (lambda: emptied({"k_cache": 2, "v_cache": 2}, 0), r"k_cache has shape .* H_kv = 0"),
    "head_dim-0": (lambda: emptied({"q": 2, "k_cache": 3, "v_cache": 3}, 0), r"q has shape .* head_dim = 0"),
    "s_max-0": (lambda: emptied({"k_cache": 1, "v_cache": 1}, 0, lengths=(0, 0)), r"k_cache .* S_max = 0"),
    "num_pages-0": (lambda: emptied({"k_cache": 0, "v_cache": 0}, 0, page_size=16), r"k_cache .* num_pages = 0"),
}


@pytest.mark.parametrize("make, message", DECODE_SIZES.values(), ids=DECODE_SIZES.keys())
def test_decode_rejects_empty_sizes(decode_stage, make, message):
    with pytest.raises(ValueError, match=f"empty input: {message}"):
        decode_stage.decode_attention(**make())


@pytest.mark.parametrize("scale, error, message", BAD_SCALES.values(), ids=BAD_SCALES.keys())
def test_decode_rejects_bad_softmax_scale(decode_stage, scale, error, message):
    with pytest.raises(error, match=message):
        decode_stage.decode_attention(**decode_inputs(), softmax_scale=scale)


DECODE_OPTIONS = {  # name: (keyword arguments, exception, what the message must say)
    "window-beyond-int32": (dict(window_size_left=INT32_MAX + 1), ValueError,
                            r"window_size_left must be an int from -1 to 2147483647"),
    "window-bool": (dict(window_size_left=False), ValueError, r"window_size_left must be an int"),
    "sink-tokens-beyond-int32": (dict(num_sink_tokens=2**40), ValueError,
                                 r"num_sink_tokens must be an int from 0 to 2147483647"),
    "splits-beyond-int32": (dict(num_splits=INT32_MAX + 1), ValueError, r"num_splits must be an int from 0 to 2147483647"),
    "splits-bool": (dict(num_splits=True), ValueError, r"num_splits must be an int"),
    "return_lse-string": (dict(return_lse="no"), TypeError, r"return_lse must be True or False; got 'no'"),
    "sink-logits-float64": (dict(sink_logits=torch.zeros(4, dtype=torch.float64)), TypeError,
                            r"sink_logits has dtype torch.float64; expected torch.float32"),
    "sink-logits-shape": (dict(sink_logits=torch.zeros(4, 1)), ValueError, r"sink_logits has shape \(4, 1\).*\[4\]"),
    "out-dtype": (dict(out=torch.empty(2, 4, 64, dtype=torch.bfloat16)), TypeError, r"out has dtype .* like q"),
    "out-shape": (dict(out=torch.empty(2, 4, 32, dtype=torch.float16)), ValueError, r"out has shape \(2, 4, 32\)"),
    **{f"out-{name}": (dict(out=view), ValueError, r"out has shape .* strides .*out must not overlap itself")
       for name, view in overlapping_views((2, 4, 64)).items()},
}


@pytest.mark.parametrize("options, error, message", DECODE_OPTIONS.values(), ids=DECODE_OPTIONS.keys())
def test_decode_rejects_bad_options(decode_stage, options, error, message):
    with pytest.raises(error, match=message):
        decode_stage.decode_attention(**decode_inputs(), **options)


DECODE_TENSORS = {  # name: (changes to the inputs, exception, what the message must say)
    "q-float32": (lambda i: dict(q=i["q"].float()), TypeError, r"q has dtype torch.float32"),
    "cache-dtype": (lambda i: dict(v_cache=i["v_cache"].bfloat16()), TypeError, r"v_cache"),
    "seqlens-float": (lambda i: dict(cache_seqlens=i["cache_seqlens"].float()), TypeError,
                      r"cache_seqlens has dtype torch.float32; expected torch.int32"),
    "seqlens-list": (lambda i: dict(cache_seqlens=[5, 9]), TypeError, r"cache_seqlens must be a torch.Tensor"),
    "on-cpu": (lambda i: {}, ValueError, r"q is on cpu; the kernels need CUDA tensors"),
}


@pytest.mark.parametrize("change, error, message", DECODE_TENSORS.values(), ids=DECODE_TENSORS.keys())
def test_decode_checks_every_tensor(decode_stage, change, error, message):
    inputs = decode_inputs()
    with pytest.raises(error, match=message):
        decode_stage.decode_attention(**{**inputs, **change(inputs)})


def test_decode_block_table_dtype(decode_stage):
    inputs = decode_inputs(page_size=16)
    with pytest.raises(TypeError, match=r"block_table has dtype torch.int64; expected torch.int32"):
        decode_stage.decode_attention(**{**inputs, "block_table": inputs["block_table"].long()})


# ---------------------------------------------------------------- what the kernels compute instead (CPU)

WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (40, 40), (INT32_MAX, INT32_MAX), (INT32_MAX, 0), (0, INT32_MAX)]


@pytest.mark.parametrize("s_q, s_k", [(7, 20), (20, 7), (13, 13)])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("num_sink_tokens", [0, 2, 30, INT32_MAX])
def test_kernel_window_sees_the_same_keys(s_q, s_k, window, num_sink_tokens):
    """The window the kernels get (every value cut to the sequences' lengths, in int32 range)
    makes the same keys visible as the one asked for."""
    shape = validation.AttentionShape(1, s_q, s_k, 1, 1, 64, 64)
    for causal in (False, True):
        left, right, sinks = prefill.kernel_window(causal, window, num_sink_tokens, shape)
        assert max(left, right, sinks) <= max(s_q, s_k)
        asked = reference.visible_keys(s_q, s_k, causal=causal, window_size=window, num_sink_tokens=num_sink_tokens)
        given = reference.visible_keys(s_q, s_k, window_size=(left, right), num_sink_tokens=sinks)
        assert torch.equal(asked, given), f"causal={causal}: {window}, {num_sink_tokens} -> {left, right, sinks}"


def test_sink_tile_model_with_minus_inf_sinks_on_empty_rows():
    """The kernels' normalization in PyTorch: no visible key and a -inf sink give O = 0, not NaN."""
    q, k, v = testing.random_qkv(1, 300, 100, 4, 2, 64, torch.float16, device="cpu", seed=6)
    sinks = torch.tensor([-math.inf, 1.0, -math.inf, -2.0])
    out = tile_models.masked_online(q, k, v, causal=True, sink_logits=sinks)
    assert (out[:, :200] == 0).all(), "rows 0..199 see no key (S_q > S_k, causal): O must be 0"
    testing.assert_attention_matches(out, q, k, v, where="tile model, -inf sinks", causal=True, sink_logits=sinks)


# ---------------------------------------------------------------- devices (a GPU, no launch)

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k", "v", "out", "sink_logits"])
def test_prefill_names_the_tensor_on_the_wrong_device(impl, name):
    stage = stages.get(5).load(impl)  # the first stage that takes sink_logits
    q, k, v = testing.random_qkv(1, 16, 16, 4, 2, 64, torch.float16)
    inputs = dict(q=q, k=k, v=v, out=torch.empty_like(q), sink_logits=torch.zeros(4, device="cuda"))
    inputs[name] = inputs[name].cpu()
    with pytest.raises(ValueError, match=rf"^{name} is on cpu; the kernels need CUDA tensors"):
        stage.attention(**inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lse_a", "o_b", "lse_b", "out"])
def test_merge_names_the_tensor_on_the_wrong_device(lse_stage, name):
    inputs = {key: t.cuda() for key, t in partials().items()}
    inputs["out"] = torch.empty_like(inputs["o_a"])
    inputs[name] = inputs[name].cpu()
    with pytest.raises(ValueError, match=rf"^{name} is on cpu; the kernels need CUDA tensors"):
        lse_stage.merge_attention_states(**inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "cache_seqlens", "block_table", "sink_logits", "out"])
def test_decode_names_the_tensor_on_the_wrong_device(decode_stage, name):
    inputs = testing.random_decode_inputs([5, 9], 4, 2, 64, torch.float16, page_size=16)
    inputs.update(sink_logits=torch.zeros(4, device="cuda"), out=torch.empty_like(inputs["q"]))
    inputs[name] = inputs[name].cpu()
    with pytest.raises(ValueError, match=rf"^{name} is on cpu; the kernels need CUDA tensors"):
        decode_stage.decode_attention(**inputs)


# ---------------------------------------------------------------- valid edge cases, computed (Hopper GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("number", [n for n in PREFILL_STAGES if n >= 5], ids=lambda n: f"stage{n}")
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=["fp16", "bf16"])
def test_minus_inf_sink_on_rows_without_keys(impl, number, dtype):
    """Causal with S_q > S_k: the first rows see no key. Where their head's sink is -inf, O = 0
    and LSE = -inf; where it is finite, LSE = the sink. Never NaN (issue #16)."""
    stage = stages.get(number).load(impl)
    q, k, v = testing.random_qkv(2, 700, 200, 8, 2, 128, dtype, seed=16)
    sinks = torch.tensor([-math.inf, 0.5, -math.inf, -math.inf, 2.0, -1.0, -math.inf, 0.0], device="cuda")
    features = dict(causal=True, sink_logits=sinks)
    result = stage.attention(q, k, v, out=testing.poisoned_like(q), return_lse=number >= 6, **features)
    out, lse = result if number >= 6 else (result, None)
    testing.assert_attention_matches(out, q, k, v, where=f"stage {number}, -inf sinks", **features)
    empty = slice(0, 500)  # rows i < S_q - S_k see no key
    assert (out[:, empty] == 0).all(), "rows with no visible key must have O = 0 exactly"
    if lse is not None:
        assert not torch.isnan(lse).any(), "LSE has NaN"
        expected = sinks.view(1, 8, 1).expand(2, 8, 500)
        torch.testing.assert_close(lse[:, :, empty], expected, msg="empty rows: LSE = the sink logit, -inf for a -inf one")
        _, ref_lse = reference.attention(q, k, v, return_lse=True, **features)
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse.to(lse.device)[finite], rtol=1e-3, atol=1e-3)


def smallest_scale_case(number):
    """Stage ``number``'s features that meet the smallest scale: masked scores (-inf * scale), and
    rows without keys where the stage has masks; the LSE where it has one."""
    features = {}
    if number >= 4:
        features["causal"] = True  # with S_q > S_k: rows with no visible key
    if number >= 5:
        features["sink_logits"] = torch.tensor([-math.inf, 1.0, 0.0, -3.0], device="cuda")
    return features


@pytest.mark.gpu
def test_smallest_softmax_scale(prefill_stage):
    """The smallest accepted scale: every score is ~0, so each row averages its visible values."""
    number = prefill_stage.STAGE
    q, k, v = testing.random_qkv(2, 150, 100, 4, 2, 64, torch.float16, seed=3)
    features = dict(smallest_scale_case(number), softmax_scale=SMALLEST_SCALE)
    result = prefill_stage.attention(q, k, v, out=testing.poisoned_like(q), return_lse=number >= 6, **features)
    out, lse = result if number >= 6 else (result, None)
    testing.assert_attention_matches(out, q, k, v, where=f"stage {number}, softmax_scale={SMALLEST_SCALE:.3g}",
                                     **features)
    if lse is not None:
        _, ref_lse = reference.attention(q, k, v, return_lse=True, **features)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.to(lse.device)))
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse.to(lse.device)[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("number", [n for n in PREFILL_STAGES if n >= 4], ids=lambda n: f"stage{n}")
@pytest.mark.parametrize("window", [(INT32_MAX, INT32_MAX), (INT32_MAX, 0), (0, INT32_MAX)], ids=str)
def test_windows_near_int32_max(impl, number, window):
    """Window sides (and sink-token counts) up to 2**31 - 1 mean "unbounded", not an int32 wrap-around."""
    stage = stages.get(number).load(impl)
    q, k, v = testing.random_qkv(1, 300, 200, 4, 2, 128, torch.bfloat16, seed=31)
    features = dict(window_size=window, **({"num_sink_tokens": INT32_MAX} if number >= 5 else {}))
    out = stage.attention(q, k, v, out=testing.poisoned_like(q), **features)
    testing.assert_attention_matches(out, q, k, v, where=f"stage {number}, {features}", **features)


@pytest.mark.gpu
def test_decode_edge_values(decode_stage):
    """The smallest scale, a window and sink-token count of 2**31 - 1, -inf sinks on empty sequences."""
    inputs = testing.random_decode_inputs([0, 1, 300, 5000], 8, 2, 128, torch.float16, page_size=64, seed=16)
    sinks = torch.tensor([-math.inf, 0.5] * 4, device="cuda")
    for features in (dict(softmax_scale=SMALLEST_SCALE, sink_logits=sinks),
                     dict(window_size_left=INT32_MAX, num_sink_tokens=INT32_MAX, sink_logits=sinks)):
        out, lse = decode_attention_checked(decode_stage, inputs, **features)
        assert torch.isneginf(lse[0, ::2]).all() and (out[0] == 0).all(), "empty sequence, -inf sink"


def decode_attention_checked(stage, inputs, **features):
    out, lse = stage.decode_attention(**inputs, return_lse=True, num_splits=3, out=testing.poisoned_like(inputs["q"]),
                                      **features)
    testing.assert_decode_matches(out, inputs, f"decode, {features}", lse=lse, **features)
    return out, lse


# ---------------------------------------------------------------- decode under concurrency (Hopper GPU)

@pytest.mark.gpu
def test_decode_on_two_streams_at_once(decode_stage):
    """Two streams decode different batches at the same time, 50 launches each, interleaved: each
    stream has its own arrival counters, so every result is bit for bit the eager one."""
    batches = [testing.random_decode_inputs([4097, 32768, 5], 8, 2, 128, torch.float16, page_size=64, seed=1),
               testing.random_decode_inputs([70000, 1, 300, 2048, 9], 8, 2, 128, torch.float16, seed=2)]
    eager = [decode_stage.decode_attention(**inputs, num_splits=7) for inputs in batches]
    launches = 50
    outs = [[torch.full_like(inputs["q"], math.nan) for _ in range(launches)] for inputs in batches]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for i in range(launches):
        for inputs, stream, out in zip(batches, streams, outs):
            with torch.cuda.stream(stream):
                decode_stage.decode_attention(**inputs, num_splits=7, out=out[i], check_lengths=False)
    torch.cuda.synchronize()
    for b, (expected, results) in enumerate(zip(eager, outs)):
        for i, out in enumerate(results):
            assert torch.equal(out, expected), f"batch {b}, launch {i + 1} on its stream differs from the eager result"
    for stream in streams:
        with torch.cuda.stream(stream):
            counters = launch.decode_counters(batches[0]["q"].device, 1)
        assert not counters.any(), "every launch leaves its stream's counters at 0"


@pytest.mark.gpu
def test_decode_cuda_graph_replayed_1000_times(decode_stage):
    """One captured decode (auto split count, window, sinks, LSE) replayed 1000 times back to back,
    the output poisoned before each replay: every replay gives the eager result, bit for bit."""
    inputs = testing.random_decode_inputs([4097, 32768, 5, 0], 8, 2, 128, torch.float16, page_size=64, seed=4)
    features = dict(window_size_left=8191, num_sink_tokens=4, sink_logits=torch.linspace(-2, 2, 8, device="cuda"),
                    return_lse=True)
    eager_out, eager_lse = decode_stage.decode_attention(**inputs, **features)
    out = testing.poisoned_like(inputs["q"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_stage.decode_attention(**inputs, **features, out=out)  # allocate this stream's counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        _, lse = decode_stage.decode_attention(**inputs, **features, out=out)
    replays = 1000
    outs = torch.empty(replays, *out.shape, dtype=out.dtype, device="cuda")
    lses = torch.empty(replays, *lse.shape, dtype=lse.dtype, device="cuda")
    for i in range(replays):  # no host synchronization in between
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        outs[i].copy_(out)
        lses[i].copy_(lse)
    torch.cuda.synchronize()
    for i in range(replays):
        assert torch.equal(outs[i], eager_out), f"replay {i + 1} of {replays}: O differs from the eager run"
        assert torch.equal(lses[i], eager_lse), f"replay {i + 1} of {replays}: LSE differs from the eager run"
