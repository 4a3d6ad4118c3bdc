"""Launching compiled kernels from PyTorch: the compile cache and a demo run."""

from __future__ import annotations

import math
import os

from course.runtime.compile import cute_dtype

__all__ = ["cute_dtype", "compiled", "signature", "cached_plan", "check_device_values", "persistent", "placeholder",
           "decode_counters", "decode_workspace", "DecodePartials", "pick_num_splits", "sm_count"]

H100_SMS = 132  # the SMs of an H100 SXM: what a cross-compile without a GPU assumes

_CACHE: dict = {}
MAX_PLANS = 4096  # signatures one entry point remembers (cached_plan)


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


# ---------------------------------------------------------------- launch plans: what a repeated call skips

def signature(*args) -> tuple:
    """What validating a call depends on, argument by argument, as a dictionary key.

    A tensor contributes its shape, strides, dtype, device and whether its
    address is 16-byte aligned (never its values); any other argument its
    type and value, so that ``True`` and ``1``, or ``(1.0, 0)`` and ``(1, 0)``,
    are different calls. Two calls with equal signatures pass or fail
    validation alike, so an entry point validates a signature once
    (``cached_plan``) and afterwards only launches.
    """
    import torch

    key = []
    append = key.append
    for arg in args:
        if arg is None:
            append(None)
        elif isinstance(arg, torch.Tensor):
            append((arg.shape, arg.stride(), arg.dtype, arg.device, arg.data_ptr() & 15))
        elif type(arg) is tuple or type(arg) is list:
            append((type(arg), *map(type, arg), *arg))
        else:
            append((type(arg), arg))
    return tuple(key)


def cached_plan(plans: dict, key: tuple, make):
    """``plans[key]``, made by ``make()`` on the key's first call.

    ``make`` validates the call (raising for bad input) and does everything
    that depends only on the signature: choosing and compiling the kernel,
    picking splits or tiles, placeholders. A key that cannot be hashed (a
    list inside a list, say) is planned anew every time and never stored.
    """
    try:
        plan = plans.get(key)
    except TypeError:
        return make()
    if plan is None:
        if len(plans) >= MAX_PLANS:  # a server that sees every prompt length keeps a bounded table
            plans.clear()
        plan = plans[key] = make()
    return plan


# COURSE_CHECK_LENGTHS=1 in the environment (read at import) makes every decode call check its values.
CHECK_LENGTHS_DEFAULT = os.environ.get("COURSE_CHECK_LENGTHS", "") == "1"


def check_device_values(requested) -> bool:
    """Whether a decode call reads its lengths, block table and scales on the host to check them.

    ``requested``: the call's ``check_lengths``; ``None`` follows
    ``CHECK_LENGTHS_DEFAULT``, which the environment variable
    ``COURSE_CHECK_LENGTHS=1`` turns on (e.g. while debugging a model). The
    checks copy the values to the host, a synchronization with the GPU, so by
    default they are off and the kernels clamp what they read to the cache
    instead. Inside CUDA graph capture they are always skipped (a copy cannot
    run there).
    """
    if requested is None:
        requested = CHECK_LENGTHS_DEFAULT
    if not requested:
        return False
    import torch

    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def persistent(device, make):
    """``make()``'s tensor allocated where no CUDA graph's memory pool can claim it.

    A tensor that lives across calls (decode counters, placeholders) must not
    come from the pool of a graph being warmed up or captured:
    ``torch.compile``'s CUDA-graph trees refuse a pool that holds memory no
    graph output owns, and they send every allocation of the calling thread
    to that pool. So ``make`` runs on a thread of its own (with the device's
    default stream there), and the caller's stream waits for it. During a raw
    capture (no allocation may happen outside it) ``make`` runs as it is, in
    the graph's pool.
    """
    import threading

    import torch

    if torch.cuda.is_current_stream_capturing():
        return make()
    made = {}

    def allocate():
        try:
            with torch.cuda.device(device):
                made["tensor"] = make()
                made["ready"] = torch.cuda.Event()
                made["ready"].record()
        except BaseException as error:  # raised again in the caller
            made["error"] = error

    thread = threading.Thread(target=allocate, name="course-persistent-allocation")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    torch.cuda.current_stream(device).wait_event(made["ready"])
    return made["tensor"]


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

    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))  # a stream's id, without a Stream object
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _RETIRED.append(counters)  # a captured CUDA graph may still use it: never free it
        counters = persistent(device, lambda: torch.zeros(max(count, 1024), dtype=torch.int32, device=device))
        _COUNTERS[key] = counters
    return counters


_WORKSPACES: dict = {}


def decode_workspace(device, numel: int):
    """A float32 buffer of at least ``numel`` elements for the split-KV decode kernels' partial results
    (stages 7 and 9), kept per device and stream like ``decode_counters``.

    Launches on one stream run one after another, so each reuses the same
    buffer instead of allocating its workspace anew (an allocation costs the
    host about as much as the launch); launches on different streams get
    different buffers.
    """
    import torch

    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    work = _WORKSPACES.get(key)
    if work is None or work.numel() < numel:
        # At least twice the size it replaces: the buffers kept for graphs then add up to less than the new one.
        size = max(numel, 1 << 16, 2 * work.numel() if work is not None else 0)
        if work is not None:
            _RETIRED.append(work)  # a captured CUDA graph may still use it: never free it
        work = persistent(device, lambda: torch.empty(size, dtype=torch.float32, device=device))
        _WORKSPACES[key] = work
    return work


class DecodePartials:
    """The partial results of one decode plan, ``part_o`` [B, H_q, slots, D] and ``part_lse`` [B, H_q, slots]
    float32: views of the current stream's workspace (``decode_workspace``), made again only when the
    stream's buffer is another one."""

    def __init__(self, device, part_o_shape: tuple, part_lse_shape: tuple):
        self.device, self.part_o_shape, self.part_lse_shape = device, part_o_shape, part_lse_shape
        self.split = math.prod(part_o_shape)
        self.numel = self.split + math.prod(part_lse_shape)
        self.work = None

    def views(self):
        work = decode_workspace(self.device, self.numel)
        if work is not self.work:
            self.work = work
            self.part_o = work[:self.split].view(self.part_o_shape)
            self.part_lse = work[self.split:self.numel].view(self.part_lse_shape)
        return self.part_o, self.part_lse


_PLACEHOLDERS: dict = {}


def placeholder(device, shape: tuple, dtype=None, fill: float = 0.0):
    """A small tensor of ``fill``, cached per (device, shape, dtype, fill), for an argument whose feature
    the call does not use: one the kernel never reads or writes (LSE, block table), or one whose value
    means "none" (-inf sink logits)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    key = (str(device), tuple(shape), dtype, fill)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = persistent(device, lambda: torch.full(shape, fill, device=device, dtype=dtype))
    return _PLACEHOLDERS[key]
