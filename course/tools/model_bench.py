"""End to end: models on the course backend next to transformers' own attention, prefill and decode.

    python -m course model-bench --out docs/results    # Hopper GPU: models.json, models.md, models.png
    python -m course model-bench --render              # models.json -> models.md again, on any machine

Two models with GPT-OSS-20b's layer shapes and random weights (model weights are not downloaded here):
GPT-OSS itself (64 query heads over 8 KV heads, head dim 64, sink logits, 128-token windows on every
other layer, 4 experts per token, hidden size 2880, its 201k vocabulary) with 8 layers instead of 24,
and a Llama with the same attention shapes and no sinks or windows. In bfloat16: the whole forward
is timed, Python and every layer included, with CUDA events after warm-up (the median of
``repeats`` runs; in eager mode the backends take turns, one run each per round, since a decode step
is mostly Python and the machine's speed drifts). Prefill is one forward over a prompt of B=1 into a fresh cache; decode is the time
per token of ``DECODE_STEPS`` one-token steps after a prompt, at B=1 and B=8, run two ways: eagerly
over a DynamicCache (as ``generate`` does by default), and over a StaticCache with the forward
compiled by ``torch.compile(mode="reduce-overhead")``, whose CUDA graphs replay each step (as
``generate(..., cache_implementation="static")`` does).

Each backend transformers refuses for a model (GPT-OSS has no SDPA path: SDPA cannot add its sinks),
or that runs out of memory, is a row that says so. Never edit the outputs by hand.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from functools import partial
from pathlib import Path

from course.tools import bench

DEFAULT_OUT = bench.DEFAULT_OUT
MODELS_JSON, MODELS_MD, MODELS_PNG = "models.json", "models.md", "models.png"
BACKENDS = ("course", "sdpa", "eager")
PROMPTS = (1024, 4096)
DECODE_PROMPT = 4096
DECODE_STEPS = 32
DECODE_BATCHES = (1, 8)
MODES = ("eager", "static+compile")
# The backends whose compiled decode step is timed (a compile each): the course's and the fastest
# other one transformers runs for the model.
STATIC_BACKENDS = {"gpt-oss": ("course", "eager"), "llama": ("course", "sdpa")}
TITLES = {"gpt-oss": "GPT-OSS, 8 layers", "llama": "Llama, same attention"}


def bench_configs() -> dict:
    from course.integration import models

    shapes = dict(num_layers=8, hidden_size=2880, vocab_size=201088)
    return {"gpt-oss": models.gpt_oss_config(**shapes), "llama": models.llama_config(**shapes)}


def on_each_model(tool: str, measure) -> dict:
    """{name: measure(name, config, model)} for each of ``bench_configs()``: its model made with random
    weights in bfloat16 on the GPU, and freed before the next one is made. ``tool`` names the caller in
    the error a machine without a GPU gets."""
    import torch

    from course.integration import models

    if not torch.cuda.is_available():
        raise SystemExit(f"{tool} times models on the GPU: it needs a Hopper GPU (sm_90)")
    measured = {}
    for name, config in bench_configs().items():
        model = models.random_model(config, device="cuda").to(torch.bfloat16)
        measured[name] = measure(name, config, model)
        del model
        torch.cuda.empty_cache()
    return measured


def prefill_sample(model, ids):
    """One sample: milliseconds of one forward over ``ids`` into a fresh DynamicCache."""
    import transformers

    def sample():
        cache = transformers.DynamicCache(config=model.config)
        return _timed(lambda: model(ids, past_key_values=cache, use_cache=True))

    return sample


def decode_sample(model, prompt_ids, step_ids):
    """One sample: milliseconds per token of one-token steps (``step_ids`` [B, steps]) after ``prompt_ids``,
    run eagerly over a DynamicCache."""
    import transformers

    return partial(_per_token, lambda: transformers.DynamicCache(config=model.config), model, model, prompt_ids,
                   step_ids)


def static_decode_sample(model, prompt_ids, step_ids):
    """Like ``decode_sample``, over a StaticCache, the steps run by ``torch.compile(mode="reduce-overhead")``
    (CUDA-graph trees: after the first steps, each is a graph replay); the prompt runs eagerly. Made
    once per backend: making it compiles."""
    import torch
    import transformers

    torch._dynamo.reset()  # a graph of its own for this model, backend and batch
    # Not fullgraph, as generate() compiles: GPT-OSS's experts route tokens with data-dependent shapes.
    compiled = torch.compile(model, mode="reduce-overhead")
    length = prompt_ids.shape[1] + step_ids.shape[1]
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)

    def fresh():
        cache.reset()
        return cache

    return partial(_per_token, fresh, model, compiled, prompt_ids, step_ids)


def _timed(fn) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _per_token(make_cache, prefill, step, prompt_ids, step_ids) -> float:
    import torch

    prompt = prompt_ids.shape[1]
    cache = make_cache()
    prefill(prompt_ids, past_key_values=cache, use_cache=True)

    def steps():
        for i in range(step_ids.shape[1]):
            position = torch.full((1,), prompt + i, device=step_ids.device)
            step(step_ids[:, i:i + 1], past_key_values=cache, use_cache=True, cache_position=position,
                 position_ids=position[None].expand(step_ids.shape[0], 1))

    return _timed(steps) / step_ids.shape[1]


def measurements(model, vocab_size: int):
    """(phase, batch, tokens, mode, make_sample) for every timing of one model: ``make_sample()``, called
    with the backend set, returns a function that times one run in milliseconds."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)

    def ids(batch, length):
        return torch.randint(0, vocab_size, (batch, length), generator=gen, device="cuda")

    for tokens in PROMPTS:
        yield "prefill", 1, tokens, "eager", partial(prefill_sample, model, ids(1, tokens))
    for batch in DECODE_BATCHES:
        prompt, steps = ids(batch, DECODE_PROMPT), ids(batch, DECODE_STEPS)
        yield "decode", batch, DECODE_PROMPT, "eager", partial(decode_sample, model, prompt, steps)
        yield "decode", batch, DECODE_PROMPT, "static+compile", partial(static_decode_sample, model, prompt, steps)


def in_rounds(model, backends, make_sample, warmup: int, repeats: int, together: bool) -> dict:
    """{backend: median milliseconds, or the error that stopped it} over ``warmup + repeats`` runs each.

    ``together``: the backends take turns, one run each per round, so that a
    slower or faster spell of the machine (a decode step of these models is
    mostly Python) falls on every backend alike. Otherwise each backend runs
    all its rounds before the next one starts (a compiled model is made once
    per backend). A backend that raises (out of memory, or any failure) gets its
    error and drops out; the others go on.
    """
    import torch

    samples, errors = {b: [] for b in backends}, {}
    groups = [list(backends)] if together else [[b] for b in backends]
    for group in groups:
        runs = {}
        for _ in range(warmup + repeats):
            for backend in [b for b in group if b not in errors]:
                try:
                    model.set_attn_implementation(backend)
                    if backend not in runs:
                        runs[backend] = make_sample()
                    with torch.no_grad():
                        samples[backend].append(runs[backend]())
                except torch.cuda.OutOfMemoryError:
                    errors[backend] = "out of memory"
                except Exception as error:  # a failure is a row of the table: the other measurements go on
                    errors[backend] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                if backend in errors:
                    runs.pop(backend, None)
                    torch.cuda.empty_cache()
    return {b: errors[b] if b in errors else statistics.median(samples[b][warmup:]) for b in backends}


def bench_model(name: str, config, model, repeats: int, warmup: int = 2) -> list[dict]:
    rows, backends = [], []
    for backend in BACKENDS:
        try:
            model.set_attn_implementation(backend)
            backends.append(backend)
        except (ValueError, ImportError) as error:
            rows.append({"model": name, "backend": backend,
                         "error": f"transformers refuses it: {str(error).splitlines()[0]}"})
    for phase, batch, tokens, mode, make_sample in measurements(model, config.vocab_size):
        eager = mode == "eager"
        timed = [b for b in backends if eager or b in STATIC_BACKENDS[name]]
        outcomes = in_rounds(model, timed, make_sample, warmup, repeats, together=eager)
        for backend, outcome in outcomes.items():
            row = {"model": name, "backend": backend, "phase": phase, "batch": batch, "tokens": tokens,
                   "mode": mode, **({"error": outcome} if isinstance(outcome, str) else {"ms": outcome})}
            rows.append(row)
            shown = f"{row['ms']:.2f} ms" if "ms" in row else row["error"]
            print(f"  {name} {backend:>6} {_what(row, DECODE_STEPS)}: {shown}", flush=True)
    return rows


def environment() -> dict:
    from importlib import metadata

    from course.integration import ops

    return {**bench.environment(), "transformers": metadata.version("transformers"), "course": asdict(ops.backing())}


def run(*, out_dir: Path = DEFAULT_OUT, impl: str = "solutions", repeats: int = 10) -> dict:
    from course.integration import ops

    ops.use_stages(impl=impl)
    measured = on_each_model("course model-bench", lambda name, config, model: bench_model(name, config, model, repeats))
    results = {"environment": environment(), "decode_steps": DECODE_STEPS,
               "rows": [row for rows in measured.values() for row in rows]}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODELS_JSON).write_text(json.dumps(results, indent=2) + "\n")
    render(out_dir)
    written = [MODELS_JSON, MODELS_MD]
    if any("ms" in row for row in results["rows"]):  # the table links the plot only then
        figure(results).savefig(out_dir / MODELS_PNG, dpi=110, facecolor="white")
        written.append(MODELS_PNG)
    print(f"wrote {', '.join(written)} in {out_dir}")
    return results


# ---------------------------------------------------------------- the table and the plot

def _cell(rows: list[dict], backend: str) -> str:
    """Milliseconds, the error of a run that failed, or "refused" (transformers has no such backend here)."""
    row = next((r for r in rows if r["backend"] == backend), None)
    if row is None:
        return "refused"
    return f"{row['ms']:.2f}" if "ms" in row else row["error"]


def _what(row: dict, steps: int) -> str:
    if row["phase"] == "prefill":
        return f"prefill, {row['tokens']} tokens"
    return f"decode B={row['batch']}, {steps} steps after {row['tokens']} tokens, {row.get('mode', 'eager')}"


def _key(row: dict) -> tuple:
    return row["phase"], row["batch"], row["tokens"], row.get("mode", "eager")


def table(results: dict | None) -> str:
    """The Markdown of models.md: the environment and one row per (model, phase), one column per backend."""
    lines = [f"<!-- Generated by `python -m course model-bench` from docs/results/{MODELS_JSON}. "
             "Do not edit by hand. -->", ""]
    if results is None:
        return "\n".join(lines + ["Not measured yet: on a Hopper GPU, `python -m course model-bench --out "
                                  "docs/results` times the models and writes this table."]) + "\n"
    env, rows = results["environment"], results["rows"]
    lines += [f"Measured on {env['gpu']} (driver {env['driver']}), PyTorch {env['torch']}, transformers "
              f"{env['transformers']}, nvidia-cutlass-dsl {env['nvidia_cutlass_dsl']}, {env['date']}; the course "
              f"backend on prefill stage {env['course']['prefill']} and decode stage {env['course']['decode']} "
              f"({env['course']['impl']}). Milliseconds, bfloat16; decode is per token, eager (DynamicCache) or "
              "static+compile (StaticCache, CUDA graphs). The last columns: how much faster the course backend "
              "is than each other backend (above 1: faster).", ""]
    refused = [r for r in rows if "phase" not in r]
    measured = [r for r in rows if "phase" in r]
    others = [b for b in BACKENDS if b != "course"]
    lines += ["| model | what | " + " | ".join(BACKENDS) + " | " + " | ".join(f"course vs {b}" for b in others)
              + " |", "|---|---|" + "---:|" * (len(BACKENDS) + len(others))]
    for model, key in dict.fromkeys((r["model"], _key(r)) for r in measured):
        same = [r for r in measured if (r["model"], _key(r)) == (model, key)]
        ms = {b: next((r.get("ms") for r in same if r["backend"] == b), None) for b in BACKENDS}
        cells = [_cell(same, backend) for backend in BACKENDS]
        ratios = [f"{ms[b] / ms['course']:.2f}x" if ms["course"] and ms[b] else "-" for b in others]
        lines.append(f"| {TITLES[model]} | {_what(same[0], results['decode_steps'])} | " + " | ".join(cells)
                     + " | " + " | ".join(ratios) + " |")
    lines += ["", *(f"- {TITLES[r['model']]}, {r['backend']}: {r['error']}" for r in refused)]
    if measured:
        lines += ["", f"![Prefill and decode time of each model and attention backend](results/{MODELS_PNG})"]
    return "\n".join(lines).rstrip() + "\n"


def render(results_dir: Path | str = DEFAULT_OUT) -> str:
    """Write models.md from models.json in ``results_dir`` (or the "not measured yet" text without it)."""
    results_dir = Path(results_dir)
    source = results_dir / MODELS_JSON
    text = table(json.loads(source.read_text()) if source.exists() else None)
    (results_dir / MODELS_MD).write_text(text)
    return text


def figure(results: dict):
    """One panel per measurement (phase, batch, prompt, mode): milliseconds of each model on each backend
    that ran; four panels a row."""
    import matplotlib.pyplot as plt

    measured = [r for r in results["rows"] if "ms" in r]
    panels = list(dict.fromkeys(_key(r) for r in measured))
    columns = min(4, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4 * columns, 3.4 * rows_of_panels), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, key in zip(axes.flat, panels):
        names = list(TITLES)
        for i, backend in enumerate(BACKENDS):
            values = [next((r["ms"] for r in measured if (r["model"], r["backend"], _key(r)) == (name, backend, key)),
                           0) for name in names]
            ax.bar([x + 0.27 * i for x in range(len(names))], values, 0.27, label=backend)
        ax.set_xticks([x + 0.27 for x in range(len(names))], [TITLES[n] for n in names], fontsize=8)
        example = next(r for r in measured if _key(r) == key)
        ax.set_title(_what(example, results["decode_steps"]).replace(", static", ",\nstatic"), fontsize=9)
        ax.set_ylabel("ms per token" if key[0] == "decode" else "ms")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"End to end on {results['environment']['gpu']} (bfloat16; no bar: not run, see the table)",
                 fontsize=10)
    fig.tight_layout()
    return fig
