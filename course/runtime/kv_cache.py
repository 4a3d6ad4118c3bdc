"""An FP8 (e4m3) KV cache from a 16-bit one, as stage 9's decode kernel reads it.

A serving engine quantizes each new token's K and V when it writes them to the cache,
with scales fixed ahead of time (calibrated per layer and KV head). For the course's
tests, benchmarks and notebooks, ``quantize_kv_cache`` derives the scales from the
cache's own contents instead: one float32 scale per KV head, so that the head's
largest magnitude lands on e4m3's largest finite value (448).

e4m3 keeps 3 mantissa bits: a normal value is stored within 2**-4 of itself
(relative); values below 2**-6 * scale are subnormal and keep an absolute error of
at most 2**-10 * scale.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """(k_fp8, v_fp8, k_scale, v_scale): the caches as float8_e4m3fn and their float32 scales [H_kv].

    ``k_cache``, ``v_cache``: [B, S_max, H_kv, D] or paged [num_pages, page_size, H_kv, D],
    fp16/bf16/fp32. The FP8 cache holds K / k_scale and V / v_scale; a head that is all zeros
    gets scale 1 (scales must be > 0). Non-finite entries (slots no sequence owns may hold
    anything) do not set the scale and stay non-finite.
    """
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must be 4-D caches of one shape ([B, S_max, H_kv, D] or "
                         f"[num_pages, page_size, H_kv, D]); got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_floating_point() and k_cache.element_size() >= 2):
        raise TypeError(f"quantize_kv_cache takes a 16- or 32-bit float cache; got {k_cache.dtype}")
    (k_fp8, k_scale), (v_fp8, v_scale) = _quantize(k_cache), _quantize(v_cache)
    return k_fp8, v_fp8, k_scale, v_scale


def _quantize(cache: torch.Tensor):
    magnitude = cache.detach().float().abs()
    amax = torch.where(magnitude.isfinite(), magnitude, 0.0).amax(dim=(0, 1, 3))  # [H_kv]; unused slots may be NaN
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    quantized = (cache.float() / scale.view(1, 1, -1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize(cache_fp8: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The values an FP8 cache stands for: cache * scale, per KV head, in ``dtype``."""
    return cache_fp8.to(dtype) * scale.to(dtype).reshape(1, 1, -1, 1)


def fp8_decode_inputs(inputs: dict) -> dict:
    """Decode arguments (``q``, ``k_cache``, ``v_cache``, ...) with the cache quantized to FP8 and its
    ``k_scale``, ``v_scale`` added: ``decode_attention(**fp8_decode_inputs(inputs))``."""
    k_fp8, v_fp8, k_scale, v_scale = quantize_kv_cache(inputs["k_cache"], inputs["v_cache"])
    return {**inputs, "k_cache": k_fp8, "v_cache": v_fp8, "k_scale": k_scale, "v_scale": v_scale}
