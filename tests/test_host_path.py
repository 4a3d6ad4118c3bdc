"""The host path of every entry point: launch plans per call signature, no hidden synchronization, and
kernels that stay inside the cache when nobody checked the lengths.

CPU: the signature tells apart what validation tells apart, a failed plan is never kept, a default
decode call reads no device value. Hopper GPU: default calls never synchronize (PyTorch's sync debug
mode), a known signature still rejects bad options, unchecked bad lengths and pages stay in the cache.
"""

import os
import subprocess
import sys

import pytest
import torch

from course.runtime import kv_cache, launch, stages, validation
from course import testing

DECODE_STAGES = [7, 9]


# ---------------------------------------------------------------- signatures and plans (CPU)

def test_signature_tells_apart_what_validation_tells_apart():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert launch.signature(a) == launch.signature(b), "values never enter a signature"
    assert launch.signature(a) != launch.signature(a.t().contiguous().t()), "strides do"
    assert launch.signature(a) != launch.signature(a.half()), "dtypes do"
    assert launch.signature(a) != launch.signature(torch.zeros(5)[1:].view(2, 2)), "shapes do"
    unaligned = torch.zeros(17, dtype=torch.float16)[1:].view(2, 8)
    assert launch.signature(unaligned) != launch.signature(torch.zeros(2, 8, dtype=torch.float16)), "alignment does"
    assert launch.signature(True) != launch.signature(1)
    assert launch.signature((1.0, 0)) != launch.signature((1, 0))
    assert launch.signature((True, 0)) != launch.signature((1, 0))
    assert launch.signature(None) != launch.signature(0)


def test_a_failed_plan_is_never_kept():
    plans, calls = {}, []

    def make():
        calls.append(1)
        raise ValueError("bad input")

    for _ in range(2):
        with pytest.raises(ValueError):
            launch.cached_plan(plans, ("key",), make)
    assert not plans and len(calls) == 2, "a call that failed validation must fail again, validated again"
    assert launch.cached_plan(plans, ("key",), lambda: "plan") == "plan"
    assert launch.cached_plan(plans, ("key",), lambda: "another") == "plan", "a known signature is planned once"


def test_unhashable_arguments_are_planned_every_time():
    plans = {}
    key = launch.signature([[1, 2]])  # a list inside a list: no dictionary key
    assert launch.cached_plan(plans, key, lambda: "plan") == "plan" and not plans


def test_the_plan_table_stays_bounded():
    plans = {}
    for i in range(launch.MAX_PLANS + 10):
        launch.cached_plan(plans, (i,), lambda i=i: i)
    assert len(plans) <= launch.MAX_PLANS


@pytest.fixture
def values_read(monkeypatch):
    """Count the calls that read lengths, pages or scales on the host (a synchronization on a GPU)."""
    calls = []
    real = validation.check_decode_values

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, "check_decode_values", counting)
    monkeypatch.setattr(launch, "CHECK_LENGTHS_DEFAULT", False)
    return calls


@pytest.mark.parametrize("number", DECODE_STAGES)
def test_a_default_decode_call_reads_no_device_value(values_read, monkeypatch, impl, number):
    stage = stages.get(number).load(impl)
    inputs = testing.random_decode_inputs([5, 9], 4, 2, 64, torch.float16, device="cpu")
    inputs["cache_seqlens"] = torch.tensor([5, 999], dtype=torch.int32)  # too long: unchecked by default
    with pytest.raises(ValueError, match="CUDA"):  # every metadata check passed; the device check is last
        stage.decode_attention(**inputs)
    assert not values_read, "decode_attention read cache_seqlens on the host without being asked"
    with pytest.raises(ValueError, match="larger than the cache"):
        stage.decode_attention(**inputs, check_lengths=True)
    monkeypatch.setattr(launch, "CHECK_LENGTHS_DEFAULT", True)  # COURSE_CHECK_LENGTHS=1 at import
    with pytest.raises(ValueError, match="larger than the cache"):
        stage.decode_attention(**inputs)
    with pytest.raises(ValueError, match="CUDA"):
        stage.decode_attention(**inputs, check_lengths=False)


# ---------------------------------------------------------------- on a Hopper GPU

def decode_cases(number, stage):
    """(name, inputs) that one decode stage takes: contiguous and paged, and an FP8 cache in stage 9."""
    contiguous = testing.random_decode_inputs([300, 4097], 32, 8, 128, torch.float16, seed=1)
    paged = testing.random_decode_inputs([1, 5000], 16, 2, 64, torch.bfloat16, page_size=64, seed=2)
    cases = [("contiguous", contiguous), ("paged", paged)]
    if number == 9:
        cases.append(("fp8-paged", kv_cache.fp8_decode_inputs(paged)))
    return cases


@pytest.mark.gpu
def test_default_calls_never_synchronize(impl):
    """Under torch.cuda.set_sync_debug_mode("error"), any synchronizing call (a .item(), a copy to the host)
    raises: the first call of a signature (validation, compile, placeholders, counters) and the next ones."""
    from course.integration import ops

    prefill = stages.get(ops.PREFILL_STAGE).load(impl)
    q, k, v = testing.random_qkv(2, 300, 1000, 8, 2, 128, torch.float16)
    sinks = torch.randn(8, device="cuda")
    calls = [("prefill", lambda: prefill.attention(q, k, v, causal=True, sink_logits=sinks, return_lse=True)),
             ("prefill-window", lambda: prefill.attention(q, k, v, window_size=(64, 0), num_sink_tokens=4))]
    for number in DECODE_STAGES:
        stage = stages.get(number).load(impl)
        for name, inputs in decode_cases(number, stage):
            calls.append((f"stage {number} {name}", lambda s=stage, i=inputs: s.decode_attention(**i)))
            calls.append((f"stage {number} {name}, window and LSE",
                          lambda s=stage, i=inputs: s.decode_attention(**i, window_size_left=100, return_lse=True)))
    contiguous = decode_cases(9, None)[0][1]
    calls.append(("course::decode_attention", lambda: torch.ops.course.decode_attention(
        contiguous["q"], contiguous["k_cache"], contiguous["v_cache"], contiguous["cache_seqlens"])))
    calls.append(("course::attention", lambda: torch.ops.course.attention(q, k, v, causal=True)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, call in calls:
            for attempt in ("first", "second"):
                try:
                    call()
                except RuntimeError as error:
                    pytest.fail(f"{name}, {attempt} call: it synchronized with the GPU: {error}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_a_known_signature_still_rejects_bad_options(impl):
    from course.integration import ops

    prefill = stages.get(ops.PREFILL_STAGE).load(impl)
    q, k, v = testing.random_qkv(1, 128, 128, 4, 2, 64, torch.float16)
    prefill.attention(q, k, v, causal=True, window_size=(8, 0))
    with pytest.raises(TypeError, match="causal"):
        prefill.attention(q, k, v, causal=1, window_size=(8, 0))
    with pytest.raises(ValueError, match="window_size"):
        prefill.attention(q, k, v, causal=True, window_size=(True, 0))
    for number in DECODE_STAGES:
        stage = stages.get(number).load(impl)
        inputs = testing.random_decode_inputs([5, 70], 4, 2, 64, torch.float16, page_size=16)
        stage.decode_attention(**inputs)
        inputs["cache_seqlens"].fill_(10**6)
        with pytest.raises(ValueError, match="larger than the cache"):
            stage.decode_attention(**inputs, check_lengths=True)


@pytest.mark.gpu
@pytest.mark.parametrize("number", DECODE_STAGES)
def test_unchecked_lengths_and_pages_stay_in_the_cache(impl, number):
    """Nobody checked the values: lengths past the cache read as the cache's capacity, pages outside the
    pool as a page of the pool. Never an illegal address (compute-sanitizer's memcheck says more)."""
    stage = stages.get(number).load(impl)
    inputs = testing.random_decode_inputs([100, 4097], 8, 2, 128, torch.float16, seed=5)
    capacity = inputs["k_cache"].shape[1]
    expected = stage.decode_attention(**{**inputs, "cache_seqlens": torch.full_like(inputs["cache_seqlens"],
                                                                                   capacity)})
    too_long = stage.decode_attention(**{**inputs, "cache_seqlens": inputs["cache_seqlens"] + 10**6})
    torch.cuda.synchronize()
    # Sequence 0's slots past its 100 tokens are NaN (random_decode_inputs): both read them, alike.
    torch.testing.assert_close(too_long, expected, rtol=0, atol=0, equal_nan=True,
                               msg="a length past the cache must read as the cache's capacity")
    paged = testing.random_decode_inputs([100, 4097], 8, 2, 128, torch.float16, page_size=64, seed=6)
    for bad_page in (10**6, -5):
        paged["block_table"][1, 3] = bad_page
        out = stage.decode_attention(**paged)
        torch.cuda.synchronize()  # an illegal address would surface here
        assert out.shape == paged["q"].shape


def test_the_environment_variable_sets_the_default():
    """COURSE_CHECK_LENGTHS=1, read at import, turns the checks on for calls that leave check_lengths None."""
    code = "from course import launch; print(launch.check_device_values(None), launch.check_device_values(False))"
    for value, expected in (("1", "True False"), ("", "False False")):
        env = {**os.environ, "COURSE_CHECK_LENGTHS": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == expected.split(), f"COURSE_CHECK_LENGTHS={value!r}: {out.stdout}{out.stderr}"
