"""In-process swarms for the swarm tests: every peer is its own SwarmNode (its own p2p daemon) and
StagePeer in this process, all bootstrapped from one client node that also plays the coordinator:
it is the run's owner, so the peers obey it, and the training peers started with the swarm are
the admitted ones. Its `workers()` sign each stage's weight lineage as the coordinator does.
`start_swarm` shuts every node down on the way out and checks that none left a unix socket.
`launched_swarm` is the other kind: every peer a separate `decentrl join` process."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from helpers import build
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from decentrl.client.sessions import RemoteChain
from decentrl.client.training import RemoteStageWorker
from decentrl.client.training_push import PushedTraining
from decentrl.config import RunConfig, parse_config
from decentrl.coordinator.lineage import LineageSigner
from decentrl.coordinator.local_backend import local_run
from decentrl.launch.local_swarm import LocalSwarm
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel
from decentrl.model.spec import ModelSpec
from decentrl.net.calls import TRUNCATED_REPLY_RETRIES
from decentrl.net.dht_storage import RunNamespace
from decentrl.net.directory import Directory
from decentrl.net.link import LinkProfile
from decentrl.net.local_node import LocalNetwork
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import Role
from decentrl.net.session import new_session
from decentrl.net.signing import signed_envelope
from decentrl.net.wire import TensorLimits, TensorManifest, encode_struct, to_messages
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.sampling import sampling_config
from decentrl.stage.batching import Outcome, StepRequest
from decentrl.stage.inference import InferenceService
from decentrl.stage.peer import Service, StagePeer
from decentrl.stage.replica import ReplicaWeights
from decentrl.stage.verification import VerifyService
from decentrl.sync.distribute import WeightPublisher

CPU = torch.device("cpu")


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def tiny_run_config(model_dir: Path, num_stages: int, codec: str = "fp32",
                    **overrides: Any) -> RunConfig:
    """A run over a tiny model on the CPU in fp32. Announcements are renewed rarely (entries live
    5x longer than the test), so no background DHT traffic competes with the test. Peers block a
    sender only after many malformed requests: the malformed-request tests send dozens from one
    client on purpose. The trainer's poison flags are off: many tests train on made-up behaviour
    log-probs. New identities are not on probation (tests of probation turn it on): most tests
    count the checks and bans of peers that are all new. `overrides` are merged section by
    section, e.g. `swarm={"retries": 10}`."""
    data: dict[str, Any] = {
        "name": f"t{secrets.token_hex(3)}",  # a fresh DHT key space per swarm
        "model": str(model_dir), "num_stages": num_stages,
        "host": {"device": "cpu", "dtype": "fp32"},
        "rollout": {"max_new_tokens": 8},
        "train": {"micro_batch_size": 2, "lr": 1e-2},
        "swarm": {"activation_codec": codec, "announce_every_s": 60.0, "request_timeout_s": 20.0,
                  "retries": 4, "avoid_failed_peer_s": 30.0},
        "trust": {"strikes_to_block": 1000, "flag_log_ratio": None, "flag_surprise": None,
                  "probation_checks": 0},
    }
    return parse_config(deep_merge(data, overrides))


def two_episode_steps(model_dir: Path, run_dir: Path, task: dict[str, Any],
                      eval_problems: int, **rollout: Any) -> tuple[list[dict[str, Any]],
                                                                   dict[str, Any]]:
    """A tiny local run of 2 synchronous steps on an environment (groups of 4, 2 problems a
    step, 60 tokens), evaluated on `eval_problems`: its step records, checked to be versions 1
    and 2, and its eval_after.json."""
    config = tiny_run_config(
        model_dir, 2, host={"run_dir": str(run_dir), "threads": 1}, task=task,
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 60, **rollout},
        train={"steps": 2, "micro_batch_size": 4, "zero_variance_groups": "keep",
               "mode": "sync"},
        eval={"task": task, "problems": eval_problems, "max_new_tokens": 60})
    summary = local_run(config).run()
    assert summary.steps == 2
    records = [json.loads(line) for line in (summary.path / "metrics.jsonl").read_text()
               .splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["version"] for r in steps] == [1, 2]
    return steps, json.loads((summary.path / "eval_after.json").read_text())


def local_chain(model: LoadedModel, num_stages: int) -> LocalChain:
    return LocalChain(build(model, num_stages))


def local_trainer(model: LoadedModel, config: RunConfig) -> PipelineTrainer:
    loss = loss_config_from(config.train, config.rollout.max_new_tokens)
    return PipelineTrainer.local(build(model, config.num_stages), config.train, loss,
                                 sampling_config(config.rollout), torch.float32)


@dataclass
class Swarm:
    config: RunConfig
    client: SwarmNode  # the bootstrap node and the run's owner; tests call peers from it
    peers: list[StagePeer]
    checkpoint_dir: Path
    sockets: list[str] = field(default_factory=list)
    killed: list[StagePeer] = field(default_factory=list)
    lineage: LineageSigner | None = None  # made by the first workers()
    network: LocalNetwork | None = None  # where its nodes are, in local mode

    def admitted(self, peer_id: str) -> bool:
        """The swarm's own training peers (those started with it or added later, not killed)."""
        return any(p.node.peer_id == peer_id and p.training is not None
                   and p not in self.killed for p in self.peers)

    def sign(self, trainer: StagePeer, version: int | None = None) -> None:
        """What the coordinator does after a step: sign `trainer`'s published `version` (by
        default its learner's) into its stage's lineage, so that the replicas take it; returns
        once it is announced."""
        if self.lineage is None:
            self.lineage = LineageSigner(self.client, self.config, new_session())
        self.lineage.published(trainer.index, trainer.node.peer_id,
                               trainer.version if version is None else version)
        self.lineage.wait()

    def directory(self) -> Directory:
        directory = Directory(self.client, self.config.name, self.config.num_stages,
                              self.config.swarm)
        directory.refresh()
        return directory

    def chain(self, spec: ModelSpec) -> RemoteChain:
        return RemoteChain(self.client, self.directory(), self.config.swarm, self.config.trust,
                           spec)

    def workers(self) -> list[RemoteStageWorker]:
        directory = self.directory()
        if self.lineage is None:
            self.lineage = LineageSigner(self.client, self.config, new_session())
        workers = [RemoteStageWorker(self.client, directory, stage, self.config.num_stages,
                                     self.config.swarm, self.admitted, self.lineage)
                   for stage in range(self.config.num_stages)]
        for worker in workers:
            worker.connect()
        return workers

    def remote_trainer(self) -> PipelineTrainer:
        """The coordinator's trainer over this swarm's training peers: micro-batches pushed
        down the chain, or relayed stage by stage, as `config.swarm.data_plane` says."""
        loss = loss_config_from(self.config.train, self.config.rollout.max_new_tokens)
        workers = self.workers()
        chain = PushedTraining(self.client, workers, self.config.swarm, self.config.name, "") \
            if self.config.swarm.data_plane == "peer_to_peer" else None
        return PipelineTrainer(workers, self.config.train, loss,
                               sampling_config(self.config.rollout), CPU, chain=chain)

    def peer(self, stage: int, role: Role | None = None, index: int = 0) -> StagePeer:
        found = [p for p in self.peers if p.index == stage and role in (None, p.role)]
        return found[index]

    def by_id(self, peer_id: str) -> StagePeer:
        (found,) = [p for p in self.peers if p.node.peer_id == peer_id]
        return found

    def add(self, stage: int, role: Role) -> StagePeer:
        """A peer that joins the running swarm (shut down with the others)."""
        peer = start_peer(self.config, stage, role, self.client.addresses(), self.client.peer_id,
                          checkpoint_dir=self.checkpoint_dir, name=f"s{stage}{role[0]}late",
                          network=self.network)
        self.peers.append(peer)
        self.sockets.extend(peer.node.socket_paths())
        return peer

    def kill(self, peer: StagePeer) -> None:
        """A peer that goes away (as a crash would, but its process stays up)."""
        peer.stop()
        peer.node.shutdown()
        self.killed.append(peer)


def start_node(config: RunConfig, name: str, initial_peers: Sequence[str],
               limits: TensorLimits, link: LinkProfile, network: LocalNetwork | None = None
               ) -> SwarmNode:
    """A SwarmNode that blocks senders of malformed requests as `config.trust` says: over its
    own p2p daemon, or on `network` in this process (net/local_node.py)."""
    if network is not None:
        return network.start_node(name, link, limits,
                                  strikes_to_block=config.trust.strikes_to_block,
                                  block_s=config.trust.block_s)
    return SwarmNode.start(name, initial_peers, link, limits,
                           strikes_to_block=config.trust.strikes_to_block,
                           block_s=config.trust.block_s)


def start_peer(config: RunConfig, stage: int, role: Role, initial_peers: Sequence[str],
               owner: str, limits: TensorLimits = TensorLimits(),
               checkpoint_dir: Path | None = None, name: str = "peer",
               link: LinkProfile = LinkProfile(),
               wrap_inference: Callable[[InferenceService], Service] | None = None,
               wrap_verification: Callable[[VerifyService], Service] | None = None,
               network: LocalNetwork | None = None) -> StagePeer:
    """A SwarmNode and a started StagePeer on it, of the run the peer id `owner` owns (its
    inference or verification wrapped by a hostile peer's wrapper); the node is shut down if
    the peer fails."""
    node = start_node(config, name, initial_peers, limits, link, network)
    try:
        peer = StagePeer(config, stage, role, node, owner, checkpoint_dir=checkpoint_dir,
                         name=name, wrap_inference=wrap_inference,
                         wrap_verification=wrap_verification)
        peer.start()
    except BaseException:
        node.shutdown()
        raise
    return peer


@contextmanager
def start_swarm(config: RunConfig, layout: Sequence[tuple[int, Role]],
                limits: TensorLimits = TensorLimits(),
                client_link: LinkProfile = LinkProfile(), local: bool = False,
                peer_link: LinkProfile = LinkProfile()) -> Iterator[Swarm]:
    """A client node and one peer per (stage, role) of `layout`, every one shut down on exit.
    On a normal exit it also asserts that no node left its unix sockets behind. `local`: every
    node in this process without a p2p daemon (the protocols' local mode, net/local_node.py)."""
    network = LocalNetwork() if local else None
    client = start_node(config, "client", [], TensorLimits(), client_link, network)
    # Before the peers announce themselves, so that the client keeps their records too.
    client.dht_storage.join(RunNamespace.of(config, client.peer_id))
    sockets: list[str] = []
    peers: list[StagePeer] = []
    failed = True
    errors: list[Exception] = []
    swarm: Swarm | None = None
    with tempfile.TemporaryDirectory(prefix="decentrl-swarm-") as folder:
        try:
            sockets += client.socket_paths()
            addresses = client.addresses()
            for number, (stage, role) in enumerate(layout):
                peer = start_peer(config, stage, role, addresses, client.peer_id, limits,
                                  Path(folder), name=f"s{stage}{role[0]}{number}",
                                  link=peer_link, network=network)
                peers.append(peer)
                sockets += peer.node.socket_paths()
            swarm = Swarm(config, client, peers, Path(folder), sockets, network=network)
            yield swarm
            failed = False
        finally:
            if swarm is not None and swarm.lineage is not None:
                swarm.lineage.close()
            for peer in peers:
                for close in (peer.stop, peer.node.shutdown):
                    try:
                        close()
                    except Exception as error:  # noqa: BLE001 - shut the others down too
                        errors.append(error)
            client.shutdown()
    leaked = [path for path in sockets if os.path.exists(path)]
    if not failed:
        if errors:
            raise errors[0]
        assert not leaked, f"nodes left unix sockets behind: {leaked}"


# ---- raw requests: what a buggy or hostile peer could send ---------------------------------

@dataclass(frozen=True)
class Unsigned:
    """A request's envelope that `call_raw` signs with the node's key: the signature covers the
    method, the request id and the parts too, which only `call_raw` knows."""

    body: bytes
    manifest: TensorManifest


def call_raw(node: SwarmNode, peer: str, method: str, metadata: bytes | Unsigned,
             parts: Sequence[runtime_pb2.Tensor] = (), timeout: float = 20.0,
             request_id: str = "") -> list[runtime_pb2.ExpertResponse]:
    """Send hand-made messages to `peer`'s `method`: `metadata` as it is (bytes), or signed (an
    `envelope(...)`); a refusal is a RemoteError, as from SwarmNode.call. A stream that closes
    with no reply at all (libp2p does this about once in a thousand streams under load, see
    SwarmNode.call) is sent again, as SwarmNode.call does; a `request_id` given sends a request
    with that id again."""
    request_id = request_id or secrets.token_hex(8)
    if isinstance(metadata, Unsigned):
        metadata = signed_envelope(node.identity, "request", method, request_id, metadata.body,
                                   metadata.manifest, parts)
    requests = to_messages(runtime_pb2.ExpertRequest, metadata, list(parts), uid=request_id)

    async def go() -> list[runtime_pb2.ExpertResponse]:
        async def feed() -> Any:
            for request in requests:
                yield request
        assert node.p2p is not None
        for _ in range(TRUNCATED_REPLY_RETRIES + 1):
            stream = await node.p2p.iterate_protobuf_handler(
                PeerID.from_base58(peer), f"decentrl.{method}", feed(),
                runtime_pb2.ExpertResponse)
            responses = [r async for r in stream]
            if responses:
                break
        return responses

    try:
        return node.run(asyncio.wait_for(go(), timeout), timeout + 5)
    except Exception as error:
        # As SwarmNode.call: a peer that refuses a request too big to read past cuts the stream
        # (net/streams.py discard_rest), and the reset can overtake its refusal.
        if isinstance(error, P2PHandlerError | P2PDaemonError | ConnectionError
                      | asyncio.IncompleteReadError):
            raise RemoteError(str(error) or repr(error)) from error
        raise


def envelope(body: Any, manifest: TensorManifest = TensorManifest()) -> Unsigned:
    """The envelope of a request, for `call_raw` to sign: `body` (a struct, or raw bytes sent
    as they are)."""
    return Unsigned(body if isinstance(body, bytes) else encode_struct(body), manifest)


# ---- watching sessions -----------------------------------------------------------------------

class ObservedChain:
    """Wraps an inference chain: keeps every session it opens (tests read their `failovers` and
    `peers`), calls `after_step(session, step)` after each step and `before_close(session)`
    before a session closes."""

    def __init__(self, chain: Any, after_step: Any = None, before_close: Any = None) -> None:
        self.chain, self.after_step, self.before_close = chain, after_step, before_close
        self.sessions: list[Any] = []

    @property
    def device(self) -> torch.device:
        return self.chain.device

    def versions(self) -> tuple[int, ...]:
        return self.chain.versions()

    def open_session(self, batch: int, max_length: int) -> _ObservedSession:
        session = self.chain.open_session(batch, max_length)
        self.sessions.append(session)
        return _ObservedSession(self, session)


class _ObservedSession:
    def __init__(self, owner: ObservedChain, session: Any) -> None:
        self.owner, self.session, self.steps = owner, session, 0

    def step(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.session.step(*args)
        if self.owner.after_step is not None:
            self.owner.after_step(self.session, self.steps)
        self.steps += 1
        return out

    def close(self) -> None:
        if self.owner.before_close is not None:
            self.owner.before_close(self.session)
        self.session.close()


@contextmanager
def launched_swarm(config: RunConfig, replicas: int) -> Iterator[LocalSwarm]:
    """The local launcher's swarm for `config` (a training peer and `replicas` inference peers per
    stage, each a process), shut down on the way out with no p2pd socket left behind."""
    config.path.mkdir(parents=True)
    config_path = config.path / "swarm-config.json"
    config_path.write_text(config.model_dump_json())
    local = LocalSwarm(config, config_path, replicas=replicas)
    try:
        local.start()
        yield local
    finally:
        local.shutdown()
    assert not local.sockets, f"leftover p2pd sockets: {local.sockets}"


def weights_of(peer: StagePeer) -> ReplicaWeights:
    """An inference replica's weights (follower, history)."""
    assert peer.replica is not None, f"{peer.name} follows no training peer"
    return peer.replica


def publisher_of(peer: StagePeer) -> WeightPublisher:
    assert peer.training is not None, f"{peer.name} does not train"
    return peer.training.publisher


def serving(peer: StagePeer) -> InferenceService:
    assert peer.inference is not None, f"{peer.name} serves no inference"
    return peer.inference


def steps_through_infer(service: InferenceService) -> None:
    """Make the peer's ticks run every step alone through `service.infer`, looked up at each
    step, so a test can wrap or replace `infer` to watch or alter single steps."""
    def one_at_a_time(requests: list[StepRequest]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for request in requests:
            try:
                outcomes.append(service.infer(request.sender, request.body, request.tensors))
            except Exception as error:  # noqa: BLE001 - the step's answer, as in run_steps
                outcomes.append(error)
        return outcomes
    service.batcher.run_tick = one_at_a_time
