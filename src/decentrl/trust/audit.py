"""Audits of training peers: on a random, hidden fraction of steps (`trust.train_audit_fraction`)
another training peer of the same stage recomputes the step from the same state and the same
micro-batches, and the coordinator compares the two. This module holds what the comparison needs
and decides nothing about the network: a training state as one flat vector and its digest, and
the checks; client/training.py (`TrainAudit`) runs the audit.

The trust argument. Every reply to a training step commits the digest of the peer's whole
training state after it (trainable weights, Adam moments, step count: `FlatState`), and the
coordinator keeps the digests of the last two versions. It decides whether to audit a step only
after the step's reply, from a source the peer cannot predict, so a peer does not know which of
its steps are audited. On an audit the coordinator fetches the pre-step and post-step states from
the peer and refuses them unless they hash to what the peer committed (a mismatch is a proof of a
lie: the peer signed both). Then:

- Self-consistency (`check_step`, proof): from the pre-step state and its own post-step moments
  the peer's weights are one AdamW step away, with the run's learning rate at that version and
  the optimizer's step count one higher. Anything else (a change added to the weights, a learning
  rate of its own) is visible to the coordinator alone, without a second peer; fp32 arithmetic
  gives honest peers 1e-6 or so, the check allows STEP_SLACK.
- The gradient (`gradient_error`, opinion): the step's gradient is read back from the first
  moment, g = (m - beta1 m0) / (1 - beta1), for the peer and for the auditor, who loaded the
  same pre-step state and replayed the same micro-batches: the same forward inputs, the same
  gradients from the next stage, the same global clip scale (the coordinator recorded them as it
  sent them to the peer). They must agree within `trust.train_audit_tolerance` (relative L2, per
  tensor), calibrated on honest peers in bf16 and fp32 and with different thread counts
  (bench/train_audit.py).
- What the peer sent on (`output_error`, opinion): its activations to the next stage, its
  gradients to the previous one, and at the last stage its per-row statistics, from which the
  trainer flags rows (learn/trainer.py): forged flags blame honest producers or let poisoned rows
  into the loss. The same tolerance, relative to each tensor's norm.

An opinion against the peer is not a verdict: a third training peer replays the step too, and the
one of the two the third disagrees with lied. What a liar can still get away with: a change
within the tolerance on every step (bounded by it), and any change on a step nobody audited until
an audit catches it, with probability `train_audit_fraction` per step; then its whole step is
reverted and every stage rolls back to the last checkpoint, which may hold unaudited changes of
its (checkpoints are not audited). The digest binds the state the peer trains on, not what it
publishes to its replicas: those are checked by spot-checks of what they serve (trust/verify.py).
Two colluding training peers of one stage, auditor and primary, pass each other's lies. With only
two training peers at a stage a disagreement cannot be settled: the step is reverted (the loop
rolls back) and nobody is blamed, so a liar there costs the run its audited steps but never gets
a lie through an audit.

Costs: every training peer keeps two CPU copies of its state (weights and both moments: three
times the trainable parameters, twice) and copies and hashes one per step; an auditor holds a
second trainer of its stage; an audit moves the state four times through the coordinator (pre
and post from the primary, pre to the auditor, its post back), which holds three copies while it
compares. bench/train_audit.py measures them."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from decentrl.config import TrainConfig
from decentrl.learn.stage_trainer import StageTrainer

# fp32 arithmetic (another device, another kernel order) moves an honest AdamW step by 1e-6 of
# its size or so; a change added to the weights is of the order of the step itself.
STEP_SLACK = 1e-3
# Below this share of the stage's gradient norm, a tensor's gradient is compared against the
# stage's (a tensor whose gradient is almost zero would otherwise amplify rounding noise).
NORM_FLOOR = 1e-2


@dataclass(frozen=True)
class FlatState:
    """A stage's training state as one float32 vector: per trainable parameter, in the
    optimizer's order, its weights, Adam's first moment, then its second moment (zeros before
    the first step). `names` and `sizes` say which parameter each stretch holds."""

    version: int
    step: int  # the optimizer's step count
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    flat: torch.Tensor

    @property
    def digest(self) -> str:
        return state_digest(self.version, self.step, self.names, self.sizes, self.flat)

    def parts(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Parameter `index`'s (weights, first moment, second moment)."""
        start = 3 * sum(self.sizes[:index])
        size = self.sizes[index]
        return (self.flat[start:start + size], self.flat[start + size:start + 2 * size],
                self.flat[start + 2 * size:start + 3 * size])


def state_digest(version: int, step: int, names: tuple[str, ...], sizes: tuple[int, ...],
                 flat: torch.Tensor) -> str:
    digest = hashlib.sha256()  # several times blake2b's speed where the CPU has SHA instructions
    digest.update(f"{version}:{step}:{','.join(names)}:{sizes}".encode())
    digest.update(flat.contiguous().numpy())  # the buffer itself: no copy of the state
    return digest.hexdigest()


def trainable(trainer: StageTrainer) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer steps, in its order (it was given `trainer.params`)."""
    return [(name, p) for name, p in trainer.stage.named_parameters() if p.requires_grad]


def state_layout(trainer: StageTrainer) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The names and sizes of a FlatState of `trainer`."""
    params = trainable(trainer)
    return tuple(name for name, _ in params), tuple(p.numel() for _, p in params)


def flat_state(trainer: StageTrainer) -> FlatState:
    """A CPU copy of the trainer's training state."""
    names, sizes = state_layout(trainer)
    flat = torch.zeros(3 * sum(sizes), dtype=torch.float32)
    start, step = 0, 0
    for (_, p), size in zip(trainable(trainer), sizes):
        state = trainer.optimizer.state.get(p, {})
        flat[start:start + size].copy_(p.detach().flatten())
        for part, key in enumerate(("exp_avg", "exp_avg_sq"), start=1):
            if key in state:
                flat[start + part * size:start + (part + 1) * size].copy_(state[key].flatten())
        if "step" in state:
            step = max(step, int(state["step"]))
        start += 3 * size
    return FlatState(trainer.version, step, names, sizes, flat)


def load_flat_state(trainer: StageTrainer, state: FlatState) -> None:
    """Put `state` into `trainer` (same stage, same trainable parameters)."""
    params = trainable(trainer)
    if state_layout(trainer) != (state.names, state.sizes):
        raise ValueError(f"the state is of other parameters than stage {trainer.stage.index}'s")
    trainer.optimizer.state.clear()
    with torch.no_grad():
        for index, (_, p) in enumerate(params):
            weights, first, second = (t.view(p.shape).to(p.device) for t in state.parts(index))
            p.copy_(weights)
            if state.step > 0:
                trainer.optimizer.state[p] = {
                    "step": torch.tensor(float(state.step)),
                    "exp_avg": first.to(p.dtype).clone(), "exp_avg_sq": second.to(p.dtype).clone()}
    trainer.stage.version = state.version


def learning_rate(train: TrainConfig, version: int) -> float:
    """The learning rate of the step that makes `version` (StageTrainer.step)."""
    if not train.lr_warmup_steps:
        return train.lr
    return train.lr * min(1.0, version / train.lr_warmup_steps)


def _norm(t: torch.Tensor) -> float:
    return float(t.norm())


def check_step(pre: FlatState, post: FlatState, train: TrainConfig) -> str | None:
    """Why `post` is not one AdamW step from `pre` with its own moments, or None."""
    if post.names != pre.names or post.sizes != pre.sizes:
        return "the post-step state is of other parameters than the pre-step state"
    if post.version != pre.version + 1 or post.step != pre.step + 1:
        return (f"the step goes from version {pre.version} (optimizer step {pre.step}) to "
                f"{post.version} ({post.step})")
    beta1, beta2 = train.betas
    lr = learning_rate(train, post.version)
    eps = 1e-8  # AdamW's default, which StageTrainer keeps
    correction1, correction2 = 1 - beta1 ** post.step, 1 - beta2 ** post.step
    for index, name in enumerate(pre.names):
        # In float32, as the optimizer computed it: the slack covers the rounding.
        w0, m0, v0 = pre.parts(index)
        w, m, v = post.parts(index)
        gradient = (m - beta1 * m0) / (1 - beta1)
        second = beta2 * v0 + (1 - beta2) * gradient * gradient
        if _norm(v - second) > 1e-2 * _norm(v - beta2 * v0) + 1e-30:
            return f"{name}: the second moment is not the first moment's gradient squared"
        expected = w0 * (1 - lr * train.weight_decay) - (lr / correction1) * m / (
            v.sqrt() / math.sqrt(correction2) + eps)
        if _norm(w - expected) > STEP_SLACK * _norm(expected - w0) + 2**-22 * _norm(w0):
            return (f"{name}: the weights moved {_norm(w - w0):.3g} where AdamW of its own "
                    f"moments moves them {_norm(expected - w0):.3g} (off by "
                    f"{_norm(w - expected):.3g})")
    return None


def step_gradient(pre: FlatState, post: FlatState, index: int, beta1: float) -> torch.Tensor:
    """Parameter `index`'s gradient of the step from `pre` to `post`, read from the first
    moment."""
    return (post.parts(index)[1] - beta1 * pre.parts(index)[1]) / (1 - beta1)


def gradient_error(pre: FlatState, primary: FlatState, auditor: FlatState,
                   beta1: float) -> tuple[float, str]:
    """The largest per-tensor relative L2 distance between the step's gradients of two peers
    from the same pre-step state, and the tensor where it is."""
    if auditor.names != primary.names or auditor.sizes != primary.sizes:
        return math.inf, "the two states are of different parameters"
    norms = [_norm(step_gradient(pre, auditor, i, beta1)) for i in range(len(pre.sizes))]
    total = math.sqrt(sum(norm ** 2 for norm in norms))
    worst, where = 0.0, ""
    for index, (name, norm) in enumerate(zip(pre.names, norms)):
        difference = step_gradient(pre, primary, index, beta1) - \
            step_gradient(pre, auditor, index, beta1)
        error = _norm(difference) / max(norm, NORM_FLOOR * total, 1e-30)
        if error > worst:
            worst, where = error, name
    return worst, where


def output_error(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                 floor: float = 0.0) -> float:
    """The largest relative L2 distance between two peers' outputs of the same name (activations,
    gradients, row statistics); inf if they are not the same tensors. `floor`: per element, the
    smallest scale a distance is relative to (row statistics near zero are compared in nats)."""
    if ours.keys() != theirs.keys():
        return math.inf
    worst = 0.0
    for name, a in ours.items():
        b = theirs[name]
        if a.shape != b.shape:
            return math.inf
        scale = max(_norm(b.float()), floor * math.sqrt(b.numel()), 1e-30)
        worst = max(worst, _norm(a.float() - b.float()) / scale)
    return worst
