"""The FP8 KV cache's host side (stage 9), on the CPU: quantization, the reference on an FP8
cache, and the validation of caches and scales that every decode entry point runs."""

import pytest
import torch

from course.runtime import kv_cache, validation
from course.testing import reference
from course import testing


def decode_inputs(lengths=(5, 9), h_q=4, h_kv=2, d=64, page_size=None):
    return testing.random_decode_inputs(list(lengths), h_q, h_kv, d, torch.float16, page_size=page_size, device="cpu")


def fp8_inputs(**sizes):
    return kv_cache.fp8_decode_inputs(decode_inputs(**sizes))


def check(inputs, stage=9):
    names = ("block_table", "softmax_scale", "window_size_left", "sink_logits", "num_sink_tokens", "k_scale", "v_scale",
             "k_new", "v_new", "rotary_cos", "rotary_sin", "rotary_interleaved", "alibi_slopes", "cache_capacity")
    return validation.check_decode_inputs(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["cache_seqlens"],
                                          stage=stage, **{n: inputs[n] for n in names if n in inputs})


@pytest.mark.parametrize("page_size", [None, 16])
def test_quantize_keeps_e4m3_precision(page_size):
    """Every element comes back within e4m3's rounding: 2**-4 relative, 2**-10 * scale absolute when subnormal."""
    inputs = decode_inputs(h_kv=3, page_size=page_size)
    k, v = inputs["k_cache"], inputs["v_cache"]
    k, v = k * torch.tensor([1.0, 30.0, 1e-3], dtype=k.dtype).view(1, 1, 3, 1), v  # heads of different ranges
    k8, v8, k_scale, v_scale = kv_cache.quantize_kv_cache(k, v)
    assert k8.dtype == v8.dtype == torch.float8_e4m3fn and k8.shape == k.shape
    assert k_scale.dtype == torch.float32 and k_scale.shape == (3,)
    for cache, quantized, scale in ((k, k8, k_scale), (v, v8, v_scale)):
        original = cache.float()
        used = original.isfinite()  # slots no sequence owns are NaN (testing.random_decode_inputs)
        assert kv_cache.dequantize(quantized, scale)[~used].isnan().all(), "a NaN slot must stay NaN"
        error = (kv_cache.dequantize(quantized, scale) - original).abs()[used]
        bound = torch.maximum(original.abs() * 2**-4, 2**-10 * scale.view(1, 1, -1, 1))[used] * 1.001
        assert (error <= bound).all(), f"largest error over its bound: {(error / bound).max():.3f}"
        amax = torch.where(used, original.abs(), 0.0).amax(dim=(0, 1, 3))
        assert torch.allclose(amax / scale, torch.full_like(amax, kv_cache.E4M3_MAX)), "amax must map to 448"


def test_quantize_gives_an_all_zero_head_scale_one():
    k = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    k[:, :, 1] = 1.0
    _, _, k_scale, _ = kv_cache.quantize_kv_cache(k, k)
    assert k_scale.tolist() == [1.0, torch.tensor(1.0 / kv_cache.E4M3_MAX, dtype=torch.float32).item()]


def test_quantize_rejects_what_it_cannot_quantize():
    k = torch.randn(1, 4, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="one shape"):
        kv_cache.quantize_kv_cache(k, k[:, :2])
    with pytest.raises(TypeError, match="16- or 32-bit float cache"):
        kv_cache.quantize_kv_cache(k.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("page_size", [None, 16])
def test_reference_dequantizes_an_fp8_cache(page_size):
    """The reference on an FP8 cache with scales is the reference on the cache it stands for."""
    inputs = fp8_inputs(h_q=8, h_kv=2, page_size=page_size)
    common = {n: inputs[n] for n in ("q", "cache_seqlens", "block_table") if n in inputs}
    o, lse = reference.decode_attention(k_cache=inputs["k_cache"], v_cache=inputs["v_cache"], k_scale=inputs["k_scale"],
                                        v_scale=inputs["v_scale"], return_lse=True, **common)
    k, v = (kv_cache.dequantize(inputs[c], inputs[s], torch.float64) for c, s in (("k_cache", "k_scale"),
                                                                                 ("v_cache", "v_scale")))
    o_expected, lse_expected = reference.decode_attention(k_cache=k, v_cache=v, return_lse=True, **common)
    torch.testing.assert_close(o, o_expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_expected)


def test_reference_takes_scalar_scales():
    inputs = fp8_inputs(h_kv=2)
    common = {n: inputs[n] for n in ("q", "k_cache", "v_cache", "cache_seqlens")}
    scalar = reference.decode_attention(**common, k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0))
    per_head = reference.decode_attention(**common, k_scale=torch.tensor([0.5, 0.5]), v_scale=torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(scalar, per_head, rtol=0, atol=0)


def test_validation_accepts_an_fp8_cache_with_scales():
    for sizes in ({}, {"page_size": 16}):
        inputs = fp8_inputs(**sizes)
        check(inputs)
        validation.check_kv_scale_values(inputs["k_scale"], inputs["v_scale"])
    check({**fp8_inputs(), "k_scale": torch.tensor(0.5), "v_scale": torch.tensor(2.0)})  # scalar scales


def test_stages_before_9_name_stage_9_for_an_fp8_cache():
    int8 = kv_cache.quantized_decode_inputs(decode_inputs(), torch.int8)
    for inputs in (fp8_inputs(), int8, {**decode_inputs(), "k_scale": torch.ones(2), "v_scale": torch.ones(2)}):
        with pytest.raises(NotImplementedError, match="quantized KV cache .* not implemented in stage 7; stage 9"):
            check(inputs, stage=7)


@pytest.mark.parametrize("extra", [{"k_new": torch.zeros(2, 2, 64)}, {"alibi_slopes": torch.ones(4)},
                                   {"cache_capacity": 8}, {"rotary_interleaved": True}],
                         ids=["k_new", "alibi_slopes", "cache_capacity", "rotary_interleaved"])
def test_stages_before_9_name_stage_9_for_the_serving_extras(extra):
    with pytest.raises(NotImplementedError, match=f"{next(iter(extra))} is not implemented in stage 7; stage 9"):
        check({**decode_inputs(), **extra}, stage=7)


def test_int8_quantization_rounds_to_nearest_even_and_clamps():
    x = torch.tensor([[[[0.5, 1.5, 2.5, -0.5, 200.0, -200.0, 126.6, 3.0]]]])
    assert kv_cache.quantize_rows(x, torch.tensor(1.0), torch.int8).flatten().tolist() == [0, 2, 2, 0, 127, -127, 127, 3]
    k8, _, k_scale, _ = kv_cache.quantize_kv_cache(x, x, torch.int8)
    assert k_scale.tolist() == [torch.tensor(200.0 / 127, dtype=torch.float32).item()] and k8.abs().max().item() == 127


BAD_FP8 = {  # name: (change to valid FP8 inputs, exception, what the message says)
    "k_scale-missing": (dict(k_scale=None), ValueError, r"a torch.float8_e4m3fn cache needs k_scale"),
    "v_scale-missing": (dict(v_scale=None), ValueError, r"a torch.float8_e4m3fn cache needs v_scale"),
    "k_scale-float16": (dict(k_scale=torch.ones(2, dtype=torch.float16)), TypeError, r"k_scale has dtype .*float32"),
    "v_scale-list": (dict(v_scale=[1.0, 1.0]), TypeError, r"v_scale must be a torch.Tensor"),
    "k_scale-per-query-head": (dict(k_scale=torch.ones(4)), ValueError, r"k_scale has shape \(4,\); expected \[H_kv\]"),
    "v_cache-float16": (dict(v_cache="fp16"), TypeError, r"k_cache and v_cache must share one dtype"),
    "q-fp8": (dict(q="fp8"), TypeError, r"q has dtype torch.float8_e4m3fn; supported: torch.float16, torch.bfloat16"),
}


@pytest.mark.parametrize("change, error, message", BAD_FP8.values(), ids=BAD_FP8.keys())
def test_validation_rejects_bad_fp8_arguments(change, error, message):
    inputs = fp8_inputs()
    for name, value in change.items():
        if value == "fp16":
            value = inputs[name].to(torch.float16)
        elif value == "fp8":
            value = inputs[name].to(torch.float8_e4m3fn)
        inputs[name] = value
    with pytest.raises(error, match=message):
        check(inputs)


def test_validation_rejects_scales_for_a_16_bit_cache():
    with pytest.raises(ValueError, match=r"k_scale and v_scale describe a quantized cache .* torch.float16"):
        check({**decode_inputs(), "k_scale": torch.ones(2), "v_scale": torch.ones(2)})


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_scale_values_must_be_finite_and_positive(value):
    with pytest.raises(ValueError, match=r"v_scale\[1\] = .*; scales must be finite and > 0"):
        validation.check_kv_scale_values(torch.ones(2), torch.tensor([1.0, value]))
