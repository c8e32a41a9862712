"""Run-time choice of device and compute dtype: CUDA, Apple MPS or CPU, never assumed."""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")


def pick_device(preference: str = "auto") -> torch.device:
    if preference not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {preference!r}")
    if preference == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA device")
    if preference == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError("device 'mps' was asked for but this machine has no usable Apple MPS")
    return torch.device(preference)


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively here; elsewhere bf16 would be emulated and slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "mps":
        try:
            torch.ones(1, dtype=torch.bfloat16, device=device)
            return True
        except (RuntimeError, TypeError):  # macOS < 14 has no bf16 on MPS
            return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def compute_dtype(device: torch.device, preference: str = "auto") -> torch.dtype:
    """The dtype for inference weights and training autocast: bf16 where the hardware has it."""
    choices = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    if preference not in choices:
        raise ValueError(f"dtype must be one of {tuple(choices)}, got {preference!r}")
    chosen = choices[preference]
    if chosen is not None:
        return chosen
    return torch.bfloat16 if bf16_is_fast(device) else torch.float32
