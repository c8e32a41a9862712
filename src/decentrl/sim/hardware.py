"""What a stage's work costs on a given machine: seconds of a decode step, a prefill and a training
step, and GiB of memory, from a roofline over the machine's peak matmul rate and memory bandwidth.

The roofline: a step takes the longer of moving its bytes (weights, KV cache, activations) at the
effective bandwidth and doing its FLOPs at the effective matmul rate, plus a fixed overhead per
layer and per forward (kernel launches and Python, which dominate a small model's decode). The
effective figures are the peaks times an efficiency; the defaults per kind below are estimates, and
the simulator calibrates them against measured runs (`measure_host` measures this machine).

sim/machines.py lists the consumer machines a swarm is made of (`HARDWARE`), each figure with its
source. Every cost here is a pure function of the profile and the model's shape (sim/shapes.py)."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from decentrl.sim.shapes import ModelShape

Kind = Literal["nvidia", "amd", "apple", "cpu"]
Role = Literal["inference", "training"]
Bound = Literal["memory", "compute"]
GIB = 2**30

# Share of the peak matmul rate that a stage's matmuls reach (estimated, per kind):
# - nvidia 0.70: cuBLAS reaches 70-90% of the tensor cores' fp32-accumulate peak on large bf16
#   GEMMs; a stage's GEMMs are smaller and interleaved with attention and elementwise kernels.
# - amd 0.45: the RX 7000 peak counts dual-issued WMMA, which rocBLAS/hipBLASLt sustain only in
#   part; reported bf16 GEMMs reach about half of it.
# - apple 0.55: MPS matmuls reach about half to two thirds of the GPU's ALU peak.
# - cpu 0.60: oneDNN/MKL GEMMs reach 70-80% of the FMA peak at the all-core clock, less with the
#   bf16 conversions and the threads a peer leaves to its networking.
MATMUL_EFFICIENCY: dict[Kind, float] = {"nvidia": 0.70, "amd": 0.45, "apple": 0.55, "cpu": 0.60}
# Share of the memory bandwidth that a memory-bound step (decode, the optimizer) reaches:
# - nvidia 0.80, amd 0.70: GEMV-style decode kernels reach 75-90% of the GDDR's spec rate on
#   NVIDIA, less on ROCm.
# - apple 0.70: the GPU reaches 70-90% of the unified memory's rate in copy benchmarks, less
#   through MPS.
# - cpu 0.65: STREAM on dual-channel DDR5 reaches 60-70% of the theoretical rate.
BANDWIDTH_EFFICIENCY: dict[Kind, float] = {"nvidia": 0.80, "amd": 0.70, "apple": 0.70,
                                           "cpu": 0.65}
# Fixed seconds per decoder layer of a forward (estimated): decentrl's eager decoder launches
# about 25-30 kernels a layer at about 4-5 us of Python and launch each on CUDA/ROCm, more
# through MPS's command buffers; a CPU op costs its dispatch only.
LAYER_OVERHEAD_S: dict[Kind, float] = {"nvidia": 120e-6, "amd": 150e-6, "apple": 250e-6,
                                       "cpu": 40e-6}
# Fixed seconds per forward (estimated): the stage's entry (RoPE tables, masks, the KV cache's
# bookkeeping), sampling or the hand-off of the hidden state, and the device synchronisation.
FORWARD_OVERHEAD_S: dict[Kind, float] = {"nvidia": 1.5e-3, "amd": 2e-3, "apple": 3e-3,
                                         "cpu": 0.5e-3}
# Device memory a process cannot give the model (estimated): the CUDA/HIP context and the
# allocator's slack. Apple and CPU figures are already the share usable for the model.
RESERVE_GIB: dict[Kind, float] = {"nvidia": 0.5, "amd": 0.5, "apple": 0.0, "cpu": 0.0}

# A training peer's bytes per trained parameter (stage/verification.py): fp32 weights, gradients,
# AdamW's two moments and the published state, 4 bytes each.
TRAINING_BYTES_PER_PARAMETER = 20
# Memory traffic of a forward and backward per parameter (estimated): the fp32 master weights
# read and cast for the forward, the cast copy read again for the input gradient, the fp32
# gradient read and written as it accumulates.
FORWARD_BACKWARD_BYTES_PER_PARAMETER = 16
# Memory traffic of torch.optim.AdamW's step per parameter (estimated): the fused kernel reads the
# weight, gradient and two moments and writes three of them back (28 bytes); the default
# (foreach) implementation makes several elementwise passes, about 72 bytes.
ADAMW_BYTES_PER_PARAMETER = 72


@dataclass(frozen=True)
class StepCost:
    """The parts of one step's time: moving its bytes, doing its FLOPs (the longer wins), the
    fixed overhead, and (training) the optimizer's pass."""

    memory_s: float
    compute_s: float
    overhead_s: float
    optimizer_s: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.overhead_s + self.optimizer_s

    @property
    def bound(self) -> Bound:
        """Which side of the roofline the step is on."""
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass(frozen=True)
class HardwareProfile:
    """One machine as the simulator sees it. `memory_gib`: the GPU's memory, or the share of a
    Mac's unified memory or a PC's RAM the model may use. `peak_tflops`: dense fp16/bf16 matmul
    with fp32 accumulation (what PyTorch's bf16 matmuls run; GeForce cards do it at half their
    fp16-accumulate rate), or the FMA peak of a CPU. `bandwidth_gbs`: memory bandwidth, GB/s.
    `sources`: where the figures come from; `notes`: which are estimated, and how.
    `compute_bytes`: bytes per weight and KV value in the compute dtype decentrl picks there
    (device.py compute_dtype: bf16 where it runs natively, else fp32). The efficiencies and
    overheads default to the kind's (see the tables above)."""

    name: str
    kind: Kind
    memory_gib: float
    peak_tflops: float
    bandwidth_gbs: float
    sources: tuple[str, ...]
    notes: str = ""
    compute_bytes: int = 2
    matmul_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    layer_overhead_s: float | None = None
    forward_overhead_s: float | None = None
    reserve_gib: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in MATMUL_EFFICIENCY:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of "
                             f"{tuple(MATMUL_EFFICIENCY)}")
        defaults = {"matmul_efficiency": MATMUL_EFFICIENCY, "bandwidth_efficiency":
                    BANDWIDTH_EFFICIENCY, "layer_overhead_s": LAYER_OVERHEAD_S,
                    "forward_overhead_s": FORWARD_OVERHEAD_S, "reserve_gib": RESERVE_GIB}
        for field, table in defaults.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, table[self.kind])
        figures = {"memory_gib": self.memory_gib, "peak_tflops": self.peak_tflops,
                   "bandwidth_gbs": self.bandwidth_gbs}
        bad = {name: value for name, value in figures.items()
               if not (math.isfinite(value) and value > 0)}
        if bad:
            raise ValueError(f"{self.name}: figures must be positive and finite, got {bad}")
        for name in ("matmul_efficiency", "bandwidth_efficiency"):
            if not 0 < self._figure(name) <= 1:
                raise ValueError(f"{self.name}: {name} must be in (0, 1], got "
                                 f"{getattr(self, name)}")
        if self.compute_bytes not in (2, 4):
            raise ValueError(f"{self.name}: compute_bytes is 2 (bf16/fp16) or 4 (fp32), got "
                             f"{self.compute_bytes}")
        if not self.sources:
            raise ValueError(f"{self.name}: a profile needs at least one source")

    def _figure(self, name: str) -> float:
        value = getattr(self, name)
        assert value is not None  # filled in by __post_init__
        return float(value)

    @property
    def flops(self) -> float:
        """FLOP/s a stage's matmuls reach here."""
        return self.peak_tflops * 1e12 * self._figure("matmul_efficiency")

    @property
    def bytes_per_s(self) -> float:
        """Bytes/s a memory-bound step moves here."""
        return self.bandwidth_gbs * 1e9 * self._figure("bandwidth_efficiency")

    @property
    def usable_gib(self) -> float:
        """Memory the model may fill: `memory_gib` less the runtime's reserve."""
        return self.memory_gib - self._figure("reserve_gib")

    def forward_overhead(self, layers: int) -> float:
        """The fixed seconds of one forward through `layers` layers."""
        return layers * self._figure("layer_overhead_s") + self._figure("forward_overhead_s")

    # ---- inference ---------------------------------------------------------------------------

    def _read_weight_bytes(self, shape: ModelShape, layers: int, first: bool, last: bool,
                           positions: int) -> float:
        """Weight bytes a forward of `positions` positions reads: every matrix once, but of the
        embedding only the rows of its tokens."""
        table = shape.embedding_parameters * first
        weights = shape.stage_parameters(layers, first, last) - table
        return (weights + positions * shape.hidden * first) * self.compute_bytes

    def decode_step_cost(self, shape: ModelShape, layers: int, batch: int, context: int,
                         first: bool, last: bool) -> StepCost:
        """One decode step of `batch` sequences, each attending to `context` positions (the new
        one included): the stage's weights and the batch's KV cache read once, the FLOPs of
        `batch` positions."""
        if batch < 1:
            raise ValueError(f"a decode step needs a batch of at least 1, got {batch}")
        kv = shape.kv_bytes(layers, batch * context, self.compute_bytes)
        moved = self._read_weight_bytes(shape, layers, first, last, batch) + kv
        flops = batch * shape.forward_flops_per_token(layers, context, last=last)
        return StepCost(moved / self.bytes_per_s, flops / self.flops,
                        self.forward_overhead(layers))

    def decode_step_s(self, shape: ModelShape, layers: int, batch: int, context: int,
                      first: bool, last: bool) -> float:
        return self.decode_step_cost(shape, layers, batch, context, first, last).seconds

    def prefill_cost(self, shape: ModelShape, layers: int, tokens: int, first: bool, last: bool,
                     *, batch: int = 1, past: int = 0) -> StepCost:
        """A prefill of `tokens` new positions in each of `batch` sequences after `past` cached
        ones: the weights read once, the cached keys and values read, the new ones written."""
        if batch < 1:
            raise ValueError(f"a prefill needs a batch of at least 1, got {batch}")
        kv = shape.kv_bytes(layers, batch * (past + tokens), self.compute_bytes)
        moved = self._read_weight_bytes(shape, layers, first, last, batch * tokens) + kv
        flops = batch * shape.forward_flops(layers, tokens, last=last, past=past)
        return StepCost(moved / self.bytes_per_s, flops / self.flops,
                        self.forward_overhead(layers))

    def prefill_s(self, shape: ModelShape, layers: int, tokens: int, first: bool, last: bool,
                  *, batch: int = 1, past: int = 0) -> float:
        return self.prefill_cost(shape, layers, tokens, first, last, batch=batch,
                                 past=past).seconds

    # ---- training ----------------------------------------------------------------------------

    def train_step_cost(self, shape: ModelShape, layers: int, tokens: int, first: bool,
                        last: bool, *, sequence_length: int | None = None) -> StepCost:
        """A training step over `tokens` positions, cut into sequences of `sequence_length`
        (default: one sequence): the forward and backward at 3x the forward's FLOPs, their
        traffic (the weights and gradients, the saved activations written and read back), then
        AdamW's pass over the stage's fp32 state at bandwidth."""
        length = tokens if sequence_length is None else sequence_length
        if tokens < 1 or length < 1:
            raise ValueError(f"need tokens >= 1 and sequence_length >= 1, got {tokens} and "
                             f"{sequence_length}")
        whole, rest = divmod(tokens, length)
        forward = whole * shape.forward_flops(layers, length, last=last)
        if rest:
            forward += shape.forward_flops(layers, rest, last=last)
        parameters = shape.stage_parameters(layers, first, last)
        activations = 2 * tokens * shape.activation_bytes_per_token(layers, last=last)
        moved = parameters * FORWARD_BACKWARD_BYTES_PER_PARAMETER + activations
        # The backward launches about twice the forward's kernels.
        overhead = 3 * layers * self._figure("layer_overhead_s") \
            + 2 * self._figure("forward_overhead_s")
        return StepCost(moved / self.bytes_per_s, 3 * forward / self.flops, overhead,
                        self.optimizer_step_s(shape, layers, first, last))

    def train_step_s(self, shape: ModelShape, layers: int, tokens: int, first: bool, last: bool,
                     *, sequence_length: int | None = None) -> float:
        return self.train_step_cost(shape, layers, tokens, first, last,
                                    sequence_length=sequence_length).seconds

    def optimizer_step_s(self, shape: ModelShape, layers: int, first: bool, last: bool) -> float:
        """AdamW's step over a stage's parameters: memory-bound, at ADAMW_BYTES_PER_PARAMETER."""
        parameters = shape.stage_parameters(layers, first, last)
        return parameters * ADAMW_BYTES_PER_PARAMETER / self.bytes_per_s

    # ---- memory ------------------------------------------------------------------------------

    def memory_needed_gib(self, shape: ModelShape, layers: int, role: Role, first: bool,
                          last: bool, *, kv_tokens: int = 0, train_tokens: int = 0,
                          verifies: bool = False) -> float:
        """GiB a stage needs here. An inference replica: its weights in the compute dtype and a
        KV budget of `kv_tokens` positions (summed over the sessions it holds). A training peer:
        TRAINING_BYTES_PER_PARAMETER a parameter, autocast's bf16 copies of the weights (where it
        computes in bf16), the activations of `train_tokens` positions kept for the backward,
        and with `verifies` (trust.training_peer_verifies) a copy of the served weights."""
        parameters = shape.stage_parameters(layers, first, last)
        if role == "inference":
            needed = parameters * self.compute_bytes \
                + shape.kv_bytes(layers, kv_tokens, self.compute_bytes)
        elif role == "training":
            autocast_copies = parameters * 2 if self.compute_bytes == 2 else 0
            needed = (parameters * TRAINING_BYTES_PER_PARAMETER + autocast_copies
                      + train_tokens * shape.activation_bytes_per_token(layers, last=last)
                      + parameters * self.compute_bytes * verifies)
        else:
            raise ValueError(f"role must be 'inference' or 'training', got {role!r}")
        return needed / GIB

    def fits(self, shape: ModelShape, layers: int, role: Role, first: bool, last: bool, *,
             kv_tokens: int = 0, train_tokens: int = 0, verifies: bool = False) -> bool:
        """Whether the stage fits in the memory usable here."""
        return self.memory_needed_gib(shape, layers, role, first, last, kv_tokens=kv_tokens,
                                      train_tokens=train_tokens,
                                      verifies=verifies) <= self.usable_gib


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls of `run` (warm it first where it matters)."""
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def _physical_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (AttributeError, ValueError, OSError) as error:
        raise RuntimeError("cannot read this machine's physical memory: pass memory_gib") \
            from error


def measure_host(threads: int, *, sizes: tuple[int, ...] = (256, 512, 1024),
                 copy_mib: int = 256, repeats: int = 5,
                 memory_gib: float | None = None) -> HardwareProfile:
    """This machine's CPU with torch on `threads` threads: the best over `sizes` of a warmed
    fp32 n x n matmul's FLOP/s and a `copy_mib` MiB tensor copy's bytes/s (read plus write), each
    the median of `repeats` runs. Efficiencies are 1.0, the measured rates being what the host
    reaches; the simulator calibrates the rest. `memory_gib`: the RAM the model may use
    (default: all of the physical memory). Leaves torch's thread count as it found it."""
    import torch

    if threads < 1 or repeats < 1 or copy_mib < 1 or not sizes:
        raise ValueError("need threads, repeats and copy_mib >= 1 and at least one size")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = 0.0
        for size in sizes:
            a, b = torch.randn(size, size), torch.randn(size, size)
            out = torch.empty(size, size)
            torch.mm(a, b, out=out)  # warm-up: thread pool, kernel choice, pages
            seconds = median_seconds(lambda: torch.mm(a, b, out=out), repeats)
            flops = max(flops, 2 * size**3 / seconds)
        source = torch.ones(copy_mib * 2**20 // 4)
        target = torch.empty_like(source)
        target.copy_(source)
        seconds = median_seconds(lambda: target.copy_(source), repeats)
        bytes_per_s = 2 * source.numel() * 4 / seconds
    finally:
        torch.set_num_threads(previous)
    return HardwareProfile(
        name="this host", kind="cpu",
        memory_gib=_physical_memory_gib() if memory_gib is None else memory_gib,
        peak_tflops=flops / 1e12, bandwidth_gbs=bytes_per_s / 1e9,
        sources=("measured: sim/hardware.py measure_host",),
        notes=f"measured with torch on {threads} threads: fp32 matmul at sizes {sizes}, a "
              f"{copy_mib} MiB copy; median of {repeats}",
        compute_bytes=4, matmul_efficiency=1.0, bandwidth_efficiency=1.0,
    )
