"""What running a stage's file does (``python solutions/stageNN_*.py``): one call on random inputs, its
error printed next to PyTorch's own against the float64 reference."""

from __future__ import annotations

from course import testing


def prefill(attention, *, seqlen_q: int, seqlen_k: int, batch: int = 2, heads_q: int = 8,
            heads_kv: int = 2, head_dim: int = 128, **features):
    """Run one stage once on random inputs and print its error next to PyTorch's."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("This demo launches the kernel: it needs a CUDA GPU (Hopper, sm_90).")
    q, k, v = testing.random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, torch.float16)
    out = attention(q, k, v, **features)
    if isinstance(out, tuple):  # (O, LSE)
        out = out[0]
    torch.cuda.synchronize()
    mask_features = {name: value for name, value in features.items() if name != "return_lse"}
    print(f"stage output {tuple(out.shape)}: {testing.compare_with_reference(out, q, k, v, **mask_features)}")


def decode(decode_attention, *, lengths, heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128,
           page_size=None, **features):
    """Run a decode stage once on a ragged batch of random caches and print its error next to PyTorch's."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("This demo launches the kernel: it needs a CUDA GPU (Hopper, sm_90).")
    inputs = testing.random_decode_inputs(lengths, heads_q, heads_kv, head_dim, torch.float16, page_size=page_size)
    out = decode_attention(**inputs, **features)
    torch.cuda.synchronize()
    print(f"decode output {tuple(out.shape)}: {testing.compare_decode_with_reference(out, **inputs, **features)}")


def varlen(attention_varlen, *, lengths_q=(300, 1, 1000, 0), lengths_k=(1000, 5, 1000, 17), heads_q: int = 8,
           heads_kv: int = 2, head_dim: int = 128, page_size=64, **features):
    """Run the variable-length stage once on a ragged batch over a paged cache and print its error next to PyTorch's."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("This demo launches the kernel: it needs a CUDA GPU (Hopper, sm_90).")
    inputs = testing.random_varlen_inputs(lengths_q, lengths_k, heads_q, heads_kv, head_dim, torch.float16,
                                          page_size=page_size)
    out = attention_varlen(**inputs, **features)
    torch.cuda.synchronize()
    print(f"varlen output {tuple(out.shape)}: {testing.assert_varlen_matches(out, inputs, 'demo', **features)}")


def backward(attention, attention_backward, *, batch: int = 2, seqlen_q: int = 300, seqlen_k: int = 1000,
             heads_q: int = 8, heads_kv: int = 2, head_dim: int = 128, dtype=None, **features):
    """One forward and backward against the float64 reference's autograd; prints each gradient's error."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("This demo launches the kernel: it needs a CUDA GPU (Hopper, sm_90).")
    dtype = dtype or torch.bfloat16
    q, k, v = testing.random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
    do = torch.randn_like(q)
    out, lse = attention(q, k, v, return_lse=True, **features)
    grads = attention_backward(do, q, k, v, out, lse, **features)
    reports = testing.assert_gradients_match(grads, q, k, v, do, "demo", out=out, **features)
    for name, report in zip(testing.GRADIENT_NAMES, reports):
        print(f"{name} {tuple(grads[testing.GRADIENT_NAMES.index(name)].shape)}: {report}")
