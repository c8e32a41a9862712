"""Rewinding a replica's served weights (sync/history.py): through the real update codec, a bf16
and an fp32 model rewound to any recorded version hold that version's weights bit for bit, and
come back exactly, also when the block raises."""

from __future__ import annotations

import pytest
import torch

from decentrl.model.loading import LoadedModel
from decentrl.model.stages import StageModule, StagePlan, build_stage
from decentrl.sync.delta import (
    PublishedState,
    TensorChange,
    apply_payload,
    decode_payload,
    encode_delta,
    payload_bytes,
)
from decentrl.sync.history import UpdateHistory, VersionUnavailable

UPDATES = 5
DENSITY = 0.05


def bits(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of the raw bits (bit-for-bit comparisons: -0.0 is not 0.0, NaN equals itself)."""
    ints = {2: torch.int16, 4: torch.int32}
    return {name: t.detach().view(ints[t.element_size()]).clone() for name, t in tensors.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


class Replica:
    """A served stage following a publisher through encoded updates, as `StagePeer` does."""

    def __init__(self, model: LoadedModel, dtype: torch.dtype, keep: int) -> None:
        plan = StagePlan.even(model.spec.num_layers, 2)
        stage: StageModule = build_stage(model.spec, plan, 0, model.tensors,
                                         torch.device("cpu"), torch.float32)
        self.trainer = {name: t.clone() for name, t in stage.state_dict().items()}
        self.publisher = PublishedState.of(0, self.trainer)
        self.published = PublishedState.of(0, self.trainer)
        self.model = stage.to(dtype)
        self.history = UpdateHistory(keep)
        self.snapshots = {0: bits(self.params)}
        self.changed_entries = 0

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def update(self, version: int, g: torch.Generator) -> None:
        # Optimizer-like steps: the same entries keep moving, so updates overlap.
        for name, t in self.trainer.items():
            t += 1e-2 * torch.randn(t.shape, generator=g) * (t.abs() > t.abs().median())
        payload = encode_delta(self.publisher, self.trainer, DENSITY)
        apply_payload(self.publisher, payload, version)
        data = payload_bytes(payload)
        changes = apply_payload(self.published, decode_payload(
            data, {n: t.shape for n, t in self.published.tensors.items()}), version)
        with torch.no_grad():
            for name, change in changes.items():
                change.write(self.params[name], change.values)
        self.history.record(version, changes)
        self.snapshots[version] = bits(self.params)
        self.changed_entries += sum(c.values.numel() for c in changes.values())


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def replica(request: pytest.FixtureRequest, tiny_model: LoadedModel) -> Replica:
    replica = Replica(tiny_model, request.param, keep=UPDATES)
    g = torch.Generator().manual_seed(0)
    for version in range(1, UPDATES + 1):
        replica.update(version, g)
    return replica


def test_rewound_to_every_recorded_version_holds_its_weights_bit_for_bit(
        replica: Replica) -> None:
    assert replica.history.oldest_version(UPDATES) == 0
    for target in range(UPDATES, -1, -1):
        with replica.history.rewound(replica.params, UPDATES, target):
            assert same_bits(bits(replica.params), replica.snapshots[target])
        assert same_bits(bits(replica.params), replica.snapshots[UPDATES])
    # The updates overlapped and did change the served weights at every version.
    assert all(not same_bits(replica.snapshots[v], replica.snapshots[v + 1])
               for v in range(UPDATES))


def test_an_exception_inside_the_block_still_restores(replica: Replica) -> None:
    with pytest.raises(RuntimeError, match="verifier crashed"), \
            replica.history.rewound(replica.params, UPDATES, 1):
        assert same_bits(bits(replica.params), replica.snapshots[1])
        raise RuntimeError("verifier crashed")
    assert same_bits(bits(replica.params), replica.snapshots[UPDATES])


def test_targets_out_of_reach_raise_before_writing(tiny_model: LoadedModel) -> None:
    replica = Replica(tiny_model, torch.bfloat16, keep=3)
    g = torch.Generator().manual_seed(0)
    for version in range(1, UPDATES + 1):
        replica.update(version, g)
    assert replica.history.oldest_version(UPDATES) == UPDATES - 3
    for target in (UPDATES + 1, UPDATES - 4, -1):
        with pytest.raises(VersionUnavailable, match=f"to version {target}: versions 2..5"):
            replica.history.rewound(replica.params, UPDATES, target)
    assert same_bits(bits(replica.params), replica.snapshots[UPDATES])
    with replica.history.rewound(replica.params, UPDATES, UPDATES - 3):
        assert same_bits(bits(replica.params), replica.snapshots[UPDATES - 3])
    # Weights at another version than the last recorded one have no history behind them.
    assert replica.history.oldest_version(UPDATES + 1) == UPDATES + 1
    with pytest.raises(ValueError, match="lacks"):
        replica.history.rewound({}, UPDATES, UPDATES - 1)


def test_a_keyframe_or_a_gap_starts_the_history_over() -> None:
    history = UpdateHistory(keep=4)
    sparse = {"w": TensorChange(torch.tensor([1, 3]), torch.ones(2), torch.zeros(2))}
    for version in (1, 2, 3):
        history.record(version, sparse)
    assert history.oldest_version(3) == 0
    history.record(4, {**sparse, "v": TensorChange(None, torch.ones(8), torch.zeros(8))})
    assert history.oldest_version(4) == 4 and history.nbytes == 0
    history.record(5, sparse)
    assert history.oldest_version(5) == 4
    history.record(9, sparse)  # versions 6-8 came some other way
    assert history.oldest_version(9) == 8
    assert UpdateHistory(keep=0).oldest_version(3) == 3


def test_history_keeps_changed_entries_not_copies(replica: Replica) -> None:
    # An int64 index and two float32 values per changed entry, nothing else.
    assert replica.history.nbytes == 16 * replica.changed_entries
    full_copies = UPDATES * sum(t.numel() * 4 for t in replica.params.values())
    assert replica.history.nbytes < 0.25 * full_copies
