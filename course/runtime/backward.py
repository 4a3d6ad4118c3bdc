"""Host side of the backward pass (stage 11): validation, the preprocess and postprocess, compile, launch.

The main kernel computes dK, dV and a float32 sum of dQ; around it:

- preprocess (a kernel of the stage): D = rowsum(dO * O) per query row, and the
  forward's LSE in the log2 domain with +inf for a row that saw no key
  (P = exp2(S - inf) = 0), both [B, H_q, S_q] padded to whole Q tiles (the
  padding is +inf and 0: no row), and the float32 dQ sum zeroed ([B, H_q, S_pad * D]:
  each Q tile's values in the order the main kernel stores them, the stage's ``DQTile``);
- postprocess (a kernel of the stage): dQ = softmax_scale * the float32 sum, in
  q's dtype; on the host, the sink logits' gradient
  dsink[h] = -sum over (b, i) of exp(sink[h] - LSE) * D.
"""

from __future__ import annotations

import math

from course.runtime import launch, prefill, validation
from course.runtime.compile import (
    CompileReport,
    cross_compile,
    fake_attention_tensors,
    symbolic_tensor,
)

LOG2_E = math.log2(math.e)
GRID_YZ_LIMIT = 65535  # CUDA's largest grid y and z dimensions
HEAD_DIMS = validation.BACKWARD_HEAD_DIMS


def kernel_configs() -> list[prefill.KernelConfig]:
    """Both dtypes, every head dim of HEAD_DIMS, every combination of window sides and sink tokens."""
    either = (False, True)
    return [prefill.KernelConfig(dtype, d, left, right, tokens, validation.distinct_head_dim_v(d, d_v))
            for dtype in prefill.DTYPES for d, d_v in HEAD_DIMS for left in either for right in either
            for tokens in (either if left else (False,))]


def fake_arguments(config: prefill.KernelConfig) -> tuple:
    import cutlass
    import torch

    dtype = getattr(torch, config.dtype)
    symbols: dict = {}
    q, k, v, do = fake_attention_tensors(dtype, config.head_dim, symbols, head_dim_v=config.dv)
    rows = {}  # LSE, D and the dQ sum share their padded sizes, not q's
    lse = symbolic_tensor(torch.float32, ("b", "h", "s_pad"), symbols=rows, stride_divisibility=4)
    d = symbolic_tensor(torch.float32, ("b", "h", "s_pad"), symbols=rows, stride_divisibility=4)
    dq_accum = symbolic_tensor(torch.float32, ("b", "h", "s_pad_d"), symbols=rows, stride_divisibility=4)
    dq_turns = symbolic_tensor(torch.int32, ("tb", "th", "tm"), symbols={}, align=4,
                               stride_divisibility=1)
    dk = symbolic_tensor(dtype, ("B", "S_k", "H_kv", config.head_dim), symbols=symbols)
    dv = symbolic_tensor(dtype, ("B", "S_k", "H_kv", config.dv), symbols=symbols)
    return (q, k, v, do, lse, d, dq_accum, dq_turns, dk, dv, cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(0),
            cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1))


def cross_compile_config(kernel_class, config: prefill.KernelConfig, *, stage: int, deterministic: bool = False,
                         keep: bool = False) -> CompileReport:
    name = f"stage{stage:02d}_bwd_{config.name}" + ("_deterministic" if deterministic else "")
    return cross_compile(kernel_class(config, deterministic), *fake_arguments(config), name=name, keep=keep)


def preprocess_kernel_and_args(kernel_class, torch_dtype, head_dim: int, head_dim_v: int | None = None):
    """The preprocess pass (``kernel_class.preprocess``) and its symbolic arguments: dO, O [B, S, H, D_v]; the
    LSE [B, H, S]; the padded log2 LSE and D [B, H, S_pad]; the float32 dQ sum [B, H, S_pad * D]."""
    import torch

    head_dim_v = head_dim_v or head_dim
    symbols: dict = {}
    do, o = (symbolic_tensor(torch_dtype, ("B", "S", "H", head_dim_v), symbols=symbols) for _ in range(2))
    lse = symbolic_tensor(torch.float32, ("B", "H", "S"), symbols=symbols, align=4, stride_divisibility=1)
    lse2, d = (symbolic_tensor(torch.float32, ("B", "H", "S_pad"), symbols=symbols, stride_divisibility=4)
               for _ in range(2))
    dq_accum = symbolic_tensor(torch.float32, ("B", "H", "S_pad_D"), symbols=symbols, stride_divisibility=4)
    return kernel_class.preprocess(head_dim, head_dim_v), (do, o, lse, lse2, d, dq_accum)


def postprocess_kernel_and_args(kernel_class, torch_dtype, head_dim: int, tile_m: int):
    """The postprocess pass (``kernel_class.postprocess``: the float32 dQ sum, in Q tiles of ``tile_m`` rows, to
    dQ) and its symbolic arguments."""
    import cutlass
    import torch

    symbols: dict = {}
    dq_accum = symbolic_tensor(torch.float32, ("B", "H", "S_pad_D"), symbols=symbols, stride_divisibility=4)
    dq = symbolic_tensor(torch_dtype, ("B", "S", "H", head_dim), symbols=symbols)
    return kernel_class.postprocess(head_dim, tile_m), (dq_accum, dq, cutlass.Float32(1.0))


def pairs_per_group(config, shape, n_blocks: int, deterministic: bool, sms: int) -> int:
    """How many (KV head, batch) pairs launch their CTAs together, KV tile by KV tile: the grid is (pairs per
    group, KV tiles, groups) (``AttentionBackward.tile_coordinates``). Under a mask, where the KV tiles' lengths
    differ, as many as fit all their tiles on the GPU at once (one CTA per SM), rounded down to a power of two that
    divides the number of pairs: then the long tiles of every pair in a group start before the short ones, rather
    than the last pairs' long tiles at the end. One without a mask (every tile is as long) and in deterministic
    mode (groups measured slower: the page), unless there are more pairs than the grid's z dimension takes."""
    pairs = shape.batch * shape.heads_kv
    group = 1
    if not deterministic and (config.has_left or config.has_right):
        fit = max(1, sms // n_blocks)
        group = min(1 << (fit.bit_length() - 1), pairs & -pairs)
    while pairs % group or pairs // group > GRID_YZ_LIMIT:
        group += 1
    return group


def sink_gradient(sink_logits, lse, d):
    """dL/dsink[h] = -sum_{b,i} P_sink[b,h,i] D[b,h,i], with P_sink = exp(sink[h] - LSE) (0 where both are -inf)."""
    import torch

    p_sink = torch.exp(sink_logits.float()[None, :, None] - lse)
    p_sink = torch.nan_to_num(p_sink, nan=0.0)
    return -(p_sink * d).sum(dim=(0, 2))


_PLANS: dict = {}


def attention_backward(kernel_class, do, q, k, v, o, lse, *, softmax_scale=None, causal=False,
                       window_size=(-1, -1), sink_logits=None, num_sink_tokens=0, dq=None, dk=None, dv=None,
                       deterministic=False):
    """Validate, preprocess, launch ``kernel_class`` (compiled once per configuration), postprocess.

    Returns (dq, dk, dv), and dsink (float32 [H_q]) last when ``sink_logits`` is given. As the prefill
    entry points do, the first call of a signature (``launch.signature``) validates and plans; later ones
    only allocate and launch.
    """
    key = (kernel_class, *launch.signature(do, q, k, v, o, lse, sink_logits, dq, dk, dv, softmax_scale, causal,
                                           window_size, num_sink_tokens, deterministic))
    run = launch.cached_plan(_PLANS, key, lambda: plan_backward(
        kernel_class, do, q, k, v, o, lse, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        sink_logits=sink_logits, num_sink_tokens=num_sink_tokens, dq=dq, dk=dk, dv=dv, deterministic=deterministic))
    return run(do, q, k, v, o, lse, sink_logits, dq, dk, dv)


def plan_backward(kernel_class, do, q, k, v, o, lse, *, softmax_scale, causal, window_size, sink_logits,
                  num_sink_tokens, dq, dk, dv, deterministic):
    """Everything ``attention_backward`` does that depends only on the call's signature: validation, the three
    kernels' configurations and compiles, the scalar arguments. Returns ``run(do, q, k, v, o, lse, sink_logits,
    dq, dk, dv)``, which allocates the workspace and the missing outputs and launches."""
    import torch

    shape = validation.check_backward_inputs(do, q, k, v, o, lse, softmax_scale=softmax_scale, causal=causal,
                                             window_size=window_size, sink_logits=sink_logits,
                                             num_sink_tokens=num_sink_tokens, dq=dq, dk=dk, dv=dv,
                                             deterministic=deterministic)
    validation.check_on_gpu(do=do, q=q, k=k, v=v, o=o, lse=lse, sink_logits=sink_logits, dq=dq, dk=dk, dv=dv)
    left, right, num_sink_tokens = prefill.kernel_window(causal, window_size, num_sink_tokens, shape)
    config = prefill.call_config(q, shape, left, right, num_sink_tokens)
    tile_n = kernel_class.kv_tile_keys(shape.head_dim)
    n_blocks = -(-shape.seqlen_k // tile_n)
    if n_blocks > GRID_YZ_LIMIT:
        raise ValueError(f"seqlen_k = {shape.seqlen_k} makes {n_blocks} KV tiles of {tile_n} keys at head_dim "
                         f"{shape.head_dim}; the backward's grid takes at most {GRID_YZ_LIMIT} (its y dimension)")
    kernel = launch.compiled((kernel_class, config, deterministic),
                             lambda: (kernel_class(config, deterministic), fake_arguments(config)))
    key = (q.dtype, shape.head_dim)
    tile_m = kernel_class.q_tile_rows(config)  # the kernel's Q tile: D, the LSE and dQ's sum are padded to whole ones
    pre = launch.compiled((kernel_class.preprocess, *key, shape.head_dim_v),
                          lambda: preprocess_kernel_and_args(kernel_class, *key, shape.head_dim_v))
    post = launch.compiled((kernel_class.postprocess, *key, tile_m),
                           lambda: postprocess_kernel_and_args(kernel_class, *key, tile_m))
    scale = validation.resolve_scale(softmax_scale, shape.head_dim)
    m_blocks = -(-shape.seqlen_q // tile_m)
    rows = (shape.batch, shape.heads_q, m_blocks * tile_m)
    device = q.device
    no_turns = torch.zeros((1, 1, 1), device=device, dtype=torch.int32)  # read only in deterministic mode
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    group_pairs = pairs_per_group(config, shape, n_blocks, deterministic, sms)
    # Deterministic and unmasked: each KV tile starts at its own Q tile (KeyTileMask.q_tile), which makes tiles
    # wait on tiles launched after them; safe only while all KV tiles of a launch group fit on the GPU at once.
    rotate = int(deterministic and not (config.has_left or config.has_right) and group_pairs * n_blocks <= sms)

    def run(do, q, k, v, o, lse, sink_logits, dq, dk, dv):
        lse_log2, d = (torch.empty(rows, device=device, dtype=torch.float32) for _ in range(2))
        dq_accum = torch.empty((*rows, shape.head_dim), device=device, dtype=torch.float32).flatten(2)
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        # Deterministic mode: per Q tile, how many KV tiles have added their dQ share (they take turns).
        turns = (torch.zeros((shape.batch, shape.heads_q, m_blocks), device=device, dtype=torch.int32)
                 if deterministic else no_turns)
        pre(do, o, lse, lse_log2, d, dq_accum)
        kernel(q, k, v, do, lse_log2, d, dq_accum, turns, dk, dv, scale * LOG2_E, scale, left, right, num_sink_tokens,
               rotate, group_pairs)
        post(dq_accum, dq, scale)
        if sink_logits is None:
            return dq, dk, dv
        return dq, dk, dv, sink_gradient(sink_logits, lse, d[..., :shape.seqlen_q])

    return run
