"""What one stage costs on one peer: seconds of compute (sim/hardware.py's roofline on the
stage's layers of sim/shapes.py's model) and bytes on the wire, the single place the event loop
asks. `speed` scales the hardware's compute per kind of work (the calibration's fitted factors,
sim/calibration.py), so the same cost model serves the loopback demo's shared CPU and a
projection's GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from decentrl.net.wire import ActivationCodec
from decentrl.sim.hardware import HardwareProfile
from decentrl.sim.shapes import ModelShape

# A token id or a position on the wire (int64), and a key-valid flag.
ID_BYTES, FLAG_BYTES = 8, 1
# The CPU seconds of sampling per logit: the seeded noise is drawn on the CPU whatever the device
# (rollout/sampling.py sampling_noise), rows x vocabulary of it per decoding step. Measured on
# the development machine's CPU, one thread (sim/calibration.py sampling_seconds_per_logit).
SAMPLING_S_PER_LOGIT = 1.2e-8
# A training peer's checkpoint (stage/training.py `_save`): its float32 weights, Adam's two
# moments and the served bf16 copy, written and the weights file hashed.
CHECKPOINT_BYTES_PER_PARAMETER = 4 + 8 + 2
# Seconds per byte to write and hash it where the host was not measured: a consumer NVMe drive
# writing about 1 GB/s (sim/calibration.py checkpoint_seconds_per_byte measures this host's).
CHECKPOINT_S_PER_BYTE = 1e-9


@dataclass(frozen=True)
class Speed:
    """Multiplies a profile's roofline throughput per kind of work: the calibration's fitted
    factors (sim/calibration.py), which also absorb what the roofline does not model (bf16
    kernels on a CPU, threads)."""

    decode: float = 1.0
    prefill: float = 1.0
    train: float = 1.0

    def __post_init__(self) -> None:
        if min(self.decode, self.prefill, self.train) <= 0:
            raise ValueError(f"speeds must be positive, got {self}")


@dataclass(frozen=True)
class StageCosts:
    profile: HardwareProfile
    shape: ModelShape
    layers: int
    first: bool
    last: bool
    codec: ActivationCodec = "fp32"
    speed: Speed = Speed()
    sampling_s_per_logit: float = SAMPLING_S_PER_LOGIT
    checkpoint_s_per_byte: float = CHECKPOINT_S_PER_BYTE

    def forward_s(self, rows: int, positions: int, context: int) -> float:
        """One inference forward of `rows` rows of `positions` new positions each (a batch's
        mean) after `context` cached ones: a decoding step when each row has one new position,
        a prefill otherwise."""
        if positions == 1:
            return self.profile.decode_step_s(self.shape, self.layers, rows, context + 1,
                                              self.first, self.last) / self.speed.decode
        return self.profile.prefill_s(self.shape, self.layers, positions, self.first,
                                      self.last, batch=rows, past=context) / self.speed.prefill

    def sampling_s(self, draws: int) -> float:
        """The last stage's seeded draws (or, re-executing, scores) of `draws` tokens: CPU work
        over the whole vocabulary each; nothing at other stages."""
        return draws * self.shape.vocab * self.sampling_s_per_logit if self.last else 0.0

    def train_forward_s(self, tokens: int, rows: int) -> float:
        """A training micro-batch's forward of `rows` rows, `tokens` in all: a third of forward
        and backward's compute."""
        return self._train_compute_s(tokens, rows) / 3

    def train_backward_s(self, tokens: int, rows: int) -> float:
        return 2 * self._train_compute_s(tokens, rows) / 3

    def optimizer_s(self) -> float:
        """The optimizer's pass over the stage's parameters."""
        return self.profile.optimizer_step_s(self.shape, self.layers, self.first,
                                             self.last) / self.speed.train

    def checkpoint_s(self) -> float:
        """Saving the stage's training state (every `train.checkpoint_every` steps)."""
        parameters = self.shape.stage_parameters(self.layers, self.first, self.last)
        return parameters * CHECKPOINT_BYTES_PER_PARAMETER * self.checkpoint_s_per_byte

    def _train_compute_s(self, tokens: int, rows: int) -> float:
        step = self.profile.train_step_s(self.shape, self.layers, tokens, self.first, self.last,
                                         sequence_length=max(1, tokens // rows))
        return step / self.speed.train - self.optimizer_s()

    def input_bytes(self, positions: int) -> int:
        """A stage's input for `positions` positions: token ids at stage 0, hidden states after,
        with their position ids and key flags."""
        per = ID_BYTES if self.first else self.shape.hidden_state_bytes(self.codec)
        return positions * (per + ID_BYTES + FLAG_BYTES)

    def output_bytes(self, positions: int) -> int:
        """Its reply for `positions` new positions: their hidden states; at the last stage
        (`positions` being its rows) a token and a log-prob per row."""
        if self.last:
            return positions * (ID_BYTES + 4)
        return positions * self.shape.hidden_state_bytes(self.codec)
