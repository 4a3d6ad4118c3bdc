"""The "course" attention backend for transformers (course/integration/models.py).

CPU: the argument mapping against transformers' own eager attention and mask functions, small GPT-OSS,
Llama and Qwen2 models on the float64 reference (prompt and decode steps, dynamic and static caches,
torch.compile), and the inputs the backend refuses. Hopper GPU: the same models on the kernels, in bf16 and
fp16, within 2x of transformers' eager error against eager fp32; torch.compile; a CUDA graph of a decode step.
"""

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: these tests need the models extra, "
                           "pip install -e '.[models]'")

from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager  # noqa: E402

from course.integration import models, ops  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture
def fresh_dynamo():
    """Dynamo's compiled code starts empty: each test compiles transformers' forward for its own model, and
    the graphs of earlier tests' models would count against the recompile limit of the same code."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def backed_by():
    """``backed_by(**setting)`` switches what backs the ops for one test; the setting is restored after it."""
    before = ops.backing()
    yield ops.use_stages
    ops.use_stages(**dataclasses.asdict(before))


# ---------------------------------------------------------------- the argument mapping, one layer (CPU)

def transformers_attention(q, k, v, *, scaling, sliding_window, sinks, query_offset):
    """transformers' own eager attention (GPT-OSS's with sinks, Llama's without) in float64, with the mask
    from its own mask functions. q [B, H_q, S_q, D], k/v [B, H_kv, S_k, D]; query i is token query_offset + i."""
    q_idx = torch.arange(q.shape[2])[:, None] + query_offset
    kv_idx = torch.arange(k.shape[2])[None, :]
    visible = (sliding_window_causal_mask_function(sliding_window) if sliding_window
               else causal_mask_function)(0, 0, q_idx, kv_idx)
    mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, -math.inf)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False,
                             sinks=None if sinks is None else sinks.double())
    eager = gpt_oss_eager if sinks is not None else llama_eager
    out, _ = eager(module, q.double(), k.double(), v.double(), mask, scaling=scaling)
    return out


def layer_inputs(seqlen_q, seqlen_k, dtype, *, layout, sinks, seed=0):
    """q [B, 8, S_q, 64] and k, v [B, 2, S_k, 64] as transformers hands them over: BHSD-contiguous, or
    transposed views of BSHD memory (what a projection followed by .transpose(1, 2) gives)."""
    gen = torch.Generator().manual_seed(seed)

    def make(heads, seqlen):
        if layout == "bhsd":
            return torch.randn(2, heads, seqlen, 64, generator=gen).to(dtype)
        return torch.randn(2, seqlen, heads, 64, generator=gen).to(dtype).transpose(1, 2)

    q, k, v = make(8, seqlen_q), make(2, seqlen_k), make(2, seqlen_k)
    return q, k, v, (torch.randn(8, generator=gen) * 2).to(dtype) if sinks else None


MAPPING_CASES = {  # (S_q, S_k, sliding_window): prompt, chunk after a cache, decode steps
    "prompt-full": (40, 40, None), "prompt-window1": (40, 40, 1), "prompt-window7": (40, 40, 7),
    "chunk-after-cache-window7": (10, 50, 7), "decode-full": (1, 50, None), "decode-window1": (1, 50, 1),
    "decode-window7": (1, 50, 7), "decode-window-longer-than-cache": (1, 5, 7),
}


@pytest.mark.parametrize("layout", ["bhsd", "bshd-view"])
@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no-sinks"])
@pytest.mark.parametrize("case", MAPPING_CASES.values(), ids=MAPPING_CASES.keys())
def test_backend_matches_transformers_eager_attention(backed_by, case, sinks, layout):
    """sliding_window = W is W keys with the query's own (left bound W - 1), s_aux is the sink logit,
    scaling the softmax scale, GQA from the shapes: the backend's output is transformers' eager result
    (float64, its own mask functions) up to the rounding of the fp16 output."""
    backed_by(impl="reference")
    seqlen_q, seqlen_k, window = case
    q, k, v, s_aux = layer_inputs(seqlen_q, seqlen_k, torch.float16, layout=layout, sinks=sinks)
    out, weights = models.attention_forward(SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.2,
                                            sliding_window=window, s_aux=s_aux)
    expected = transformers_attention(q, k, v, scaling=0.2, sliding_window=window, sinks=s_aux,
                                      query_offset=seqlen_k - seqlen_q)
    assert weights is None and out.shape == (2, seqlen_q, 8, 64) and out.dtype == torch.float16
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-3)


def test_static_cache_free_slots_are_not_attended(backed_by):
    """With a StaticCache the keys include free slots; the backend's mask is the count of real keys."""
    backed_by(impl="reference")
    q, k, v, s_aux = layer_inputs(1, 64, torch.float16, layout="bhsd", sinks=True)
    k[:, :, 30:], v[:, :, 30:] = float("nan"), float("nan")  # free slots
    counts = models.visible_key_counts(2, 1, kv_length=64, q_offset=torch.tensor(29), device="cpu")
    out, _ = models.attention_forward(SimpleNamespace(is_causal=True), q, k, v, counts, scaling=0.2,
                                      sliding_window=7, s_aux=s_aux)
    expected = transformers_attention(q, k[:, :, :30], v[:, :, :30], scaling=0.2, sliding_window=7,
                                      sinks=s_aux, query_offset=29)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-3)


def test_mask_counts_the_real_keys():
    """DynamicCache: a prompt's keys are all real (no mask); a decode step gets their count, made once per
    forward for every layer. StaticCache: the count from the cache's counter, on the device."""
    assert models.visible_key_counts(2, 48, kv_length=48) is None                              # a prompt
    for counts in (models.visible_key_counts(2, 1, kv_length=51, q_offset=50, device="cpu"),  # full layer
                   models.visible_key_counts(2, 1, kv_length=51, q_offset=300, kv_offset=250, device="cpu")):
        assert counts.tolist() == [51, 51] and counts.dtype == torch.int32
    for batch in (3, 1):  # the kernels take the counts with a unit stride, one sequence too
        counts = models.visible_key_counts(batch, 1, kv_length=64, q_offset=torch.tensor(9), device="cpu")
        assert counts.tolist() == [10] * batch and counts.dtype == torch.int32 and counts.stride() == (1,)


# ---------------------------------------------------------------- whole models (CPU: reference; GPU: kernels)

def cpu_config(family):
    """Small models whose windows (16 keys) prompts of 48 tokens cross: an off-by-one shows in the logits."""
    small = dict(num_layers=2, hidden_size=256, vocab_size=512)
    if family == "gpt-oss":
        return models.gpt_oss_config(**small, sliding_window=16)
    if family == "llama":
        return models.llama_config(**small)
    return transformers.Qwen2Config(num_hidden_layers=2, hidden_size=512, intermediate_size=512, vocab_size=512,
                                    num_attention_heads=8, num_key_value_heads=2, use_sliding_window=True,
                                    sliding_window=16, max_window_layers=1)


def build(config, device):
    return models.random_model(config, device=device, experts_implementation="batched_mm")


def token_ids(config, batch, seqlen, device):
    return torch.randint(0, config.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(1)).to(device)


def assert_within_yardstick(logits, baseline, reference, where):
    report = models.logit_errors(logits, baseline, reference)
    assert report.ok, f"{where}: the course backend's logits are off: {report}"


def check_full_sequence(config, dtype, ids):
    reference = build(config, ids.device)
    with torch.no_grad():
        expected = reference(ids).logits
        baseline = models.in_dtype(reference, dtype, "eager")(ids).logits
        logits = models.in_dtype(reference, dtype, "course")(ids).logits
    assert_within_yardstick(logits, baseline, expected, f"{config.model_type} {dtype}, full sequence")


def check_incremental(config, dtype, ids, prompt, make_cache=None, step=1):
    """The prompt through the prefill op, then ``step`` tokens per forward through the decode op over the cache
    (one token, or draft tokens)."""
    reference = build(config, ids.device)
    with torch.no_grad():
        expected = reference(ids).logits[:, prompt - 1:]
        runs = {}
        for name in ("eager", "course"):
            model = models.in_dtype(reference, dtype, name)
            runs[name] = models.incremental_logits(model, ids, prompt, make_cache(model) if make_cache else None,
                                                   step=step)
    for step in range(expected.shape[1]):
        assert_within_yardstick(runs["course"][:, step], runs["eager"][:, step], expected[:, step],
                                f"{config.model_type} {dtype}, position {prompt - 1 + step}")


FAMILIES = ["gpt-oss", "llama", "qwen2"]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", FAMILIES)
def test_full_sequence_logits_on_the_reference(backed_by, family, dtype):
    backed_by(impl="reference")
    config = cpu_config(family)
    check_full_sequence(config, dtype, token_ids(config, 2, 48, "cpu"))


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decode_on_the_reference(backed_by, family):
    backed_by(impl="reference")
    config = cpu_config(family)
    check_incremental(config, torch.bfloat16, token_ids(config, 2, 48, "cpu"), prompt=30)


def head_dim_config(head_dim: int):
    """A small Llama at a head dim other than 64, 128 and 256 (Phi-2's 80, Phi-3's 96, 192): prefill and decode
    both take it (stage 9's decode computes it padded)."""
    return models.llama_config(num_layers=2, hidden_size=256, vocab_size=512, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [80, 96, 192])
def test_incremental_decode_at_other_head_dims_on_the_reference(backed_by, head_dim):
    backed_by(impl="reference")
    config = head_dim_config(head_dim)
    check_incremental(config, torch.bfloat16, token_ids(config, 2, 40, "cpu"), prompt=30)


@pytest.mark.parametrize("check", ["full", "incremental"])
def test_deepseek_v3_mla_on_the_reference(backed_by, check):
    """DeepSeek-V3's attention: q and k of 192 columns, v of 128, through prefill and decode."""
    backed_by(impl="reference")
    config = models.deepseek_v3_config(num_layers=2, hidden_size=256, vocab_size=512)
    ids = token_ids(config, 2, 40, "cpu")
    if check == "full":
        check_full_sequence(config, torch.bfloat16, ids)
    else:
        check_incremental(config, torch.bfloat16, ids, prompt=30)


STATIC_CACHES = {
    "StaticCache": lambda model: transformers.StaticCache(config=model.config, max_cache_len=64),
    "graph-safe": lambda model: models.graph_safe_cache(model, max_cache_len=64),
}


@pytest.mark.parametrize("make_cache", STATIC_CACHES.values(), ids=STATIC_CACHES.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_static_caches_on_the_reference(backed_by, family, make_cache):
    """A static cache holds free slots: the prompt's keys are cut to the real ones, decode gets their count.
    (transformers' StaticCache gives the window layers a ring of 16 slots; the graph-safe one keeps all.)"""
    backed_by(impl="reference")
    config = cpu_config(family)
    check_incremental(config, torch.bfloat16, token_ids(config, 2, 48, "cpu"), prompt=30, make_cache=make_cache)


def counting_draft_calls(monkeypatch) -> list:
    """The shapes of the queries the decode op gets with draft tokens (q [B, n, H_q, D]), recorded as it runs:
    behind the op (a traced model's call) and its eager shortcut alike."""
    calls, decode = [], ops._decode

    def counted(q, *args, **kwargs):
        if q.dim() == 4:
            calls.append(tuple(q.shape))
        return decode(q, *args, **kwargs)
    monkeypatch.setattr(ops, "_decode", counted)
    return calls


DRAFT_CACHES = {"dynamic": None, **STATIC_CACHES}


@pytest.mark.parametrize("make_cache", DRAFT_CACHES.values(), ids=DRAFT_CACHES.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_draft_tokens_on_the_reference(backed_by, monkeypatch, family, make_cache):
    """Forwards of 4 tokens over the cache (assisted generation's verification) run on the decode op as draft
    tokens, windows sliding, next to eager at every position; with autograd on they stay on prefill."""
    backed_by(impl="reference")
    config = cpu_config(family)
    calls = counting_draft_calls(monkeypatch)
    check_incremental(config, torch.bfloat16, token_ids(config, 2, 46, "cpu"), prompt=30, make_cache=make_cache,
                      step=4)
    assert calls and all(shape[:2] == (2, 4) for shape in calls), f"draft forwards on the decode op: {calls}"
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    before = len(calls)
    models.incremental_logits(model, token_ids(config, 2, 34, "cpu"), 30, step=4)  # grad enabled, weights need it
    assert len(calls) == before, "a forward autograd records must not take the decode op (it has no backward)"


def assisted_generation(model, assistant, ids, new_tokens: int = 12):
    """Greedy ``generate`` of ``model`` alone and with ``assistant`` proposing 3 tokens per step (speculative
    decoding: the model verifies each draft in one forward of 4 tokens), with their logits."""
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # a random assistant drafts all 3 anyway
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        return model.generate(ids, **options), model.generate(ids, assistant_model=assistant, **options)


@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_assisted_generation_on_the_reference(backed_by, monkeypatch, family):
    """``generate(assistant_model=...)``: the course model verifies each draft on the decode op (draft tokens)
    and generates the tokens it generates alone."""
    backed_by(impl="reference")
    config = cpu_config(family)
    reference = build(config, "cpu")
    calls = counting_draft_calls(monkeypatch)
    alone, assisted = assisted_generation(models.in_dtype(reference, torch.bfloat16, "course"),
                                          models.in_dtype(reference, torch.bfloat16, "eager"),
                                          token_ids(config, 1, 30, "cpu"))
    assert calls and all(shape[1] == 4 for shape in calls), f"the drafts' verification on the decode op: {calls}"
    assert_same_greedy_generation(assisted, alone, f"{family}, assisted generation")


# ---------------------------------------------------------------- a quantized KV cache in the model

QUANTIZED = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def check_quantized(config, dtype, ids, prompt, cache_dtype, max_cache_len=None, step=1):
    """The course backend over ``models.quantized_cache`` (its decode steps read the cache as stored, with the
    scales), next to eager attention over the same cache dequantized (``dequantized=True``), against eager
    float32 over it: the usual yardstick, with the cache's rounding in all three. The logits must differ
    from a 16-bit cache's: otherwise nothing was quantized."""
    reference = build(config, ids.device)
    runs = {}
    with torch.no_grad():
        for name, model_dtype, backend in (("float32", torch.float32, "eager"), ("eager", dtype, "eager"),
                                           ("course", dtype, "course")):
            model = models.in_dtype(reference, model_dtype, backend)
            cache = models.quantized_cache(model, cache_dtype, max_cache_len, dequantized=backend == "eager")
            runs[name] = models.incremental_logits(model, ids, prompt, cache, step=step)
        sixteen_bit = models.incremental_logits(models.in_dtype(reference, dtype, "course"), ids, prompt, step=step)
    where = f"{config.model_type} {dtype}, {cache_dtype} cache" + (f" of {max_cache_len} slots" if max_cache_len else "")
    for step in range(runs["course"].shape[1]):
        assert_within_yardstick(runs["course"][:, step], runs["eager"][:, step], runs["float32"][:, step],
                                f"{where}, position {prompt - 1 + step}")
    assert not torch.equal(runs["course"], sixteen_bit), f"{where}: the logits of a 16-bit cache: K and V unquantized?"


@pytest.mark.parametrize("max_cache_len", [None, 64], ids=["dynamic", "static"])
@pytest.mark.parametrize("cache_dtype", QUANTIZED.values(), ids=QUANTIZED.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_quantized_cache_on_the_reference(backed_by, family, cache_dtype, max_cache_len):
    backed_by(impl="reference")
    config = cpu_config(family)
    check_quantized(config, torch.bfloat16, token_ids(config, 2, 48, "cpu"), 30, cache_dtype, max_cache_len)


def test_quantized_cache_with_draft_tokens_on_the_reference(backed_by, monkeypatch):
    """Draft tokens read a quantized cache as stored, like one-token steps."""
    backed_by(impl="reference")
    config = cpu_config("gpt-oss")
    calls = counting_draft_calls(monkeypatch)
    check_quantized(config, torch.bfloat16, token_ids(config, 2, 46, "cpu"), 30, torch.float8_e4m3fn, 64, step=4)
    assert calls, "the draft forwards did not reach the decode op"


@pytest.mark.parametrize("cache_dtype", QUANTIZED.values(), ids=QUANTIZED.keys())
def test_quantized_cache_layer_stores_what_the_kernel_reads(cache_dtype):
    """The prompt sets each KV head's scale (CALIBRATION_HEADROOM x its largest magnitude on the format's
    largest value); every update stores ``kv_cache.quantize_rows`` of its rows with those scales, larger
    values clamped; a reset calibrates again."""
    from course.runtime import kv_cache

    model = models.in_dtype(models.random_model(cpu_config("llama")), torch.bfloat16, "course")
    heads = model.config.num_key_value_heads
    gen = torch.Generator().manual_seed(0)
    spread = torch.linspace(0.25, 4.0, heads)[:, None, None]
    prompt = [(torch.randn(2, heads, 10, 8, generator=gen) * spread).to(torch.bfloat16) for _ in range(2)]
    step = [torch.randn(2, heads, 1, 8, generator=gen).to(torch.bfloat16) * 50 for _ in range(2)]
    for cache in (models.quantized_cache(model, cache_dtype), models.quantized_cache(model, cache_dtype, 16)):
        layer = cache.layers[0]
        layer.update(*prompt)
        for scale, states in zip(layer.scales, prompt):
            amax = states.float().abs().amax(dim=(0, 2, 3))
            torch.testing.assert_close(scale, amax * models.CALIBRATION_HEADROOM / kv_cache.QUANTIZED_DTYPES[cache_dtype],
                                       rtol=0, atol=0)
        keys, values = layer.update(*step)
        assert keys.dtype == values.dtype == cache_dtype
        for stored, index in ((keys, 0), (values, 1)):
            rows = torch.cat([prompt[index], step[index]], dim=2)
            expected = kv_cache.quantize_rows(rows, layer.scales[index].view(1, -1, 1, 1), cache_dtype)
            assert torch.equal(stored[:, :, :11].view(torch.uint8), expected.view(torch.uint8)), type(layer).__name__
            assert stored[:, :, 10].float().abs().max() == kv_cache.QUANTIZED_DTYPES[cache_dtype], "the step's rows clamp"
        before = layer.scales[0].clone()
        layer.reset()
        layer.update(step[0], step[1])
        assert not torch.equal(layer.scales[0], before), f"{type(layer).__name__}: a reset cache kept the old scales"


def test_quantized_cache_takes_fp8_and_int8_only():
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.int8"):
        models.quantized_cache(models.random_model(cpu_config("llama")), torch.float16)


def test_quantized_cache_traces_in_one_graph(backed_by, fresh_dynamo):
    """Dynamo traces a decode step over a static quantized cache without a graph break (the layer's checks
    and the backend's scales are Python it resolves while tracing), with the eager steps' logits."""
    backed_by(impl="reference")
    config = cpu_config("llama")
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    ids = token_ids(config, 2, 24, "cpu")
    with torch.no_grad():
        eager = models.incremental_logits(model, ids, 16, models.quantized_cache(model, max_cache_len=32))
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        cache = models.quantized_cache(model, max_cache_len=32)
        logits = [model(ids[:, :16], past_key_values=cache, use_cache=True).logits[:, -1]]  # the prompt eagerly
        logits += [compiled(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1] for i in range(16, 24)]
    assert torch.equal(torch.stack(logits, dim=1), eager)


def test_quantized_caches_take_turns_and_belong_to_their_model(backed_by):
    """Two caches of one model, made before either runs, give each its own logits (the attention modules
    point at the cache that ran last); a cache of another model object, or read by an attention
    implementation that cannot take FP8 without ``dequantized``, raises saying what to do."""
    backed_by(impl="reference")
    config = cpu_config("llama")
    reference = build(config, "cpu")
    model = models.in_dtype(reference, torch.bfloat16, "course")
    ids = token_ids(config, 2, 24, "cpu")
    with torch.no_grad():
        alone = [models.incremental_logits(model, ids, 16, models.quantized_cache(model, dtype)) for dtype in QUANTIZED.values()]
        caches = [models.quantized_cache(model, dtype) for dtype in QUANTIZED.values()]
        turns = [[], []]
        for start, end in [(0, 16)] + [(i, i + 1) for i in range(16, 24)]:  # the prompt, then steps, in turns
            for cache, logits in zip(caches, turns):
                logits.append(model(ids[:, start:end], past_key_values=cache, use_cache=True).logits[:, -1])
        for first, second in zip(alone, turns):
            assert torch.equal(first, torch.stack(second, dim=1)), "two quantized caches taking turns gave other logits"
        with pytest.raises(ValueError, match="made for another model object"):
            models.incremental_logits(model, ids, 16, models.quantized_cache(models.in_dtype(reference, torch.bfloat16,
                                                                                         "course")))
        eager = models.in_dtype(reference, torch.bfloat16, "eager")
        with pytest.raises(ValueError, match="cannot read a quantized KV cache.*dequantized=True"):
            models.incremental_logits(eager, ids, 16, models.quantized_cache(eager))


@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_torch_compile_fullgraph_of_a_model(backed_by, fresh_dynamo, family):
    """Dynamo traces the whole model through the ops' fake implementations, without a graph break."""
    backed_by(impl="reference")
    config = cpu_config(family)
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    ids = token_ids(config, 2, 40, "cpu")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_draft_tokens_under_torch_compile(backed_by, fresh_dynamo, monkeypatch):
    """A forward of 4 tokens over a cache, traced whole (fullgraph): the decode op with draft tokens, through
    its fake implementation, gives the eager forward's logits."""
    backed_by(impl="reference")
    config = cpu_config("gpt-oss")
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    ids = token_ids(config, 2, 34, "cpu")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(ids[:, :30], past_key_values=cache, use_cache=True)
        twin = copy.deepcopy(cache)
        calls = counting_draft_calls(monkeypatch)
        expected = model(ids[:, 30:], past_key_values=cache, use_cache=True).logits
        eager_calls = len(calls)
        got = compiled(ids[:, 30:], past_key_values=twin, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert eager_calls and len(calls) == 2 * eager_calls and all(shape[1] == 4 for shape in calls), (
        f"both forwards' layers on the decode op with 4 draft tokens: {calls}")


# ---------------------------------------------------------------- what the backend refuses (CPU)

@pytest.fixture
def small_gpt_oss(backed_by):
    backed_by(impl="reference")
    config = cpu_config("gpt-oss")
    return models.in_dtype(build(config, "cpu"), torch.bfloat16, "course"), token_ids(config, 2, 20, "cpu")


def padded_mask(ids, padding=(0, 5), left=True):
    """A mask of ``ids`` [B, S] with ``padding[b]`` pad tokens at the start (left) or the end of sequence b."""
    mask = torch.ones_like(ids)
    for b, n in enumerate(padding):
        if n:
            mask[b, :n] = 0 if left else 1
            if not left:
                mask[b, -n:] = 0
    return mask


def check_padded(config, dtype, ids, mask, prompt):
    """A padded batch, prompt then decode steps: the course backend next to eager, at every real position."""
    reference = build(config, ids.device)
    with torch.no_grad():
        expected = models.incremental_logits(reference, ids, prompt, attention_mask=mask)
        runs = {name: models.incremental_logits(models.in_dtype(reference, dtype, name), ids, prompt,
                                                attention_mask=mask) for name in ("eager", "course")}
    for step in range(expected.shape[1]):
        assert_within_yardstick(runs["course"][:, step], runs["eager"][:, step], expected[:, step],
                                f"{config.model_type} {dtype}, padded batch, position {prompt - 1 + step}")


@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_left_padded_batch_on_the_reference(backed_by, family):
    """Prompts of different lengths, left-padded as generate pads them: prompt and decode steps on
    course::attention_varlen (the real queries and keys packed), next to eager at every real position."""
    backed_by(impl="reference")
    config = cpu_config(family)
    ids = token_ids(config, 3, 40, "cpu")
    check_padded(config, torch.bfloat16, ids, padded_mask(ids, (0, 7, 19)), prompt=30)


def test_right_padded_prompt_on_the_reference(backed_by):
    """Right padding (a prompt batch of a classifier): the real rows match eager; padded rows are 0."""
    backed_by(impl="reference")
    config = cpu_config("llama")
    ids = token_ids(config, 2, 30, "cpu")
    mask = padded_mask(ids, (0, 9), left=False)
    reference = build(config, "cpu")
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        baseline = models.in_dtype(reference, torch.bfloat16, "eager")(ids, attention_mask=mask).logits
        logits = models.in_dtype(reference, torch.bfloat16, "course")(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_within_yardstick(logits[real], baseline[real], expected[real], "llama, right-padded prompt")


PADDED_GENERATE_CACHES = {  # (a static cache, the dynamic cache with the same values)
    **{name: (make, lambda model: None) for name, make in STATIC_CACHES.items()},
    "quantized": (lambda model: models.quantized_cache(model, max_cache_len=64), models.quantized_cache),
}


@pytest.mark.parametrize("caches", PADDED_GENERATE_CACHES.values(), ids=PADDED_GENERATE_CACHES.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_generate_a_left_padded_batch_over_a_static_cache(backed_by, family, caches):
    """``generate`` with a compileable (static) cache makes the masks before the forward (``.contiguous()`` on
    each, a padded batch's too) and hands them to the model: eagerly, it generates the tokens of the same
    values in a dynamic cache."""
    backed_by(impl="reference")
    config = cpu_config(family)
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    ids = token_ids(config, 2, 30, "cpu")
    options = dict(attention_mask=padded_mask(ids, (0, 7)), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                   pad_token_id=0)
    make_static, make_dynamic = caches
    with torch.no_grad():
        dynamic = model.generate(ids, past_key_values=make_dynamic(model), **options)
        static = model.generate(ids, past_key_values=make_static(model), **options)
    assert torch.equal(static, dynamic), f"{family}: generate over a static cache chose other tokens for a padded batch"


@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_padded_prompts_under_torch_compile(backed_by, fresh_dynamo, family):
    """A forward traced in one graph (fullgraph) with a padded mask, which it cannot read: left and right
    padding run row by row (``PaddedBatch.row_sequences``) and give the eager forward's logits, which
    packs the real tokens, at every position, padding included."""
    backed_by(impl="reference")
    config = cpu_config(family)
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    ids = token_ids(config, 3, 30, "cpu")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for left in (True, False):
        mask = padded_mask(ids, (0, 7, 29), left=left)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, attention_mask=mask).logits,
                                       model(ids, attention_mask=mask).logits, rtol=0, atol=0)


@pytest.mark.parametrize("padding", [None, (0, 7, 19)], ids=["equal-lengths", "left-padded"])
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_generate_under_torch_compile(backed_by, fresh_dynamo, family, padding):
    """``generate`` over a static cache compiles its decode step in one graph (fullgraph), the masks made
    before it: a left-padded batch's steps read the cache in place, the padding skipped (stage 9's
    ``cache_leftpad``); the tokens are the eager generation's."""
    from transformers import CompileConfig

    backed_by(impl="reference")
    config = cpu_config(family)
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    ids = token_ids(config, 3, 30, "cpu")
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True)
    compile_config._compile_all_devices = True  # generate compiles on accelerators only, unless told
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    if padding is not None:
        options["attention_mask"] = padded_mask(ids, padding)
    with torch.no_grad():
        eager = model.generate(ids, **options, disable_compile=True)
        compiled = model.generate(ids, **options, compile_config=compile_config)
    assert torch.equal(compiled, eager), f"{family}: the compiled decode steps chose other tokens"


def test_padding_with_a_gap_raises_under_torch_compile(small_gpt_oss, fresh_dynamo):
    model, ids = small_gpt_oss
    mask = torch.ones_like(ids)
    mask[1, 5:8] = 0  # real tokens on both sides: two runs in one row
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # traced: an assertion in the graph
    with pytest.raises(RuntimeError, match="real tokens are one run per row"), torch.no_grad():
        compiled(ids, attention_mask=mask)


def test_custom_4d_mask_raises(small_gpt_oss):
    model, ids = small_gpt_oss
    mask = torch.zeros(2, 1, 20, 20, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="takes no explicit attention mask"), torch.no_grad():
        model(ids, attention_mask=mask)


def test_attention_weights_raise(small_gpt_oss):
    model, ids = small_gpt_oss
    with pytest.raises(NotImplementedError, match="returning attention weights"), torch.no_grad():
        model(ids, output_attentions=True)


def test_dropout_raises(small_gpt_oss):
    model, ids = small_gpt_oss
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(NotImplementedError, match="no attention dropout"):
        model(ids)


def check_training_gradients(model, ids):
    """A language-model loss's gradients through the course backend match eager attention's: every
    parameter's, the sink logits' included, within twice eager bf16's error against a float32 eager model."""
    def gradients(m):
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        return torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])

    expected = gradients(models.in_dtype(model, torch.float32, "eager"))
    course, eager = gradients(model), gradients(models.in_dtype(model, torch.bfloat16, "eager"))
    assert course.shape == expected.shape, "a parameter got no gradient through the course backend"
    error, yardstick = ((g - expected).norm() / expected.norm() for g in (course, eager))
    assert error <= 2 * yardstick + 1e-3, f"gradients off by {error:.2e} (relative); eager bf16: {yardstick:.2e}"
    if hasattr(model.model.layers[0].self_attn, "sinks"):
        sinks = model.model.layers[0].self_attn.sinks.grad
        assert sinks is not None and sinks.abs().sum() > 0, "the sink logits got no gradient"


def test_model_trains_through_the_backend(small_gpt_oss):
    """course::attention's registered backward, on the reference backing (CPU)."""
    check_training_gradients(*small_gpt_oss)


def test_model_trains_at_head_dim_96_through_the_backend(backed_by):
    """A small Llama at Phi-3's head dim 96, which stage 11's backward takes, on the reference backing (CPU)."""
    backed_by(impl="reference")
    config = head_dim_config(96)
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    check_training_gradients(model, token_ids(config, 2, 48, "cpu"))


def test_padded_batches_have_no_backward(small_gpt_oss):
    model, ids = small_gpt_oss
    with pytest.raises(NotImplementedError, match="forward-only"):
        model(ids, attention_mask=padded_mask(ids)).logits.float().sum().backward()


def test_eager_inference_skips_the_op_only_where_nothing_needs_it():
    x = torch.randn(2, 3)
    w = torch.randn(2, 3, requires_grad=True)
    with torch.no_grad():
        assert models.eager_inference(x, w), "under no_grad the op's Python function runs directly"
    assert models.eager_inference(x, x), "no input needs a gradient: the op's dispatch adds nothing"
    assert not models.eager_inference(x, w), "autograd must record the op (for its backward)"


def test_float32_model_is_rejected_by_the_kernels_validation(backed_by):
    backed_by(impl="reference")
    config = cpu_config("llama")
    model = build(config, "cpu")
    model.set_attn_implementation("course")
    with pytest.raises(TypeError, match="supported: torch.float16, torch.bfloat16"), torch.no_grad():
        model(token_ids(config, 1, 8, "cpu"))


def test_packed_sequences_raise_without_their_offsets(backed_by):
    """Two sequences packed in one row (positions restart) without cu_seq_lens_q/k: refused in eager mode."""
    backed_by(impl="reference")
    config = cpu_config("llama")
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with pytest.raises(NotImplementedError, match="packed sequences"), torch.no_grad():
        model(token_ids(config, 1, 20, "cpu"), position_ids=positions, use_cache=False)


def test_packed_sequences_with_their_offsets(backed_by):
    """Two sequences in one row with cu_seq_lens_q/k (DataCollatorWithFlattening's flash kwargs): each one's
    logits are those of the sequence run alone."""
    backed_by(impl="reference")
    config = cpu_config("llama")
    model = models.in_dtype(build(config, "cpu"), torch.bfloat16, "course")
    ids = token_ids(config, 1, 20, "cpu")
    offsets = torch.tensor([0, 12, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=positions, use_cache=False, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                       max_length_q=12, max_length_k=12).logits[0]
        alone = [model(ids[:, a:b], use_cache=False).logits[0] for a, b in ((0, 12), (12, 20))]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- on a Hopper GPU: the kernels

def gpu_config(family):
    """The attention of GPT-OSS (64 / 8 heads, head dim 64, sinks, 128-token windows) or the same shapes in
    a Llama, in small models: prompts of 300 tokens cross the window and a KV tile boundary."""
    make = models.gpt_oss_config if family == "gpt-oss" else models.llama_config
    return make(num_layers=4, hidden_size=256)


@pytest.fixture
def kernels(backed_by, impl):
    backed_by(impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_full_sequence_logits_on_gpu(kernels, family, dtype):
    config = gpu_config(family)
    check_full_sequence(config, dtype, token_ids(config, 2, 300, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_incremental_decode_on_gpu(kernels, family, dtype):
    """A 200-token prompt, then 20 single-token steps over the cache (the 128-token windows slide)."""
    config = gpu_config(family)
    check_incremental(config, dtype, token_ids(config, 2, 220, "cuda"), prompt=200)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [80, 96, 192])
def test_incremental_decode_at_other_head_dims_on_gpu(kernels, head_dim):
    """A 200-token prompt through prefill, then 20 steps through stage 9's decode at a padded head dim."""
    config = head_dim_config(head_dim)
    check_incremental(config, torch.bfloat16, token_ids(config, 2, 220, "cuda"), prompt=200)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_deepseek_v3_mla_on_gpu(kernels, dtype):
    """A 200-token prompt through prefill at (192, 128), then 20 steps through stage 9's decode at (192, 128),
    and draft tokens of 4."""
    config = models.deepseek_v3_config(num_layers=2, hidden_size=256, vocab_size=512)
    check_incremental(config, dtype, token_ids(config, 2, 220, "cuda"), prompt=200)
    check_incremental(config, dtype, token_ids(config, 2, 216, "cuda"), prompt=200, step=4)


GPU_DRAFT_CACHES = {
    "dynamic": None,
    "StaticCache": lambda model: transformers.StaticCache(config=model.config, max_cache_len=256),
    "graph-safe": lambda model: models.graph_safe_cache(model, max_cache_len=256),
}


@pytest.mark.gpu
@pytest.mark.parametrize("make_cache", GPU_DRAFT_CACHES.values(), ids=GPU_DRAFT_CACHES.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_draft_tokens_on_gpu(kernels, monkeypatch, family, make_cache):
    """A 200-token prompt, then forwards of 4 tokens over the cache on stage 9's draft tokens (the 128-token
    windows slide), next to eager at every position."""
    config = gpu_config(family)
    calls = counting_draft_calls(monkeypatch)
    check_incremental(config, torch.bfloat16, token_ids(config, 2, 220, "cuda"), prompt=200, make_cache=make_cache,
                      step=4)
    assert calls, "the draft forwards did not reach the decode op"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_assisted_generation_on_gpu(kernels, monkeypatch, family):
    """Speculative decoding with an assistant on the kernels: the drafts verified on stage 9's draft tokens give
    the tokens the model generates alone."""
    config = gpu_config(family)
    reference = build(config, "cuda")
    calls = counting_draft_calls(monkeypatch)
    alone, assisted = assisted_generation(models.in_dtype(reference, torch.bfloat16, "course"),
                                          models.in_dtype(reference, torch.bfloat16, "eager"),
                                          token_ids(config, 1, 200, "cuda"), new_tokens=20)
    assert calls, "the drafts' verification did not reach the decode op"
    assert_same_greedy_generation(assisted, alone, f"{family}, assisted generation")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_left_padded_batch_on_gpu(kernels, family, dtype):
    """Prompts of 220, 150 and 41 tokens left-padded to 220, then 20 decode steps: stage 10's varlen kernel on
    the real rows (windows of 128 slide over the prompt), next to eager at every real position."""
    config = gpu_config(family)
    ids = token_ids(config, 3, 240, "cuda")
    check_padded(config, dtype, ids, padded_mask(ids, (0, 70, 179)), prompt=220)


@pytest.mark.gpu
def test_model_trains_on_the_kernels(kernels):
    """Stage 11's backward under a GPT-OSS-shaped model (sinks, 128-token windows, GQA 64 / 8, head dim 64)."""
    config = gpu_config("gpt-oss")
    model = models.in_dtype(build(config, "cuda"), torch.bfloat16, "course")
    check_training_gradients(model, token_ids(config, 2, 300, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [80, 96, 192, 256])
def test_model_trains_at_other_head_dims_on_the_kernels(kernels, head_dim):
    """Stage 11's backward at Phi-2's and Phi-3's head dims, 192, and Gemma's 256 (a small Llama, GQA 8 / 2)."""
    config = head_dim_config(head_dim)
    model = models.in_dtype(build(config, "cuda"), torch.bfloat16, "course")
    check_training_gradients(model, token_ids(config, 2, 300, "cuda"))


@pytest.mark.gpu
def test_deepseek_v3_mla_trains_on_the_kernels(kernels):
    """Stage 11's backward with q and k of 192 columns and v of 128 (DeepSeek-V3's attention in training)."""
    config = models.deepseek_v3_config(num_layers=2, hidden_size=256, vocab_size=512)
    model = models.in_dtype(build(config, "cuda"), torch.bfloat16, "course")
    check_training_gradients(model, token_ids(config, 2, 300, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_generate_with_a_left_padded_batch(kernels, family):
    """``generate`` on prompts of 100 and 61 tokens, left-padded: each greedy token is the float32 model's best
    choice for that prompt alone, or within 0.1 of it (a near tie that fp16 rounding may break either way)."""
    config = gpu_config(family)
    reference = build(config, "cuda")
    model = models.in_dtype(reference, torch.float16, "course")
    prompts = [token_ids(config, 1, n, "cuda")[0] for n in (100, 61)]
    ids = torch.zeros(2, 100, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, 100 - len(prompt):], mask[b, 100 - len(prompt):] = prompt, 1
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                   pad_token_id=0)[:, 100:]
        for b, prompt in enumerate(prompts):
            logits = reference(torch.cat([prompt, generated[b]])[None]).logits[0, len(prompt) - 1:-1].float()
            chosen = logits.gather(1, generated[b][:, None])[:, 0]
            gap = logits.max(dim=1).values - chosen
            assert (gap <= 0.1).all(), (f"{family}: prompt {b}'s token {int(gap.argmax())} of 8 is "
                                        f"{float(gap.max()):.3f} below the float32 model's best choice")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_torch_compile_on_gpu_gives_the_same_logits(kernels, fresh_dynamo, family):
    config = gpu_config(family)
    reference = build(config, "cuda")
    ids = token_ids(config, 2, 300, "cuda")
    model = models.in_dtype(reference, torch.bfloat16, "course")
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        expected, eager_logits = reference(ids).logits, model(ids).logits
        logits = compiled(ids).logits
        baseline = models.in_dtype(reference, torch.bfloat16, "eager")(ids).logits
    assert_within_yardstick(logits, baseline, expected, f"{family}, torch.compile")
    torch.testing.assert_close(logits, eager_logits, rtol=2e-2, atol=2e-2)


def graphed_decode_logits(model, ids, prompt, cache=None):
    """Like models.incremental_logits over a static cache (``graph_safe_cache`` when None), but every step after
    the first is a replay of one CUDA graph of the whole model's decode step (token and position in static
    buffers)."""
    cache = cache if cache is not None else models.graph_safe_cache(model, max_cache_len=ids.shape[1])
    logits = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
    token, position = ids[:, prompt:prompt + 1].clone(), torch.full((1, 1), prompt, device=ids.device)

    def step():
        return model(token, position_ids=position, past_key_values=cache, use_cache=True).logits[:, -1]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first step runs eagerly: kernels compiled, decode counters allocated
        logits.append(step())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        graphed = step()
    for i in range(prompt + 1, ids.shape[1]):
        token.copy_(ids[:, i:i + 1])
        position.fill_(i)
        graph.replay()
        logits.append(graphed.clone())
    return torch.stack(logits, dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_cuda_graph_of_a_decode_step_replays_correctly(kernels, family):
    config = gpu_config(family)
    reference = build(config, "cuda")
    ids, prompt = token_ids(config, 2, 220, "cuda"), 200
    with torch.no_grad():
        expected = reference(ids).logits[:, prompt - 1:]
        baseline = models.incremental_logits(models.in_dtype(reference, torch.bfloat16, "eager"), ids, prompt)
        logits = graphed_decode_logits(models.in_dtype(reference, torch.bfloat16, "course"), ids, prompt)
    for step in range(logits.shape[1]):
        assert_within_yardstick(logits[:, step], baseline[:, step], expected[:, step],
                                f"{family}, CUDA graph replay at position {prompt - 1 + step}")


ROUNDING_LOGITS = 0.25  # how far two runs' logits may drift apart by rounding alone (logits of std ~1 here)


def assert_same_greedy_generation(got, expected, where: str) -> None:
    """Two greedy generations (``return_dict_in_generate``, ``output_logits``) of code that rounds differently
    (eager and inductor-compiled): per sequence, the logits agree within ``ROUNDING_LOGITS`` and the tokens
    are equal up to the first step where they differ, and there ``expected``'s top two logits are closer than
    the two runs' logits differ: a near-tie that rounding may break either way (after it, the inputs differ)."""
    prompt = expected.sequences.shape[1] - len(expected.logits)
    for row in range(expected.sequences.shape[0]):
        for step, (mine, theirs) in enumerate(zip(got.logits, expected.logits)):
            drift = (mine[row].float() - theirs[row].float()).abs().max().item()
            assert drift <= ROUNDING_LOGITS, (
                f"{where}: sequence {row}, step {step}: the logits differ by {drift:.3f}, more than rounding")
            if got.sequences[row, prompt + step] != expected.sequences[row, prompt + step]:
                top2 = theirs[row].float().topk(2).values
                margin = (top2[0] - top2[1]).item()
                assert margin <= 2 * drift, (
                    f"{where}: sequence {row}, step {step}: a different token where the top two logits are "
                    f"{margin:.3f} apart and the runs' logits only {drift:.3f}")
                break


def test_a_near_tie_may_break_either_way_and_nothing_else():
    """The comparison of generate's compiled and eager runs: equal runs pass, a token flipped at a near-tie
    passes, a token flipped where the top two are far apart fails, and so do logits that drift."""
    from types import SimpleNamespace

    logits = [torch.tensor([[3.0, 1.0, 0.0]]), torch.tensor([[2.0, 1.99, 0.0]])]
    expected = SimpleNamespace(sequences=torch.tensor([[7, 0, 0]]), logits=logits)
    assert_same_greedy_generation(expected, expected, "same")
    near_tie = SimpleNamespace(sequences=torch.tensor([[7, 0, 1]]),
                               logits=[logits[0], torch.tensor([[1.99, 2.0, 0.0]])])
    assert_same_greedy_generation(near_tie, expected, "near tie")
    with pytest.raises(AssertionError, match="top two logits are 2.000 apart"):
        assert_same_greedy_generation(SimpleNamespace(sequences=torch.tensor([[7, 1, 0]]),
                                                      logits=[logits[0] + 0.01, logits[1]]), expected, "flip")
    with pytest.raises(AssertionError, match="more than rounding"):
        assert_same_greedy_generation(SimpleNamespace(sequences=expected.sequences,
                                                      logits=[logits[0] + 1.0, logits[1]]), expected, "drift")


@pytest.mark.gpu
@pytest.mark.parametrize("padding", [None, (0, 37)], ids=["equal-lengths", "left-padded"])
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_generate_with_a_static_cache_and_torch_compile(kernels, fresh_dynamo, family, padding):
    """transformers' static cache makes ``generate`` compile the decode step with CUDA-graph trees, whose
    pools must hold no memory a graph output does not own (the decode counters and placeholders are
    allocated outside them): a second compiled generation, the graphs replayed, gives the first one's
    tokens exactly, and both are the eager generation's, but for a near-tie that inductor's rounding of
    the rest of the model (not the attention: the same kernels run) may break the other way. A
    left-padded batch decodes in the same graphs (``cache_leftpad``)."""
    config = gpu_config(family)
    model = models.in_dtype(build(config, "cuda"), torch.float16, "course")
    ids = token_ids(config, 2, 100, "cuda")
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static",
                   pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    if padding is not None:
        options["attention_mask"] = padded_mask(ids, padding)
    with torch.no_grad():
        eager = model.generate(ids, **options, disable_compile=True)
        compiled = model.generate(ids, **options)
        again = model.generate(ids, **options)  # the graphs replayed, with the lengths of a new generation
    assert_same_greedy_generation(compiled, eager, f"{family}, compiled against eager")
    assert torch.equal(again.sequences, compiled.sequences), f"{family}: a second compiled generation differs"


@pytest.mark.gpu
@pytest.mark.parametrize("max_cache_len", [None, 220], ids=["dynamic", "static"])
@pytest.mark.parametrize("cache_dtype", QUANTIZED.values(), ids=QUANTIZED.keys())
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_quantized_cache_on_gpu(kernels, family, cache_dtype, max_cache_len):
    """A 200-token prompt, then 20 decode steps on stage 9 reading the FP8 or int8 cache as it is stored."""
    config = gpu_config(family)
    check_quantized(config, torch.bfloat16, token_ids(config, 2, 220, "cuda"), 200, cache_dtype, max_cache_len)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt-oss", "llama"])
def test_quantized_cache_under_cuda_graphs_and_torch_compile(kernels, fresh_dynamo, family):
    """A static FP8 cache: a replayed CUDA graph of the decode step gives the eager steps' logits, and ``generate``
    compiled over it (transformers compiles the step for a static cache) the tokens of the eager generation."""
    config = gpu_config(family)
    model = models.in_dtype(build(config, "cuda"), torch.bfloat16, "course")
    ids, prompt = token_ids(config, 2, 220, "cuda"), 200
    with torch.no_grad():
        eager = models.incremental_logits(model, ids, prompt, models.quantized_cache(model, max_cache_len=220))
        graphed = graphed_decode_logits(model, ids, prompt, models.quantized_cache(model, max_cache_len=220))
        torch.testing.assert_close(graphed, eager, rtol=1e-2, atol=1e-2)
        options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        tokens = {}
        for name, extra in (("eager", {"disable_compile": True}), ("compiled", {}), ("again", {})):
            cache = models.quantized_cache(model, max_cache_len=ids.shape[1] + 12)
            tokens[name] = model.generate(ids, past_key_values=cache, **options, **extra)
    assert torch.equal(tokens["compiled"], tokens["eager"]), f"{family}: compiled tokens over an FP8 cache differ"
    assert torch.equal(tokens["again"], tokens["eager"]), f"{family}: a second compiled generation differs"
