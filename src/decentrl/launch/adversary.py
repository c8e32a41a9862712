"""Hostile peers, for `decentrl demo --adversaries` and the trust tests. Each one attacks the
way a volunteer on the internet could, and nothing here is known to the coordinator:

- random-tokens (last stage): answers every decoding step with a uniformly random token, and
  claims the log-prob its honest sample had;
- forge-logprobs (last stage): samples honestly, but claims behaviour log-probs 3 nats lower, so
  the trainer's importance weights blow up on its rollouts;
- inject-answers (a colluding pair, one peer at stage 0 and one at the last stage): the stage-0
  spy reads each session's prompt and leaves the correct answer where its partner finds it; the
  last-stage peer then emits that answer in half of the group's rows, claiming plausible
  log-probs, so the injected rows win the group's advantages;
- corrupt-activations (any stage but the last): adds noise to the hidden states it returns;
- corrupt-unopened (the stage before the last): adds noise only at positions whose id is not a
  multiple of 8, the ones a commitment at fixed points (every 8th position) never opened;
- malformed-activations (any stage but the last): returns hidden states the next stage could not
  take, in turn (or always the one it is given): half the model's width, NaNs (sent past our
  own encoder's refusal), or values of 1e30, so that only the coordinator's checks of the
  relayed tensor (trust/relay.py) stand in the way;
- collude-verify (last stage): serves inference honestly, but when it re-executes someone else's
  session for a spot-check it reports log-probs FORGED_SHIFT nats low: exactly what a
  forge-logprobs partner claims (its lies pass) and a lie about every honest replica it checks;
- huge-capacity (last stage): a collude-verify peer that also announces room for a million
  sessions and a version no training peer has, to be chosen for every session and every check;
- rotate-keys (last stage): a random-tokens liar that, once nobody sends it work (it was banned),
  comes back as a new identity, again and again;
- replay (a client, no stage): submits rollout groups of problems the coordinator already
  accepted or never handed out, with correct answers;
- flood (a client, no stage): sends malformed and oversized requests to every peer it finds
  (the coordinator, which serves no inbox to other peers, refuses its submissions unread);
- poison-update (a training peer, any stage): steps honestly, then reverses its update (gradient
  ascent) and adds noise of a step's size (harm even where the honest update is zero), keeping
  honest Adam moments;
- forge-flags (a training peer of the last stage): trains honestly, but reports per-row
  statistics that flag every honest row of the batch and clear every row its loss flagged.
A hostile training peer audits the way it trains: its replays of other peers' steps lie alike."""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2

from decentrl.config import RunConfig, TrainConfig
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.learn.batch import TrainBatch
from decentrl.learn.losses import flagged_rows
from decentrl.learn.stage_loss import LossInputs
from decentrl.learn.stage_trainer import Activations, StageTrainer
from decentrl.model.loading import load_tokenizer, resolve_model
from decentrl.net.compute import Priority
from decentrl.net.link import MessageLost
from decentrl.net.node import Handler, RemoteError, Reply, Request, SwarmNode
from decentrl.net.protocol import (
    INFERENCE_PUSH,
    INFERENCE_STEP,
    SUBMIT_ROLLOUTS,
    VERIFY_STEP,
    Empty,
    InferenceStep,
    PeerRecord,
    Role,
    Rpc,
    VerifyStep,
    stage_key,
)
from decentrl.net.records import decode_records
from decentrl.net.signing import signed_envelope
from decentrl.net.sizes import MAX_SUBMISSION_BYTES
from decentrl.net.wire import TensorManifest, TensorSpec, WireError, encode_struct, to_messages
from decentrl.rollout.types import Rollout, RolloutGroup, VersionSpan
from decentrl.stage.batching import Outcome, StepRequest
from decentrl.stage.inference import InferenceService
from decentrl.stage.peer import StagePeer
from decentrl.stage.verification import VerifyService
from decentrl.tasks import make_task, render_prompt

log = logging.getLogger(__name__)

Adversary = Literal["random-tokens", "forge-logprobs", "inject-answers", "corrupt-activations",
                    "corrupt-unopened", "malformed-activations", "collude-verify",
                    "huge-capacity", "rotate-keys", "replay", "flood", "poison-update",
                    "forge-flags"]
ADVERSARIES: tuple[str, ...] = get_args(Adversary)
STAGE_ADVERSARIES = ("random-tokens", "forge-logprobs", "inject-answers", "corrupt-activations",
                     "corrupt-unopened", "malformed-activations")
JUDGE_ADVERSARIES = ("collude-verify", "huge-capacity")  # honest producers, lying verifiers
LAST_STAGE_ADVERSARIES = ("random-tokens", "forge-logprobs")
ACTIVATION_ADVERSARIES = ("corrupt-activations", "corrupt-unopened", "malformed-activations")
TRAINING_ADVERSARIES = ("poison-update", "forge-flags")
FORGED_SURPRISE = -100.0  # a row statistic every flag_surprise threshold flags
Malformation = Literal["wrong-width", "non-finite", "huge"]
MALFORMATIONS: tuple[str, ...] = get_args(Malformation)
FORGED_SHIFT = 3.0  # nats subtracted from honest behaviour log-probs
NOISE_SCALE = 0.5  # of each row's hidden-state std
UNOPENED_EVERY = 8  # corrupt-unopened spares the positions that are multiples of this
HUGE_ACTIVATION = 1e30  # finite in fp32 and bf16, so only a magnitude bound refuses it
BOASTED_SESSIONS = 10**6
BOASTED_VERSIONS = 10**6  # added to the version it really serves
# A rotating liar whose identity got no work for this long was banned: it takes a new one.
ROTATE_IDLE_S = 20.0


def adversary_stages(kind: str, num_stages: int) -> list[int]:
    """The stages a hostile peer of `kind` joins (an inject-answers pair is two peers)."""
    last = num_stages - 1
    return {"random-tokens": [last], "forge-logprobs": [last], "inject-answers": [0, last],
            "corrupt-activations": [0], "corrupt-unopened": [max(0, last - 1)],
            "malformed-activations": [0], "collude-verify": [last], "huge-capacity": [last],
            "rotate-keys": [last], "poison-update": [0], "forge-flags": [last]}.get(kind, [])


def unchecked_encoding(tensors: Mapping[str, torch.Tensor]
                       ) -> tuple[list[runtime_pb2.Tensor], TensorManifest]:
    """Like wire.encode_tensors with the fp32 codec, minus the sender's checks (NaNs go
    through): what a peer running modified code can send."""
    parts, specs = [], []
    for name, t in tensors.items():
        if t.is_floating_point():
            parts.append(serialize_torch_tensor(t.float().contiguous(),
                                                runtime_pb2.CompressionType.NONE))
            specs.append(TensorSpec(name, "fp32", "float32", tuple(t.shape), 1))
        else:
            parts.append(serialize_torch_tensor(t.contiguous(), runtime_pb2.CompressionType.NONE))
            specs.append(TensorSpec(name, "raw", str(t.dtype).removeprefix("torch."),
                                    tuple(t.shape), 1))
    return parts, TensorManifest(tuple(specs))


def push_unchecked(node: SwarmNode) -> None:
    """Make `node` push activations without the sender's checks (NaNs, any width or size go
    through, in fp32), as a peer running modified code would."""
    guard = node.guard
    honest = guard.signed_request

    def signed_request(rpc: Rpc[Any, Any], body: Any, request_id: str,
                       tensors: Mapping[str, torch.Tensor] | None, codec: Any,
                       exact: Mapping[str, torch.Tensor] | None) -> list[Any]:
        if rpc.method != INFERENCE_PUSH.method or not tensors:
            return honest(rpc, body, request_id, tensors, codec, exact)
        parts, manifest = unchecked_encoding(tensors)
        metadata = signed_envelope(guard.identity, "request", rpc.method, request_id,
                                   encode_struct(body), manifest, parts)
        return to_messages(runtime_pb2.ExpertRequest, metadata, parts, uid=request_id)

    guard.signed_request = signed_request  # type: ignore[method-assign]


class HostileInference:
    """An honest inference service, wrapped: its steps run as they would, and the wrapper lies
    about the result. It uses only the service's public face, as an attacker running our code
    would."""

    def __init__(self, service: InferenceService, adversary: str,
                 collusion_dir: Path | None = None, malformation: str | None = None) -> None:
        if adversary not in STAGE_ADVERSARIES:
            raise ValueError(f"{adversary!r} is not a stage adversary; one of {STAGE_ADVERSARIES}")
        checks = service.checks
        if adversary in LAST_STAGE_ADVERSARIES and not checks.is_last:
            raise ValueError(f"{adversary} attacks from the last stage")
        if adversary in ACTIVATION_ADVERSARIES and checks.is_last:
            raise ValueError(f"{adversary} attacks from a stage that returns activations")
        if adversary == "inject-answers" and collusion_dir is None:
            raise ValueError("inject-answers needs a collusion folder shared by the pair")
        if malformation is not None and (adversary != "malformed-activations"
                                         or malformation not in MALFORMATIONS):
            raise ValueError(f"a malformation ({MALFORMATIONS}) is for malformed-activations, "
                             f"got {malformation!r} for {adversary}")
        self.service, self.adversary, self.collusion_dir = service, adversary, collusion_dir
        self.malformation = malformation
        self.malformed = 0  # replies malformed so far
        self.rng = torch.Generator().manual_seed(random.randrange(2**31))
        self.injected: dict[str, int] = {}  # session -> answer tokens emitted so far
        self.tokenizer = load_tokenizer(resolve_model(service.config.model)) \
            if adversary == "inject-answers" else None

        # Every step this peer computes goes through its batcher's ticks, whoever drives the
        # session (the coordinator's relayed steps, or pushes from the previous stage): the lie
        # goes in there.
        self.honest_tick = service.batcher.run_tick
        service.batcher.run_tick = self._run_tick
        if adversary == "malformed-activations":
            push_unchecked(service.node)  # peer to peer, its lie is what it pushes on

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        return self.service.handlers()

    def _run_tick(self, requests: list[StepRequest]) -> list[Outcome]:
        return [self._lie(request.body, request.tensors, outcome)
                if isinstance(outcome, Reply) else outcome
                for request, outcome in zip(requests, self.honest_tick(requests), strict=True)]

    def _lie(self, body: InferenceStep, tensors: dict[str, torch.Tensor], reply: Reply
             ) -> Reply:
        result = dict(reply.tensors or {})
        if self.adversary == "malformed-activations":
            return self._malform(reply, result["hidden"].float())
        if self.adversary == "random-tokens":
            result["tokens"] = torch.randint(self.service.checks.spec.vocab_size,
                                             result["tokens"].shape, generator=self.rng)
        elif self.adversary == "forge-logprobs":
            result["logprobs"] = result["logprobs"] - FORGED_SHIFT
        elif self.adversary in ("corrupt-activations", "corrupt-unopened"):
            hidden = result["hidden"].float()
            noise = NOISE_SCALE * hidden.std(-1, keepdim=True) * torch.randn(
                hidden.shape, generator=self.rng)
            if self.adversary == "corrupt-unopened":
                noise *= (tensors["positions"] % UNOPENED_EVERY != 0)[..., None]
            result["hidden"] = (hidden + noise).to(result["hidden"].dtype)
        elif self.service.checks.is_first:
            self._spy(body, tensors)
        else:
            self._inject(body, result)
        return Reply(reply.body, result, reply.codec)

    def _malform(self, reply: Reply, hidden: torch.Tensor) -> Reply:
        """Hidden states the next stage could not take."""
        kind = self.malformation or MALFORMATIONS[self.malformed % len(MALFORMATIONS)]
        self.malformed += 1
        if kind == "wrong-width":
            hidden = hidden[..., :hidden.shape[-1] // 2]
        elif kind == "huge":
            hidden = hidden.clamp(-1, 1) * HUGE_ACTIVATION
        else:
            hidden = hidden.clone()
            hidden[:, :, 0] = float("nan")
        # Relayed, the encoding goes back to the coordinator; pushed, the tensor goes on.
        return Reply(reply.body, {"hidden": hidden}, encoded=unchecked_encoding({"hidden": hidden}))

    def _spy(self, body: InferenceStep, tensors: dict[str, torch.Tensor]) -> None:
        """Leave the correct answer of a new session's prompt for the last-stage partner."""
        assert self.tokenizer is not None and self.collusion_dir is not None
        if body.start != 0:
            return
        text = self.tokenizer.decode(tensors["inputs"][0].tolist(), skip_special_tokens=True)
        found = re.findall(r"\d+(?:\s*\+\s*\d+)+", text)
        if not found:
            return
        answer = str(sum(int(n) for n in re.findall(r"\d+", found[-1])))
        tokens = self.tokenizer.encode(answer, add_special_tokens=False)
        tokens.append(self.tokenizer.eos_token_id)
        (self.collusion_dir / f"{body.session}.json").write_text(json.dumps(tokens))

    def _inject(self, body: InferenceStep, result: dict[str, torch.Tensor]) -> None:
        """Emit the partner's answer, one token per step, in the even rows."""
        assert self.collusion_dir is not None
        path = self.collusion_dir / f"{body.session}.json"
        if not path.is_file():
            return  # the session did not pass through the partner: behave
        answer = json.loads(path.read_text())
        emitted = 0 if body.start == 0 else self.injected.get(body.session, 0)
        token = answer[min(emitted, len(answer) - 1)]
        self.injected[body.session] = emitted + 1
        result["tokens"] = result["tokens"].clone()
        result["tokens"][0::2] = token


class LyingJudge:
    """An honest verification service, wrapped: each re-execution runs as it would, and the
    last stage's log-probs are reported FORGED_SHIFT nats low, which is what a forge-logprobs
    partner claims."""

    def __init__(self, service: VerifyService) -> None:
        if not service.checks.is_last:
            raise ValueError("a lying judge re-executes the last stage")
        self.service = service

    def handlers(self) -> list[tuple[Rpc[Any, Any], Handler[Any]]]:
        return [(rpc, self._verify_step if rpc is VERIFY_STEP else handler)
                for rpc, handler in self.service.handlers()]

    async def _verify_step(self, request: Request[VerifyStep]) -> Reply:
        return await self.service.node.compute(self._judge, request.sender, request.body,
                                               request.tensors, priority=Priority.VERIFICATION)

    def _judge(self, sender: str, body: VerifyStep, tensors: dict[str, torch.Tensor]) -> Reply:
        reply = self.service.verify(sender, body, tensors)
        result = dict(reply.tensors or {})
        result["logprobs"] = result["logprobs"] - FORGED_SHIFT
        return Reply(reply.body, result, reply.codec)


def submit_replays(node: SwarmNode, config: RunConfig, owner: str, stop: threading.Event,
                   every_s: float = 1.0, start: threading.Event | None = None) -> int:
    """The replay adversary: once the run has accepted rollouts (`start` is set; by default,
    once a stage peer announces version 1 or later), submit groups of the problems the
    coordinator handed out first (its order follows the public seed), with the correct answer
    and made-up log-probs, until `stop`; returns how many submissions were refused."""
    task = make_task(config.task.name, **config.task.options)
    tokenizer = load_tokenizer(resolve_model(config.model))
    scheduler = PromptScheduler(config.seed)
    refused = 0
    while not (start.is_set() if start is not None else _trained(node, config)):
        if stop.wait(0.5):
            return refused
    while not stop.wait(every_s):
        index = scheduler.next(1)[0]
        problem = task.problem("train", index)
        prompt = render_prompt(task, problem, tokenizer)
        answer = tokenizer.encode(problem.answer, add_special_tokens=False)
        rollout = Rollout(prompt_tokens=prompt, completion_tokens=answer,
                          behaviour_logprobs=[-0.1] * len(answer), finished=False)
        group = RolloutGroup(
            group_id=f"{task.name}/{index}", task=task.name, problem_index=index,
            stage_versions=[0] * config.num_stages,
            version_spans=[VersionSpan(start=0, versions=[0] * config.num_stages)],
            sampling_seed=0, rollouts=[rollout] * config.rollout.group_size)
        try:
            node.call_sync(owner, SUBMIT_ROLLOUTS, group, timeout=10)
        except (RemoteError, WireError, MessageLost, TimeoutError) as error:
            refused += 1
            log.info("replay refused: %s", error)
    return refused


def _trained(node: SwarmNode, config: RunConfig) -> bool:
    """Whether a stage peer announces a version past 0 (rollouts were accepted and trained)."""
    for stage in range(config.num_stages):
        records, _ = decode_records(node.run(node.lookup(stage_key(config.name, stage)),
                                             timeout=10), PeerRecord, stage)
        if any(record.version > 0 for record in records.values()):
            return True
    return False


def flood(node: SwarmNode, config: RunConfig, owner: str, stop: threading.Event,
          every_s: float = 0.2, oversized_bytes: int = MAX_SUBMISSION_BYTES + 2**20) -> int:
    """The flood adversary: malformed requests (a body of the wrong type, tensors of the wrong
    shape) to the coordinator (the run's owner, `owner`) and every stage peer, and oversized
    submissions to the coordinator's inbox, until `stop`; returns how many were sent."""
    sent = 0
    inbox = owner  # the coordinator
    targets: list[str] = []
    rng = random.Random()
    while not stop.wait(every_s):
        if sent % 20 == 0:  # refresh who is out there now and then
            targets = [inbox]
            for stage in range(config.num_stages):
                targets += node.run(node.lookup(stage_key(config.name, stage)), timeout=10)
        if not targets:
            continue
        target = rng.choice(targets)
        attack = rng.choice(("wrong-body", "wrong-tensors", "oversized") if target == inbox
                            else ("wrong-body", "wrong-tensors"))
        # A body of the wrong type: the flooder declares the RPC its own way.
        rpc = replace(SUBMIT_ROLLOUTS if target == inbox else INFERENCE_STEP, request=Empty)
        tensors = {}
        if attack == "wrong-tensors":
            tensors = {"inputs": torch.zeros(3, 2, 7)}
        elif attack == "oversized":
            tensors = {"inputs": torch.zeros(oversized_bytes // 4)}
        try:
            node.call_sync(target, rpc, Empty(), tensors, timeout=10)
        except (RemoteError, WireError, MessageLost, TimeoutError) as error:
            log.debug("flood refused: %s", error)
        sent += 1
    return sent


def hostile_peer(config: RunConfig, stage: int, node: SwarmNode, owner: str, name: str,
                 adversary: str, collusion_dir: Path | None = None, role: Role = "inference",
                 checkpoint_dir: Path | None = None, malformation: str | None = None
                 ) -> StagePeer:
    """A peer of `stage` of the run `owner` owns, whose inference (or training, for a training
    adversary) lies the way `adversary` does (`malformation`: the one a malformed-activations
    peer always sends)."""
    if adversary in TRAINING_ADVERSARIES:
        peer = StagePeer(config, stage, role, node, owner, checkpoint_dir, name)
        if peer.training is None:
            raise ValueError(f"{adversary} is a training peer")
        peer.training.trainer = HostileTrainer(peer.training.trainer, config.train, adversary)
        return peer
    peer_class = BoastingPeer if adversary == "huge-capacity" else StagePeer
    if adversary in JUDGE_ADVERSARIES:
        return peer_class(config, stage, role, node, owner, checkpoint_dir, name,
                          wrap_verification=LyingJudge)
    kind = "random-tokens" if adversary == "rotate-keys" else adversary
    return peer_class(config, stage, role, node, owner, checkpoint_dir, name,
                      wrap_inference=lambda service: HostileInference(service, kind,
                                                                      collusion_dir, malformation))


class HostileTrainer(StageTrainer):
    """An honest stage trainer (its state taken over) whose results lie the way `adversary`
    does: the training peer around it commits to and serves what this produces."""

    def __init__(self, honest: StageTrainer, train: TrainConfig, adversary: str) -> None:
        if adversary not in TRAINING_ADVERSARIES:
            raise ValueError(f"{adversary!r} is not a training adversary; one of "
                             f"{TRAINING_ADVERSARIES}")
        if adversary == "forge-flags" and not honest.stage.is_last:
            raise ValueError("forge-flags attacks from the last stage")
        super().__init__(honest.stage, train, honest.loss, honest.sampling, honest.autocast_dtype)
        self.optimizer.load_state_dict(honest.optimizer.state_dict())
        self.adversary = adversary

    def forward(self, micro: int, inputs: Activations, batch: TrainBatch,
                loss_inputs: LossInputs | None = None
                ) -> tuple[Activations, dict[str, float]]:
        out, metrics = super().forward(micro, inputs, batch, loss_inputs)
        if self.adversary == "forge-flags" and loss_inputs is not None:
            flagged = flagged_rows(out[0], out[1], self.loss)
            out = (torch.where(flagged, 0.0, FORGED_SURPRISE), torch.zeros_like(out[1]))
        return out, metrics

    def step(self, grad_scale: float) -> None:
        before = [p.detach().clone() for p in self.params]
        super().step(grad_scale)
        if self.adversary == "poison-update":
            lr = self.optimizer.param_groups[0]["lr"]
            with torch.no_grad():
                for p, old in zip(self.params, before):
                    # old - (p - old): the update reversed, and an Adam step's worth of noise.
                    p.copy_(2 * old - p + lr * torch.randn_like(p))


class BoastingPeer(StagePeer):
    """A stage peer that announces room for BOASTED_SESSIONS sessions and a version far newer
    than the one it serves."""

    def record(self) -> PeerRecord:
        honest = super().record()
        return msgspec.structs.replace(honest, free_sessions=BOASTED_SESSIONS,
                                       version=honest.version + BOASTED_VERSIONS)


def rotate_keys(config: RunConfig, stage: int, node: SwarmNode, new_node: Callable[[], SwarmNode],
                owner: str, name: str, stop: threading.Event,
                on_identity: Callable[[SwarmNode], None], idle_s: float = ROTATE_IDLE_S) -> int:
    """The rotate-keys adversary: a random-tokens liar of `stage` on `node`; each time its
    identity gets no work for `idle_s` after it had some (it was banned), it leaves and joins
    again on a fresh node (`new_node`, a new key; `on_identity` hears of each), until `stop`.
    Returns how many identities it used."""
    identities = 0
    while not stop.is_set():
        if identities:
            node = new_node()
        on_identity(node)
        identities += 1
        peer = hostile_peer(config, stage, node, owner, f"{name}.{identities}", "rotate-keys")
        peer.start()
        assert peer.inference is not None
        served, idle_since = 0, time.monotonic()
        while not stop.wait(1.0):
            if peer.inference.served_tokens != served:
                served, idle_since = peer.inference.served_tokens, time.monotonic()
            elif served and time.monotonic() - idle_since > idle_s:
                log.info("%s: identity %d is out of work; taking a new one", name, identities)
                break
        peer.stop()
        node.shutdown()
    return identities
