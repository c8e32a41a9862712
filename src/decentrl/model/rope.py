"""Rotary position embeddings (RoPE): every type the supported families use, read from a Hugging
Face config (its transformers-5 form and the older forms checkpoints carry on disk), and turned
into the cos/sin tables and the rotation of queries and keys, exactly as transformers computes
them (same fp32 operations in the same order, so the tables agree to the last bit on CPU).

Types: "default" (plain RoPE), "linear" (positions interpolated by `factor`), "dynamic" (NTK:
the base grows with the sequence past `max_position_embeddings`), "yarn", "llama3" (Llama 3.1's
frequency bands) and "longrope" (Phi-3's short and long per-frequency factors)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from decentrl.errors import DecentrlError

ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Older names of a type: early Phi-3 checkpoints call longrope "su".
KIND_ALIASES = {"su": "longrope"}
# transformers' default base when a config names none; the families that differ override it.
DEFAULT_THETA = 10_000.0
FAMILY_THETA = {"smollm3": 2_000_000.0, "mixtral": 1_000_000.0, "gemma3_text": 1_000_000.0}
# Gemma 3's sliding-window layers have their own base, `rope_local_base_freq` in older configs.
GEMMA3_LOCAL_THETA = 10_000.0
# Phi3Config always has an `original_max_position_embeddings` attribute (4096 unless given), and
# transformers lets it override the one inside the RoPE parameters.
PHI3_ORIGINAL_MAX_POSITIONS = 4096
# yarn's ramp bounds when a config leaves them out (or sets them to 0/None), as in the paper.
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


class RopeConfigError(DecentrlError, ValueError):
    """A config's RoPE is malformed or of a type decentrl does not implement."""


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE, with its parameters resolved (defaults filled in as transformers fills them).

    `rotary_dim` is the number of leading head dims rotated (head_dim x partial_rotary_factor);
    the rest pass through. `original_max_positions` is the context the type's scaling is anchored
    to: dynamic NTK rescales past it (it is the config's `max_position_embeddings`), llama3 and
    yarn derive their frequency bands from it, and longrope switches from its short to its long
    factors once the longest position of a forward reaches it (max(positions) + 1 > it).
    `attention_factor` multiplies cos and sin (yarn's mscale, longrope's scaling; 1 otherwise)."""

    kind: str
    theta: float
    rotary_dim: int
    factor: float = 1.0
    original_max_positions: int = 0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = field(default=(), repr=False)
    long_factor: tuple[float, ...] = field(default=(), repr=False)

    @property
    def depends_on_length(self) -> bool:
        """Whether the tables depend on the longest position of the forward, not only on each
        position: dynamic NTK and longrope choose their frequencies from max(positions) + 1."""
        return self.kind in ("dynamic", "longrope")

    @classmethod
    def from_hf(cls, params: Mapping[str, Any], head_dim: int, max_positions: int) -> RopeSpec:
        """The RoPE described by one transformers-5 `rope_parameters` dict (`rope_type` or the
        older `type`), for heads of `head_dim` and a config's `max_position_embeddings` (0 when
        the config has none). Refuses an unknown type, a missing or malformed parameter."""
        raw_kind = params.get("rope_type", params.get("type", "default"))
        kind = KIND_ALIASES.get(raw_kind, raw_kind) if isinstance(raw_kind, str) else raw_kind
        if kind not in ROPE_KINDS:
            raise RopeConfigError(f"RoPE type {raw_kind!r} is not supported; supported types: "
                                  f"{', '.join(ROPE_KINDS)}")
        theta = _positive_number(params, "rope_theta", kind, default=DEFAULT_THETA)
        partial = _positive_number(params, "partial_rotary_factor", kind, default=1.0)
        rotary_dim = int(head_dim * partial)
        if partial > 1 or rotary_dim < 2 or rotary_dim % 2:
            raise RopeConfigError(
                f"RoPE partial_rotary_factor {partial} of head_dim {head_dim} gives {rotary_dim} "
                "rotated dims; it must be an even number from 2 to head_dim")
        if kind == "default":
            return cls(kind, theta, rotary_dim)
        if kind == "linear":
            return cls(kind, theta, rotary_dim, factor=_positive_number(params, "factor", kind))
        if kind == "dynamic":
            if rotary_dim == 2:  # its base grows by a power d / (d - 2)
                raise RopeConfigError("RoPE type 'dynamic' needs more than 2 rotated dims")
            return cls(kind, theta, rotary_dim, factor=_positive_number(params, "factor", kind),
                       original_max_positions=_known_length(max_positions, kind))
        original = _known_length(
            _positive_number(params, "original_max_position_embeddings", kind,
                             default=max_positions or None), kind)
        if kind == "llama3":
            return _llama3_spec(params, theta, rotary_dim, original)
        if kind == "yarn":
            return _yarn_spec(params, theta, rotary_dim, max_positions, original)
        return _longrope_spec(params, theta, rotary_dim, max_positions, original)


def _positive_number(params: Mapping[str, Any], name: str, kind: str,
                     default: float | None = None) -> float:
    """params[name] as a float > 0; `default` when absent or null (refused when that is None)."""
    value = params.get(name)
    if value is None:
        if default is None:
            raise RopeConfigError(f"RoPE type {kind!r} needs {name!r} in its parameters")
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise RopeConfigError(f"RoPE {name!r} must be a positive number, got {value!r}")
    return float(value)


def _optional_number(params: Mapping[str, Any], name: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RopeConfigError(f"RoPE {name!r} must be a number, got {value!r}")
    return float(value)


def _known_length(length: float, kind: str) -> int:
    if length != int(length) or length < 1:
        raise RopeConfigError(
            f"RoPE type {kind!r} needs a positive whole max_position_embeddings "
            f"(or original_max_position_embeddings), got {length!r}")
    return int(length)


def _llama3_spec(params: Mapping[str, Any], theta: float, rotary_dim: int, original: int
                 ) -> RopeSpec:
    factor = _positive_number(params, "factor", "llama3")
    low = _positive_number(params, "low_freq_factor", "llama3")
    high = _positive_number(params, "high_freq_factor", "llama3")
    if high <= low:
        raise RopeConfigError(
            f"RoPE type 'llama3' needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    return RopeSpec("llama3", theta, rotary_dim, factor=factor, original_max_positions=original,
                    low_freq_factor=low, high_freq_factor=high)


def _yarn_spec(params: Mapping[str, Any], theta: float, rotary_dim: int, max_positions: int,
               original: int) -> RopeSpec:
    if "factor" not in params:
        raise RopeConfigError("RoPE type 'yarn' needs 'factor' in its parameters")
    # A null factor is the ratio of the extended to the pretrained context (DeepSeek-V3's way).
    factor = _positive_number(params, "factor", "yarn", default=max_positions / original or None)
    # transformers reads the betas with `or`, so 0 means the default as much as null does.
    beta_fast = float(params.get("beta_fast") or YARN_BETA_FAST)
    beta_slow = float(params.get("beta_slow") or YARN_BETA_SLOW)
    if beta_fast < beta_slow:
        raise RopeConfigError(
            f"RoPE type 'yarn' needs beta_fast >= beta_slow, got {beta_fast} < {beta_slow}")
    mscale = _optional_number(params, "mscale")
    mscale_all_dim = _optional_number(params, "mscale_all_dim")
    if "attention_factor" in params and params["attention_factor"] is not None:
        attention_factor = _positive_number(params, "attention_factor", "yarn")
    elif mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    return RopeSpec("yarn", theta, rotary_dim, factor=factor, original_max_positions=original,
                    beta_fast=beta_fast, beta_slow=beta_slow, mscale=mscale,
                    mscale_all_dim=mscale_all_dim, truncate=bool(params.get("truncate", True)),
                    attention_factor=attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_spec(params: Mapping[str, Any], theta: float, rotary_dim: int, max_positions: int,
                   original: int) -> RopeSpec:
    short_factor = _per_frequency(params, "short_factor", rotary_dim)
    long_factor = _per_frequency(params, "long_factor", rotary_dim)
    # Phi-3 gives no factor: the ratio of the extended to the pretrained context stands for it.
    factor = _positive_number(params, "factor", "longrope",
                              default=max_positions / original or None)
    if params.get("attention_factor") is not None:
        attention_factor = _positive_number(params, "attention_factor", "longrope")
    elif factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeSpec("longrope", theta, rotary_dim, factor=factor, original_max_positions=original,
                    attention_factor=attention_factor, short_factor=short_factor,
                    long_factor=long_factor)


def _per_frequency(params: Mapping[str, Any], name: str, rotary_dim: int) -> tuple[float, ...]:
    """longrope's list of one positive factor per rotated frequency (rotary_dim / 2 of them)."""
    values = params.get(name)
    if values is None:
        raise RopeConfigError(f"RoPE type 'longrope' needs {name!r} in its parameters")
    if (not isinstance(values, Sequence) or isinstance(values, str)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                       for v in values)):
        raise RopeConfigError(f"RoPE {name!r} must be a list of positive numbers, got {values!r}")
    if len(values) != rotary_dim // 2:
        raise RopeConfigError(
            f"RoPE {name!r} has {len(values)} entries; it needs one per rotated frequency, "
            f"{rotary_dim // 2} (rotary dim {rotary_dim})")
    return tuple(float(v) for v in values)


def rope_specs(hf_config: Mapping[str, Any], head_dim: int) -> dict[str, RopeSpec]:
    """The RoPE of each layer type ("full_attention", "sliding_attention") of a Hugging Face
    config.json. Reads the transformers-5 `rope_parameters` (flat, or nested per layer type as
    Gemma 3 has it) and the older forms: `rope_scaling` with `type` or `rope_type`, a top-level
    `rope_theta` and `partial_rotary_factor`, Gemma 3's `rope_local_base_freq` (its sliding
    layers' base; `rope_scaling` then applies to its full layers only), Phi-3's top-level
    `original_max_position_embeddings`. A flat config gives both layer types the same spec; a
    nested one the layer types it names (Gemma 3 both, defaulting a missing one)."""
    model_type = hf_config.get("model_type")
    text_config = hf_config.get("text_config")
    if isinstance(text_config, Mapping):
        # A multimodal checkpoint (Gemma 3 from 4B up): its decoder's RoPE is in its text config.
        return rope_specs({"model_type": f"{model_type}_text", **text_config}, head_dim)
    max_positions = hf_config.get("max_position_embeddings") or 0
    # transformers takes rope_scaling over rope_parameters when a config has both.
    parameters = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if not isinstance(parameters, Mapping):
        raise RopeConfigError(f"the config's RoPE parameters must be a dict, got {parameters!r}")
    nested = [key for key in parameters if key in LAYER_TYPES]
    if model_type == "gemma3_text":
        return _gemma3_specs(hf_config, parameters, nested, head_dim, max_positions)
    if not nested:
        flat = dict(parameters)
        flat.setdefault("rope_theta", hf_config.get("rope_theta",
                                                    FAMILY_THETA.get(model_type, DEFAULT_THETA)))
        _set_partial_rotary_default(flat, hf_config)
        if model_type == "phi3" and flat.get("rope_type", flat.get("type")) == "yarn":
            flat["rope_type"] = "longrope"  # Phi3Config reads an old "yarn" as longrope
        original = hf_config.get("original_max_position_embeddings")
        if original is None and model_type == "phi3":
            original = PHI3_ORIGINAL_MAX_POSITIONS
        if original is not None:
            flat["original_max_position_embeddings"] = original
        spec = RopeSpec.from_hf(flat, head_dim, max_positions)
        return dict.fromkeys(LAYER_TYPES, spec)
    # Nested: each layer type the config names has its own RoPE (and no other type is used).
    return {layer_type: _nested_spec(hf_config, parameters[layer_type], layer_type,
                                     FAMILY_THETA.get(model_type, DEFAULT_THETA), head_dim,
                                     max_positions)
            for layer_type in nested}


def _set_partial_rotary_default(params: dict[str, Any], hf_config: Mapping[str, Any]) -> None:
    if hf_config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf_config["partial_rotary_factor"])


def _nested_spec(hf_config: Mapping[str, Any], params: Any, layer_type: str, theta: float,
                 head_dim: int, max_positions: int) -> RopeSpec:
    """The spec of one layer type's entry of a nested `rope_parameters`."""
    if not isinstance(params, Mapping):
        # transformers reads a null entry as a layer type without positional encoding.
        raise RopeConfigError(
            f"rope_parameters[{layer_type!r}] must be a dict of RoPE parameters, got {params!r}")
    resolved = dict(params)
    resolved.setdefault("rope_theta", theta)
    _set_partial_rotary_default(resolved, hf_config)
    return RopeSpec.from_hf(resolved, head_dim, max_positions)


def _gemma3_specs(hf_config: Mapping[str, Any], parameters: Mapping[str, Any], nested: list[str],
                  head_dim: int, max_positions: int) -> dict[str, RopeSpec]:
    """Gemma 3: its full-attention layers default to base 1e6, its sliding ones to 1e4; an older
    config's flat `rope_scaling` and `rope_theta` are the full layers', `rope_local_base_freq`
    the sliding layers' base."""
    if nested:
        full = parameters.get("full_attention") or {"rope_type": "default"}
        sliding = parameters.get("sliding_attention") or {"rope_type": "default"}
    else:
        full = {"rope_type": "default", **parameters}
        sliding = {"rope_type": "default"}
    full_theta = hf_config.get("rope_theta", FAMILY_THETA["gemma3_text"])
    sliding_theta = hf_config.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)
    return {
        "full_attention": _nested_spec(hf_config, full, "full_attention", full_theta, head_dim,
                                       max_positions),
        "sliding_attention": _nested_spec(hf_config, sliding, "sliding_attention", sliding_theta,
                                          head_dim, max_positions),
    }


# ---- tables --------------------------------------------------------------------------------


def _exponents(rotary_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """2i / rotary_dim for each rotated frequency i: theta ** this is its wavelength / 2pi."""
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim


def _plain_inverse_frequencies(rope: RopeSpec) -> torch.Tensor:
    return 1.0 / (rope.theta ** _exponents(rope.rotary_dim))


def _llama3_inverse_frequencies(rope: RopeSpec) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, the band between blended."""
    inv_freq = _plain_inverse_frequencies(rope)
    original, low, high = rope.original_max_positions, rope.low_freq_factor, rope.high_freq_factor
    low_freq_wavelength = original / low
    high_freq_wavelength = original / high
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelength < high_freq_wavelength) * ~(wavelength > low_freq_wavelength)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inverse_frequencies(rope: RopeSpec) -> torch.Tensor:
    """Frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those that turn more than beta_fast times are kept, with a
    linear ramp between."""
    dim = rope.rotary_dim

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    wavelengths = rope.theta ** _exponents(dim)
    extrapolated = 1.0 / wavelengths
    interpolated = 1.0 / (rope.factor * wavelengths)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def _longrope_inverse_frequencies(per_frequency: tuple[float, ...], rope: RopeSpec
                                  ) -> torch.Tensor:
    factors = torch.tensor(per_frequency, dtype=torch.float32)
    return 1.0 / (factors * rope.theta ** _exponents(rope.rotary_dim))


@functools.cache
def _inverse_frequencies(rope: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(inverse frequencies within the original context, those past it) on the CPU in fp32, as
    transformers builds its buffers; the two are the same tensor unless the type's tables depend
    on the length (dynamic NTK's past-the-context ones are computed per call instead)."""
    # Built outside inference mode even when first asked for during generation: the cached
    # tables then serve training forwards too, where an inference tensor may not enter autograd.
    with torch.inference_mode(False):
        if rope.kind == "linear":
            within = _plain_inverse_frequencies(rope) / rope.factor
        elif rope.kind == "llama3":
            within = _llama3_inverse_frequencies(rope)
        elif rope.kind == "yarn":
            within = _yarn_inverse_frequencies(rope)
        elif rope.kind == "longrope":
            return (_longrope_inverse_frequencies(rope.short_factor, rope),
                    _longrope_inverse_frequencies(rope.long_factor, rope))
        elif rope.kind == "dynamic":
            # transformers' table up to max_position_embeddings: its growth formula at that
            # length, in float64 arithmetic (1 up to rounding), then fp32 like the plain one.
            dim, limit = rope.rotary_dim, rope.original_max_positions
            theta = rope.theta * ((rope.factor * limit / limit) - (rope.factor - 1)) ** (
                dim / (dim - 2))
            within = 1.0 / (theta ** _exponents(dim))
        else:
            within = _plain_inverse_frequencies(rope)
        return within, within


@functools.lru_cache(maxsize=64)
def _device_inverse_frequencies(rope: RopeSpec, device: torch.device
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):
        within, beyond = _inverse_frequencies(rope)
        return within.to(device), beyond.to(device)


def _length_dependent_inverse_frequencies(positions: torch.Tensor, rope: RopeSpec,
                                          within: torch.Tensor, beyond: torch.Tensor
                                          ) -> torch.Tensor:
    """The inverse frequencies for a forward whose longest length is max(positions) + 1, chosen
    on the device (no host sync): past `original_max_positions`, longrope's long ones and dynamic
    NTK's base grown to base * (factor * length / max - (factor - 1)) ** (d / (d - 2))."""
    length = positions.max() + 1
    limit = rope.original_max_positions
    if rope.kind == "dynamic":
        dim = rope.rotary_dim
        grown = torch.clamp(length, min=limit)
        base = rope.theta * ((rope.factor * grown / limit) - (rope.factor - 1)) ** (dim / (dim - 2))
        beyond = 1.0 / (base ** _exponents(dim, positions.device))
    return torch.where(length > limit, beyond, within)


def rotary_tables(positions: torch.Tensor, rope: RopeSpec, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [B, 1, T, rotary_dim], for positions [B, T]: computed in fp32, scaled by
    the type's attention factor, then cast to `dtype`, as transformers' rotary embeddings do.

    For dynamic NTK and longrope the frequencies follow the forward's longest length,
    max(positions) + 1 over the whole tensor (all rows). transformers' dynamic RoPE also keeps
    the longest length it has seen (a later, shorter forward past max_position_embeddings still
    uses the longer one's frequencies); these tables are stateless per call, which is the same
    while positions only grow, as in decoding."""
    within, beyond = _device_inverse_frequencies(rope, positions.device)
    if rope.depends_on_length:
        inv_freq = _length_dependent_inverse_frequencies(positions, rope, within, beyond)
    else:
        inv_freq = within
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    cos, sin = angles.cos(), angles.sin()
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, head_dim] rotated by the tables (HF Llama's half-rotation convention) on its
    first rotary_dim = cos.shape[-1] dims, the rest passed through; returned in x's dtype, so
    tables kept in fp32 (OLMo 2 rotates in fp32) give a rotation computed in fp32."""
    rotary_dim = cos.shape[-1]
    rotated_part = x if rotary_dim == x.shape[-1] else x[..., :rotary_dim]
    half = rotary_dim // 2
    turned = torch.cat((-rotated_part[..., half:], rotated_part[..., :half]), dim=-1)
    rotated = (rotated_part * cos + turned * sin).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
