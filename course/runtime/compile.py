"""Compiling kernels: symbolic (fake) tensors, the sm_90a cross-compile, resource usage.

A CuTe DSL kernel compiles on any machine: ``cute.compile`` traces the Python,
lowers it to MLIR and PTX, and runs ptxas for sm_90a. Only running it needs a
Hopper GPU. This module is what every stage's cross-compile check and the
``course status`` table use.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GPU_ARCH = "sm_90a"
ARTIFACT_ROOT = Path(__file__).resolve().parents[2] / "artifacts"


def cute_dtype(torch_dtype):
    """The CuTe numeric type for a torch dtype (fp16, bf16, fp32, int32, fp8 e4m3, int8)."""
    import cutlass
    import torch

    table = {
        torch.float16: cutlass.Float16,
        torch.bfloat16: cutlass.BFloat16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.int8: cutlass.Int8,
    }
    return table[torch_dtype]


def symbolic_tensor(dtype, shape: tuple, *, symbols: dict, align: int = 16, stride_divisibility: int = 8):
    """A fake global-memory tensor whose extents and strides are runtime values.

    Each entry of ``shape`` is an int (a compile-time extent, e.g. the head
    dim) or a name; tensors that use the same name share one runtime symbol
    (Q and O share B, S_q and H_q). The last mode is contiguous (stride 1);
    the other strides are multiples of ``stride_divisibility`` elements: 8 by
    default, as TMA needs (16-byte rows); 1 for tensors that no TMA touches
    (LSE, sink logits). Calls are checked against these promises at run time.
    """
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    extents = tuple(
        e if isinstance(e, int) else symbols.setdefault(e, cute.sym_int(symbol=e)) for e in shape
    )
    stride = tuple(cute.sym_int64(divisibility=stride_divisibility) for _ in shape[:-1]) + (1,)
    return make_fake_tensor(cute_dtype(dtype), extents, stride, assumed_align=align)


def fake_attention_tensors(dtype, head_dim: int, symbols: dict | None = None, head_dim_v: int | None = None):
    """Fake q, k, v, o ([B, S, H, D]; v and o with ``head_dim_v``, by default ``head_dim``) for compiling
    an attention kernel once for all shapes.

    Pass ``symbols`` to share B, S_q, S_k, H_q, H_kv with further fake tensors.
    """
    symbols = {} if symbols is None else symbols
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = symbolic_tensor(dtype, ("B", "S_q", "H_q", head_dim), symbols=symbols)
    k = symbolic_tensor(dtype, ("B", "S_k", "H_kv", head_dim), symbols=symbols)
    v = symbolic_tensor(dtype, ("B", "S_k", "H_kv", head_dim_v), symbols=symbols)
    o = symbolic_tensor(dtype, ("B", "S_q", "H_q", head_dim_v), symbols=symbols)
    return q, k, v, o


def fake_stream():
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream()


@dataclass
class CompileReport:
    """What one cross-compile produced and what the cubin needs per thread/CTA."""

    name: str
    seconds: float
    artifacts: dict[str, str] = field(default_factory=dict)
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    ptx_instructions: dict[str, int] = field(default_factory=dict)
    # ptxas's note when it made every WGMMA wait for the one before (e.g. "C7514: wgmma.mma_async instructions
    # are serialized due to ..."): the kernel runs, correct and much slower. None without a note (or a report).
    wgmma_serialized: str | None = None

    def summary(self) -> str:
        parts = [f"{self.seconds:.1f}s"]
        if self.registers is not None:
            parts.append(f"{self.registers} regs")
        if self.spill_bytes is not None:
            parts.append(f"{self.spill_bytes} B spill")
        if self.shared_bytes is not None:
            parts.append(f"{self.shared_bytes // 1024} KiB smem")
        return ", ".join(parts)


_CUOBJDUMP = re.compile(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores")
_PTXAS_SERIALIZED = re.compile(
    r"\((C75\d\d)\) Potential Performance Loss: (wgmma\.mma_async instructions are serialized[^']*?)(?: in the function|$)",
    re.M)


def resource_usage(cubin: Path, ptx: Path, ptxas_report: str = "") -> tuple[int, int] | None:
    """(registers per thread, spill bytes) of the compiled kernel.

    Read from ``ptxas_report`` (the ``-v`` lines of the compile's own ptxas run)
    when given, else from the cubin with ``cuobjdump -res-usage`` where the CUDA
    toolkit has it, else from a second ``ptxas -v`` on the PTX (same ptxas,
    same numbers, half a second more).
    """
    regs, spill = _PTXAS_REGS.search(ptxas_report), _PTXAS_SPILL.search(ptxas_report)
    if regs and spill:
        return int(regs.group(1)), int(spill.group(1))
    if shutil.which("cuobjdump") and cubin.exists():
        out = subprocess.run(["cuobjdump", "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        m = _CUOBJDUMP.search(out)
        if m:
            return int(m.group(1)), int(m.group(3))
    if shutil.which("ptxas") and ptx.exists():
        out = subprocess.run(
            ["ptxas", f"-arch={GPU_ARCH}", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True
        ).stderr
        regs, spill = _PTXAS_REGS.search(out), _PTXAS_SPILL.search(out)
        if regs and spill:
            return int(regs.group(1)), int(spill.group(1))
    return None


def wgmma_serialized(ptxas_report: str) -> str | None:
    """ptxas's note that it serialized the kernel's WGMMAs ("C7514: wgmma.mma_async instructions are serialized
    due to ..."), from the ``-v`` lines of its run; None when it made no such note."""
    found = _PTXAS_SERIALIZED.search(ptxas_report)
    return f"{found.group(1)}: {' '.join(found.group(2).split())}" if found else None


@contextlib.contextmanager
def _without_source_locations():
    """Trace without recording each op's Python source location.

    The ``remarks{ptx}`` option also turns on the DSL's tracking of source
    locations (for its own diagnostics), a walk up the Python stack for every
    op traced: about half of a cross-compile's time, and nothing a report
    reads. Compiles without remarks (every launch) never track them. Without
    the DSL's private switch (another DSL version) the compile is only slower.
    """
    from cutlass.base_dsl import dsl

    switch = getattr(dsl, "_set_enable_frame_filtering", None)
    if switch is None:
        yield
        return
    dsl._set_enable_frame_filtering = lambda enable: switch(False)
    try:
        yield
    finally:
        dsl._set_enable_frame_filtering = switch


def cross_compile(jit_fn, *args, name: str, keep: bool = False) -> CompileReport:
    """Compile ``jit_fn(*args, stream)`` for sm_90a without a GPU and report on the result.

    With ``keep`` the PTX and cubin are kept in ``artifacts/<name>.ptx|.cubin``.
    Shared memory is dynamic (not in the cubin): it is read from the kernel's
    ``shared_storage`` struct, which its ``__call__`` defines while tracing.
    """
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="course-cc-") as tmp:
        start = time.perf_counter()
        # remarks{ptx}: the DSL runs its ptxas with -v and writes what it says to the remark file.
        remarks = Path(tmp) / "ptxas-remarks.yaml"
        with _without_source_locations():
            compiled = cute.compile(
                jit_fn, *args, fake_stream(),
                options=f"--gpu-arch {GPU_ARCH} --keep-ptx --keep-cubin --dump-dir {tmp} "
                        f"--remark-output {remarks} remarks{{ptx}}",
            )
        report = CompileReport(name=name, seconds=time.perf_counter() - start)
        storage = getattr(jit_fn, "shared_storage", None)
        if storage is not None:
            report.shared_bytes = storage.size_in_bytes()
        ptx, cubin = Path(tmp) / f"{name}.ptx", Path(tmp) / f"{name}.cubin"
        ptx.write_text(compiled.artifacts.PTX)
        cubin.write_bytes(compiled.artifacts.CUBIN)
        report.ptx_instructions = _ptx_features(compiled.artifacts.PTX)
        ptxas_report = remarks.read_text() if remarks.exists() else ""
        usage = resource_usage(cubin, ptx, ptxas_report)
        if usage is not None:
            report.registers, report.spill_bytes = usage
        report.wgmma_serialized = wgmma_serialized(ptxas_report)
        if keep:
            ARTIFACT_ROOT.mkdir(parents=True, exist_ok=True)
            for path in (ptx, cubin):
                # Copied whole, then renamed: parallel test workers may read the same artefact.
                staged = Path(tempfile.mkstemp(dir=ARTIFACT_ROOT, prefix=f".{path.name}.")[1])
                shutil.copy(path, staged)
                staged.replace(ARTIFACT_ROOT / path.name)
                report.artifacts[path.suffix[1:]] = str(ARTIFACT_ROOT / path.name)
        return report


def _ptx_features(ptx: str) -> dict[str, int]:
    """How often the Hopper instructions a stage relies on appear in its PTX."""
    return {op: ptx.count(op) for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier")}
