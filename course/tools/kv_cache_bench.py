"""A quantized KV cache inside a model: what an FP8 or int8 cache buys and costs in a decode step.

    python -m course.tools.kv_cache_bench --out docs/results   # Hopper GPU: kv-cache.json and kv-cache.md
    python -m course.tools.kv_cache_bench --render             # kv-cache.json -> kv-cache.md, on any machine

The capstone's two models (``model_bench``'s: GPT-OSS-20b's layer shapes with 8 layers, and a Llama with
the same attention), bfloat16, random weights. For each batch size and context length the prompt is
prefilled in chunks into a static cache of bfloat16 (``models.graph_safe_cache``), FP8 or int8
(``models.quantized_cache``, its scales set by the prompt); then one decode step of the whole model is
captured in a CUDA graph, as a serving engine or ``generate`` with a static cache runs it, and the three
caches' graphs are replayed in the same rounds (``bench.time_graphs``). Every replay is the same step at
the same position: the graph also steps each layer's length counter back after the step's append.

Reported per cache: milliseconds per decode step, the cache's bytes, and how far the step's logits are
from the bfloat16 cache's (largest and mean absolute difference: what the quantization costs).
Never edit the outputs by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from course.tools import bench

DEFAULT_OUT = bench.DEFAULT_OUT
JSON, MD = "kv-cache.json", "kv-cache.md"
SHAPES = [(1, 4096), (8, 4096), (1, 32768), (8, 32768)]  # (batch, context)
CHUNK = 4096  # prefill chunk: tokens per sequence per forward
CACHES = ("bfloat16", "float8_e4m3fn", "int8")


def make_cache(model, name: str, length: int):
    import torch

    from course.integration import models

    if name == "bfloat16":
        return models.graph_safe_cache(model, max_cache_len=length)
    return models.quantized_cache(model, getattr(torch, name), max_cache_len=length)


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def graphed_step(model, cache, token, position):
    """A CUDA graph of one decode step and its logits: the step, then each layer's length counter stepped
    back, so that every replay appends at the same slot and attends to the same keys."""
    import torch

    def step():
        logits = model(token, position_ids=position, past_key_values=cache, use_cache=True).logits[:, -1]
        for layer in cache.layers:
            layer.cumulative_length.sub_(1)
        return logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream: kernels compiled, counters allocated
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    return graph, logits


def bench_shape(model, vocab_size: int, batch: int, context: int) -> dict:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, context + 1), generator=gen, device="cuda")
    token, position = ids[:, context:], torch.full((batch, 1), context, device="cuda")
    experts = getattr(model.config, "_experts_implementation", None) if hasattr(model.config, "num_local_experts") else None
    graphs, logits, caches = {}, {}, {}
    for name in CACHES:
        cache = caches[name] = make_cache(model, name, context + 1)  # alive while its graph replays: it writes there
        with torch.no_grad():
            if experts:  # the prompt on the model's own experts code (tokens grouped per expert)
                model.set_experts_implementation(experts)
            for start in range(0, context, CHUNK):
                model(ids[:, start:min(start + CHUNK, context)], past_key_values=cache, use_cache=True, logits_to_keep=1)
            if experts:  # the step: no data-dependent shapes in the graph
                model.set_experts_implementation("batched_mm")
            graphs[name], logits[name] = graphed_step(model, cache, token, position)
    ms = bench.time_graphs(graphs, calls=1)
    for graph in graphs.values():  # the logits of a replay (capture only records)
        graph.replay()
    base = logits["bfloat16"].float()
    row = {"batch": batch, "context": context, "logit_std": base.std().item(), "caches": {}}
    for name in CACHES:
        difference = (logits[name].float() - base).abs()
        row["caches"][name] = {"ms": ms[name], "bytes": cache_bytes(caches[name]), "max_logit_difference": difference.max().item(),
                               "mean_logit_difference": difference.mean().item()}
    if experts:
        model.set_experts_implementation(experts)  # the next shape's prompt reads it
    del graphs, logits, caches
    torch.cuda.empty_cache()
    return row


def bench_model(name: str, config, model) -> list[dict]:
    """Every shape of ``SHAPES`` on one model, on the course backend."""
    model.set_attn_implementation("course")
    rows = []
    for batch, context in SHAPES:
        rows.append(bench_shape(model, config.vocab_size, batch, context))
        print(name, rows[-1], flush=True)
    return rows


def run(out_dir: Path = DEFAULT_OUT) -> dict:
    from course.tools import model_bench

    rows = model_bench.on_each_model("kv_cache_bench", bench_model)
    results = {"environment": model_bench.environment(), "rows": rows}
    bench.save_results(Path(out_dir), JSON, results)
    render(out_dir)
    return results


def table(results: dict) -> str:
    from course.tools import model_bench

    env = results["environment"]
    lines = [f"<!-- generated by python -m course.tools.kv_cache_bench from docs/results/{JSON}; do not edit -->",
             f"GPU: {env['gpu']}; torch {env['torch']}, transformers {env['transformers']}; bfloat16 models; "
             "one decode step of the whole model in a CUDA graph, milliseconds (median of rounds); the cache's "
             "size in GiB; the logits' mean and largest absolute difference from the bfloat16 cache's, next to "
             "the standard deviation of the bfloat16 cache's logits.", "",
             "| model | B | context | bf16 ms | FP8 ms | int8 ms | bf16 / FP8 | bf16 / int8 | cache GiB, bf16 "
             "/ FP8 | logit std | logit difference, FP8: mean / max | int8: mean / max |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results["rows"].items():
        for row in rows:
            c = row["caches"]
            bf16, fp8, int8 = (c[k] for k in CACHES)
            lines.append(f"| {model_bench.TITLES[name]} | {row['batch']} | {row['context']} | {bf16['ms']:.2f} | "
                         f"{fp8['ms']:.2f} | {int8['ms']:.2f} | {bf16['ms'] / fp8['ms']:.2f}x | "
                         f"{bf16['ms'] / int8['ms']:.2f}x | {bf16['bytes'] / 2**30:.2f} / {fp8['bytes'] / 2**30:.2f} | "
                         f"{row['logit_std']:.2f} | {fp8['mean_logit_difference']:.3f} / "
                         f"{fp8['max_logit_difference']:.3f} | {int8['mean_logit_difference']:.3f} / "
                         f"{int8['max_logit_difference']:.3f} |")
    return "\n".join(lines) + "\n"


def render(out_dir: Path = DEFAULT_OUT) -> str:
    return bench.render_results(out_dir, JSON, MD, table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render", action="store_true", help=f"{JSON} -> {MD} (no GPU)")
    args = parser.parse_args(argv)
    print(render(args.out) if args.render else table(run(args.out)))


if __name__ == "__main__":
    main()
