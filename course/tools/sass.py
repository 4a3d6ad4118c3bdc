"""``course sass``: what the tensor-core loops of a compiled kernel look like in SASS, without a GPU.

A cross-compiled cubin (``course.runtime.compile.cross_compile(..., keep=True)``) is
disassembled with ``cuobjdump -sass``. For every loop that issues HGMMA (the
KV loops of a prefill stage, the loop over Q tiles of stage 11's backward) this
prints its length and instruction mix, and for every
``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (``wgmma.wait_group 1``: in the prefill stages
a wait for Q K^T, not for P V; in stage 11 for S^T, not for dP^T) how much of
the exponentials the compiler left before the following ``wait_group 0``: those
run under the other product, the ones after it do not. That is the number
intra-warpgroup overlap is about.

    python -m course sass 8              # stage 8, fp16, D = 128, no mask and causal
    python -m course sass 8 --steps 2    # the kernel after step 2 of stage 8's ablation
    python -m course sass 11             # stage 11's backward, bf16, D = 128 and 64, no mask

cuobjdump and nvdisasm come with the CUDA toolkit, or from the package index
(``nvidia-cuda-cuobjdump``, ``nvidia-cuda-nvdisasm``, in the dev extras).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)([^;]*);")


def tool_dir() -> str | None:
    """The folder of cuobjdump: on the PATH, else the nvidia-cuda-cuobjdump wheel's bin/ (with nvdisasm)."""
    found = shutil.which("cuobjdump")
    if found:
        return str(Path(found).parent)
    for entry in sys.path:
        for candidate in Path(entry).glob("nvidia/cu*/bin/cuobjdump") if entry else ():
            return str(candidate.parent)
    return None


def disassemble(cubin: Path) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction of the cubin."""
    folder = tool_dir()
    if folder is None:
        raise SystemExit("cuobjdump not found: install the CUDA toolkit, or `pip install nvidia-cuda-cuobjdump "
                         "nvidia-cuda-nvdisasm` (both are in this project's dev extras)")
    env = dict(os.environ, PATH=folder + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([str(Path(folder) / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          env=env, check=True).stdout
    return [(int(address, 16), opcode, operands) for address, opcode, operands in _INSTRUCTION.findall(sass)]


@dataclass
class Overlap:
    """Between a ``wait_group 1`` and the next ``wait_group 0``: what runs while P V is still on the tensor cores."""

    address: int  # of the wait_group 1
    exp2: int  # MUFU.EX2
    max: int  # FMNMX
    instructions: int


def overlaps(code) -> list[Overlap]:
    found, current = [], None
    for address, opcode, operands in code:
        if opcode == "WARPGROUP.DEPBAR.LE" and "0x1" in operands:
            current = Overlap(address, 0, 0, 0)
        elif opcode == "WARPGROUP.DEPBAR.LE" and current is not None:
            found.append(current)
            current = None
        elif current is not None:
            current.instructions += 1
            current.exp2 += opcode == "MUFU.EX2"
            current.max += opcode == "FMNMX"
    return found


def hgmma_loops(code) -> list[tuple[int, int, collections.Counter]]:
    """(first address, last address, instruction counts) of every loop (a backward branch) whose body issues
    HGMMA. A backward branch from past a loop's end into its middle (the out-of-line retry of an mbarrier wait
    jumping back) is not a loop."""
    loops = []
    for address, opcode, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = collections.Counter(op for a, op, _ in code if start <= a <= address)
            contains = any(start < s <= address for s, _, _ in loops)
            straddles = any(s < start <= e < address for s, e, _ in loops)
            if any(op.startswith("HGMMA") for op in body) and not contains and not straddles:
                loops.append((start, address, body))
    return loops


def report(cubin: Path, title: str, loop_name: str = "KV loop", marks_masks: bool = True) -> str:
    """Each loop (``loop_name``) with its instruction mix, and under it each stretch between a ``wait_group 1``
    and the next ``wait_group 0`` inside it: how many of the loop's exponentials run while its P V is in flight.
    With ``marks_masks`` (a forward kernel's KV loops), loops with a select per score (``SEL`` or ``FSEL``) are the
    masked ones and the others are marked "no mask", the common case; stage 11's loops are not told apart."""
    code = disassemble(cubin)
    lines = [title]
    regions, loops = overlaps(code), hgmma_loops(code)
    def innermost(region):  # loops may nest: a stretch belongs to the smallest loop around it
        around = [loop for loop in loops if loop[0] <= region.address <= loop[1]]
        return min(around, key=lambda loop: loop[1] - loop[0])[0] if around else None

    for start, _, body in loops:
        top = ", ".join(f"{op} {n}" for op, n in body.most_common(8))
        # a mask selects each of a thread's 64 scores, with SEL or FSEL as ptxas picks (and a few are not masks)
        masked = body["SEL"] + body["FSEL"] >= 32
        label = " (no mask)" if marks_masks and not masked else ""
        lines.append(f"  {loop_name} at {start:#06x}{label}: {sum(body.values())} instructions; {top}")
        for overlap in (r for r in regions if innermost(r) == start):
            lines.append(f"    between wait_group 1 (at {overlap.address:#06x}) and wait_group 0: {overlap.instructions} "
                         f"instructions, {overlap.exp2} of the loop's {body['MUFU.EX2']} MUFU.EX2, {overlap.max} FMNMX")
    for overlap in (r for r in regions if innermost(r) is None):
        lines.append(f"  outside the loops, between wait_group 1 (at {overlap.address:#06x}) and wait_group 0: "
                     f"{overlap.instructions} instructions, {overlap.exp2} MUFU.EX2, {overlap.max} FMNMX")
    return "\n".join(lines)


def kernels(number: int, steps: int | None = None) -> list[tuple]:
    """(kernel, its fake arguments, config name) of what ``course sass N`` compiles: a prefill stage's kernel at
    fp16, D = 128, without a mask and causal; stage 11's backward at bf16, D = 128 and 64, without a mask."""
    from course.runtime import backward, prefill, stages

    module = stages.get(number).load("solutions")
    if number == 11:
        configs = (prefill.KernelConfig("bfloat16", 128), prefill.KernelConfig("bfloat16", 64))
        return [(module.AttentionBackward(config), backward.fake_arguments(config), config.name) for config in configs]
    kernel_class = module.Attention
    if steps is not None:
        kernel_class = list(module.ABLATION.values())[steps - 1]
    configs = (prefill.KernelConfig("float16", 128), prefill.KernelConfig("float16", 128, has_right=True))
    return [(kernel_class(config), prefill.fake_arguments(config), config.name) for config in configs]


def main(number: int, steps: int | None = None) -> int:
    from course.runtime.compile import cross_compile

    backward = number == 11
    loop_name = "loop over Q tiles" if backward else "KV loop"
    for kernel, arguments, config_name in kernels(number, steps):
        compiled = cross_compile(kernel, *arguments, name=f"sass_stage{number:02d}_{config_name}", keep=True)
        resources = f"{compiled.registers} registers, {compiled.spill_bytes} B spilled"
        print(report(Path(compiled.artifacts["cubin"]), f"stage {number} {type(kernel).__name__} {config_name} "
                     f"({resources})", loop_name, marks_masks=not backward))
    return 0
