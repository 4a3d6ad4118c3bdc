"""Input validation for the attention API contract (COURSE.md).

Every stage calls these before launching anything, so bad input fails with a
message that says what was wrong and what is accepted, never inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DTYPES = ("torch.float16", "torch.bfloat16")

# The stage that adds each optional feature; earlier stages reject it.
FEATURE_STAGE = {
    "causal": (4, "in-kernel sliding-window and causal masking"),
    "window_size": (4, "in-kernel sliding-window and causal masking"),
    "sink_logits": (5, "attention sinks"),
    "num_sink_tokens": (5, "attention sinks"),
    "return_lse": (6, "per-row LSE"),
}


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int


def _check_tensor(name: str, t, *, rank: int, layout: str) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(t.shape)} (rank {t.dim()}); expected rank {rank}: {layout}")
    if str(t.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.float16, torch.bfloat16")
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} has stride {t.stride()}: its last dimension (head dim) must be contiguous "
            "(stride 1); call .contiguous() first"
        )
    if any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(
            f"{name} has strides {t.stride()} and address {t.data_ptr():#x}: TMA needs a 16-byte "
            "aligned base and strides that are multiples of 8 elements; call .contiguous() first"
        )


def check_attention_inputs(q, k, v, *, softmax_scale=None, window_size=(-1, -1), sink_logits=None,
                           num_sink_tokens=0, out=None, head_dims=(64, 128)) -> AttentionShape:
    """Validate q, k, v ([B, S_q, H_q, D], [B, S_k, H_kv, D]) and the options; return the sizes.

    Devices are checked separately by ``check_on_gpu``, right before a launch.
    """
    bshd = "[batch, seqlen, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, rank=4, layout=bshd)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    b, s_q, h_q, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match")
    b_k, s_k, h_kv, d_k = k.shape
    if b_k != b:
        raise ValueError(f"q has batch {b} but k/v have batch {b_k}")
    if d_k != d:
        raise ValueError(f"q has head_dim {d} but k/v have head_dim {d_k}")
    if d not in head_dims:
        raise ValueError(f"head_dim {d} is not supported; supported: {', '.join(map(str, head_dims))}")
    if s_q == 0 or s_k == 0 or b == 0:
        raise ValueError(
            f"empty input: batch {b}, S_q {s_q}, S_k {s_k}; attention needs at least one query and one key"
        )
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(
            f"q has {h_q} heads and k/v have {h_kv}: H_q must be a multiple of H_kv (GQA/MQA)"
        )
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(not isinstance(w, int) or w < -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded); got {window_size!r}")
    if not isinstance(num_sink_tokens, int) or num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be an int >= 0; got {num_sink_tokens!r}")
    if sink_logits is not None:
        import torch

        if not isinstance(sink_logits, torch.Tensor):
            raise TypeError(f"sink_logits must be a torch.Tensor or None; got {type(sink_logits).__name__}")
        if sink_logits.shape != (h_q,) or sink_logits.dtype != torch.float32:
            raise ValueError(
                f"sink_logits has shape {tuple(sink_logits.shape)} and dtype {sink_logits.dtype}; "
                f"expected [{h_q}] (one per query head) float32"
            )
    if out is not None:
        _check_tensor("out", out, rank=4, layout=bshd)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out has shape {tuple(out.shape)} {out.dtype}; expected {tuple(q.shape)} {q.dtype} like q"
            )
    return AttentionShape(b, s_q, s_k, h_q, h_kv, d)


def check_on_gpu(**tensors) -> None:
    """All tensors on one CUDA device (checked last, so CPU tests reach every other check)."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    for name, device in devices.items():
        if device.type != "cuda":
            raise ValueError(f"{name} is on {device}; the kernels need CUDA tensors (move them with .cuda())")
    if len(set(devices.values())) > 1:
        found = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one CUDA device; got {found}")


def reject_later_features(stage: int, *, causal=False, window_size=(-1, -1), sink_logits=None,
                          num_sink_tokens=0, return_lse=False) -> None:
    """Raise NotImplementedError for a feature that a later stage adds."""
    used = {
        "causal": bool(causal),
        "window_size": tuple(window_size) != (-1, -1),
        "sink_logits": sink_logits is not None,
        "num_sink_tokens": num_sink_tokens != 0,
        "return_lse": bool(return_lse),
    }
    for feature, on in used.items():
        added_in, title = FEATURE_STAGE[feature]
        if on and added_in > stage:
            raise NotImplementedError(
                f"{feature} is not implemented in stage {stage}; stage {added_in} ({title}) adds it"
            )
