"""The stage registry: the one list of stages that the CLI, the tests and the docs share."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("stages", "solutions")


@dataclass(frozen=True)
class Stage:
    number: int
    slug: str
    title: str
    adds: str
    ready: bool  # False: planned, no code yet
    kind: str = "prefill"  # "prefill": module.attention on [B, S, H, D]; "decode": module.decode_attention

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


STAGES = [
    Stage(1, "single_tile", "Single-tile FMHA",
          "TMA loads, WGMMA for Q K^T and P V, softmax in registers, GQA", ready=True),
    Stage(2, "multi_tile", "Multi-tile TMA loading",
          "a pipelined loop over KV tiles (smem ring + mbarriers), two-pass softmax", ready=True),
    Stage(3, "online_softmax", "Online softmax correction",
          "one pass: running max and sum, rescaling O", ready=True),
    Stage(4, "masking", "Sliding-window and causal masking",
          "masks from coordinates, skipping fully masked KV tiles", ready=True),
    Stage(5, "sinks", "Attention sinks",
          "sink logits (gpt-oss) and sink tokens (StreamingLLM)", ready=True),
    Stage(6, "lse", "Per-row LSE and merging",
          "log-sum-exp output and merging partial results", ready=True),
    Stage(7, "decode", "Decode with split-KV",
          "one query token, paged KV cache, multi-block reduction", ready=True, kind="decode"),
]


def get(number: int) -> Stage:
    for stage in STAGES:
        if stage.number == number:
            return stage
    raise ValueError(f"there is no stage {number}; stages are {STAGES[0].number}..{STAGES[-1].number}")
