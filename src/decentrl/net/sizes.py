"""The sizes every message of a run is bounded by: the run's `RunSizes` (hidden width, positions,
session tokens, micro-batch, routing record, stages) and the byte limit of each kind of request
and reply as a function of them (net/protocol.py declares which RPC gets which). Every limit is
checked as a message is read (net/streams.py), before anything is decoded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from decentrl.config import RunConfig
from decentrl.learn.batch import BATCH_FIELDS, Layout
from decentrl.model.spec import ModelSpec
from decentrl.net.evidence import MAX_PER_SENDER

# A request without tensors is a few hundred bytes; this leaves room, and nothing more. Also the
# room a message of tensors gets for its envelope and its manifest.
SMALL_REQUEST_BYTES = 64 * 2**10
# A push's acknowledgement: a failure's detail is cut to 500 characters, and the signed envelope
# is a few hundred bytes more. Kept small because a call over a relayed connection reserves its
# reply's limit of the connection's 100 KiB (net/circuits.py): with 64 KiB, each push to a peer
# behind a relay would dial a fresh circuit.
ACK_REPLY_BYTES = 8 * 2**10
# A rollout group is token ids and log-probs, a few hundred KiB even for long completions (and a
# mixture of experts' routing records beside them: submission_bytes).
MAX_SUBMISSION_BYTES = 8 * 2**20

# ---- size limits ---------------------------------------------------------------------------
#
# Every request and every reply has a limit on its bytes on the wire, checked as it is read (net/
# streams.py) before anything is decoded. Messages without tensors get SMALL_REQUEST_BYTES. The
# activations and micro-batches of a run are bounded by its sizes (RunSizes): a function of them
# declares those limits, and the node evaluates it with the sizes it was given.

# Bytes per element at their widest on the wire: token ids and positions are int64, a float is
# float32 at most (the fp32 codec), a mask is bool.
ID_BYTES, FLOAT_BYTES, FLAG_BYTES = 8, 4, 1
# An expert index at its widest (int16, model/moe.py routing_dtype).
ROUTING_BYTES = 2
# A sha256 digest (a stage's commitment to one row of a step).
DIGEST_BYTES = 32


@dataclass(frozen=True)
class RunSizes:
    """What bounds the tensors a run's RPCs carry: the model's hidden width and positions, the
    tokens one inference session may hold (batch x max_length), the sequences of a training
    micro-batch, and a position's routing record (a mixture of experts: every sparse layer's
    top_k experts at ROUTING_BYTES each; 0 for a dense model)."""

    hidden_size: int
    max_positions: int
    max_session_tokens: int
    micro_batch_size: int
    routing_bytes: int = 0
    num_stages: int = 1

    @classmethod
    def of(cls, spec: ModelSpec, config: RunConfig) -> RunSizes:
        routing = 0 if spec.moe is None else \
            len(spec.sparse_layers) * spec.moe.top_k * ROUTING_BYTES
        return cls(spec.hidden_size, spec.max_positions, config.swarm.max_session_tokens,
                   config.train.micro_batch_size, routing, config.num_stages)

    @property
    def activation_bytes(self) -> int:
        """One position's input or output of a stage: a token id, or a hidden state."""
        return max(ID_BYTES, FLOAT_BYTES * self.hidden_size)

    @property
    def batch_positions(self) -> int:
        """Positions of a micro-batch's prompts, or of its completions, at most: every row is
        at most max_positions long."""
        return self.micro_batch_size * self.max_positions


def with_envelope(tensor_bytes: int) -> int:
    """A message's bytes on the wire for `tensor_bytes` of tensors: its envelope, and the chunk
    and frame headers (a few dozen bytes per MiB)."""
    return tensor_bytes + tensor_bytes // 1024 + SMALL_REQUEST_BYTES


def step_request_bytes(sizes: RunSizes) -> int:
    """An inference or verification step: per position of the session, its input, its position
    id, its key mask and (verification) its target and claimed experts."""
    per_position = sizes.activation_bytes + 2 * ID_BYTES + FLAG_BYTES + sizes.routing_bytes
    return with_envelope(sizes.max_session_tokens * per_position)


def step_reply_bytes(sizes: RunSizes) -> int:
    """An inference step's reply: per new position its hidden state, or at the last stage a
    few scores, and (a mixture of experts) its experts in the stage's sparse layers (bounded by
    the model's)."""
    return with_envelope(sizes.max_session_tokens
                         * (sizes.activation_bytes + sizes.routing_bytes))


def commits_bytes(sizes: RunSizes) -> int:
    """Every stage's signed commitment to one step (net/push_messages.py StepCommit): a digest
    per row (a session has at most max_session_tokens rows) and a few hundred bytes besides."""
    return sizes.num_stages * (sizes.max_session_tokens * (DIGEST_BYTES + 2) + 512)


def push_request_bytes(sizes: RunSizes) -> int:
    """A pushed step (or a failover's replay): an inference step and the earlier stages'
    commitments."""
    return step_request_bytes(sizes) + commits_bytes(sizes)


def evidence_reply_bytes(sizes: RunSizes) -> int:
    """A peer's kept pushes from one sender (net/evidence.py), each with its envelope."""
    return MAX_PER_SENDER * with_envelope(push_request_bytes(sizes))


def outcome_reply_bytes(sizes: RunSizes) -> int:
    """A sampled step collected from the last stage: per row its token and log-prob, every new
    position's experts (a mixture of experts), and every stage's commitment."""
    return with_envelope(sizes.max_session_tokens * (ID_BYTES + FLOAT_BYTES
                                                     + sizes.routing_bytes)) \
        + commits_bytes(sizes)


def reveal_reply_bytes(sizes: RunSizes) -> int:
    """A reveal: the rows asked for of at most a session's positions, and every row's digest of
    each step (a session holds at most max_session_tokens rows x steps)."""
    return step_reply_bytes(sizes) + sizes.max_session_tokens * (DIGEST_BYTES + 2)


def verify_reply_bytes(sizes: RunSizes) -> int:
    """A re-execution's reply: per position its hidden state, or at the last stage a few
    scores, and (claimed experts judged) its routing gap."""
    return with_envelope(sizes.max_session_tokens * (sizes.activation_bytes + FLOAT_BYTES))


def batch_bytes(layout: Layout) -> int:
    """The bytes a micro-batch's fields (learn/batch.py TrainBatch) take per element of `layout`:
    per prompt position, per completion position or per row."""
    return sum(rule.dtype.itemsize for rule in BATCH_FIELDS.values() if rule.layout == layout)


def forward_request_bytes(sizes: RunSizes) -> int:
    """A training micro-batch and the stage's inputs: the batch's fields per prompt position, per
    completion position and per row; each position's input; and per completion position the
    proximal and reference log-probs, the entropy method's selection (a byte) and (routing
    replay) its experts in the stage's sparse layers (bounded by the model's)."""
    prompt = batch_bytes("prompt tokens") + sizes.activation_bytes
    completion = batch_bytes("completion tokens") + 2 * FLOAT_BYTES + FLAG_BYTES \
        + sizes.activation_bytes + sizes.routing_bytes
    return with_envelope(sizes.batch_positions * (prompt + completion)
                         + sizes.micro_batch_size * batch_bytes("completions"))


def activation_pair_bytes(sizes: RunSizes) -> int:
    """A micro-batch's prompt and completion hidden states, or their gradients (a forward's
    outputs, a backward's request and reply), and two floats per row."""
    return with_envelope(2 * sizes.batch_positions * sizes.activation_bytes
                         + 2 * sizes.micro_batch_size * FLOAT_BYTES)


def train_chain_request_bytes(sizes: RunSizes) -> int:
    """A micro-batch pushed down the training chain: a training forward's request."""
    return forward_request_bytes(sizes)


def train_chain_reply_bytes(sizes: RunSizes) -> int:
    """The gradients of a micro-batch's inputs, its row statistics, and every stage's signed
    commitment (four digests and a signature: under 1 KiB each)."""
    return activation_pair_bytes(sizes) + sizes.num_stages * 2**10


def logprobs_chain_reply_bytes(sizes: RunSizes) -> int:
    """A forward-only micro-batch's answer down the training chain: the last stage's log-prob
    of every completion position, and every stage's signed commitment (two digests and a
    signature: under 1 KiB each)."""
    return with_envelope(sizes.batch_positions * FLOAT_BYTES) + sizes.num_stages * 2**10


def tape_reply_bytes(sizes: RunSizes) -> int:
    """What a training stage received and sent for one micro-batch: inputs, outputs and two
    gradients, each an activation pair at most."""
    return 4 * activation_pair_bytes(sizes)


def submission_bytes(sizes: RunSizes) -> int:
    """A rollout group: MAX_SUBMISSION_BYTES, and (a mixture of experts) every completion token's
    routing record. The swarm samples a group's rows in one inference session (coordinator/
    inflight.py groups_per_session), which no peer serves past max_session_tokens positions, so
    a group's tokens are at most a session's."""
    return MAX_SUBMISSION_BYTES + sizes.max_session_tokens * sizes.routing_bytes


# A size limit: bytes, or a function of the run's sizes.
SizeLimit = int | Callable[[RunSizes], int]


def size_limit(limit: SizeLimit, sizes: RunSizes | None) -> int | None:
    """`limit` in bytes; None where it depends on sizes that are not known."""
    if isinstance(limit, int):
        return limit
    return None if sizes is None else limit(sizes)
