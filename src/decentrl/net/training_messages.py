"""The bodies of the RPCs that drive a training peer (net/protocol.py declares the RPCs): a
micro-batch's forward and backward, the optimizer step, checkpoints and their shards, and the
training state an audit reads and loads. The bodies of its published weights (what its replicas
are brought to) are in net/protocol.py, beside the weight updates."""

from __future__ import annotations

from typing import Literal

from decentrl.net.wire import Body


class TrainForward(Body):
    """One micro-batch through one training stage. Tensors: the micro-batch (TrainBatch fields),
    `prompt_in` / `completion_in` (token ids at stage 0, hidden states after), at the last
    stage optionally `proximal` / `reference` log-probs and the `selected` tokens of the
    entropy method (learn/entropy.py), and with routing replay (a stage with
    mixture-of-experts layers) `routing`: the experts [B, C, the stage's sparse layers, top_k]
    each completion token went to when it was sampled, to replay."""

    micro: int
    version: int  # the learner version this step starts from; a peer at another version refuses
    last: bool  # compute the loss here (the coordinator's view of the chain)
    total_sequences: int  # the minibatch's sampled rows, whose policy loss it normalises
    total_tokens: int  # their sampled tokens
    audit: bool = False  # on the audit's state (TRAIN_AUDIT_LOAD), not the peer's own
    # The minibatch's supervised rows' tokens (the coordinator's demonstrations, learn/batch.py).
    total_supervised_tokens: int = 0
    # The adaptive entropy bonus's weight in this update (train.entropy.target), at most
    # train.entropy.max_coef.
    entropy_coef: float = 0.0


class TrainForwardReply(Body):
    """`prompt_out` / `completion_out` tensors, or at the last stage the loss metrics."""

    metrics: dict[str, float]


class TrainBackward(Body):
    """Tensors `prompt_grad` / `completion_grad` (none at the last stage)."""

    micro: int
    audit: bool = False


class GradNorm(Body):
    square_norm: float


class TrainStep(Body):
    grad_scale: float
    version: int  # the version after this step; a peer at another version refuses
    audit: bool = False  # step the audit's state: nothing is published
    commit: bool = False  # keep the states before and after, and reply the digest of the latter


class VersionReply(Body):
    version: int
    # A step's reply when asked to commit (TrainStep.commit): the digest of the peer's training
    # state at `version` (trust/audit.py), which the peer commits to.
    state_digest: str = ""


class CheckpointReply(Body):
    version: int
    # A save's: the sha256 and size of the stage shard the peer wrote (the coordinator signs
    # them into the checkpoint's manifest, and checks a shard it fetches against them).
    shard_sha256: str = ""
    shard_bytes: int = 0


class ShardRequest(Body):
    """Bytes [offset, offset + count) of a training peer's checkpoint shard at `version`."""

    version: int
    offset: int
    count: int  # at most SHARD_CHUNK_BYTES


class ShardChunk(Body):
    """Tensor `data`: uint8, the bytes asked for (fewer at the end of the file)."""

    version: int
    total: int  # the shard's size in bytes


class CheckpointRequest(Body):
    action: Literal["save", "load"]
    version: int
    # The coordinator's last committed checkpoint (-1: none): a training peer may delete its
    # older ones after a save.
    committed: int = -1


class StateRequest(Body):
    """A stretch of a training peer's flat training state (trust/audit.py FlatState)."""

    version: int
    offset: int  # in floats
    count: int  # floats wanted, at most STATE_CHUNK_FLOATS (0: the header alone)
    audit: bool = False  # the audit's recomputed state instead of the peer's own


class StateChunk(Body):
    """Tensor `data`: float32 [min(count, total - offset)]."""

    version: int
    step: int  # the optimizer's step count
    total: int  # floats in the whole state
    digest: str
    names: tuple[str, ...]  # the trainable parameters, in the optimizer's order
    sizes: tuple[int, ...]


class AuditLoad(Body):
    """A stretch of the state an audit starts from, in order (tensor `data`, float32); the last
    one makes the peer check the digest and load it."""

    version: int
    step: int
    offset: int
    total: int
    digest: str
    names: tuple[str, ...]
    sizes: tuple[int, ...]


class TrainChain(Body):
    """One micro-batch pushed down the training chain (`swarm.data_plane = "peer_to_peer"`):
    `forward` as a TrainForward would say it (each stage sets `last` for itself), the owner's
    signed TrainingRoute. Tensors: the micro-batch's fields, `prompt_in` / `completion_in` (token
    ids to stage 0, the previous stage's outputs after), and for the stages that use them
    `proximal` / `reference` and the whole `routing` record (each stage replays its part). The
    reply, once every later stage answered: the gradients of the inputs (none from stage 0), the
    last stage's row statistics and metrics, and every stage's signed TrainCommit from this one
    on, in stage order."""

    route: bytes
    forward: TrainForward


class TrainChainReply(Body):
    metrics: dict[str, float]
    commits: list[bytes]


class TapeRequest(Body):
    """An audit's reveal of what a training peer received and sent for micro-batch `micro` of
    the step from `version` (kept for the last two versions)."""

    version: int
    micro: int


class TapeReply(Body):
    """Tensors `prompt_in` / `completion_in` (what it received), `prompt_out` /
    `completion_out` or at the last stage `row_surprise` / `row_log_ratio` (what it sent on),
    `prompt_grad_in` / `completion_grad_in` (the gradients it received; none at the last stage)
    and `prompt_grad` / `completion_grad` (those it sent back; none at stage 0)."""

    metrics: dict[str, float]


class LogprobsForward(Body):
    """One micro-batch through one training stage, forward only (`train_logprobs`): the proximal
    log-probs of a batch that takes several optimizer steps (learn/trainer.py
    `PipelineTrainer.proximal_logprobs`). Tensors as a TrainForward's, without `proximal` and
    `reference` (no loss is computed). The stage runs its learner at `version` without gradient
    and keeps nothing: not the activations, not a tape; its weights and optimizer state do not
    change. The reply: `prompt_out` / `completion_out`, or at the last stage `logprobs` [rows,
    completion] float32, the sampling-transformed log-prob of every completion target (0 past a
    row's end), as its training forward computes them for the loss."""

    micro: int
    version: int  # the learner version to run; a peer at another version refuses
    last: bool  # the coordinator's view of the chain, as in TrainForward


class LogprobsChain(Body):
    """A forward-only micro-batch pushed down the training chain (`train_logprobs_chain`):
    `forward` as a LogprobsForward would say it (each stage sets `last` for itself) under the
    owner's signed TrainingRoute of `forward.version`. Tensors: the micro-batch's fields,
    `prompt_in` / `completion_in` (token ids to stage 0, the previous stage's outputs after)
    and the whole `routing` record. The reply: tensor `logprobs` from the last stage, and every
    stage's signed ForwardCommit from this one on, in stage order."""

    route: bytes
    forward: LogprobsForward


class LogprobsChainReply(Body):
    commits: list[bytes]
