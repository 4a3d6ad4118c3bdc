"""The stage registry: the one list of stages that the CLI, the tests, the benchmarks and the docs share.

Each entry says what the stage adds and which shapes ``course bench`` times
it on, so a stage's kernel file holds only its kernel and its API.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from pathlib import Path

from course.runtime.shapes import DecodeShape, PrefillShape, RaggedShape
from course.runtime.validation import distinct_head_dim_v

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("stages", "solutions")
# How messages spell the command: the project's virtual environment has the dependencies, a bare `python` may not.
COURSE_COMMAND = ".venv/bin/python -m course"


@dataclass(frozen=True)
class Stage:
    number: int
    slug: str
    title: str
    adds: str
    ready: bool  # False: planned, no code yet
    # "prefill": module.attention on [B, S, H, D]; "decode": module.decode_attention; "backward":
    # module.attention_backward (and the forward it differentiates as module.attention)
    kind: str = "prefill"
    bench_shapes: tuple = ()  # PrefillShape or DecodeShape: what `course bench` times this stage on
    starts_from: int | None = None  # a stage this one is timed next to on its shapes (the one it improves)
    # The functions with this stage's TODOs whose results tests/cpu_numerics.py computes on the CPU and
    # compares with course.testing.reference; the others (TMA, pipelines, WGMMA) only a Hopper GPU can check.
    cpu_numerics: tuple[str, ...] = ()
    # The functions with this stage's TODOs whose barriers, wait groups and buffer releases tests/cpu_sync.py
    # records on the CPU and replays in a model of the hardware's rules (deadlocks, register races, early releases).
    cpu_sync: tuple[str, ...] = ()
    # False: the solution subclasses the kernel of the stage it starts from and imports the rest, so its
    # file already is the difference (course diffs writes no diff for it).
    diffed: bool = True
    ragged_shapes: tuple = ()  # RaggedShape: the variable-length batches `course bench` times (stage 10)

    @property
    def module_name(self) -> str:
        return f"stage{self.number:02d}_{self.slug}"

    def path(self, impl: str) -> Path:
        return ROOT / impl / f"{self.module_name}.py"

    def load(self, impl: str = "solutions"):
        """Import this stage's module from ``stages/`` (the learner's) or ``solutions/``."""
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
        if not self.ready:
            raise NotImplementedError(f"stage {self.number} ({self.title}) is planned; it has no code yet")
        return importlib.import_module(f"{impl}.{self.module_name}")

    @property
    def docs_page(self) -> str:
        return f"stages/{self.number:02d}-{self.slug.replace('_', '-')}.md"


# Prefill: the reference shapes B=4, H=16, D=128 and 64, S from 1k to 16k; each later stage times
# what its feature costs (a mask, sinks, the LSE) next to the same shape without it.
FULL_ATTENTION = tuple(PrefillShape(4, 16, s, s, d) for d in (128, 64) for s in (1024, 4096, 16384))
WINDOWS = (
    *(PrefillShape(4, 16, s, s, 128, causal=True) for s in (1024, 4096, 16384)),
    *(PrefillShape(4, 16, 16384, 16384, 128, window=(w, 0)) for w in (256, 512, 1024, 4096)),
    # The same 16k queries against 1k keys, and against all 16k: what a window should cost.
    PrefillShape(4, 16, 16384, 1024, 128), PrefillShape(4, 16, 16384, 16384, 128),
)
SINKS = (  # sinks on and off at the same shapes: the cost of the feature, and its absence when unused
    PrefillShape(4, 16, 16384, 16384, 128, window=(1024, 0), sinks=True),
    PrefillShape(4, 16, 16384, 16384, 128, window=(1024, 0)),
    PrefillShape(4, 16, 4096, 4096, 128, causal=True, sinks=True),
    PrefillShape(4, 16, 4096, 4096, 128, causal=True),
)
LSE = (  # writing the LSE costs one float per row: timed next to the same shape without it
    PrefillShape(4, 16, 4096, 4096, 128, causal=True, lse=True),
    PrefillShape(4, 16, 4096, 4096, 128, causal=True),
)
# Stage 8: the FA3 paper's plots, TFLOP/s against the sequence length at B * S = 16k and H * D = 2048, for
# every head dim pair (D, D_v) stage 8 takes.
SWEEP_HEAD_DIMS = ((128, 128), (64, 64), (80, 80), (96, 96), (192, 192), (192, 128), (256, 256))
FA3_SWEEP = tuple(PrefillShape(16384 // s, 2048 // d, s, s, d, causal=causal, head_dim_v=distinct_head_dim_v(d, d_v))
                  for d, d_v in SWEEP_HEAD_DIMS for causal in (False, True)
                  for s in (512, 1024, 2048, 4096, 8192, 16384))
FA3_REFERENCE = (  # the shapes of the issue that set stage 8's targets
    PrefillShape(4, 16, 4096, 4096, 128), PrefillShape(4, 16, 4096, 4096, 128, causal=True),
    PrefillShape(2, 16, 8192, 8192, 128, causal=True), PrefillShape(4, 16, 4096, 4096, 64),
    PrefillShape(8, 16, 2048, 2048, 128),
)
DECODE = tuple(DecodeShape(b, length, paged=paged) for paged in (False, True)
               for b in (1, 8, 64) for length in (4096, 32768, 131072))
# Stage 9: every head grouping a serving engine meets (MHA, GQA 4, 8 and 16, MQA), same B, L and layouts.
GROUPINGS = ((32, 32), (32, 8), (64, 8), (32, 2), (8, 1), (64, 1))
DECODE_GROUPINGS = tuple(DecodeShape(b, length, h_q, h_kv, paged=paged) for h_q, h_kv in GROUPINGS
                         for paged in (False, True) for b in (1, 8, 64) for length in (4096, 32768, 131072))

# Stage 10: 32 sequences with lengths drawn from 128-8192 (one seed), one long sequence among short ones,
# chunked prefill against paged caches, and speculative decoding (a few query tokens against the cache).
_LENGTHS = random.Random(0)
_MIXED = tuple(_LENGTHS.randint(128, 8192) for _ in range(32))
_ONE_LONG = (8192,) + (256,) * 31
RAGGED = (
    RaggedShape("32 sequences of 128-8192", _MIXED, _MIXED),
    RaggedShape("32 sequences of 128-8192", _MIXED, _MIXED, causal=False),
    RaggedShape("one of 8192, 31 of 256", _ONE_LONG, _ONE_LONG),
    *(RaggedShape("4 chunks of 1024 after 15k", (1024,) * 4, (16384,) * 4, 32, 8, page_size=page)
      for page in (0, 16, 64, 256)),
    *(RaggedShape("2 chunks of 2048 after 62k", (2048,) * 2, (65536,) * 2, 32, 8, page_size=page) for page in (0, 64)),
    *(RaggedShape(f"{b} x {n} draft tokens, 8k cache", (n,) * b, (8192,) * b, h_q, 8, page_size=64)
      for b, n, h_q in ((1, 4, 32), (8, 4, 32), (64, 4, 32), (8, 2, 32), (8, 8, 32), (8, 4, 64), (64, 8, 64))),
)

# Stage 11: the FA3 paper's backward sweep (B * S = 16k, H * D = 2048), every head dim the backward takes, causal
# and not, in bf16.
BACKWARD = tuple(PrefillShape(16384 // s, 2048 // d, s, s, d, "bfloat16", causal=causal,
                              head_dim_v=distinct_head_dim_v(d, d_v))
                 for d, d_v in ((128, 128), (64, 64), (96, 96), (80, 80), (192, 192), (192, 128), (256, 256))
                 for causal in (False, True) for s in (512, 1024, 2048, 4096, 8192, 16384))

STAGES = [
    Stage(1, "single_tile", "Single-tile FMHA",
          "TMA loads, WGMMA for Q K^T and P V, softmax in registers, GQA", ready=True,
          cpu_numerics=("softmax_rows",),
          # S_k = 128 is all one tile can hold: the CTA streams Q in and O out around one K/V tile.
          bench_shapes=(PrefillShape(16, 16, 4096, 128, 128), PrefillShape(16, 16, 4096, 128, 64))),
    Stage(2, "multi_tile", "Multi-tile TMA loading",
          "a pipelined loop over KV tiles (smem ring + mbarriers), two-pass softmax", ready=True,
          bench_shapes=FULL_ATTENTION, cpu_numerics=("load_tile", "update_row_max", "exponentiate_rows"),
          cpu_sync=("tile_scores", "first_pass_row_max", "second_pass_accumulate")),
    Stage(3, "online_softmax", "Online softmax correction",
          "one pass: running max and sum, rescaling O", ready=True, bench_shapes=FULL_ATTENTION,
          cpu_numerics=("online_softmax",)),
    Stage(4, "masking", "Sliding-window and causal masking",
          "masks from coordinates, skipping fully masked KV tiles", ready=True, bench_shapes=WINDOWS,
          cpu_numerics=("kv_block_range", "apply")),
    Stage(5, "sinks", "Attention sinks",
          "sink logits (gpt-oss) and sink tokens (StreamingLLM)", ready=True, bench_shapes=SINKS,
          cpu_numerics=("sink_block_count", "outside_left_bound", "normalize_rows")),
    Stage(6, "lse", "Per-row LSE and merging",
          "log-sum-exp output and merging partial results", ready=True, bench_shapes=LSE,
          cpu_numerics=("normalize_rows", "store_lse", "merge_weights")),
    Stage(7, "decode", "Decode with split-KV",
          "one query token, paged KV cache, multi-block reduction", ready=True, kind="decode",
          bench_shapes=DECODE, cpu_numerics=("online_softmax_update", "split_partial", "arrive_and_elect_last",
                                             "fold_in_split", "finish_combine")),
    Stage(8, "fa3_prefill", "FA3-class prefill",
          "ping-pong warpgroups, softmax under the GEMMs, persistent tiles, TMA-store epilogue", ready=True,
          bench_shapes=tuple(dict.fromkeys(FA3_REFERENCE + FA3_SWEEP)), starts_from=6,
          cpu_numerics=("l2_group", "coords"),
          cpu_sync=("pingpong_start", "pingpong_wait", "pingpong_pass", "overlapped_step")),
    Stage(9, "tc_decode", "Tensor-core decode, FP8 KV cache",
          "GQA packing on mma.sync, whole-row copies into swizzled warp tiles, an e4m3 cache with scales",
          ready=True, kind="decode", bench_shapes=DECODE_GROUPINGS, starts_from=7,
          cpu_numerics=("online_softmax_update", "q_fragment", "k_fragment", "v_fragment")),
    Stage(10, "varlen_prefill", "Variable-length and paged prefill",
          "packed sequences of different lengths, a paged KV cache, a scheduler over ragged tiles",
          ready=True, bench_shapes=FA3_REFERENCE, starts_from=8, diffed=False, ragged_shapes=RAGGED,
          cpu_numerics=("locate", "page_lookup", "load_paged_tile")),
    Stage(11, "backward", "The backward pass",
          "dQ, dK, dV and dsink: P recomputed from the LSE, the transposed products on WGMMA, dQ by bulk reduce-adds",
          ready=True, kind="backward", bench_shapes=BACKWARD, starts_from=10, diffed=False,
          cpu_numerics=("m_block_range", "probabilities_and_score_gradients")),
]


def get(number: int) -> Stage:
    for stage in STAGES:
        if stage.number == number:
            return stage
    raise ValueError(f"there is no stage {number}; stages are {STAGES[0].number}..{STAGES[-1].number}")
