"""Activation commitments (trust/commit.py): an honest stage's claim passes a recomputation in
another dtype and batch layout, with a 2x margin; scaled or noisy outputs, other dims and
malformed wire tensors do not. The real-model calibration is marked slow."""

from __future__ import annotations

import pytest
import torch

from decentrl.model.loading import DEFAULT_MODEL, LoadedModel, load_model
from decentrl.model.stages import StageModule, StagePlan, build_stage
from decentrl.net.wire import decode_tensor, encode_tensor
from decentrl.trust.commit import (
    Commitment,
    CommitTolerance,
    check_commitment,
    commit_points,
    commitment_to_wire,
    make_commitment,
    parse_commitment,
)

TOLERANCE = CommitTolerance()
# Half as loose: honest computation must pass this too (the defaults' margin).
TIGHT = CommitTolerance(rel_tol=TOLERANCE.rel_tol / 2, max_mean_error=TOLERANCE.max_mean_error / 2)
INTERVAL, TOP_K = 4, 8
LENGTHS = (40, 17, 33, 26)


def stage0(model: LoadedModel, dtype: torch.dtype) -> StageModule:
    plan = StagePlan.even(model.spec.num_layers, 2)
    return build_stage(model.spec, plan, 0, model.tensors, torch.device("cpu"), dtype)


def sequences(model: LoadedModel, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, model.spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def layout(seqs: list[list[int]], extra: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, position ids and the valid mask [B, T] of left-padded rows, as generation
    builds them; `extra` pads every row by that many more columns."""
    length = max(len(s) for s in seqs) + extra
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    valid = torch.zeros(len(seqs), length, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        ids[row, length - len(seq):] = torch.tensor(seq)
        valid[row, length - len(seq):] = True
    return ids, (valid.long().cumsum(-1) - 1).clamp(min=0), valid


@torch.no_grad()
def decoded(stage: StageModule, seqs: list[list[int]], prefill: int = 8
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stage's output as an inference session computes it: a prefill, then one column per
    step through the KV cache. Returns (hidden float32, positions, valid)."""
    ids, positions, valid = layout(seqs)
    cache = stage.new_cache(*ids.shape)
    outs = [stage.body(ids[:, :prefill], positions[:, :prefill], valid[:, :prefill], cache)]
    for t in range(prefill, ids.shape[1]):
        outs.append(stage.body(ids[:, t:t + 1], positions[:, t:t + 1], valid[:, :t + 1], cache))
    return torch.cat(outs, 1).float(), positions, valid


@torch.no_grad()
def teacher_forced(stage: StageModule, seqs: list[list[int]], extra: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's recomputation: whole sequences at once, in another padding layout."""
    ids, positions, valid = layout(seqs, extra)
    return stage.body(ids, positions, valid).float(), positions, valid


def claim_of(hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> Commitment:
    return make_commitment(hidden, positions, valid, INTERVAL, TOP_K)


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_sharp_dir"])
def model(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(request.getfixturevalue(request.param)))


def test_commit_points_are_named_by_position_ids_not_columns(tiny_model: LoadedModel) -> None:
    seqs = sequences(tiny_model)
    _, positions, valid = layout(seqs)
    _, positions_padded, valid_padded = layout(seqs, extra=5)
    points = [sorted(zip(rows.tolist(), p[rows, cols].tolist()))
              for p, v in ((positions, valid), (positions_padded, valid_padded))
              for rows, cols in [commit_points(p, v, INTERVAL)]]
    assert points[0] == points[1]
    # Every multiple of the interval below each row's length, padding never.
    assert points[0] == [(row, position) for row, n in enumerate(LENGTHS)
                         for position in range(0, n, INTERVAL)]


@pytest.mark.parametrize("claim_dtype, verify_dtype", [(torch.bfloat16, torch.float32),
                                                       (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("extra", [0, 3])
def test_honest_recomputation_passes_with_margin(model: LoadedModel, claim_dtype: torch.dtype,
                                                 verify_dtype: torch.dtype, extra: int) -> None:
    seqs = sequences(model)
    claim = claim_of(*decoded(stage0(model, claim_dtype), seqs))
    hidden, positions, valid = teacher_forced(stage0(model, verify_dtype), seqs, extra)
    assert len(claim) == sum(len(range(0, n, INTERVAL)) for n in LENGTHS)
    for tolerance in (TOLERANCE, TIGHT):
        check = check_commitment(claim, hidden, positions, valid, tolerance)
        assert (check.checked, check.failed, check.first_failure) == (len(claim), 0, None)
    # Single rows (no padding at all) recompute the same points.
    for row, seq in enumerate(seqs):
        single = teacher_forced(stage0(model, verify_dtype), [seq], 0)
        own = claim.select(claim.rows == row)
        own = Commitment(torch.zeros_like(own.rows), own.positions, own.indices, own.values)
        assert check_commitment(own, *single, TIGHT).failed == 0


@pytest.mark.parametrize("corruption", ["scale 1.1", "noise 0.1"])
def test_scaled_or_noisy_outputs_fail(model: LoadedModel, corruption: str) -> None:
    seqs = sequences(model)
    hidden, positions, valid = decoded(stage0(model, torch.bfloat16), seqs)
    if corruption == "scale 1.1":
        hidden = hidden * 1.1
    else:
        noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
        hidden = hidden + 0.1 * hidden.std(-1, keepdim=True) * noise
    check = check_commitment(claim_of(hidden, positions, valid),
                             *teacher_forced(stage0(model, torch.float32), seqs, 3), TOLERANCE)
    assert check.checked >= TOLERANCE.mean_min_points
    assert check.failed > check.checked // 2
    assert check.mean > TOLERANCE.max_mean_error


def test_first_failure_is_the_earliest_wrong_point(tiny_model: LoadedModel) -> None:
    seqs = sequences(tiny_model)
    hidden, positions, valid = decoded(stage0(tiny_model, torch.bfloat16), seqs)
    row, start = 2, 12  # row 2 (33 tokens) goes wrong at its position 12, a commit point
    column = int((positions[row] == start).logical_and(valid[row]).nonzero())
    hidden[row, column:] *= 1.5
    claim = claim_of(hidden, positions, valid)
    check = check_commitment(claim, *teacher_forced(stage0(tiny_model, torch.float32), seqs, 0),
                             TOLERANCE)
    assert check.first_failure == (row, start)
    assert check.failed == len(range(start, LENGTHS[row], INTERVAL))
    assert check.worst > 0.3


def test_dims_outside_the_top_k_fail_even_with_true_values(tiny_model: LoadedModel) -> None:
    seqs = sequences(tiny_model)
    hidden, positions, valid = decoded(stage0(tiny_model, torch.float32), seqs)
    rows, cols = commit_points(positions, valid, INTERVAL)
    points = hidden[rows, cols]
    smallest = points.abs().topk(TOP_K, dim=-1, largest=False).indices
    claim = Commitment(rows, positions[rows, cols], smallest,
                       points.gather(-1, smallest).to(torch.bfloat16).float())
    check = check_commitment(claim, hidden, positions, valid, TOLERANCE)
    assert check.failed == check.checked == len(claim)


def test_points_the_recomputation_lacks_are_not_checked(tiny_model: LoadedModel) -> None:
    seqs = sequences(tiny_model)
    claim = claim_of(*decoded(stage0(tiny_model, torch.float32), seqs))
    # The verifier re-executes the first 20 tokens of every row (a segment of the session).
    prefix = [seq[:20] for seq in seqs]
    check = check_commitment(claim, *teacher_forced(stage0(tiny_model, torch.float32), prefix, 0),
                             TOLERANCE)
    assert check.checked == sum(len(range(0, min(n, 20), INTERVAL)) for n in LENGTHS)
    assert check.failed == 0
    # `within` keeps the points of given positions; concat puts parts back together.
    _, positions, valid = layout(prefix)
    early = claim.within(positions, valid)
    assert len(early) == check.checked
    late = claim.select(claim.positions >= 20)
    merged = Commitment.concat([early, late], TOP_K)
    assert sorted(zip(merged.rows.tolist(), merged.positions.tolist())) \
        == sorted(zip(claim.rows.tolist(), claim.positions.tolist()))
    assert len(Commitment.concat([], TOP_K)) == 0


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_wire_round_trip_is_exact_under_any_activation_codec(tiny_model: LoadedModel,
                                                             codec: str) -> None:
    claim = claim_of(*decoded(stage0(tiny_model, torch.float32), sequences(tiny_model)))
    received = {}
    for name, tensor in commitment_to_wire(claim).items():
        parts, spec = encode_tensor(tensor, codec, name)  # type: ignore[arg-type]
        received[name] = decode_tensor(parts, spec)
    parsed = parse_commitment(received, len(LENGTHS), tiny_model.spec.hidden_size, TOP_K)
    for name in ("rows", "positions", "indices", "values"):
        assert torch.equal(getattr(parsed, name), getattr(claim, name))


def wire_tensors() -> dict[str, torch.Tensor]:
    """A valid commitment on the wire: 3 points of a batch of 2, hidden 16, top-2."""
    values = torch.tensor([[3.0, -2.0], [1.5, 1.0], [-4.0, 0.5]])
    return {"commit_rows": torch.tensor([0, 0, 1]), "commit_positions": torch.tensor([0, 4, 0]),
            "commit_indices": torch.tensor([[3, 7], [0, 15], [2, 9]]),
            "commit_values": values.to(torch.bfloat16).view(torch.int16)}


INF_BITS = torch.tensor(float("inf"), dtype=torch.bfloat16).view(torch.int16)


@pytest.mark.parametrize("name, tensor, message", [
    ("commit_indices", None, "no commitment tensors"),
    ("commit_rows", torch.tensor([0, 0, 1], dtype=torch.int32), "commit_rows must be int64"),
    ("commit_values", torch.ones(3, 2), "bf16 bits as int16"),
    ("commit_positions", torch.tensor([0, 4]), "shapes"),
    ("commit_indices", torch.tensor([[3, 7, 8], [0, 15, 1], [2, 9, 4]]), "shapes"),
    ("commit_rows", torch.tensor([0, 0, 2]), r"commit_rows must be in \[0, 2\)"),
    ("commit_rows", torch.tensor([0, -1, 1]), "commit_rows must be in"),
    ("commit_positions", torch.tensor([0, -4, 0]), "commit_positions must be in"),
    ("commit_positions", torch.tensor([0, 2**40, 0]), "commit_positions must be in"),
    ("commit_indices", torch.tensor([[3, 7], [0, 16], [2, 9]]), r"in \[0, 16\)"),
    ("commit_indices", torch.tensor([[3, 7], [-1, 15], [2, 9]]), "commit_indices must be in"),
    ("commit_indices", torch.tensor([[3, 7], [5, 5], [2, 9]]), "repeat a hidden dim"),
    ("commit_values", torch.cat([INF_BITS.view(1, 1), torch.zeros(1, 1, dtype=torch.int16)], 1)
     .expand(3, 2).contiguous(), "finite"),
    ("commit_positions", torch.tensor([0, 0, 0]), "twice"),
])
def test_parse_commitment_refuses_malformed_tensors(name: str, tensor: torch.Tensor | None,
                                                    message: str) -> None:
    tensors = wire_tensors()
    assert len(parse_commitment(tensors, 2, 16, 2)) == 3
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    with pytest.raises(ValueError, match=message):
        parse_commitment(tensors, 2, 16, 2)


@pytest.mark.slow
def test_real_model_commitments() -> None:
    """SmolLM2's stage 0 (15 of 30 layers): honest bf16 decoding passes an fp32 recomputation
    with another padding, an output scaled by 1.1 or with noise of 0.2x its std fails."""
    real = load_model(DEFAULT_MODEL)  # converted from the wheel's GGUF on first use
    texts = ["The quick brown fox jumps over the lazy dog, twice, and then sleeps.",
             "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
             "What is 37 + 48? Let me think step by step. 37 + 48 = 85.",
             "Translate to French: 'I would like a cup of coffee, please.'"]
    seqs = [real.tokenizer(text)["input_ids"] for text in texts]
    claimed, positions, valid = decoded(stage0(real, torch.bfloat16), seqs)
    verify = teacher_forced(stage0(real, torch.float32), seqs, 3)
    honest = check_commitment(claim_of(claimed, positions, valid), *verify, TIGHT)
    assert honest.failed == 0 and honest.checked == len(claim_of(claimed, positions, valid))
    noise = torch.randn(claimed.shape, generator=torch.Generator().manual_seed(0))
    for corrupted in (claimed * 1.1, claimed + 0.2 * claimed.std(-1, keepdim=True) * noise):
        assert check_commitment(claim_of(corrupted, positions, valid), *verify,
                                TOLERANCE).failed > 0
