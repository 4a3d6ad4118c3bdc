"""``course sanitize``: every stage's kernels under compute-sanitizer, one summary line per stage.

Each stage runs a few small launches that switch on every feature it has
(masks, sinks, LSE, GQA, tails; for decode a ragged paged batch with forced
splits) under each tool:

* memcheck: out-of-bounds and misaligned global/shared accesses;
* racecheck: shared-memory hazards between threads (the named barriers and
  mbarrier phases are where they would hide);
* synccheck: illegal barrier use (a bar.sync not every thread reaches).

The DSL's host runtime probes the driver at start-up, and memcheck reports
those calls' CUDA_ERROR_INVALID_VALUE results as API errors; they come from
host code, not from a kernel, so they are counted separately as host API
noise. A stage is clean when no tool reports anything from a kernel.

Run on a machine with a Hopper GPU and compute-sanitizer (the CUDA toolkit):

    python -m course sanitize          # every ready stage
    python -m course sanitize 8 --tool racecheck
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from course.runtime import stages

TOOLS = ("memcheck", "racecheck", "synccheck")
_SUMMARY = re.compile(r"=+ (?:ERROR|RACECHECK) SUMMARY: (\d+) (?:error|hazard)")
_HOST_API = re.compile(r"Program hit \S+ .*on CUDA API call to (\w+)")


@dataclass
class ToolResult:
    tool: str
    returncode: int
    kernel_findings: list[str] = field(default_factory=list)
    host_api_calls: dict[str, int] = field(default_factory=dict)
    summary_count: int | None = None
    failed_to_run: str = ""

    @property
    def clean(self) -> bool:
        return not self.failed_to_run and not self.kernel_findings

    def line(self) -> str:
        if self.failed_to_run:
            return f"{self.tool}: did not run ({self.failed_to_run})"
        noise = sum(self.host_api_calls.values())
        text = f"{self.tool}: {len(self.kernel_findings)} kernel findings"
        if noise:
            calls = ", ".join(f"{name} x{count}" for name, count in sorted(self.host_api_calls.items()))
            text += f" ({noise} host API results ignored: {calls})"
        return text


def classify(tool: str, output: str, returncode: int) -> ToolResult:
    """Split compute-sanitizer's report into kernel findings and host API noise.

    Each finding starts with a line "========= <message>"; the lines under it
    ("=========     at ...", backtraces) are indented further.
    """
    result = ToolResult(tool, returncode)
    for line in output.splitlines():
        if not line.startswith("========= ") or line[len("========= "):][:1].isspace():
            continue
        message = line[len("========= "):].strip()
        host = _HOST_API.search(message)
        if host:
            result.host_api_calls[host.group(1)] = result.host_api_calls.get(host.group(1), 0) + 1
        elif message and "SUMMARY" not in message and not message.startswith(("COMPUTE-SANITIZER", "Saved host")):
            result.kernel_findings.append(message)
    summary = _SUMMARY.search(output)
    result.summary_count = int(summary.group(1)) if summary else None
    if summary is None and returncode != 0:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        result.failed_to_run = f"exit code {returncode}: {tail[0][:200]}"
    return result


def run_tool(number: int, tool: str) -> ToolResult:
    """One tool over one stage's small launches (``python -m course.tools.sanitize --launch N``)."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        return ToolResult(tool, 1, failed_to_run="compute-sanitizer is not on the PATH (it ships with the CUDA toolkit)")
    command = [sanitizer, "--tool", tool, "--print-limit", "200", sys.executable, "-m", "course.tools.sanitize",
               "--launch", str(number)]
    completed = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    output = completed.stdout + completed.stderr
    result = classify(tool, output, completed.returncode)
    if "LAUNCHES OK" not in completed.stdout and not result.failed_to_run:
        result.failed_to_run = f"the launches did not finish (exit code {completed.returncode}): " + \
            (output.strip().splitlines() or ["no output"])[-1][:200]
    return result


def launch_stage(number: int) -> None:
    """The small launches of stage ``number``, every feature on at least once (run under the sanitizer)."""
    import torch

    from course import testing

    stage = stages.get(number)
    module = stage.load("solutions")
    if stage.kind == "decode":
        inputs = testing.random_decode_inputs([1, 70, 300], 8, 2, 128, torch.float16, page_size=16, seed=1)
        module.decode_attention(**inputs, num_splits=3, return_lse=True, window_size_left=100, num_sink_tokens=2,
                                sink_logits=torch.randn(8, device="cuda"))
        inputs = testing.random_decode_inputs([129, 5], 4, 4, 64, torch.bfloat16, seed=2)
        module.decode_attention(**inputs, num_splits=2)
        if number >= 9:  # an FP8 cache, a group of 24 query heads (two CTAs of 16 rows), D = 256
            from unittest import mock

            from course.runtime import kv_cache

            inputs = testing.random_decode_inputs([300, 17], 24, 1, 256, torch.float16, page_size=32, seed=3)
            module.decode_attention(**kv_cache.fp8_decode_inputs(inputs), num_splits=2, return_lse=True)
            # Groups of 24 and 64 heads on 2 and 4 row tiles per CTA, which only launches that fill the GPU
            # pick on their own: forced here.
            most_tiles = lambda batch, heads_kv, group, keys, sms, head_dim, cache: module.row_tiles(group, head_dim)  # noqa: E731
            with mock.patch.object(module, "pick_row_tiles", most_tiles):
                for heads_q, heads_kv in ((48, 2), (64, 1)):
                    inputs = testing.random_decode_inputs([300, 70], heads_q, heads_kv, 128, torch.float16,
                                                          page_size=16, seed=heads_q)
                    module.decode_attention(**inputs, num_splits=3, return_lse=True)
            # 8-warp CTAs, which launches of at most one CTA per SM pick (pick_warps): forced on a ragged batch.
            with mock.patch.object(module, "pick_warps", lambda *args: 8):
                inputs = testing.random_decode_inputs([300, 1000, 1], 32, 2, 128, torch.float16, page_size=32, seed=5)
                module.decode_attention(**inputs, num_splits=3, return_lse=True, window_size_left=500,
                                        num_sink_tokens=2)
            # The serving extras: the new token appended and rotated into a paged int8 cache, a rolling
            # fp16 cache with ALiBi and an append that overwrites the row leaving the window.
            inputs = testing.append_decode_inputs([0, 300, 31], 32, 8, 128, torch.bfloat16, page_size=16, seed=6)
            new = {name: inputs.pop(name) for name in ("k_new", "v_new")}
            cos, sin = testing.rotary_tables(400, 64, torch.bfloat16)
            module.decode_attention(**kv_cache.quantized_decode_inputs(inputs, torch.int8), **new, rotary_cos=cos,
                                    rotary_sin=sin, rotary_interleaved=True, num_splits=4, return_lse=True)
            # Head dims computed padded (96 as 128, 192 and (192, 128) as 256): copies that write zeros.
            inputs = testing.append_decode_inputs([0, 300, 31], 16, 4, 96, torch.bfloat16, page_size=16, seed=8)
            new = {name: inputs.pop(name) for name in ("k_new", "v_new")}
            cos, sin = testing.rotary_tables(400, 96, torch.bfloat16)
            module.decode_attention(**kv_cache.quantized_decode_inputs(inputs, torch.float8_e4m3fn), **new,
                                    rotary_cos=cos, rotary_sin=sin, num_splits=4, return_lse=True)
            inputs = testing.random_decode_inputs([300, 17], 16, 2, 192, torch.float16, page_size=32, seed=9)
            module.decode_attention(**inputs, num_splits=2, return_lse=True)
            inputs = testing.append_decode_inputs([0, 300, 31], 8, 8, 192, torch.bfloat16, page_size=16,
                                                  head_dim_v=128, seed=10)
            new = {name: inputs.pop(name) for name in ("k_new", "v_new")}
            cos, sin = testing.rotary_tables(400, 64, torch.bfloat16)
            module.decode_attention(**inputs, **new, rotary_cos=cos, rotary_sin=sin, num_splits=3, return_lse=True)
            inputs = testing.rolling_decode_inputs([70, 500], 64, 16, 2, 128, torch.float16, seed=7)
            new = {name: torch.randn(2, 2, 128, device="cuda", dtype=torch.float16) for name in ("k_new", "v_new")}
            module.decode_attention(**inputs, **new, cache_capacity=64, window_size_left=50, num_sink_tokens=4,
                                    alibi_slopes=testing.alibi_slopes(16), num_splits=3)
    elif stage.kind == "backward":  # the forward runs too: the sanitizer checks both
        # D = 96: narrower swizzles (swizzle_span); D = 80: dQ on one warpgroup; both: several pieces per row thread.
        # From 192 the products turn around (P and dS through shared memory: one buffer each and DS_EMPTY at 192,
        # two at (192, 128) and 256); at 256, dQ in two rounds and one dO buffer released early; (192, 128): V and
        # dO narrower than Q and K, dV^T split by head dim; D = 128 unmasked: 80-row Q tiles and dQ^T.
        for (head_dim, head_dim_v), options in (
                ((64, 64), {"causal": True}), ((128, 128), {}),
                ((128, 128), {"window_size": (100, 10), "num_sink_tokens": 3,
                              "sink_logits": torch.linspace(-1, 1, 4, device="cuda")}),
                ((96, 96), {"causal": True}), ((80, 80), {"window_size": (100, 10)}), ((192, 192), {"causal": True}),
                ((192, 128), {"window_size": (100, 10)}), ((256, 256), {})):
            q, k, v = testing.random_qkv(1, 200, 300, 4, 2, head_dim, torch.bfloat16, seed=head_dim,
                                         head_dim_v=head_dim_v)
            o, lse = module.attention(q, k, v, return_lse=True, **options)
            for deterministic in (False, True):
                module.attention_backward(torch.randn_like(o), q, k, v, o, lse, deterministic=deterministic, **options)
    else:
        features = [{}]
        if number >= 4:
            features.append({"causal": True})
        if number >= 5:
            features.append({"window_size": (100, 10), "num_sink_tokens": 3,
                             "sink_logits": torch.linspace(-1, 1, 4, device="cuda")})
        seqlen_k = 100 if number == 1 else 300
        lse = {"return_lse": True} if number >= 6 else {}
        for head_dim in (64, 128):
            q, k, v = testing.random_qkv(1, 200, seqlen_k, 4, 2, head_dim, torch.float16, seed=head_dim)
            for options in features:
                module.attention(q, k, v, **lse, **options)
        if number >= 8:  # D = 256: O in Q's bytes; 144 tiles, so some CTAs load a Q where they stored an O
            wide = testing.random_qkv(2, 1100, 300, 8, 2, 256, torch.float16, seed=256)
            module.attention(*wide, causal=True)
        if hasattr(module, "attention_varlen"):  # ragged batches: packed K/V, and paged (gathered and by TMA)
            for page_size in (None, 16, 64):
                inputs = testing.random_varlen_inputs([200, 1, 129], [300, 47, 129], 4, 2, 128, torch.float16,
                                                      page_size=page_size, seed=page_size or 0)
                module.attention_varlen(**inputs, causal=True)
                module.attention_varlen(**inputs, window_size=(100, 10), num_sink_tokens=3, return_lse=True)
        if hasattr(module, "merge_attention_states"):  # stage 6's merge kernel (stage 8 imports it)
            o, lse = module.attention(q, k, v, return_lse=True)
            module.merge_attention_states(o, lse, o, lse)
    torch.cuda.synchronize()
    print("LAUNCHES OK")


def main(numbers=None, tools=TOOLS, jobs: int = 1) -> int:
    """Run every (stage, tool) pair, ``jobs`` sanitizer processes at a time; one summary line per stage."""
    from concurrent.futures import ThreadPoolExecutor

    numbers = numbers or [s.number for s in stages.STAGES if s.ready]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {(n, t): pool.submit(run_tool, n, t) for n in numbers for t in tools}
    all_clean = True
    for number in numbers:
        results = [futures[number, tool].result() for tool in tools]
        clean = all(r.clean for r in results)
        all_clean &= clean
        print(f"stage {number}: {'clean' if clean else 'FINDINGS'}; " + "; ".join(r.line() for r in results))
        for r in results:
            for finding in r.kernel_findings[:10]:
                print(f"    {r.tool}: {finding}")
    return 0 if all_clean else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--launch":
        launch_stage(int(sys.argv[2]))
    else:
        raise SystemExit("use `python -m course sanitize [N ...]`")
