"""A quantized KV cache (FP8 e4m3 or int8) from a 16-bit one, as stage 9's decode kernel reads it.

A serving engine quantizes each new token's K and V when it writes them to the cache,
with scales fixed ahead of time (calibrated per layer and KV head). For the course's
tests, benchmarks and notebooks, ``quantize_kv_cache`` derives the scales from the
cache's own contents instead: one float32 scale per KV head, so that the head's
largest magnitude lands on the format's largest value (448 for e4m3, 127 for int8).

e4m3 keeps 3 mantissa bits: a normal value is stored within 2**-4 of itself
(relative); values below 2**-6 * scale are subnormal and keep an absolute error of
at most 2**-10 * scale. int8 (symmetric, round to nearest even) keeps an absolute
error of at most scale / 2 = amax / 254 for every value: better than e4m3 near the
head's largest values, worse for the small ones.

``quantize_rows`` is the one rounding rule: the kernel's fused append writes a new
token's row exactly as it computes it.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric: -127 .. 127 (-128 unused, so that -x is representable)
QUANTIZED_DTYPES = {torch.float8_e4m3fn: E4M3_MAX, torch.int8: INT8_MAX}


def quantize_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """(k_q, v_q, k_scale, v_scale): the caches as ``dtype`` (float8_e4m3fn or int8) and their float32
    scales [H_kv].

    ``k_cache``, ``v_cache``: [B, S_max, H_kv, D] or paged [num_pages, page_size, H_kv, D] (v_cache's D
    may differ), fp16/bf16/fp32. The quantized cache holds K / k_scale and V / v_scale; a head that is all
    zeros gets scale 1 (scales must be > 0). Non-finite entries (slots no sequence owns may hold
    anything) do not set the scale; they stay non-finite in e4m3 (int8 has no NaN: they become
    0 or +-127).
    """
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache and v_cache must be 4-D caches of one shape but for the head dim ([B, S_max, "
                         f"H_kv, D] or [num_pages, page_size, H_kv, D]); got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if not (k_cache.is_floating_point() and k_cache.element_size() >= 2):
        raise TypeError(f"quantize_kv_cache takes a 16- or 32-bit float cache; got {k_cache.dtype}")
    if dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"quantize_kv_cache makes a torch.float8_e4m3fn or torch.int8 cache; got dtype={dtype}")
    (k_q, k_scale), (v_q, v_scale) = _quantize(k_cache, dtype), _quantize(v_cache, dtype)
    return k_q, v_q, k_scale, v_scale


def _quantize(cache: torch.Tensor, dtype: torch.dtype):
    scale = head_scales(cache, dtype)
    return quantize_rows(cache, scale.view(1, 1, -1, 1), dtype), scale


def head_scales(cache: torch.Tensor, dtype: torch.dtype, headroom: float = 1.0) -> torch.Tensor:
    """float32 [H_kv]: per KV head of ``cache`` [.., .., H_kv, D], the scale that puts ``headroom`` x the head's
    largest finite magnitude on ``dtype``'s largest value (1 for a head of zeros)."""
    magnitude = cache.detach().float().abs()
    amax = torch.where(magnitude.isfinite(), magnitude, 0.0).amax(dim=(0, 1, 3))  # unused slots may be NaN
    return torch.where(amax > 0, amax * headroom / QUANTIZED_DTYPES[dtype], torch.ones_like(amax))


def quantize_rows(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in ``dtype``: float32 division, then e4m3 (round to nearest even, clamped to +-448) or
    int8 (round to nearest even, clamped to +-127). ``scale`` broadcasts against x."""
    scaled = (x.float() / scale).clamp(-QUANTIZED_DTYPES[dtype], QUANTIZED_DTYPES[dtype])
    if dtype == torch.int8:
        scaled = torch.where(scaled.isnan(), 0.0, scaled).round()
    return scaled.to(dtype)


def dequantize(cache_q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The values a quantized cache stands for: cache * scale, per KV head, in ``dtype``."""
    return cache_q.to(dtype) * scale.to(dtype).reshape(1, 1, -1, 1)


def quantized_decode_inputs(inputs: dict, dtype: torch.dtype = torch.float8_e4m3fn) -> dict:
    """Decode arguments (``q``, ``k_cache``, ``v_cache``, ...) with the cache quantized to ``dtype`` and its
    ``k_scale``, ``v_scale`` added: ``decode_attention(**quantized_decode_inputs(inputs))``."""
    k_q, v_q, k_scale, v_scale = quantize_kv_cache(inputs["k_cache"], inputs["v_cache"], dtype)
    return {**inputs, "k_cache": k_q, "v_cache": v_q, "k_scale": k_scale, "v_scale": v_scale}


def fp8_decode_inputs(inputs: dict) -> dict:
    """``quantized_decode_inputs`` with an FP8 (e4m3) cache."""
    return quantized_decode_inputs(inputs, torch.float8_e4m3fn)
