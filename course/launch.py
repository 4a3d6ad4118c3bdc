"""Launching compiled kernels from PyTorch: tensor conversion, the compile cache, a demo."""

from __future__ import annotations

from course.compile import cute_dtype

__all__ = ["cute_dtype", "to_cute", "compiled", "demo"]

_CACHE: dict = {}


def to_cute(t):
    """A torch CUDA tensor as a CuTe tensor whose shape and strides are runtime values.

    One compiled kernel then serves every shape; the last dim stays the
    compile-time contiguous one (validation guarantees it).
    """
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)


def _as_kernel_arg(a):
    import cutlass
    import torch

    if isinstance(a, torch.Tensor):
        return to_cute(a)
    if isinstance(a, float):
        return cutlass.Float32(a)
    if isinstance(a, bool) or isinstance(a, int):
        return cutlass.Int32(int(a))
    return a


def _current_stream():
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


class CompiledKernel:
    """A kernel compiled for this GPU; call it with torch tensors and Python floats."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        self.fn(*(_as_kernel_arg(a) for a in args), _current_stream())


def compiled(key, make_kernel, *example_args) -> CompiledKernel:
    """The kernel for ``key``, compiled on first use from ``make_kernel()`` and example arguments."""
    import cutlass.cute as cute

    if key not in _CACHE:
        converted = [_as_kernel_arg(a) for a in example_args]
        _CACHE[key] = CompiledKernel(cute.compile(make_kernel(), *converted, _current_stream()))
    return _CACHE[key]


def demo(attention, *, seqlen_q: int, seqlen_k: int, batch: int = 2, heads_q: int = 8,
         heads_kv: int = 2, head_dim: int = 128, **features):
    """Run one stage once on random inputs and print its error next to PyTorch's."""
    import torch

    from course import testing

    if not torch.cuda.is_available():
        raise SystemExit("This demo launches the kernel: it needs a CUDA GPU (Hopper, sm_90).")
    q, k, v = testing.random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, torch.float16)
    out = attention(q, k, v, **features)
    torch.cuda.synchronize()
    print(f"stage output {tuple(out.shape)}: {testing.compare_with_reference(out, q, k, v, **features)}")
