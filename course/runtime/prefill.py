"""Host code every prefill stage shares: what a kernel is compiled for, the cross-compile, the launch.

Each prefill stage's kernel class (``Attention`` in solutions/stageNN_*.py)
takes a ``KernelConfig`` and has the same call signature in every stage:

    (mQ, mK, mV, mO, mLSE, mSinks, scale_log2, window_left, window_right, num_sink_tokens, stream)

A stage ignores the arguments of the features it does not have yet, so this
module compiles and launches every stage the same way, and the diff between
two consecutive solutions holds only the stage's own idea.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course.runtime import launch, validation
from course.runtime.compile import (
    CompileReport,
    cross_compile,
    cute_dtype,
    fake_attention_tensors,
    symbolic_tensor,
)

LOG2_E = math.log2(math.e)
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)  # stages 1-7 (and stage 6's merge); stage 8 adds validation.HEAD_DIMS_FROM_STAGE_8


@dataclass(frozen=True)
class KernelConfig:
    """What one compiled kernel is specialized for: the features that shape its main loop (a bounded
    window side, sink tokens) compile out when off.

    Everything else (batch, lengths, heads, the window sizes, the number of
    sink tokens, the softmax scale) is a runtime value, so one compile serves
    every shape; so are the two features of the epilogue alone: sink logits
    (-inf for none: exp2(-inf) = 0 adds nothing) and writing the LSE (a flag).
    """

    dtype: str = "float16"             # "float16" or "bfloat16" (q, k, v and o)
    head_dim: int = 128
    has_left: bool = False             # a bounded left window side (stage 4)
    has_right: bool = False            # a bounded right side: causal, or a window's right (stage 4)
    has_sink_tokens: bool = False      # keys exempt from the left bound; only with has_left (stage 5)
    head_dim_v: int = 0                # V's and O's head dim when it differs from head_dim (stage 8), else 0

    @property
    def dv(self) -> int:
        """V's and O's head dim."""
        return self.head_dim_v or self.head_dim

    @property
    def cute_dtype(self):
        import torch

        return cute_dtype(getattr(torch, self.dtype))

    @property
    def name(self) -> str:
        """e.g. ``bfloat16_d128_LRT``: L/R bounded window sides, T sink tokens (``d192v128``: D_v = 128)."""
        flags = (self.has_left, self.has_right, self.has_sink_tokens)
        dims = f"d{self.head_dim}" + (f"v{self.dv}" if self.dv != self.head_dim else "")
        return f"{self.dtype}_{dims}_" + ("".join(c for c, on in zip("LRT", flags) if on) or "full")


def kernel_configs(stage: int) -> list[KernelConfig]:
    """Every configuration stage ``stage`` compiles: its loop-shaping features (validation.FEATURE_STAGE)
    on and off, at D = 64 and 128. The head dims stage 8 adds compile with no window and with every
    feature on, the dtypes alternating: the features' code is the same at every head dim, the tiles
    are not. The last configuration has every feature of the stage on.
    """
    def added_by(feature: str) -> bool:
        return validation.FEATURE_STAGE[feature][0] <= stage

    either = (False, True)
    sides = either if added_by("window_size") else (False,)
    tokens = either if added_by("num_sink_tokens") else (False,)
    configs = [KernelConfig(dtype, d, left, right, with_tokens)
               for dtype in DTYPES for d in HEAD_DIMS for left in sides for right in sides
               for with_tokens in (tokens if left else (False,))]
    if added_by("head_dim"):
        added = [pair for pair in validation.HEAD_DIMS_FROM_STAGE_8
                 if pair not in validation.HEAD_DIMS_BEFORE_STAGE_8]
        every = (True, True, True)
        configs = [KernelConfig(DTYPES[i % 2], d, *flags, head_dim_v=validation.distinct_head_dim_v(d, d_v))
                   for i, (d, d_v) in enumerate(added) for flags in ((False, False, False), every)] + configs
    return configs


def fake_arguments(config: KernelConfig) -> tuple:
    """The symbolic arguments a kernel is compiled with: one compile for every shape, with and without sink
    logits and the LSE. The LSE argument has sizes of its own: without ``return_lse`` it is a placeholder
    that the kernel, told so by its ``write_lse`` flag (the last argument), never touches.
    """
    import cutlass
    import torch

    symbols: dict = {}
    q, k, v, o = fake_attention_tensors(getattr(torch, config.dtype), config.head_dim, symbols, config.dv)
    lse = symbolic_tensor(torch.float32, ("b", "h", "s"), symbols={}, align=4, stride_divisibility=1)
    sinks = symbolic_tensor(torch.float32, ("H_q",), symbols=symbols, align=4, stride_divisibility=1)
    return (q, k, v, o, lse, sinks, cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0),
            cutlass.Int32(0))


def cross_compile_config(kernel_class, config: KernelConfig, *, stage: int, keep: bool = False) -> CompileReport:
    """Compile ``kernel_class(config)`` for sm_90a on any machine (no GPU needed); report registers, smem, spills."""
    return cross_compile(kernel_class(config), *fake_arguments(config), name=f"stage{stage:02d}_{config.name}",
                         keep=keep)


def kernel_window(causal, window_size, num_sink_tokens: int, shape: validation.AttentionShape):
    """(left, right, num_sink_tokens) as the kernel takes them: the same visible keys, in int32 range.

    A left side of S_k or more, or a right side of S_q or more, hides no key,
    and S_k sink tokens already exempt every key: larger values mean the same.
    The kernels add these to row and key indices in 32-bit integers, where a
    window near 2**31 would wrap around, so they get the smallest equivalent.
    """
    left, right = validation.resolve_window(causal, window_size)
    return min(left, shape.seqlen_k), min(right, shape.seqlen_q), min(num_sink_tokens, shape.seqlen_k)


_PLANS: dict = {}


def call_config(q, shape: validation.AttentionShape, left: int, right: int, num_sink_tokens: int) -> KernelConfig:
    """The KernelConfig of a call: q's dtype, the shape's head dims, the window sides and sink tokens it bounds
    (``kernel_window``'s results)."""
    return KernelConfig(str(q.dtype).removeprefix("torch."), shape.head_dim, left >= 0, right >= 0,
                        left >= 0 and num_sink_tokens > 0,
                        validation.distinct_head_dim_v(shape.head_dim, shape.head_dim_v))


def attention(stage: int, kernel_class, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
              sink_logits=None, num_sink_tokens=0, return_lse=False, out=None):
    """Validate, compile once per configuration (cached), launch ``kernel_class``; return O (and LSE).

    ``stage`` names the stage whose features are available: a later stage's
    feature raises NotImplementedError naming that stage. ``out`` (optional)
    receives O; tests pass a NaN-poisoned buffer to prove every element is written.
    The first call of a signature (``launch.signature``: shapes, strides,
    dtypes, options) validates and plans; later ones only launch.
    """
    key = (kernel_class, *launch.signature(q, k, v, sink_logits, out, softmax_scale, causal, window_size,
                                           num_sink_tokens, return_lse))
    run = launch.cached_plan(_PLANS, key, lambda: plan_attention(
        stage, kernel_class, q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, return_lse=return_lse, out=out))
    return run(q, k, v, sink_logits, out)


def plan_attention(stage: int, kernel_class, q, k, v, *, softmax_scale, causal, window_size, sink_logits,
                   num_sink_tokens, return_lse, out):
    """Everything ``attention`` does that depends only on the call's signature: validation, the kernel
    configuration and its compile, the placeholders and the kernel's scalar arguments.

    Returns ``run(q, k, v, sink_logits, out)``, which allocates the outputs and launches.
    """
    import torch

    shape = validation.check_attention_inputs(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, sink_logits=sink_logits,
        num_sink_tokens=num_sink_tokens, return_lse=return_lse, out=out,
    )
    validation.reject_later_features(
        stage, causal=causal, window_size=window_size, sink_logits=sink_logits,
        num_sink_tokens=num_sink_tokens, return_lse=return_lse,
        seqlen_k=shape.seqlen_k, max_seqlen_k=getattr(kernel_class, "max_seqlen_k", None),
        head_dims=(shape.head_dim, shape.head_dim_v),
    )
    validation.check_on_gpu(q=q, k=k, v=v, out=out, sink_logits=sink_logits)
    left, right, num_sink_tokens = kernel_window(causal, window_size, num_sink_tokens, shape)
    config = call_config(q, shape, left, right, num_sink_tokens)
    kernel = launch.compiled((kernel_class, config), lambda: (kernel_class(config), fake_arguments(config)))
    device = q.device
    lse_shape = (shape.batch, shape.heads_q, shape.seqlen_q)
    out_shape = (shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim_v)
    no_lse = launch.placeholder(device, (1, 1, 1))
    no_sinks = launch.placeholder(device, (shape.heads_q,), fill=float("-inf"))  # a -inf sink is no sink
    scale_log2 = validation.resolve_scale(softmax_scale, shape.head_dim) * LOG2_E
    write_lse = int(bool(return_lse))

    def run(q, k, v, sink_logits, out):
        if out is None:
            out = q.new_empty(out_shape)
        lse = torch.empty(lse_shape, device=device, dtype=torch.float32) if return_lse else no_lse
        kernel(q, k, v, out, lse, no_sinks if sink_logits is None else sink_logits, scale_log2, left, right,
               num_sink_tokens, write_lse)
        return (out, lse) if return_lse else out

    return run
