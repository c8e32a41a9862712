"""Weight-only int8 for a LoRA run's frozen base (`train.lora_base = "int8"`).

Each projection's weight is stored as int8 with one fp32 scale per output row (absmax / 127) and
used as `q * scale` computed in fp32, then cast to the input's dtype. Every peer quantizes the
same way from the same file: from the weight rounded to bf16 first, whatever dtype it was loaded
in, so a replica that loaded its base in bf16 and an export that loaded it in fp32 hold the same
int8 values and scales. Replicas, verifiers and the trainer then compute with the same weights,
and spot-checks and importance ratios stay exact; the model that is trained and released is the
quantized base plus the adapters."""

from __future__ import annotations

import torch


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale per row) of a [out, in] weight; a zero row gets scale 1."""
    canonical = weight.detach().to(torch.bfloat16).float()
    scale = canonical.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(canonical / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return values, scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                    ) -> torch.Tensor:
    """The weight int8 `values` and `scale` stand for, computed in fp32, in `dtype`."""
    return (values.float() * scale[:, None]).to(dtype)
