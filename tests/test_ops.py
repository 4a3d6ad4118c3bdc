"""The custom ops course::attention and course::decode_attention: fake implementations, torch.compile,
the backing setting (CPU), and the kernels behind them in a CUDA graph (Hopper GPU)."""

import dataclasses

import pytest
import torch

from course.testing import reference
from course import testing
from course.integration import ops


@pytest.fixture
def backed_by():
    """``backed_by(**setting)`` switches what backs the ops for one test; the setting is restored after it."""
    before = ops.backing()
    yield ops.use_stages
    ops.use_stages(**dataclasses.asdict(before))


def prefill_inputs(device="cpu", dtype=torch.bfloat16, seqlen_q=40, seqlen_k=40):
    q, k, v = testing.random_qkv(2, seqlen_q, seqlen_k, 8, 2, 64, dtype, device=device)
    sinks = torch.randn(8, device=device)
    return (q, k, v), dict(sink_logits=sinks, softmax_scale=0.1, causal=True, window_size_left=5)


def decode_inputs(device="cpu", dtype=torch.bfloat16):
    inputs = testing.random_decode_inputs([1, 17, 40], 8, 2, 64, dtype, device="cpu")
    args = tuple(inputs[name].to(device) for name in ("q", "k_cache", "v_cache", "cache_seqlens"))
    return args, dict(sink_logits=torch.randn(8, device=device), softmax_scale=0.1, window_size_left=5)


def test_fake_implementations_give_the_output_shape_on_the_meta_device():
    (q, k, v), options = prefill_inputs(device="meta", seqlen_q=40, seqlen_k=70)
    out, lse = torch.ops.course.attention(q, k, v, **options)
    assert (out.device.type, out.shape, out.dtype) == ("meta", q.shape, q.dtype)
    assert out.is_contiguous()
    assert (lse.shape, lse.dtype) == ((q.shape[0], q.shape[2], q.shape[1]), torch.float32)
    (q, k_cache, v_cache, seqlens), options = decode_inputs(device="meta")
    out = torch.ops.course.decode_attention(q, k_cache, v_cache, seqlens, **options)
    assert (out.device.type, out.shape, out.dtype) == ("meta", q.shape, q.dtype)


@pytest.mark.parametrize("make", [prefill_inputs, decode_inputs], ids=["attention", "decode_attention"])
def test_opcheck(backed_by, make):
    """torch.library.opcheck: the schema, the fake implementation against the real one, and AOT dispatch."""
    backed_by(impl="reference")
    op = torch.ops.course.attention if make is prefill_inputs else torch.ops.course.decode_attention
    args, options = make()
    torch.library.opcheck(op, args, options)


def test_ops_compute_the_contract_with_the_reference_backing(backed_by):
    backed_by(impl="reference")
    (q, k, v), options = prefill_inputs(seqlen_q=30, seqlen_k=50)
    out, _ = torch.ops.course.attention(q, k, v, **options)
    expected = reference.attention(q, k, v, softmax_scale=0.1, causal=True, window_size=(5, -1),
                                   sink_logits=options["sink_logits"])
    torch.testing.assert_close(out, expected.to(q.dtype), rtol=0, atol=0)
    (q, k_cache, v_cache, seqlens), options = decode_inputs()
    out = torch.ops.course.decode_attention(q, k_cache, v_cache, seqlens, **options)
    expected = reference.decode_attention(q, k_cache, v_cache, seqlens, **options)
    torch.testing.assert_close(out, expected.to(q.dtype), rtol=0, atol=0)


def test_torch_compile_fullgraph_traces_both_ops(backed_by):
    """Dynamo traces through the ops with their fake implementations: no graph break, the same results."""
    backed_by(impl="reference")
    (q, k, v), options = prefill_inputs()
    decode_args, decode_options = decode_inputs()

    def both(q, k, v, decode_q):
        out = torch.ops.course.attention(q, k, v, **options)[0]
        return out * 2, torch.ops.course.decode_attention(decode_q, *decode_args[1:], **decode_options) + 1

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(q, k, v, decode_args[0]), both(q, k, v, decode_args[0])):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_prefill_op_is_differentiable(backed_by):
    """course::attention's registered backward (course::attention_backward) gives the reference backward's
    gradients, the sink logits' included, eagerly and under torch.compile; the LSE output is not differentiable."""
    backed_by(impl="reference")
    (q, k, v), options = prefill_inputs(seqlen_q=30, seqlen_k=50)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, options.pop("sink_logits"))]
    do = torch.randn(q.shape, dtype=q.dtype)
    window = (options.pop("window_size_left"), -1)
    expected = reference.attention_backward(do, q, k, v, sink_logits=leaves[3].detach(), window_size=window, **options)

    def loss(q, k, v, sinks):
        out, lse = torch.ops.course.attention(q, k, v, sinks, window_size_left=window[0], **options)
        assert not lse.requires_grad
        return (out.float() * do.float()).sum()

    for run in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        grads = torch.autograd.grad(run(*leaves), leaves)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got.float(), want.to(got.dtype).float(), rtol=0, atol=0)


def test_opcheck_backward(backed_by):
    backed_by(impl="reference")
    (q, k, v), options = prefill_inputs()
    out, lse = torch.ops.course.attention(q, k, v, **options)
    torch.library.opcheck(torch.ops.course.attention_backward, (torch.randn_like(out), q, k, v, out, lse), options)


def test_deterministic_algorithms_reach_the_backward(backed_by, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the op's backward asks stage 11 for its deterministic
    mode (dQ added in a fixed order); otherwise for the default one."""
    backed_by(impl="reference")
    asked = []
    backing = ops.backward_function

    def recording():
        function = backing()
        return lambda *args, **kwargs: asked.append(kwargs["deterministic"]) or function(*args, **kwargs)

    monkeypatch.setattr(ops, "backward_function", recording)
    (q, k, v), options = prefill_inputs()
    q.requires_grad_(True)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for mode in (False, True):
            torch.use_deterministic_algorithms(mode)
            torch.ops.course.attention(q, k, v, **options)[0].sum().backward()
    finally:
        torch.use_deterministic_algorithms(before)
    assert asked == [False, True]


def test_the_decode_and_varlen_ops_are_forward_only(backed_by):
    backed_by(impl="reference")
    (q, k_cache, v_cache, seqlens), options = decode_inputs()
    q.requires_grad_(True)
    out = torch.ops.course.decode_attention(q, k_cache, v_cache, seqlens, **options)
    with pytest.raises(NotImplementedError, match="course::decode_attention is forward-only"):
        out.sum().backward()


def test_a_backward_needs_a_prefill_stage_with_the_lse(backed_by):
    backed_by(prefill=4, impl="solutions")
    q, k, v = (t.requires_grad_() for t in prefill_inputs()[0])
    with pytest.raises(ValueError, match="CUDA"):  # the forward still validates first
        torch.ops.course.attention(q, k, v)


def test_the_setting_picks_the_stage(backed_by):
    """One setting picks the code behind the ops: a stage without sinks refuses them, naming the stage
    that adds them; the kernels of the default stage reject CPU tensors only at their device check."""
    (q, k, v), options = prefill_inputs()
    backed_by(prefill=4, impl="solutions")
    with pytest.raises(NotImplementedError, match="stage 5"):
        torch.ops.course.attention(q, k, v, **options)
    backed_by(prefill=ops.PREFILL_STAGE)
    with pytest.raises(ValueError, match="the kernels need CUDA tensors"):
        torch.ops.course.attention(q, k, v, **options)


@pytest.mark.parametrize("setting, message", [
    (dict(prefill=7), "stage 7 .* is a decode stage; prefill= takes a prefill stage"),
    (dict(decode=6), "stage 6 .* is a prefill stage; decode= takes a decode stage"),
    (dict(impl="mine"), "impl must be one of"),
])
def test_use_stages_rejects_a_wrong_setting(backed_by, setting, message):
    with pytest.raises(ValueError, match=message):
        backed_by(**setting)


@pytest.mark.gpu
def test_both_ops_replay_in_a_cuda_graph(backed_by, impl):
    """The ops launch on the current stream: captured in one CUDA graph, they replay with new inputs."""
    backed_by(impl=impl)
    (q, k, v), options = prefill_inputs(device="cuda", seqlen_q=300, seqlen_k=300)
    (dq, k_cache, v_cache, seqlens), decode_options = decode_inputs(device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and allocate the decode counters off the capture
        torch.ops.course.attention(q, k, v, **options)
        torch.ops.course.decode_attention(dq, k_cache, v_cache, seqlens, **decode_options, check_lengths=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out, _ = torch.ops.course.attention(q, k, v, **options)
        decode_out = torch.ops.course.decode_attention(dq, k_cache, v_cache, seqlens, **decode_options,
                                                       check_lengths=False)
    for replay in range(3):
        for t in (q, k, v, dq):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        testing.assert_attention_matches(out, q, k, v, f"replay {replay}", softmax_scale=0.1, causal=True,
                                         window_size=(5, -1), sink_logits=options["sink_logits"])
        inputs = dict(q=dq, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=None)
        testing.assert_decode_matches(decode_out, inputs, f"replay {replay}", **decode_options)


@pytest.mark.gpu
def test_prefill_op_backward_on_the_kernels(backed_by, impl):
    """Autograd through course::attention runs stage 11's kernel: the reference's gradients, dsink included."""
    backed_by(impl=impl)
    (q, k, v), options = prefill_inputs(device="cuda", seqlen_q=300, seqlen_k=500)
    sinks = options.pop("sink_logits")
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    do = torch.randn_like(q)
    out, _ = torch.ops.course.attention(*leaves, **options)
    grads = torch.autograd.grad(out, leaves, do)
    testing.assert_gradients_match(grads, q, k, v, do, "course::attention backward", out=out.detach(), sink_logits=sinks,
                                   softmax_scale=0.1, causal=True, window_size=(5, -1))


def varlen_inputs(device="cpu", dtype=torch.bfloat16, page_size=16):
    inputs = testing.random_varlen_inputs([5, 0, 17], [9, 3, 40], 8, 2, 64, dtype, page_size=page_size, device="cpu")
    args = tuple(inputs[name].to(device) if inputs[name] is not None else None
                 for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    options = dict(seqused_k=inputs["seqused_k"].to(device), block_table=inputs["block_table"].to(device),
                   sink_logits=torch.randn(8, device=device), softmax_scale=0.1, causal=True, window_size_left=5)
    return (*args, inputs["max_seqlen_q"], inputs["max_seqlen_k"]), options


def test_attention_varlen_op(backed_by):
    """course::attention_varlen (stage 10): the fake gives O's shape, and with the reference backing the op is
    the float64 reference of each sequence on its own (paged cache, a sequence without queries)."""
    backed_by(impl="reference")
    args, options = varlen_inputs()
    out = torch.ops.course.attention_varlen(*args, **options)
    inputs = dict(q=args[0], k=args[1], v=args[2], cu_seqlens_q=args[3], cu_seqlens_k=None,
                  seqused_k=options["seqused_k"], block_table=options["block_table"])
    for b, q, k, v in testing.varlen_sequences(inputs):
        rows = slice(*args[3][b:b + 2].tolist())
        if q.shape[1]:
            expected = reference.attention(q, k, v, softmax_scale=0.1, causal=True, window_size=(5, -1),
                                           sink_logits=options["sink_logits"])[0]
            torch.testing.assert_close(out[rows], expected.to(out.dtype), rtol=0, atol=0)
    meta_args = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args)
    fake = torch.ops.course.attention_varlen(*meta_args, **{k: v.to("meta") if isinstance(v, torch.Tensor) else v
                                                            for k, v in options.items()})
    assert (fake.device.type, fake.shape) == ("meta", out.shape)


def append_inputs(device="cpu", dtype=torch.bfloat16):
    """A decode step with a new token per sequence: (q, k_cache, v_cache, cache_seqlens, k_new, v_new), options."""
    inputs = testing.append_decode_inputs([0, 17, 40], 8, 2, 64, dtype, device="cpu", seed=3)
    cos, sin = testing.rotary_tables(64, 32, dtype, device="cpu")
    args = tuple(inputs[name].to(device) for name in ("q", "k_cache", "v_cache", "cache_seqlens", "k_new", "v_new"))
    return args, dict(rotary_cos=cos.to(device), rotary_sin=sin.to(device), rotary_interleaved=True,
                      alibi_slopes=testing.alibi_slopes(8, device=device), window_size_left=20, num_sink_tokens=2)


def test_the_append_op_writes_the_cache_and_attends(backed_by):
    """course::decode_attention_append with the reference backing: O as the reference computes it, the caches
    holding the new rows (and nothing else changed), cache_seqlens unchanged; torch.compile (fullgraph)
    keeps the write: a second compiled step reads it."""
    backed_by(impl="reference")
    (q, k_cache, v_cache, seqlens, k_new, v_new), options = append_inputs()
    before = k_cache.clone(), v_cache.clone()
    out = torch.ops.course.decode_attention_append(q, k_cache, v_cache, seqlens, k_new, v_new, **options)
    expected = reference.decode_attention(q, *before, seqlens, k_new=k_new, v_new=v_new, **options)
    torch.testing.assert_close(out, expected.to(q.dtype), rtol=0, atol=0)
    appended = reference.append_to_cache(*before, seqlens, k_new, v_new, rotary_cos=options["rotary_cos"],
                                         rotary_sin=options["rotary_sin"], rotary_interleaved=True)
    assert all(torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) for got, want in zip((k_cache, v_cache), appended))
    assert seqlens.tolist() == [0, 17, 40]

    def two_steps(q, q_rotated, k_cache, v_cache, seqlens, k_new, v_new):
        first = torch.ops.course.decode_attention_append(q, k_cache, v_cache, seqlens, k_new, v_new, **options)
        second = torch.ops.course.decode_attention(q_rotated, k_cache, v_cache, seqlens + 1, window_size_left=20,
                                                   num_sink_tokens=2, alibi_slopes=options["alibi_slopes"])
        return first, second

    k_cache.copy_(before[0])
    v_cache.copy_(before[1])
    compiled = torch.compile(two_steps, fullgraph=True, backend="aot_eager")
    q_rotated = reference.rotary(q, options["rotary_cos"], options["rotary_sin"], seqlens, True)
    first, second = compiled(q, q_rotated, k_cache, v_cache, seqlens, k_new, v_new)
    torch.testing.assert_close(first, out, rtol=0, atol=0)
    torch.testing.assert_close(second, out, rtol=0, atol=0)  # the same keys, the new one read from the cache


def test_opcheck_append(backed_by):
    backed_by(impl="reference")
    args, options = append_inputs()
    torch.library.opcheck(torch.ops.course.decode_attention_append, args, options,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_decode_extras_need_stage_9(backed_by):
    backed_by(decode=7, impl="solutions")
    (q, k_cache, v_cache, seqlens), options = decode_inputs()
    with pytest.raises(NotImplementedError, match="alibi_slopes is not implemented in stage 7; stage 9"):
        torch.ops.course.decode_attention(q, k_cache, v_cache, seqlens, alibi_slopes=torch.ones(8), **options)


@pytest.mark.gpu
def test_append_op_on_the_kernels(backed_by, impl):
    """course::decode_attention_append runs stage 9's fused step: the reference's O and cache rows, eagerly
    and replayed in a CUDA graph (the caches reset before each replay: an append is not idempotent)."""
    backed_by(impl=impl)
    (q, k_cache, v_cache, seqlens, k_new, v_new), options = append_inputs(device="cuda")
    pristine = k_cache.clone(), v_cache.clone()
    out = torch.ops.course.decode_attention_append(q, k_cache, v_cache, seqlens, k_new, v_new, **options)
    inputs = dict(q=q, k_cache=pristine[0], v_cache=pristine[1], cache_seqlens=seqlens, block_table=None)
    testing.assert_decode_matches(out, inputs, "append op", k_new=k_new, v_new=v_new, **options)
    written = k_cache.clone(), v_cache.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        replayed = torch.ops.course.decode_attention_append(q, k_cache, v_cache, seqlens, k_new, v_new, **options)
    for _ in range(3):
        k_cache.copy_(pristine[0])
        v_cache.copy_(pristine[1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
        assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip((k_cache, v_cache), written))
