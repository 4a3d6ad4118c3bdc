"""Launching compiled kernels from PyTorch: the compile cache and a demo run."""

from __future__ import annotations

import math

from course.compile import cute_dtype

__all__ = ["cute_dtype", "compiled", "placeholder", "decode_counters", "pick_num_splits", "sm_count", "demo",
           "decode_demo"]

H100_SMS = 132  # the SMs of an H100 SXM: what a cross-compile without a GPU assumes

_CACHE: dict = {}


def compiled(key, make_kernel_and_args):
    """The kernel for ``key``, compiled for this GPU on first use.

    ``make_kernel_and_args()`` returns the kernel object and the symbolic
    (fake) arguments it is compiled with: the same ones as the CPU
    cross-compile, so one compile serves every batch, length and head count.
    The result is compiled with TVM-FFI: it is called with torch tensors and
    Python floats directly and launches on PyTorch's current stream, which
    keeps the per-call host overhead to a few microseconds.
    """
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    if key not in _CACHE:
        kernel, args = make_kernel_and_args()
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        _CACHE[key] = cute.compile(kernel, *args, stream, options="--enable-tvm-ffi")
    return _CACHE[key]


def sm_count() -> int:
    """The number of SMs of the current GPU (a persistent kernel launches one CTA per SM).

    Kernels are compiled on the GPU they run on (``compiled``), so the count
    is that GPU's; without a GPU (a cross-compile) it is an H100's.
    """
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return H100_SMS


# --8<-- [start:pick_num_splits]
def pick_num_splits(base_ctas: int, max_keys: int, num_sms: int, ctas_per_sm: int, *, split_ctas_per_sm: int,
                    min_keys_per_split: int) -> int:
    """How many CTAs share one sequence's keys when the caller of a split-KV decode kernel (stages 7
    and 9) passes num_splits=0.

    ``base_ctas``: the launch's CTAs without splitting (sequences x KV heads x
    head chunks). ``max_keys``: the most keys a sequence can see, from the
    cache capacity clipped by the window; it is known on the host without
    reading the lengths, so there is no synchronization and the choice is
    CUDA-graph safe. ``ctas_per_sm``: the kernel's CTAs that fit on one SM.

    Short sequences get 1 split, and no split gets fewer than
    ``min_keys_per_split`` keys. Few long sequences: as many splits as give
    every SM ``split_ctas_per_sm`` CTAs, and no SM one more than the others. A
    batch that already has a wave's worth of CTAs: the split count (at most 4)
    whose last wave is fullest, so that few SMs idle at the end.
    """
    resident = num_sms * ctas_per_sm
    most = max(1, -(-max_keys // min_keys_per_split))
    if base_ctas < resident:
        target = num_sms * min(split_ctas_per_sm, ctas_per_sm)
        return max(1, min(most, target // base_ctas))

    def wave_efficiency(splits):
        waves = base_ctas * splits / resident
        return waves / math.ceil(waves)

    return max(range(1, min(most, 4) + 1), key=lambda splits: (wave_efficiency(splits), -splits))
# --8<-- [end:pick_num_splits]


_COUNTERS: dict = {}
_RETIRED: list = []


def decode_counters(device, count: int):
    """Arrival counters of the split-KV decode kernels (stages 7 and 9) for ``count`` (sequence, KV head
    chunk) pairs, zeroed once and then kept.

    Every launch leaves them at 0 (the last CTA of each pair resets its
    counter), so they are allocated once per device and stream and reused by
    every later call, of either stage, eagerly or inside a CUDA graph. Launches
    on different streams get different counters: they may run at the same time.
    """
    import torch

    key = (device, torch.cuda.current_stream(device).cuda_stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _RETIRED.append(counters)  # a captured CUDA graph may still use it: never free it
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


_PLACEHOLDERS: dict = {}


def placeholder(device, shape: tuple, dtype=None):
    """A small zero tensor, cached per (device, shape, dtype), for an argument that a kernel
    compiled without its feature (sinks, LSE, block table) never reads or writes."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    key = (str(device), tuple(shape), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(shape, device=device, dtype=dtype)
    return _PLACEHOLDERS[key]


def demo(attention, *, seqlen_q: int, seqlen_k: int, batch: int = 2, heads_q: int = 8,
         heads_kv: int = 2, head_dim: int = 128, **features):
    """Run one stage once on random inputs and print its error next to PyTorch's."""
    import torch

    from course import testing

    if not torch.cuda.is_available():
        raise SystemExit("This demo launches the kernel: it needs a CUDA GPU (Hopper, sm_90).")
    q, k, v = testing.random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, torch.float16)
    out = attention(q, k, v, **features)
    if isinstance(out, tuple):  # (O, LSE)
        out = out[0]
    torch.cuda.synchronize()
    mask_features = {name: value for name, value in features.items() if name != "return_lse"}
    print(f"stage output {tuple(out.shape)}: {testing.compare_with_reference(out, q, k, v, **mask_features)}")


def decode_demo(decode_attention, *, lengths, heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128,
                page_size=None, **features):
    """Run a decode stage once on a ragged batch of random caches and print its error next to PyTorch's."""
    import torch

    from course import testing

    if not torch.cuda.is_available():
        raise SystemExit("This demo launches the kernel: it needs a CUDA GPU (Hopper, sm_90).")
    inputs = testing.random_decode_inputs(lengths, heads_q, heads_kv, head_dim, torch.float16, page_size=page_size)
    out = decode_attention(**inputs, **features)
    torch.cuda.synchronize()
    print(f"decode output {tuple(out.shape)}: {testing.compare_decode_with_reference(out, **inputs, **features)}")
