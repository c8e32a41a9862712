"""What a stage peer checks in a request before it computes anything: shapes, ranges and the
session arithmetic of inference steps and re-executions, the fields of a training micro-batch,
the activations and gradients a training stage receives. The node has already checked the body's
type and the tensors' names and dtype kinds against the RPC's declaration (net/protocol.py);
what is checked here depends on the stage (its model's sizes, whether it is the first or last).

A check that fails raises PeerError: the request was malformed, and the sender gets a strike.
A request that is well formed but cannot be served now raises PeerBusy: no strike."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentrl.errors import DecentrlError, SenderFault
from decentrl.learn.batch import BATCH_FIELDS, TrainBatch
from decentrl.model.moe import FREE_ROUTE, RoutingReplayError, checked_replay
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StagePlan, routing_layers
from decentrl.net.protocol import InferenceStep, VerifyStep
from decentrl.trust.relay import check_hidden_states


class PeerError(SenderFault):
    """A malformed request this peer refuses; the message says why. The peer keeps serving, and
    counts a strike against the sender (net/serving.py)."""


class PeerBusy(DecentrlError, RuntimeError):
    """A well-formed request this peer cannot serve in its present state (a session it no longer
    holds, no room, another version): no fault of the sender's, so no strike."""


def check_ids(name: str, ids: torch.Tensor, limit: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise PeerError(f"{name} must be in [0, {limit})")


@dataclass(frozen=True)
class InboundChecks:
    """The checks of one stage of a model."""

    spec: ModelSpec
    stage: int
    num_stages: int
    max_session_tokens: int
    stage_layers: tuple[int, ...] = ()  # the run's plan (config `stage_layers`); () even

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # ---- inference and re-execution ------------------------------------------------------

    def step(self, body: InferenceStep | VerifyStep, tensors: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, positions, key_valid) of positions [start, start + T) of a session."""
        inputs, positions, key_valid = tensors["inputs"], tensors["positions"], tensors["key_valid"]
        spec = self.spec
        if not 1 <= body.batch or not 1 <= body.max_length <= spec.max_positions \
                or body.batch * body.max_length > self.max_session_tokens:
            raise PeerError(f"batch {body.batch} x max_length {body.max_length} out of range "
                            f"(max_length <= {spec.max_positions}, batch x max_length <= "
                            f"{self.max_session_tokens})")
        self.inputs(inputs)
        batch, new = inputs.shape[0], inputs.shape[1]
        if batch != body.batch or new < 1 or body.start + new > body.max_length:
            raise PeerError(f"inputs {tuple(inputs.shape)} do not fit batch {body.batch}, start "
                            f"{body.start}, max_length {body.max_length}")
        if tuple(positions.shape) != (batch, new):
            raise PeerError(f"positions must be int64 [{batch}, {new}], got "
                            f"{tuple(positions.shape)}")
        check_ids("positions", positions, spec.max_positions)
        if tuple(key_valid.shape) != (batch, body.start + new):
            raise PeerError(f"key_valid must be bool [{batch}, {body.start + new}], got "
                            f"{tuple(key_valid.shape)}")
        if self.is_last and body.sampling is None:
            raise PeerError("the last stage needs sampling parameters")
        return inputs, positions, key_valid

    def inputs(self, inputs: torch.Tensor) -> None:
        """A step's inputs: token ids in the vocabulary at stage 0, hidden states of the model's
        width at any other."""
        spec = self.spec
        if self.is_first:
            if inputs.dtype != torch.long or inputs.dim() != 2:
                raise PeerError(f"stage 0 takes token ids [B, T] (int64), got "
                                f"{inputs.dtype} {tuple(inputs.shape)}")
            check_ids("token ids", inputs, spec.vocab_size)
        elif not inputs.is_floating_point() or inputs.dim() != 3 \
                or inputs.shape[2] != spec.hidden_size:
            raise PeerError(f"stage {self.stage} takes hidden states [B, T, {spec.hidden_size}], "
                            f"got {inputs.dtype} {tuple(inputs.shape)}")

    def pushed_inputs(self, inputs: torch.Tensor) -> None:
        """A pushed step's inputs (stage/push.py), checked whole as the coordinator checks a
        relayed reply: `inputs`, and hidden states finite and within the bound no honest
        activation reaches (trust/relay.py). The coordinator runs the same check on a refused
        push shown to it as evidence (client/push_sessions.py)."""
        self.inputs(inputs)
        if not self.is_first:
            check_hidden_states(inputs, inputs.shape[0], inputs.shape[1], self.spec.hidden_size)

    def targets(self, body: VerifyStep, tensors: dict[str, torch.Tensor], shape: torch.Size
                ) -> torch.Tensor | None:
        """The last stage's targets of a re-execution (None at other stages): the token sampled
        from each position, -1 where none was."""
        if not self.is_last:
            return None
        targets = tensors.get("targets")
        if targets is None or targets.shape != shape:
            raise PeerError(f"the last stage verifies against targets int64 {tuple(shape)}")
        if targets.numel() and (int(targets.min()) < -1
                                or int(targets.max()) >= self.spec.vocab_size):
            raise PeerError(f"targets must be -1 or token ids in [0, {self.spec.vocab_size})")
        if body.sampling is None or body.sampling_seed is None \
                or not 1 <= body.prompt_columns <= body.max_length:
            raise PeerError("the last stage verifies with sampling parameters, a sampling seed "
                            "and 1 <= prompt_columns <= max_length")
        # The rows drawn for are the sampling session's: it fit in a session this peer accepts.
        if body.first_row < 0 \
                or (body.first_row + body.batch) * body.max_length > self.max_session_tokens:
            raise PeerError(f"first_row {body.first_row} out of range (0 <= first_row, "
                            f"(first_row + batch) x max_length <= {self.max_session_tokens})")
        # Position prompt_columns - 1 predicts completion token 0; earlier ones predict nothing.
        before = max(0, body.prompt_columns - 1 - body.start)
        if bool((targets[:, :before] >= 0).any()):
            raise PeerError("a target before the last prompt column has no decoding step")
        return targets

    # ---- training ------------------------------------------------------------------------

    def batch(self, tensors: dict[str, torch.Tensor]) -> TrainBatch:
        """A training micro-batch whose fields agree with each other and with the model, as
        learn/batch.py declares them (BATCH_FIELDS: shape, range, masks within masks), with the
        routing to replay it was sent (`routing`)."""
        batch = TrainBatch.from_tensors(tensors)
        prompts, completions = batch.prompts.shape, batch.completions.shape
        if len(prompts) != 2 or len(completions) != 2:
            raise PeerError("prompts and completions must be [rows, length]")
        values = batch.tensors()
        for name, rule in BATCH_FIELDS.items():
            shape = rule.shape(prompts, completions)
            if values[name].shape != shape:
                raise PeerError(f"batch tensor {name} must be {tuple(shape)}, got "
                                f"{tuple(values[name].shape)}")
        bounds = {"vocabulary": self.spec.vocab_size, "positions": self.spec.max_positions,
                  "prompt rows": prompts[0]}
        for name, rule in BATCH_FIELDS.items():
            if rule.below is not None:
                label = f"{name} token ids" if rule.below == "vocabulary" else name
                check_ids(label, values[name], bounds[rule.below])
            if rule.within is not None and bool((values[name] & ~values[rule.within]).any()):
                raise PeerError(f"{name} marks tokens that {rule.within} does not")
        batch.routing = self.routing(tensors.get("routing"), completions)
        return batch

    def routing(self, sent: torch.Tensor | None, completions: torch.Size) -> torch.Tensor | None:
        """The routing a training forward replays, from the stage's part [B, C, its sparse
        layers, top_k] sent (the model's routing dtype; each token's experts distinct, or all
        FREE_ROUTE): laid out as a whole model's record (TrainBatch.routing), the other stages'
        layers FREE_ROUTE. None when none was sent."""
        if sent is None:
            return None
        part = self._sparse_part("replay routing in")
        moe = self.spec.moe
        assert moe is not None  # a stage with a part has sparse layers
        self._check_stage_routing("routing", sent, completions, part)
        whole = torch.full((*completions, len(self.spec.sparse_layers), moe.top_k), FREE_ROUTE,
                           dtype=sent.dtype)
        whole[:, :, part] = sent
        return whole

    def claimed_experts(self, tensors: dict[str, torch.Tensor], positions: torch.Size
                        ) -> torch.Tensor | None:
        """The experts a re-execution is asked to judge (`experts`, [B, T, the stage's sparse
        layers, top_k], each token's distinct or all FREE_ROUTE), or None where none were sent."""
        claimed = tensors.get("experts")
        if claimed is None:
            return None
        self._check_stage_routing("experts", claimed, positions,
                                  self._sparse_part("judge experts in"))
        return claimed

    def _sparse_part(self, purpose: str) -> slice:
        """The stage's part of a whole model's routing record; PeerError if it has none."""
        spec = self.spec
        plan = StagePlan.of(spec.num_layers, self.num_stages, self.stage_layers)
        part = routing_layers(spec, plan.layers(self.stage))
        if spec.moe is None or part.stop == part.start:
            raise PeerError(f"stage {self.stage} has no mixture-of-experts layer to {purpose}")
        return part

    def _check_stage_routing(self, name: str, sent: torch.Tensor, leading: torch.Size,
                             part: slice) -> None:
        """PeerError unless `sent` is the stage's routing (its `part` of the sparse layers) of
        `leading` [rows, positions] tokens."""
        moe = self.spec.moe
        assert moe is not None  # a stage with a part has sparse layers
        if sent.dtype != moe.routing_dtype:
            raise PeerError(f"{name} must be {moe.routing_dtype}, got {sent.dtype}")
        expected = (*leading, part.stop - part.start, moe.top_k)
        if tuple(sent.shape) != expected:
            raise PeerError(f"{name} must be {list(expected)} (rows, positions, the stage's "
                            f"sparse layers, top_k), got {list(sent.shape)}")
        try:
            checked_replay(sent, sent.shape[:-1], moe, sent.device)
        except RoutingReplayError as error:
            raise PeerError(f"{name}: {error}") from error

    def activations(self, tensors: dict[str, torch.Tensor], batch: TrainBatch
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (prompt, completion) inputs of a training forward: token ids at stage 0, hidden
        states after."""
        inputs = (tensors["prompt_in"], tensors["completion_in"])
        shapes = (batch.prompts.shape, batch.completions.shape)
        for name, tensor, shape in zip(("prompt_in", "completion_in"), inputs, shapes):
            if self.is_first:
                if tensor.dtype != torch.long or tensor.shape != shape:
                    raise PeerError(f"stage 0 takes {name} token ids {tuple(shape)}, got "
                                    f"{tensor.dtype} {tuple(tensor.shape)}")
            elif not tensor.is_floating_point() \
                    or tuple(tensor.shape) != (*shape, self.spec.hidden_size):
                raise PeerError(f"{name} must be hidden states {(*shape, self.spec.hidden_size)}, "
                                f"got {tensor.dtype} {tuple(tensor.shape)}")
        return inputs

    def gradients(self, tensors: dict[str, torch.Tensor],
                  outputs: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gradients of a training backward, shaped as the forward's outputs (none at the
        last stage, which computed the loss itself)."""
        if self.is_last:
            return None
        if "prompt_grad" not in tensors or "completion_grad" not in tensors:
            raise PeerError("train_backward needs prompt_grad and completion_grad")
        grads = (tensors["prompt_grad"], tensors["completion_grad"])
        for name, grad, output in zip(("prompt_grad", "completion_grad"), grads, outputs):
            if grad.shape != output.shape:
                raise PeerError(f"{name} has shape {tuple(grad.shape)}, the forward output was "
                                f"{tuple(output.shape)}")
        return grads
