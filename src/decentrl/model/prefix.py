"""Training forward with a shared prompt. The G samples of a group share their prompt, so the
prompt is run once per group and its keys/values are gathered for every sample's completion
(gradients flow back through the gather and sum over the group). Exact, and it cuts the tokens a
training step processes by about G times the prompt length; prompts are most of each sequence for
short-answer tasks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentrl.model.stages import LayerList, RecordingKV, StageModule


@dataclass
class SharedPromptKV:
    """One layer's prompt keys/values gathered per completion row, in front of its own."""

    keys: torch.Tensor  # [prompts, kv_heads, P, head_dim]
    values: torch.Tensor
    prompt_of: torch.Tensor  # [completions] index of each completion's prompt

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([self.keys[self.prompt_of], keys], dim=2),
                torch.cat([self.values[self.prompt_of], values], dim=2))


def shared_prompt_body(stage: StageModule, prompt_inputs: torch.Tensor,
                       prompt_positions: torch.Tensor, prompt_valid: torch.Tensor,
                       completion_inputs: torch.Tensor, completion_positions: torch.Tensor,
                       completion_valid: torch.Tensor, prompt_of: torch.Tensor,
                       completion_replay: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's body over prompts [Np, P] and completions [B, C]; returns both hidden states.
    `completion_replay` [B, C, the stage's sparse layers, top_k]: the completions' recorded
    routing, replayed (the prompts route freely)."""
    recorded = LayerList([RecordingKV() for _ in stage.layers])
    prompt_hidden = stage.body(prompt_inputs, prompt_positions, prompt_valid, recorded)
    shared = LayerList([SharedPromptKV(r.keys, r.values, prompt_of) for r in recorded.layers],
                       length=prompt_inputs.shape[1])
    key_valid = torch.cat([prompt_valid[prompt_of], completion_valid], dim=1)
    completion_hidden = stage.body(completion_inputs, completion_positions, key_valid, shared,
                                   completion_replay)
    return prompt_hidden, completion_hidden


def predicting_hidden(prompt_hidden: torch.Tensor, completion_hidden: torch.Tensor,
                      prompt_of: torch.Tensor) -> torch.Tensor:
    """[B, C, H]: the hidden state that predicts completion token j is the last prompt position's
    for j = 0 and completion position j - 1's after."""
    return torch.cat([prompt_hidden[prompt_of, -1:], completion_hidden[:, :-1]], dim=1)
