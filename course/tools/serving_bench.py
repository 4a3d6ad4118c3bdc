"""What the serving extras cost: stage 9's fused append + RoPE, int8 cache, ALiBi and rolling cache, stage 10's ALiBi.

    python -m course.tools.serving_bench --out docs/results   # Hopper GPU: serving.json, serving.md, alibi-prefill.md
    python -m course.tools.serving_bench --render             # serving.json -> the tables, on any machine
    python -m course.tools.serving_bench --only prefill --out docs/results   # one section again, the rest kept

Every decode time is one call inside a CUDA graph of 10 calls (``bench.capture_graph``, as a serving
engine runs decode), the calls of one table timed in the same rounds (``bench.time_in_rounds``),
median of the rounds. bf16 queries, D = 128, a contiguous cache.

- Append + RoPE: the fused step (``k_new``, ``v_new``, ``rotary_cos``/``sin``: the kernel rotates q
  and k_new and writes the row) next to stage 9 attending to a cache that already holds the token
  ("attention only"), and next to what a serving step does without the fusion: PyTorch's RoPE on q
  and k_new, two ``index_copy_`` into the cache, then the attention ("unfused").
- int8 and fp8 caches: tokens/s (B x 1 query / time) against the 16-bit cache, and the error each
  format adds (max |O - O_16bit| over the batch, the 16-bit cache's result in float64 as truth).
- ALiBi: the same call with and without slopes.
- A rolling cache: window 4096 (+ 4 sink tokens) read from a ring of 4100 rows after 100k tokens,
  next to a contiguous cache holding the same 4100 tokens.
- Head dims: stage 9 at every head dim it takes (80, 96, 192 and (192, 128) computed as 128 and 256,
  with zero columns), GB/s of K and V read.
- ALiBi in prefill: stage 10 on a packed batch of equal-length prompts with and without slopes,
  causal and not (eager calls, ``bench.time_in_rounds``).

Never edit the outputs by hand.
"""

from __future__ import annotations

import functools
from pathlib import Path

from course.tools import bench

DEFAULT_OUT = bench.DEFAULT_OUT
HEAD_DIM = 128
APPEND_SHAPES = [(b, length, h_q, h_kv) for h_q, h_kv in ((32, 8), (64, 8)) for b in (1, 8, 64)
                 for length in (4096, 32768)]
QUANTIZED_SHAPES = [(8, 32768, 32, 8), (64, 32768, 32, 8), (8, 131072, 32, 8)]
WINDOW, SINKS, ROLLED_LENGTH = 4096, 4, 100_000
HEAD_DIM_SHAPES = [(8, 32768, 32, 8), (64, 4096, 32, 8), (1, 32768, 32, 8)]
PREFILL_SHAPE = (4, 4096, 16)  # ALiBi in prefill: B prompts of S tokens, H heads (H_q = H_kv)
EAGER = ("fused append + RoPE", "unfused (RoPE, 2 index_copy_, attention)")  # also timed without a graph


def _cache(batch, length, heads_kv, dtype, gen):
    import torch

    shape = (batch, length, heads_kv, HEAD_DIM)
    return (torch.randn(shape, device="cuda", dtype=dtype, generator=gen),
            torch.randn(shape, device="cuda", dtype=dtype, generator=gen))


def append_calls(stage, batch, length, heads_q, heads_kv):
    """{name: call}: attention only, fused append + RoPE, and the unfused step, for one shape."""
    import torch

    from course import testing
    from course.testing import reference

    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = _cache(batch, length + 1, heads_kv, dtype, gen)
    q = torch.randn(batch, heads_q, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    k_new, v_new = (torch.randn(batch, heads_kv, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
                    for _ in range(2))
    before = torch.full((batch,), length - 1, dtype=torch.int32, device="cuda")  # tokens before the new one
    after = before + 1
    cos, sin = testing.rotary_tables(length + 1, HEAD_DIM, dtype)
    rows = (torch.arange(batch, device="cuda") * (length + 1) + before).long()  # the new rows, flattened
    flat_k, flat_v = k.view(-1, heads_kv, HEAD_DIM), v.view(-1, heads_kv, HEAD_DIM)

    def unfused():
        q_rot = reference.rotary(q, cos, sin, before)
        flat_k.index_copy_(0, rows, reference.rotary(k_new, cos, sin, before))
        flat_v.index_copy_(0, rows, v_new)
        return stage.decode_attention(q_rot, k, v, after)

    return {
        "attention only": lambda: stage.decode_attention(q, k, v, after),
        "fused append + RoPE": lambda: stage.decode_attention(q, k, v, before, k_new=k_new, v_new=v_new,
                                                              rotary_cos=cos, rotary_sin=sin),
        "unfused (RoPE, 2 index_copy_, attention)": unfused,
    }


def time_graphed(calls: dict) -> dict:
    graphs = {name: bench.capture_graph(fn) for name, fn in calls.items()}
    return bench.time_graphs(graphs)


def bench_append(stage) -> list[dict]:
    rows = []
    for batch, length, heads_q, heads_kv in APPEND_SHAPES:
        calls = append_calls(stage, batch, length, heads_q, heads_kv)
        times = time_graphed(calls)
        eager = bench.time_in_rounds({name: calls[name] for name in EAGER})
        rows.append({"batch": batch, "length": length, "heads_q": heads_q, "heads_kv": heads_kv,
                     **{name: ms * 1000 for name, ms in times.items()},
                     **{f"{name} eager": ms * 1000 for name, ms in eager.items()}})
        print(rows[-1], flush=True)
    return rows


def bench_quantized(stage) -> list[dict]:
    import torch

    from course.runtime import kv_cache
    from course.testing import reference

    rows = []
    for batch, length, heads_q, heads_kv in QUANTIZED_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(1)
        k, v = _cache(batch, length, heads_kv, torch.bfloat16, gen)
        q = torch.randn(batch, heads_q, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        caches = {"bf16": (k, v, {})}
        for name, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
            kq, vq, k_scale, v_scale = kv_cache.quantize_kv_cache(k, v, dtype)
            caches[name] = (kq, vq, {"k_scale": k_scale, "v_scale": v_scale})
        times = time_graphed({name: functools.partial(stage.decode_attention, q, kk, vv, seqlens, **sc)
                              for name, (kk, vv, sc) in caches.items()})
        row = {"batch": batch, "length": length, "heads_q": heads_q, "heads_kv": heads_kv,
               **{f"{name} us": ms * 1000 for name, ms in times.items()}}
        if batch == 8 and length == 32768:  # the error each format adds, on one shape (a float64 reference)
            truth = reference.decode_attention(q[:2], k[:2], v[:2], seqlens[:2])
            for name, (kk, vv, sc) in caches.items():
                out = stage.decode_attention(q, kk, vv, seqlens, **sc)[:2]
                row[f"{name} max error"] = (out.double() - truth).abs().max().item()
        rows.append(row)
        print(row, flush=True)
        del caches, k, v
        torch.cuda.empty_cache()
    return rows


def bench_alibi_and_rolling(stage) -> list[dict]:
    import torch

    from course import testing

    rows = []
    for batch in (8, 64):
        gen = torch.Generator(device="cuda").manual_seed(2)
        capacity = WINDOW + SINKS
        k, v = _cache(batch, capacity, 8, torch.bfloat16, gen)
        q = torch.randn(batch, 32, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        held = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
        rolled = torch.full((batch,), ROLLED_LENGTH, dtype=torch.int32, device="cuda")
        slopes = testing.alibi_slopes(32)
        window = dict(window_size_left=WINDOW - 1, num_sink_tokens=SINKS)
        call = functools.partial(stage.decode_attention, q, k, v, **window)
        times = time_graphed({
            "contiguous": functools.partial(call, held),
            "rolling": functools.partial(call, rolled, cache_capacity=capacity),
            "contiguous + ALiBi": functools.partial(call, held, alibi_slopes=slopes),
        })
        rows.append({"batch": batch, "keys": capacity, **{name: ms * 1000 for name, ms in times.items()}})
        print(rows[-1], flush=True)
    return rows


def bench_head_dims(stage) -> list[dict]:
    import torch

    from course import testing

    rows = []
    for batch, length, heads_q, heads_kv in HEAD_DIM_SHAPES:
        calls, kv_bytes = {}, {}
        for d, d_v in stage.HEAD_DIMS:
            label = f"{d}" if d == d_v else f"{d}/{d_v}"
            inputs = testing.random_decode_inputs([length] * batch, heads_q, heads_kv, d, torch.bfloat16,
                                                  head_dim_v=d_v, seed=d + d_v)
            calls[label] = functools.partial(stage.decode_attention, **inputs)
            kv_bytes[label] = batch * length * heads_kv * (d + d_v) * 2
        times = time_graphed(calls)
        rows.append({"batch": batch, "length": length, "heads_q": heads_q, "heads_kv": heads_kv,
                     **{f"D{d} us": ms * 1000 for d, ms in times.items()},
                     **{f"D{d} GB/s": kv_bytes[d] / ms / 1e6 for d, ms in times.items()}})
        print(rows[-1], flush=True)
        del calls
        torch.cuda.empty_cache()
    return rows


def bench_alibi_prefill(stage) -> list[dict]:
    import torch

    from course import testing

    batch, length, heads = PREFILL_SHAPE
    inputs = testing.random_varlen_inputs([length] * batch, [length] * batch, heads, heads, HEAD_DIM, torch.bfloat16)
    slopes = testing.alibi_slopes(heads)
    rows = []
    for causal in (False, True):
        call = functools.partial(stage.attention_varlen, **inputs, causal=causal)
        times = bench.time_in_rounds({"no bias": call, "ALiBi": functools.partial(call, alibi_slopes=slopes)})
        flops = 4 * batch * heads * length * length * HEAD_DIM * (0.5 if causal else 1.0)
        rows.append({"causal": causal, **{f"{name} TFLOP/s": flops / ms / 1e9 for name, ms in times.items()}})
        print(rows[-1], flush=True)
    return rows


def render(results: dict) -> str:
    env = results["environment"]
    lines = ["<!-- generated by python -m course.tools.serving_bench; do not edit -->",
             f"GPU: {env.get('gpu', '?')}; torch {env.get('torch', '?')}; microseconds per call inside CUDA "
             "graphs, median of rounds; bf16, D = 128, contiguous cache.", "",
             "**Append + RoPE** (attention over L keys, the last one the new token; eager: the same calls "
             "without a graph, back to back, where the host's launches show):", "",
             "| B | L | H_q/H_kv | attention only | fused append + RoPE | fused / attention | unfused | "
             "unfused / fused | fused, eager | unfused, eager |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["append"]:
        att, fused = r["attention only"], r["fused append + RoPE"]
        unfused = r["unfused (RoPE, 2 index_copy_, attention)"]
        eager = " | ".join(f"{r[f'{name} eager']:.1f}" for name in EAGER)
        lines.append(f"| {r['batch']} | {r['length']} | {r['heads_q']}/{r['heads_kv']} | {att:.1f} | {fused:.1f} | "
                     f"{fused / att:.3f} | {unfused:.1f} | {unfused / fused:.2f} | {eager} |")
    lines += ["", "**Quantized caches** (tokens/s relative to the bf16 cache; error: max |O - O_bf16 cache| "
              "against the bf16 cache's float64 result):", "",
              "| B | L | bf16 us | fp8 us | int8 us | fp8 speed-up | int8 speed-up | fp8 error | int8 error |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["quantized"]:
        errors = (f"{r['fp8 max error']:.1e} | {r['int8 max error']:.1e}" if "fp8 max error" in r else " | ")
        lines.append(f"| {r['batch']} | {r['length']} | {r['bf16 us']:.1f} | {r['fp8 us']:.1f} | {r['int8 us']:.1f} | "
                     f"{r['bf16 us'] / r['fp8 us']:.2f}x | {r['bf16 us'] / r['int8 us']:.2f}x | {errors} |")
    lines += ["", f"**A rolling cache and ALiBi** (window {WINDOW} + {SINKS} sink tokens, H_q/H_kv = 32/8; "
              f"rolling: after {ROLLED_LENGTH} tokens, in a ring of {WINDOW + SINKS} rows):", "",
              "| B | contiguous | rolling | rolling / contiguous | + ALiBi | ALiBi / contiguous |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in results["rolling"]:
        base = r["contiguous"]
        lines.append(f"| {r['batch']} | {base:.1f} | {r['rolling']:.1f} | {r['rolling'] / base:.3f} | "
                     f"{r['contiguous + ALiBi']:.1f} | {r['contiguous + ALiBi'] / base:.3f} |")
    if results.get("head dims"):
        dims = [key[1:-3] for key in results["head dims"][0] if key.endswith(" us")]
        lines += ["", "**Head dims** (microseconds per call, and GB/s of K and V read; 80 and 96 are computed as 128, "
                  "192 as 256, with zero columns; 192/128 is 192 for q and k with 128 for v):", "",
                  "| B | L | H_q/H_kv | " + " | ".join(f"D = {d}" for d in dims) + " |",
                  "|---:|---:|---:|" + "---:|" * len(dims)]
        for r in results["head dims"]:
            cells = " | ".join(f"{r[f'D{d} us']:.1f} ({r[f'D{d} GB/s']:.0f})" for d in dims)
            lines.append(f"| {r['batch']} | {r['length']} | {r['heads_q']}/{r['heads_kv']} | {cells} |")
    return "\n".join(lines) + "\n"


def render_prefill(results: dict) -> str:
    """The ALiBi-in-prefill table (stage 10's page includes it)."""
    env = results["environment"]
    batch, length, heads = PREFILL_SHAPE
    lines = ["<!-- generated by python -m course.tools.serving_bench; do not edit -->",
             f"GPU: {env.get('gpu', '?')}; torch {env.get('torch', '?')}; stage 10 on {batch} packed prompts of "
             f"{length} tokens, {heads} heads, bf16, D = 128; TFLOP/s of eager calls, median of rounds (causal "
             "counts half the FLOPs).", "",
             "| mask | no bias | ALiBi | ALiBi / no bias |", "|:---|---:|---:|---:|"]
    for r in results.get("prefill alibi", []):
        plain, alibi = r["no bias TFLOP/s"], r["ALiBi TFLOP/s"]
        lines.append(f"| {'causal' if r['causal'] else 'none'} | {plain:.0f} | {alibi:.0f} | {alibi / plain:.2f} |")
    return "\n".join(lines) + "\n"


def write_tables(results: dict, out_dir: Path) -> None:
    (out_dir / "serving.md").write_text(render(results))
    (out_dir / "alibi-prefill.md").write_text(render_prefill(results))


SECTIONS = {"append": (9, bench_append), "quantized": (9, bench_quantized), "rolling": (9, bench_alibi_and_rolling),
            "head dims": (9, bench_head_dims), "prefill alibi": (10, bench_alibi_prefill)}


def run(out_dir: Path = DEFAULT_OUT, only: str | None = None) -> dict:
    """Every section, or (``only``) one section timed again into the existing serving.json."""
    return bench.run_stage_sections(out_dir, "serving.json", SECTIONS, write_tables, only)


def main(argv=None) -> None:
    bench.sections_command(argv, __doc__.splitlines()[0], "serving.json", SECTIONS, run, write_tables)


if __name__ == "__main__":
    main()
