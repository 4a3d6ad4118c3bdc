"""What a call costs the host: the course's entry points next to PyTorch SDPA's cuDNN backend.

    python -m course host-bench --out docs/results   # Hopper GPU: host.json and host.md
    python -m course host-bench --render             # host.json -> host.md again, on any machine

A model's decode step is a chain of small launches; at batch 1 the GPU waits for the host, and what
a call costs in Python (validation, planning, allocation, launch) is what the model feels. Two
figures per call, measured in the same run:

- host: the median time one eager call takes to return, with the GPU busy, so it is the host's
  part alone;
- eager: the time per call of back-to-back eager calls (blocks of 20, wall clock, synchronized at
  the end of each; the median block): the larger of the host's and the GPU's part, as a model
  running eagerly sees it.

The calls are timed in rounds, each round every call once, so that all of them see the host in the
same state.

Never edit the outputs by hand.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from course.tools import bench

DEFAULT_OUT = bench.DEFAULT_OUT
HOST_JSON, HOST_MD = "host.json", "host.md"
EAGER_CALLS = 200
PREFILL = dict(batch=1, seqlen=128, heads=8, head_dim=128)          # the prefill call
DECODE = dict(batch=1, seqlen=4096, heads_q=32, heads_kv=8, head_dim=128)  # B1 L4k 32/8


def eager_microseconds(fn, *, calls: int = EAGER_CALLS, warmup: int = 10) -> float:
    """Microseconds per call of ``calls`` back-to-back eager calls, synchronized once at the end."""
    import torch

    with bench.setting(fn):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6


def prefill_calls(impl: str) -> dict:
    """{name: fn} for the prefill call: the course's final prefill stage, its op, SDPA cuDNN."""
    import torch
    from torch.nn.attention import SDPBackend

    from course import testing
    from course.integration import ops
    from course.runtime import stages

    stage = stages.get(ops.PREFILL_STAGE).load(impl)
    p = PREFILL
    q, k, v = testing.random_qkv(p["batch"], p["seqlen"], p["seqlen"], p["heads"], p["heads"], p["head_dim"],
                                 torch.float16)
    cudnn = bench.sdpa(SDPBackend.CUDNN_ATTENTION)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return {f"stage {ops.PREFILL_STAGE} attention": lambda: stage.attention(q, k, v, causal=True),
            "course::attention (op)": lambda: torch.ops.course.attention(q, k, v, causal=True),
            "SDPA cuDNN": with_setting(lambda: cudnn(q, k, v, causal=True), cudnn),
            "SDPA default": lambda: sdpa(qt, kt, vt, is_causal=True)}


def decode_calls(impl: str) -> dict:
    """{name: fn} for the decode call: the final decode stage (fp16 cache, FP8 cache, paged), its op,
    stage 7, and SDPA cuDNN on the same contiguous cache."""
    import torch
    from torch.nn.attention import SDPBackend

    from course.integration import ops
    from course.runtime import kv_cache, stages
    from course.runtime.shapes import DecodeShape

    d = DECODE
    shape = DecodeShape(d["batch"], d["seqlen"], d["heads_q"], d["heads_kv"], d["head_dim"])
    q, k, v, seqlens, _ = bench.decode_inputs(shape)
    paged = DecodeShape(d["batch"], d["seqlen"], d["heads_q"], d["heads_kv"], d["head_dim"], paged=True)
    table = bench.shuffled_block_table(paged)
    k8, v8, k_scale, v_scale = kv_cache.quantize_kv_cache(k, v)
    final = stages.get(ops.DECODE_STAGE).load(impl)
    stage7 = stages.get(7).load(impl)
    cudnn = bench.sdpa_decode(SDPBackend.CUDNN_ATTENTION)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q4, kt, vt = q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2)
    return {f"stage {ops.DECODE_STAGE} decode_attention": lambda: final.decode_attention(q, k, v, seqlens),
            f"stage {ops.DECODE_STAGE}, FP8 cache": lambda: final.decode_attention(q, k8, v8, seqlens,
                                                                                  k_scale=k_scale, v_scale=v_scale),
            f"stage {ops.DECODE_STAGE}, paged (64)": lambda: final.decode_attention(
                q, bench.as_pages(k, paged), bench.as_pages(v, paged), seqlens, block_table=table),
            "course::decode_attention (op)": lambda: torch.ops.course.decode_attention(q, k, v, seqlens),
            "stage 7 decode_attention": lambda: stage7.decode_attention(q, k, v, seqlens),
            "SDPA cuDNN": with_setting(lambda: cudnn(q, k, v), cudnn),
            "SDPA default": lambda: sdpa(q4, kt, vt, enable_gqa=True)}


def with_setting(fn, of):
    """``fn``, timed in the ``bench.setting`` of ``of`` (the SDPA function it calls)."""
    fn.setting = of.setting
    return fn


def measure(calls: dict, *, rounds: int = 200) -> list[dict]:
    """Host and eager microseconds of every call, measured in rounds (each round times every call once,
    in turn), so that all of them see the host in the same state: its speed drifts over seconds."""
    import statistics

    import torch

    for fn in calls.values():  # compile, plan, allocate
        for _ in range(10):
            fn()
    host = {name: [] for name in calls}
    eager = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            with bench.setting(fn):  # SDPA's backend selected outside the timed call, as a model selects it
                start = time.perf_counter()
                fn()
                host[name].append(time.perf_counter() - start)
    torch.cuda.synchronize()
    for _ in range(rounds // 20):
        for name, fn in calls.items():
            eager[name].append(eager_microseconds(fn, calls=20, warmup=0))
    rows = []
    for name in calls:
        rows.append({"call": name, "host_us": statistics.median(host[name]) * 1e6,
                     "eager_us": statistics.median(eager[name])})
        print(f"  {name:<34} host {rows[-1]['host_us']:6.1f} us   eager {rows[-1]['eager_us']:6.1f} us per call")
    return rows


def run(*, out_dir: Path = DEFAULT_OUT, impl: str = "solutions") -> dict:
    import torch

    from course.integration import ops

    if not torch.cuda.is_available():
        raise SystemExit("course host-bench times launches on the GPU: it needs a Hopper GPU (sm_90)")
    ops.use_stages(impl=impl)
    results = {"environment": bench.environment(), "prefill": PREFILL, "decode": DECODE,
               "rows": {"prefill": measure(prefill_calls(impl)), "decode": measure(decode_calls(impl))}}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / HOST_JSON).write_text(json.dumps(results, indent=2) + "\n")
    render(out_dir)
    print(f"wrote {HOST_JSON}, {HOST_MD} in {out_dir}")
    return results


def table(results: dict) -> str:
    env = results["environment"]
    p, d = results["prefill"], results["decode"]
    lines = [f"<!-- Generated by `python -m course host-bench` from docs/results/{HOST_JSON}. Do not edit by hand. -->",
             "",
             f"Measured on {env['gpu']}, PyTorch {env['torch']}, nvidia-cutlass-dsl {env['nvidia_cutlass_dsl']}, "
             f"{env['date']}. Microseconds per call, fp16. Host: the median time one call takes to return with "
             f"the GPU busy. Eager: time per call of back-to-back calls (the larger of the host's "
             "and the GPU's part); both in rounds, every call once per round. SDPA cuDNN has its backend "
             "selected once, outside the timed calls (selecting it per call would cost more than the call); "
             "SDPA default lets PyTorch choose, as transformers' sdpa backend does. The ratio is SDPA "
             "cuDNN's eager time over the call's (above 1: faster).",
             ""]
    for phase, what in (("prefill", f"causal prefill, B={p['batch']}, S={p['seqlen']}, H={p['heads']}, "
                                    f"D={p['head_dim']}"),
                        ("decode", f"decode, B={d['batch']}, L={d['seqlen']}, H_q/H_kv={d['heads_q']}/"
                                   f"{d['heads_kv']}, D={d['head_dim']}")):
        rows = results["rows"][phase]
        cudnn = next(r for r in rows if r["call"] == "SDPA cuDNN")
        lines += [f"**{what}**", "", "| call | host | host vs cuDNN | eager | cuDNN / eager |", "|---|---:|---:|---:|---:|"]
        for row in rows:
            lines.append(f"| {row['call']} | {row['host_us']:.1f} | {row['host_us'] / cudnn['host_us']:.2f}x | "
                         f"{row['eager_us']:.1f} | {cudnn['eager_us'] / row['eager_us']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def render(results_dir: Path | str = DEFAULT_OUT) -> str:
    """host.json -> host.md; returns the text."""
    results_dir = Path(results_dir)
    text = table(json.loads((results_dir / HOST_JSON).read_text()))
    (results_dir / HOST_MD).write_text(text)
    return text
