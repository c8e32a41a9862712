"""The simulator's hardware cost models (sim/hardware.py) and machine table (sim/machines.py): the
roofline's regimes, monotonicity, what fits where, and this host's measurement."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from decentrl.sim.hardware import HardwareProfile, StepCost, measure_host
from decentrl.sim.machines import HARDWARE
from decentrl.sim.shapes import LLAMA_8B, SMOLLM2_135M

GPUS = [profile for profile in HARDWARE.values() if profile.kind != "cpu"]
SHAPES = [SMOLLM2_135M, LLAMA_8B]


def test_the_table_covers_the_brief() -> None:
    names = " ".join(profile.name for profile in HARDWARE.values())
    for model in ("RTX 3060 12GB", "RTX 3070", "RTX 3080 10GB", "RTX 3090", "RTX 4060",
                  "RTX 4060 Ti 16GB", "RTX 4070", "RTX 4070 Ti SUPER", "RTX 4080", "RTX 4090",
                  "RTX 5090", "RX 7900 XTX", "M1", "M2 Pro", "M3 Max", "M4 Pro", "Ryzen",
                  "Core i7"):
        assert model in names
    assert sum(profile.kind == "cpu" for profile in HARDWARE.values()) >= 2


@pytest.mark.parametrize("key", sorted(HARDWARE))
def test_every_entry_has_sources_and_positive_figures(key: str) -> None:
    profile = HARDWARE[key]
    assert profile.sources and all(source.startswith("https://") for source in profile.sources)
    for figure in (profile.memory_gib, profile.peak_tflops, profile.bandwidth_gbs,
                   profile.usable_gib, profile.flops, profile.bytes_per_s):
        assert math.isfinite(figure) and figure > 0
    assert profile.kind in ("nvidia", "amd", "apple", "cpu")


def test_a_profile_refuses_bad_figures() -> None:
    good = HARDWARE["rtx-4090"]
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(good, bandwidth_gbs=0)
    with pytest.raises(ValueError, match="source"):
        dataclasses.replace(good, sources=())
    with pytest.raises(ValueError, match="efficiency"):
        dataclasses.replace(good, matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="kind"):
        dataclasses.replace(good, kind="tpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("profile", GPUS, ids=lambda profile: profile.name)
def test_decode_at_batch_1_is_bandwidth_bound_on_every_gpu(profile: HardwareProfile) -> None:
    for shape, (first, last) in itertools.product(SHAPES, [(True, False), (False, False),
                                                          (False, True)]):
        for context in (1, 512, 4096):
            cost = profile.decode_step_cost(shape, 4, batch=1, context=context, first=first,
                                            last=last)
            assert cost.bound == "memory"
            assert cost.seconds == profile.decode_step_s(shape, 4, 1, context, first, last)


@pytest.mark.parametrize("profile", HARDWARE.values(), ids=lambda profile: profile.name)
def test_a_large_prefill_is_compute_bound(profile: HardwareProfile) -> None:
    cost = profile.prefill_cost(LLAMA_8B, 8, tokens=4096, first=False, last=False)
    assert cost.bound == "compute"
    assert profile.prefill_cost(LLAMA_8B, 8, 2048, False, False, batch=8).bound == "compute"


def test_decode_turns_compute_bound_with_a_large_batch() -> None:
    profile = HARDWARE["rtx-3060-12gb"]
    assert profile.decode_step_cost(LLAMA_8B, 4, 1, 64, False, False).bound == "memory"
    assert profile.decode_step_cost(LLAMA_8B, 4, 512, 64, False, False).bound == "compute"


def test_decode_time_of_a_whole_8b_model_on_a_4090() -> None:
    # bf16 weights (but the embedding table: one row of it) 15 GB at 0.8 x 1008 GB/s: about
    # 19 ms a token, plus the overheads.
    cost = HARDWARE["rtx-4090"].decode_step_cost(LLAMA_8B, 32, 1, 1, True, True)
    read = LLAMA_8B.checkpoint_parameters() - LLAMA_8B.embedding_parameters
    assert cost.memory_s == pytest.approx(2 * read / (0.8 * 1008e9), rel=1e-3)
    assert cost.overhead_s == pytest.approx(32 * 120e-6 + 1.5e-3)


def work(profile: HardwareProfile) -> list[float]:
    """A spread of steps' seconds: decode, prefill and training, on both models."""
    return [seconds for shape in SHAPES for seconds in (
        profile.decode_step_s(shape, 4, 1, 256, True, False),
        profile.decode_step_s(shape, 4, 64, 2048, False, True),
        profile.prefill_s(shape, 4, 1024, False, False),
        profile.train_step_s(shape, 4, 4096, True, True, sequence_length=1024),
    )]


def test_a_faster_card_is_never_slower() -> None:
    compared = 0
    for slow, fast in itertools.permutations(HARDWARE.values(), 2):
        same_costs = slow.kind == fast.kind and slow.compute_bytes == fast.compute_bytes
        if same_costs and fast.peak_tflops >= slow.peak_tflops \
                and fast.bandwidth_gbs >= slow.bandwidth_gbs:
            compared += 1
            assert all(f <= s for f, s in zip(work(fast), work(slow), strict=True)), \
                (fast.name, slow.name)
    assert compared >= 20
    base = HARDWARE["rtx-4070"]
    for faster in (dataclasses.replace(base, peak_tflops=2 * base.peak_tflops),
                   dataclasses.replace(base, bandwidth_gbs=2 * base.bandwidth_gbs)):
        assert all(f <= s for f, s in zip(work(faster), work(base), strict=True))


def test_more_work_never_takes_less_time() -> None:
    profile = HARDWARE["m2-pro"]
    decode = [profile.decode_step_s(LLAMA_8B, 4, batch, context, False, False)
              for batch, context in ((1, 10), (1, 1000), (8, 1000), (64, 1000))]
    assert decode == sorted(decode)
    train = [profile.train_step_s(SMOLLM2_135M, layers, 2048, False, False)
             for layers in (1, 5, 10)]
    assert train == sorted(train)


def test_a_training_step_counts_backward_and_the_optimizer() -> None:
    profile = HARDWARE["rtx-3090"]
    cost = profile.train_step_cost(LLAMA_8B, 4, 8192, False, False, sequence_length=2048)
    forward = 4 * LLAMA_8B.forward_flops(4, 2048, last=False)
    assert cost.compute_s == pytest.approx(3 * forward / profile.flops)
    parameters = LLAMA_8B.stage_parameters(4, False, False)
    assert cost.optimizer_s == pytest.approx(parameters * 72 / profile.bytes_per_s)
    assert cost.seconds > cost.compute_s + cost.optimizer_s


def test_the_8b_training_peer_fits_a_24_gib_card_only_in_32_stages() -> None:
    card = HARDWARE["rtx-4090"]
    assert not card.fits(LLAMA_8B, 32, "training", True, True, train_tokens=4096)
    for first, last in ((True, False), (False, False), (False, True)):
        assert card.fits(LLAMA_8B, 1, "training", first, last, train_tokens=4096)
    # 20 bytes a parameter, plus the bf16 copies autocast keeps.
    whole = card.memory_needed_gib(LLAMA_8B, 32, "training", True, True)
    assert whole * 2**30 == pytest.approx(22 * LLAMA_8B.stage_parameters(32, True, True))


def test_inference_memory_is_weights_and_kv() -> None:
    card = HARDWARE["rtx-3060-12gb"]
    weights = LLAMA_8B.stage_parameters(8, False, False) * 2
    needed = card.memory_needed_gib(LLAMA_8B, 8, "inference", False, False, kv_tokens=10_000)
    assert needed * 2**30 == weights + 8 * 10_000 * 4096
    assert card.fits(LLAMA_8B, 8, "inference", False, False, kv_tokens=10_000)
    assert not card.fits(LLAMA_8B, 32, "inference", True, True)
    cpu = HARDWARE["core-i7-14700k"]  # computes in fp32: twice the bytes
    assert cpu.memory_needed_gib(LLAMA_8B, 8, "inference", False, False) * 2**30 == 2 * weights
    with pytest.raises(ValueError, match="role"):
        card.memory_needed_gib(LLAMA_8B, 8, "serving", False, False)  # type: ignore[arg-type]


def test_step_cost_takes_the_longer_side() -> None:
    assert StepCost(2.0, 1.0, 0.5).seconds == 2.5
    assert StepCost(1.0, 3.0, 0.5, optimizer_s=1.0).seconds == 4.5
    assert StepCost(1.0, 3.0, 0.0).bound == "compute"


def test_measure_host_returns_positive_figures() -> None:
    profile = measure_host(1, sizes=(32, 64), copy_mib=1, repeats=2)
    assert profile.name == "this host" and profile.kind == "cpu"
    for figure in (profile.peak_tflops, profile.bandwidth_gbs, profile.memory_gib):
        assert math.isfinite(figure) and figure > 0
    assert profile.matmul_efficiency == 1.0 and profile.bandwidth_efficiency == 1.0
    assert profile.decode_step_s(SMOLLM2_135M, 1, 1, 16, True, False) > 0
