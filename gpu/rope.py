"""Rotary position embeddings (HF ``rotate_half`` convention), incl. Llama-3.1 frequency scaling."""

from __future__ import annotations

import math

import torch

from gpu.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling.rope_type != "llama3":
        return inv
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Meta's reference implementation, as transformers does it).
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(config: ModelConfig) -> torch.Tensor:
    """FlashInfer's float32 rotary table ``[max_pos, D]``: each position's cos of the D/2
    frequencies, then their sin (what ``gpu.ops.FlashInferOps`` and the fused rotary + KV
    append kernel read)."""
    freqs = torch.outer(
        torch.arange(config.max_position_embeddings, dtype=torch.float32),
        inverse_frequencies(config).to(torch.float32),
    )
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``cos_sin`` is called once per step, ``apply`` per layer."""

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        inv = inverse_frequencies(config).to(torch.float32)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        # CUDA only (FlashInfer's kernels read it): elsewhere one more table of the context's
        # length.
        self.cos_sin_cache: torch.Tensor | None = None
        if torch.device(device).type == "cuda":
            self.cos_sin_cache = cos_sin_cache(config).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D]`` tables for the step's token positions (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
