"""Weight updates (sync/): the sparse int8 codec with error feedback, keyframes, and their
distribution to replicas over the swarm (chunks from each other, hashes checked, bad peers
banned, corrupt states never served)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from swarm_helpers import (
    Swarm,
    publisher_of,
    serving,
    start_swarm,
    tiny_run_config,
    weights_of,
)

from decentrl.config import parse_config
from decentrl.net.compute import Priority
from decentrl.net.node import PeerRefused
from decentrl.net.protocol import SYNC_CHUNK, ChunkRequest, ServedFidelity
from decentrl.net.wire import WireError, encode_struct
from decentrl.stage.peer import StagePeer
from decentrl.stage.replica import published_tensors
from decentrl.sync.delta import (
    PublishedState,
    Selection,
    SparseTensor,
    UpdatePayload,
    ValueFormat,
    apply_payload,
    bf16_bits,
    decode_payload,
    decode_varints,
    encode_delta,
    encode_keyframe,
    encode_varints,
    payload_bytes,
    select_served_changes,
    served_fidelity,
    state_hash,
)
from decentrl.sync.distribute import SyncError, make_update

# ---- the codec --------------------------------------------------------------------------------


def test_varints_round_trip_and_refuse_truncated_data() -> None:
    values = np.array([0, 1, 127, 128, 300, 16383, 16384, 2**31 - 1, 2**40, 5], dtype=np.uint64)
    data = encode_varints(values)
    assert np.array_equal(decode_varints(data, len(values)), values)
    assert len(encode_varints(np.array([127], dtype=np.uint64))) == 1
    assert len(encode_varints(np.array([128], dtype=np.uint64))) == 2
    with pytest.raises(WireError, match="complete varints"):
        decode_varints(data[:-1], len(values))
    with pytest.raises(WireError, match="complete varints"):
        decode_varints(data, len(values) + 1)


def random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": 0.1 * torch.randn(64, 48, generator=g),
            "b.weight": 0.1 * torch.randn(300, generator=g),
            "c.bias": 0.1 * torch.randn(7, generator=g)}


def shapes_of(state: PublishedState) -> dict[str, torch.Size]:
    return {name: t.shape for name, t in state.tensors.items()}


def send(publisher: PublishedState, replica: PublishedState, weights: dict[str, torch.Tensor],
         version: int, density: float, selection: Selection = "magnitude",
         values: ValueFormat = "int8_delta") -> int:
    """One update from publisher to replica through bytes, as the swarm does; returns its size."""
    payload = encode_delta(publisher, weights, density, selection, values)
    apply_payload(publisher, payload, version)
    publisher.hash = state_hash(publisher.tensors)
    data = payload_bytes(payload)
    apply_payload(replica, decode_payload(data, shapes_of(replica)), version)
    replica.hash = state_hash(replica.tensors)
    return len(data)


def gap(weights: dict[str, torch.Tensor], state: PublishedState) -> float:
    return max(float((weights[n] - state.tensors[n]).abs().max()) for n in weights)


def test_error_feedback_keeps_replica_bit_identical_and_the_gap_bounded() -> None:
    weights = random_state(0)
    publisher, replica = PublishedState.of(0, weights), PublishedState.of(0, weights)
    g = torch.Generator().manual_seed(1)
    drift = {n: 1e-3 * torch.randn(t.shape, generator=g) for n, t in weights.items()}
    gaps = []
    for version in range(1, 61):
        # Weights that keep moving the same way plus noise, like an optimizer's steps.
        weights = {n: t + drift[n] + 2e-4 * torch.randn(t.shape, generator=g)
                   for n, t in weights.items()}
        send(publisher, replica, weights, version, density=0.05)
        assert replica.hash == publisher.hash and replica.version == version
        assert all(torch.equal(replica.tensors[n], publisher.tensors[n]) for n in weights)
        gaps.append(gap(weights, publisher))
    # Bounded: the gap levels off instead of growing with the number of updates.
    assert max(gaps[40:]) < 1.5 * max(gaps[10:20])

    # Without error feedback (each update only the top 5% of that step's own change) the
    # untransmitted rest piles up: the gap keeps growing.
    naive, previous = PublishedState.of(0, random_state(0)), random_state(0)
    g = torch.Generator().manual_seed(1)
    naive_gaps, moving = [], random_state(0)
    for version in range(1, 61):
        moving = {n: t + drift[n] + 2e-4 * torch.randn(t.shape, generator=g)
                  for n, t in moving.items()}
        step_only = {n: naive.tensors[n] + (moving[n] - previous[n]) for n in moving}
        apply_payload(naive, encode_delta(naive, step_only, 0.05), version)
        previous = moving
        naive_gaps.append(gap(moving, naive))
    assert naive_gaps[-1] > 5 * gaps[-1]

    # Nothing is lost: once the weights stop, further updates carry the rest over.
    before = gap(weights, publisher)
    for version in range(61, 161):
        send(publisher, replica, weights, version, density=0.05)
    assert gap(weights, publisher) < 1e-2 * before
    assert replica.hash == publisher.hash


def test_delta_is_small_and_a_keyframe_restores_the_exact_state() -> None:
    weights = {**random_state(2), "big.weight": torch.randn(512, 512)}
    publisher, replica = PublishedState.of(0, weights), PublishedState.of(0, weights)
    moved = {n: t + 1e-3 * torch.randn(t.shape) for n, t in weights.items()}
    size = send(publisher, replica, moved, 1, density=0.01)
    # An int8 value and one or two bytes of index per entry sent, 1% of the entries: more than
    # 50x under dense bf16's two bytes per entry.
    assert size < 2 * publisher.numel() / 50
    late = PublishedState.of(0, {n: torch.zeros(t.shape) for n, t in weights.items()})
    keyframe = payload_bytes(encode_keyframe(publisher))
    apply_payload(late, decode_payload(keyframe, shapes_of(late)), 1)
    assert state_hash(late.tensors) == publisher.hash


def bad_sparse(**fields: object) -> bytes:
    good = dict(name="b.weight", count=2, index_gaps=encode_varints(np.array([3, 4])),
                values=bytes([1, 2]), scales=np.float32([0.1]).tobytes())
    return encode_struct(UpdatePayload(kind="delta", sparse=[SparseTensor(**{**good, **fields})]))


@pytest.mark.parametrize(("data", "error"), [
    (b"\x00garbage", "bad UpdatePayload message"),
    (bad_sparse(name="nope"), "unknown or repeated tensor 'nope'"),
    (bad_sparse(count=0), "0 entries"),
    (bad_sparse(values=bytes([1])), "2 entries with 1 value bytes"),
    (bad_sparse(scales=b""), "0 scale bytes"),
    (bad_sparse(index_gaps=encode_varints(np.array([3, 2**40]))), "index out of range"),
    (bad_sparse(index_gaps=encode_varints(np.array([298, 5]))), "index out of range"),
    (bad_sparse(scales=np.float32([np.nan]).tobytes()), "scales must be finite"),
    (encode_struct(UpdatePayload(kind="keyframe")), "do not match the stage's"),
    (bad_sparse(format="bf16_value", values=bytes(4)), "4 value bytes and 4 scale bytes, "
                                                       "expected 4 and 0"),
    (bad_sparse(format="bf16_value", values=bytes(3), scales=b""), "expected 4 and 0"),
    (bad_sparse(format="bf16_value", values=bf16_bits(torch.tensor([1.0, float("inf")])),
                scales=b""), "makes non-finite weights"),
    (bad_sparse(format="float64"), "bad UpdatePayload message"),
])
def test_bad_payloads_are_refused_and_change_nothing(data: bytes, error: str) -> None:
    state = PublishedState.of(0, random_state(3))
    before = {n: t.clone() for n, t in state.tensors.items()}
    with pytest.raises(WireError, match=error):
        apply_payload(state, decode_payload(data, shapes_of(state)), 1)
    assert state.version == 0
    assert all(torch.equal(before[n], state.tensors[n]) for n in before)


def bf16_differs(weights: dict[str, torch.Tensor], state: PublishedState) -> int:
    return sum(int((t.bfloat16() != state.tensors[n].bfloat16()).sum())
               for n, t in weights.items())


def test_served_changes_selection_picks_only_entries_whose_bf16_value_changes() -> None:
    published = torch.tensor([1.0, 1.0, 1.0, 1.0, -0.5, 0.25])
    # bf16 has 8 bits of mantissa: a step of 2**-7 at 1.0 and 2**-9 at 0.25.
    current = published + torch.tensor([2**-10, 2**-6, -2**-7, 2**-12, 2**-8, 2**-9])
    assert select_served_changes(published, current, 1.0).tolist() == [1, 2, 4, 5]
    # The density cap keeps those that moved most.
    assert select_served_changes(published, current, 0.3).tolist() == [1, 2]
    # Nothing served would change: nothing to send.
    assert select_served_changes(published, published + 2**-12, 1.0).numel() == 0


def test_bf16_values_land_on_the_learners_bf16_values_bit_identically() -> None:
    weights = random_state(4)
    publisher, replica = PublishedState.of(0, weights), PublishedState.of(0, weights)
    g = torch.Generator().manual_seed(5)
    for version in range(1, 31):
        weights = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in weights.items()}
        before = {n: t.clone() for n, t in publisher.tensors.items()}
        send(publisher, replica, weights, version, 0.05, "served_changes", "bf16_value")
        assert replica.hash == publisher.hash and replica.version == version
        for name, value in weights.items():
            sent = publisher.tensors[name] != before[name]
            # Every entry sent is served exactly as the learner's bf16 value, and was one whose
            # served value changed.
            assert torch.equal(publisher.tensors[name][sent], value[sent].bfloat16().float())
            assert bool((before[name][sent].bfloat16() != value[sent].bfloat16()).all())
    # Error feedback: once the weights stop, every served value reaches the learner's.
    assert bf16_differs(weights, publisher) > 0
    for version in range(31, 61):
        send(publisher, replica, weights, version, 0.05, "served_changes", "bf16_value")
    assert bf16_differs(weights, publisher) == 0
    assert replica.hash == publisher.hash


def test_served_fidelity_measures_the_unserved_movement_and_differing_entries() -> None:
    start = {"w": torch.zeros(4)}
    learner = {"w": torch.tensor([3.0, 4.0, 2**-8, 0.0])}
    published = PublishedState.of(1, {"w": torch.tensor([3.0, 0.0, 0.0, 0.0])})
    fidelity = served_fidelity(learner, published, start)
    assert fidelity == ServedFidelity(unserved_square=16.0 + 2**-16, moved_square=25.0 + 2**-16,
                                      differing=2, entries=4)
    assert fidelity.unserved_share == pytest.approx(0.8, rel=1e-4)
    assert fidelity.differing_fraction == 0.5
    fidelity.check()
    with pytest.raises(ValueError, match="3 differing entries out of 2"):
        ServedFidelity(unserved_square=0.0, moved_square=0.0, differing=3, entries=2).check()
    with pytest.raises(ValueError, match="finite and >= 0"):
        ServedFidelity(unserved_square=-1.0, moved_square=0.0, differing=0, entries=2).check()


@pytest.mark.parametrize(("field", "value"), [("selection", "random"), ("values", "fp8")])
def test_sync_encoding_options_are_validated(tiny_sharp_dir: Path, field: str,
                                             value: str) -> None:
    data = tiny_run_config(tiny_sharp_dir, 1).model_dump()
    data["sync"][field] = value
    with pytest.raises(ValueError, match=f"sync.{field}"):
        parse_config(data)


# ---- over the swarm ---------------------------------------------------------------------------

def fake_step(swarm: Swarm, trainer_peer: StagePeer, seed: int, sign: bool = True) -> None:
    """Stand-in for an optimizer step on a training peer: move its weights, publish the version,
    and sign it into the stage's lineage as the coordinator would (unless `sign` is False: as if
    every attempt to sign it failed)."""
    assert trainer_peer.training is not None
    stage = trainer_peer.training.trainer.stage
    g = torch.Generator().manual_seed(seed)

    def step() -> None:
        with torch.no_grad():
            for param in stage.parameters():
                if param.requires_grad:
                    param.add_(0.01 * torch.randn(param.shape, generator=g))
        stage.version += 1
        publisher_of(trainer_peer).publish(stage.version, published_tensors(stage))
    trainer_peer.node.run(trainer_peer.node.compute(step, priority=Priority.TRAINING), timeout=30)
    publisher_of(trainer_peer).wait(timeout=30)
    if sign:
        swarm.sign(trainer_peer)


def follow_all(replicas: list[StagePeer]) -> list[bool]:
    """Every replica syncs at the same time, as their follow loops would, and returns once
    their probes of other replicas after the update (sync/sources.py) are done."""
    def follow(replica: StagePeer) -> bool:
        changed = replica.node.run(weights_of(replica).follow(), timeout=60)
        replica.node.run(weights_of(replica).follower.probed(), timeout=60)
        return changed
    with ThreadPoolExecutor(len(replicas)) as pool:
        return list(pool.map(follow, replicas))


def assert_serves_published(replica: StagePeer, trainer_peer: StagePeer) -> None:
    published = publisher_of(trainer_peer).state
    assert weights_of(replica).follower.state.hash == published.hash
    assert replica.version == published.version
    model = serving(replica).model.state_dict()
    for name, value in published.tensors.items():
        assert torch.equal(model[name].float(), value), name


def sync_config(model_dir: Path, **sync: object) -> object:
    return tiny_run_config(model_dir, 1, sync={"density": 0.5, "chunk_wait_s": 1.0, **sync})


@pytest.mark.network
def test_the_end_of_a_warm_up_reaches_replicas_whole(tiny_sharp_dir: Path) -> None:
    # Sparse updates of 1% carry a small share of a supervised step's movement; generation
    # starts after the warm-up, so its last version is published whole.
    config = tiny_run_config(tiny_sharp_dir, 1, sync={"density": 0.01},
                             supervised={"steps": 2}, train={"steps": 4})
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        learner = trainer_peer.training.trainer.stage  # type: ignore[union-attr]
        for step in (1, 2, 3):
            fake_step(swarm, trainer_peer, step)
            follow_all([replica])
            assert_serves_published(replica, trainer_peer)
            published = publisher_of(trainer_peer).state.tensors
            exact = all(torch.equal(published[name], value.float())
                        for name, value in published_tensors(learner).items())
            assert exact == (step == 2), step


@pytest.mark.network
def test_replicas_spread_updates_among_themselves(tiny_sharp_dir: Path) -> None:
    # A replica probed while it still fetches the chunk asked for holds the probe up to
    # chunk_wait_s (sync/sources.py): long enough here for a loaded test machine.
    config = sync_config(tiny_sharp_dir, chunk_wait_s=5.0)
    layout = [(0, "training"), (0, "inference"), (0, "inference"), (0, "inference")]
    with start_swarm(config, layout) as swarm:
        trainer_peer, replicas = swarm.peer(0, "training"), swarm.peers[1:]
        assert follow_all(replicas) == [False] * 3  # everyone starts from the same file
        # The first update comes from the publisher: no replica has served another yet. Each
        # then probes the others for a chunk, and waits on them from the next update on.
        fake_step(swarm, trainer_peer, 1)
        follow_all(replicas)
        for replica in replicas:
            assert_serves_published(replica, trainer_peer)
            sources = weights_of(replica).follower.sources
            assert all(sources.proven(other.node.peer_id) for other in replicas
                       if other is not replica)
        for step in range(2, 5):
            fake_step(swarm, trainer_peer, step)
            # (A replica asked for a chunk of a version it lacks wakes up and syncs on its own, so
            # which of these calls did the work varies.)
            follow_all(replicas)
            for replica in replicas:
                assert_serves_published(replica, trainer_peer)
            # The training peer measured what its replicas serve against its learner, and the
            # coordinator's signer took it into the step metrics.
            publisher = publisher_of(trainer_peer)
            learner = {n: t.detach().float() for n, t in
                       published_tensors(trainer_peer.training.trainer.stage).items()}
            fidelity = served_fidelity(learner, publisher.state, publisher.start)
            assert publisher.fidelity[step] == fidelity
            assert 0 < fidelity.unserved_share < 1 and 0 < fidelity.differing_fraction < 1
            assert swarm.lineage is not None and swarm.lineage.fidelity_fields() == {
                "served_gap": fidelity.unserved_share,
                "served_bf16_differing": fidelity.differing_fraction,
                "served_gap_by_stage": {0: fidelity.unserved_share},
                "served_bf16_differing_by_stage": {0: fidelity.differing_fraction}}
            rows = [r for r in publisher_of(trainer_peer).traffic() if r.version == step
                    and r.kind == "delta"]
            size = publisher_of(trainer_peer).updates[("delta", step)].manifest.size
            manifest = publisher_of(trainer_peer).updates[("delta", step)].manifest
            chunks = len(manifest.chunk_hashes)
            assert chunks >= 6
            # The publisher's uplink carried the update about once, not once per replica...
            assert sum(r.sent for r in rows) < 1.5 * size
            # ...and every replica received all of it, most from the other replicas.
            for replica in replicas:
                got = [r for r in weights_of(replica).follower.traffic() if r.version == step]
                assert sum(r.received for r in got) == size
            from_replicas = sum(r.received for replica in replicas
                                for r in weights_of(replica).follower.traffic()
                                if r.version == step and r.peer != trainer_peer.node.peer_id)
            assert from_replicas > size
        # The running totals keep what every update cost (its probes included), per peer.
        for replica in replicas:
            follower = weights_of(replica).follower
            assert sum(follower.received_total.values()) == sum(
                r.received for r in follower.traffic())
            assert {r.version for r in follower.traffic()} == {1, 2, 3, 4}


@pytest.mark.network
@pytest.mark.parametrize(("selection", "values"), [("served_changes", "int8_delta"),
                                                   ("served_changes", "bf16_value"),
                                                   ("magnitude", "int8_delta")])
def test_late_joiner_catches_up_from_keyframe_and_deltas(tiny_sharp_dir: Path, selection: str,
                                                         values: str) -> None:
    config = sync_config(tiny_sharp_dir, keyframe_every=3, selection=selection, values=values)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        trainer_peer = swarm.peer(0, "training")
        for step in range(1, 6):
            fake_step(swarm, trainer_peer, step)
        late = swarm.add(0, "inference")  # joins at v5: keyframe v3, then deltas v4 and v5
        assert_serves_published(late, trainer_peer)
        traffic = weights_of(late).follower.traffic()
        fetched = {(r.kind, r.version) for r in traffic if r.received}
        assert fetched == {("keyframe", 3), ("delta", 4), ("delta", 5)}
        # The first replica, five deltas behind, woke up when the late one asked it for chunks
        # of a version it did not have yet, and caught up as well.
        first = swarm.peer(0, "inference")
        first.node.run(weights_of(first).follow(), timeout=60)
        assert_serves_published(first, trainer_peer)


@pytest.mark.network
def test_corrupt_chunk_is_refetched_and_its_server_banned(tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir, chunk_wait_s=0.0)
    with start_swarm(config, [(0, "training"), (0, "inference"), (0, "inference")]) as swarm:
        trainer_peer = swarm.peer(0, "training")
        honest, victim = swarm.peer(0, "inference", 0), swarm.peer(0, "inference", 1)
        # One update first, so that the victim waits on the honest replica's chunks (it served
        # the victim's probe well).
        fake_step(swarm, trainer_peer, 1)
        follow_all([honest])
        follow_all([victim])
        assert weights_of(victim).follower.sources.proven(honest.node.peer_id)
        fake_step(swarm, trainer_peer, 2)
        assert honest.node.run(weights_of(honest).follow(), timeout=60)
        stored = weights_of(honest).follower.updates[("delta", 2)]
        stored.data[:] = bytes(len(stored.data))  # every chunk it serves is now wrong
        assert victim.node.run(weights_of(victim).follow(), timeout=60)
        assert_serves_published(victim, trainer_peer)
        assert weights_of(victim).follower.sources.bad_chunks >= 1
        assert weights_of(victim).follower.sources.avoids(honest.node.peer_id)


@pytest.mark.network
def test_wrong_state_hash_is_undone_and_resynced_from_a_keyframe(tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir, keyframe_every=1)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        before = {n: t.clone() for n, t in serving(replica).model.state_dict().items()}
        fake_step(swarm, trainer_peer, 1)
        honest = publisher_of(trainer_peer).updates[("delta", 1)]
        # A publisher whose payload does not make the state it (and the owner) promised: its
        # chunks match their own hashes, so only the state hash after applying tells.
        payload = msgspec.msgpack.decode(bytes(honest.data), type=UpdatePayload)
        first = payload.sparse[0]
        values = bytearray(first.values)
        values[0] = (values[0] + 1) % 128
        payload = msgspec.structs.replace(
            payload, sparse=[msgspec.structs.replace(first, values=bytes(values)),
                             *payload.sparse[1:]])
        liar = make_update(0, 1, "delta", (honest.manifest.base_version,
                                           honest.manifest.base_hash),
                           honest.manifest.state_hash, msgspec.msgpack.encode(payload),
                           config.sync.chunks_per_update)
        publisher_of(trainer_peer).updates[("delta", 1)] = liar
        with pytest.raises(SyncError, match="undone, resynchronizing from a keyframe"):
            replica.node.run(weights_of(replica).follow(), timeout=60)
        # Never served: the model and the published state are what they were.
        assert replica.version == 0 and weights_of(replica).follower.state.version == 0
        served = serving(replica).model.state_dict()
        assert all(torch.equal(before[n], t) for n, t in served.items())
        assert weights_of(replica).follower.hash_mismatches == 1
        publisher_of(trainer_peer).updates[("delta", 1)] = honest
        assert replica.node.run(weights_of(replica).follow(), timeout=60) is True
        assert_serves_published(replica, trainer_peer)
        follower = weights_of(replica).follower
        assert {(r.kind, r.version) for r in follower.traffic() if r.received} >= \
            {("keyframe", 1)}


@pytest.mark.network
def test_an_update_the_owner_did_not_sign_is_refused_before_it_is_fetched(
        tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        fake_step(swarm, trainer_peer, 1)
        update = publisher_of(trainer_peer).updates[("delta", 1)]
        honest_manifest = update.manifest
        # The publisher offers a state the coordinator never saw it make.
        update.manifest = type(honest_manifest)(**{
            **{f: getattr(honest_manifest, f) for f in honest_manifest.__struct_fields__},
            "state_hash": "0" * 64})
        with pytest.raises(SyncError, match="the run owner signed .* for that version; not "
                                            "applied"):
            replica.node.run(weights_of(replica).follow(), timeout=60)
        assert replica.version == 0 and not weights_of(replica).follower.traffic()
        # A version the publisher made but the owner has not signed yet waits.
        update.manifest = honest_manifest
        publisher = publisher_of(trainer_peer)
        assert trainer_peer.training is not None
        stage = trainer_peer.training.trainer.stage
        trainer_peer.node.run(trainer_peer.node.compute(
            lambda: setattr(stage, "version", 2), priority=Priority.TRAINING), timeout=30)
        publisher.publish(2, published_tensors(stage))
        publisher.wait(timeout=30)
        assert replica.node.run(weights_of(replica).follow(), timeout=60) is True
        assert replica.version == 1  # v1 was signed, v2 not yet
        swarm.sign(trainer_peer)
        assert replica.node.run(weights_of(replica).follow(), timeout=60) is True
        assert_serves_published(replica, trainer_peer)


@pytest.mark.network
def test_a_version_left_unsigned_is_signed_with_the_next_and_replicas_step_through_it(
        tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        fake_step(swarm, trainer_peer, 1)
        replica.node.run(weights_of(replica).follow(), timeout=60)
        fake_step(swarm, trainer_peer, 2, sign=False)  # its answer lost, every retry too
        assert swarm.lineage is not None and set(swarm.lineage.records[0].hashes) == {1}
        fake_step(swarm, trainer_peer, 3)
        # v2 is signed with v3, from the hash the publisher still keeps with its update: the
        # replica takes both (before, it stopped at v1 for good: no update may skip a version).
        assert set(swarm.lineage.records[0].hashes) == {1, 2, 3}
        assert swarm.lineage.records[0].hashes[2] == \
            publisher_of(trainer_peer).updates[("delta", 2)].manifest.state_hash
        assert replica.node.run(weights_of(replica).follow(), timeout=60) is True
        assert_serves_published(replica, trainer_peer)


@pytest.mark.network
def test_a_chunk_of_a_version_a_replica_does_not_hold_is_refused_without_a_strike(
        tiny_sharp_dir: Path) -> None:
    """Replicas are not in step: one behind asks for what the others dropped. No fault."""
    config = sync_config(tiny_sharp_dir)
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        replica = swarm.peer(0, "inference")
        for version in (5, 6):
            with pytest.raises(PeerRefused, match=f"no chunk 0 of delta v{version} of stage 0 "
                                                  "here"):
                swarm.client.call_sync(replica.node.peer_id, SYNC_CHUNK, ChunkRequest(
                    stage=0, kind="delta", version=version, index=0, wait_s=0.0))
        assert replica.node.strikes(swarm.client.peer_id) == 0


@pytest.mark.network
def test_lora_mode_publishes_only_the_adapters(tiny_sharp_dir: Path) -> None:
    config = tiny_run_config(tiny_sharp_dir, 1, train={"lora_rank": 2},
                             sync={"density": 0.5})
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
        names = set(publisher_of(trainer_peer).state.tensors)
        assert names and all("lora" in name for name in names)
        assert trainer_peer.training is not None
        full = sum(p.numel() for p in trainer_peer.training.model.parameters())
        assert publisher_of(trainer_peer).state.numel() < full / 3
        base = {n: t.clone() for n, t in serving(replica).model.state_dict().items()
                if n not in names}
        fake_step(swarm, trainer_peer, 1)
        assert replica.node.run(weights_of(replica).follow(), timeout=60) is True
        assert_serves_published(replica, trainer_peer)
        assert all(torch.equal(base[n], serving(replica).model.state_dict()[n]) for n in base)



@pytest.mark.network
def test_a_chunk_is_served_in_the_pieces_asked_for_and_a_piece_outside_it_is_refused(
        tiny_sharp_dir: Path) -> None:
    config = sync_config(tiny_sharp_dir, chunks_per_update=2)
    with start_swarm(config, [(0, "training")]) as swarm:
        trainer_peer = swarm.peer(0, "training")
        fake_step(swarm, trainer_peer, 1)
        update = publisher_of(trainer_peer).updates[("delta", 1)]
        span = update.span(0)
        length = span.stop - span.start

        def piece(offset: int, count: int) -> bytes:
            _, tensors = swarm.client.call_sync(trainer_peer.node.peer_id, SYNC_CHUNK, ChunkRequest(
                stage=0, kind="delta", version=1, index=0, wait_s=0.0, offset=offset,
                count=count))
            return tensors["data"].numpy().tobytes()
        whole = bytes(update.data[span])
        assert piece(0, 0) == whole
        assert piece(0, 100) + piece(100, 0) == whole
        assert piece(length - 1, 1) == whole[-1:]
        for offset, count in ((length, 0), (0, length + 1), (-1, 5), (10, -1)):
            with pytest.raises(PeerRefused, match=f"chunk 0 of delta v1 has {length} bytes: no "
                                                  f"piece of {count} from {offset}"):
                piece(offset, count)
        assert trainer_peer.node.strikes(swarm.client.peer_id) == 4
