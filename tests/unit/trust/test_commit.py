"""Activation sketches (trust/commit.py): the coordinator's secret sketch of an honest stage's
delivery passes a recomputation in another dtype and batch layout, also through the int8 codec,
with a 2x margin; scaled or noisy outputs fail, and so does a lie at a single position no stage
could predict, blamed on the liar rather than the honest stage it fed. The matrix must stay
secret, and no reply carries anything but its tensors. The real-model calibration is slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import DEFAULT_MODEL, LoadedModel, load_model
from decentrl.model.stages import StageModule, StagePlan, build_stage
from decentrl.net.protocol import INFERENCE_STEP
from decentrl.net.wire import WireError, decode_tensor, encode_tensor
from decentrl.rollout.generate import left_pad
from decentrl.trust.commit import (
    CommitCheck,
    CommitTolerance,
    Sketches,
    check_sketches,
    earliest_failure,
    sketch_matrix,
    take_sketches,
)
from decentrl.trust.provenance import Provenance

TOLERANCE = CommitTolerance()
INT8 = CommitTolerance.for_codec("int8")
DIMS = 32
LENGTHS = (40, 17, 33, 26)


def tight(tolerance: CommitTolerance) -> CommitTolerance:
    """Half as loose: honest computation must pass this too (the defaults' margin)."""
    return CommitTolerance(tolerance.max_error / 2, tolerance.max_mean_error / 2)


def stage(model: LoadedModel, dtype: torch.dtype, index: int = 0) -> StageModule:
    plan = StagePlan.even(model.spec.num_layers, 2)
    return build_stage(model.spec, plan, index, model.tensors, torch.device("cpu"), dtype)


def sequences(model: LoadedModel, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, model.spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def layout(seqs: list[list[int]], extra: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, position ids and the valid mask [B, T] of left-padded rows, as generation
    builds them; `extra` pads every row by that many more columns."""
    ids, valid = left_pad(seqs, 0, torch.device("cpu"))
    ids, valid = F.pad(ids, (extra, 0)), F.pad(valid, (extra, 0))
    return ids, positions_from_valid(valid), valid


@torch.no_grad()
def decoded(module: StageModule, seqs: list[list[int]], prefill: int = 8
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stage's output as an inference session computes it: a prefill, then one column per
    step through the KV cache. Returns (hidden float32, positions, valid)."""
    ids, positions, valid = layout(seqs)
    cache = module.new_cache(*ids.shape)
    outs = [module.body(ids[:, :prefill], positions[:, :prefill], valid[:, :prefill], cache)]
    for t in range(prefill, ids.shape[1]):
        outs.append(module.body(ids[:, t:t + 1], positions[:, t:t + 1], valid[:, :t + 1], cache))
    return torch.cat(outs, 1).float(), positions, valid


@torch.no_grad()
def teacher_forced(module: StageModule, seqs: list[list[int]], extra: int,
                   inputs: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's recomputation: whole sequences at once, in another padding layout (of
    token ids, or of the given hidden-state `inputs` [B, T, H] laid out like `seqs` with
    `extra` more padding columns)."""
    ids, positions, valid = layout(seqs, extra)
    x = ids if inputs is None else inputs
    return module.body(x, positions, valid).float(), positions, valid


def int8(hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` as it arrives through the int8 activation codec."""
    parts, spec = encode_tensor(hidden, "int8", "hidden")
    return decode_tensor(parts, spec).float()


def kept(hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
         matrix: torch.Tensor) -> Sketches:
    """The coordinator's sketches of a whole session delivered in steps (prefill, then one
    column at a time), concatenated as the verifier reads them."""
    steps = [slice(0, 8), *(slice(t, t + 1) for t in range(8, hidden.shape[1]))]
    return Sketches.concat([take_sketches(hidden[:, s], positions[:, s], valid[:, s], matrix)
                            for s in steps], matrix.shape[0])


def column_of(positions: torch.Tensor, valid: torch.Tensor, row: int, position: int) -> int:
    return int((positions[row] == position).logical_and(valid[row]).nonzero())


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_sharp_dir"])
def model(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(request.getfixturevalue(request.param)))


MATRIX_SEED = 12345


@pytest.mark.parametrize("claim_dtype, verify_dtype", [(torch.bfloat16, torch.float32),
                                                       (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("extra", [0, 3])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_honest_recomputation_passes_with_margin(model: LoadedModel, claim_dtype: torch.dtype,
                                                 verify_dtype: torch.dtype, extra: int,
                                                 codec: str) -> None:
    seqs = sequences(model)
    matrix = sketch_matrix(MATRIX_SEED, DIMS, model.spec.hidden_size)
    hidden, positions, valid = decoded(stage(model, claim_dtype), seqs)
    recomputed, re_positions, re_valid = teacher_forced(stage(model, verify_dtype), seqs, extra)
    tolerance = TOLERANCE
    if codec == "int8":  # the delivery and the verifier's reply both crossed the codec
        hidden, recomputed, tolerance = int8(hidden), int8(recomputed), INT8
    sketches = kept(hidden, positions, valid, matrix)
    assert len(sketches) == sum(LENGTHS)  # every valid position, padding never
    for bound in (tolerance, tight(tolerance)):
        check = check_sketches(sketches, matrix, recomputed, re_positions, re_valid, bound)
        assert (check.checked, check.failed, check.first_failure) == (sum(LENGTHS), 0, None)


@pytest.mark.parametrize("corruption", ["scale 1.1", "noise 0.2", "noise 0.05"])
def test_scaled_or_noisy_outputs_fail(model: LoadedModel, corruption: str) -> None:
    """x 1.1 and noise of 0.2x std fail at most positions on their own; noise of 0.05x std
    fails the mean test over the session."""
    seqs = sequences(model)
    matrix = sketch_matrix(MATRIX_SEED, DIMS, model.spec.hidden_size)
    hidden, positions, valid = decoded(stage(model, torch.bfloat16), seqs)
    if corruption == "scale 1.1":
        hidden = hidden * 1.1
    else:
        scale = float(corruption.split()[1])
        noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
        hidden = hidden + scale * hidden.std(-1, keepdim=True) * noise
    check = check_sketches(kept(hidden, positions, valid, matrix), matrix,
                           *teacher_forced(stage(model, torch.float32), seqs, 3), TOLERANCE)
    assert check.checked == sum(LENGTHS)
    assert check.failed > check.checked // 2
    assert check.mean > TOLERANCE.max_mean_error


def test_a_lie_at_one_unpredictable_position_is_caught_and_blamed_on_the_liar(
        model: LoadedModel) -> None:
    """Stage 0 adds noise of 0.4x std at one position whose id is not a multiple of 8 (none the
    old fixed-point commitments opened). Stage 1 computes honestly on what it was fed. The
    verifier re-executes both on the truth: stage 0 fails at that position alone; stage 1, whose
    outputs carry the lie forward, may fail at it or later (whether depends on the secret matrix)
    but never before; the earliest failure blames stage 0."""
    seqs = sequences(model)
    row, position = 2, 13
    first, second = stage(model, torch.bfloat16), stage(model, torch.bfloat16, 1)
    delivered, positions, valid = decoded(first, seqs)
    column = column_of(positions, valid, row, position)
    noise = torch.randn(delivered.shape[-1], generator=torch.Generator().manual_seed(1))
    delivered[row, column] += 0.4 * delivered[row, column].std() * noise
    with torch.no_grad():  # stage 1 fed the lie, in one pass (the same as decoding it)
        relayed = second.body(delivered.to(torch.bfloat16), positions, valid).float()
    truth0, re_positions, re_valid = teacher_forced(stage(model, torch.float32), seqs, 3)
    truth1 = teacher_forced(stage(model, torch.float32, 1), seqs, 3, truth0)[0]
    checks: list[tuple[int, CommitCheck]] = []
    for index, (output, truth) in enumerate(((delivered, truth0), (relayed, truth1))):
        matrix = Provenance.empty(2).stages[index].matrix(DIMS, model.spec.hidden_size)
        checks.append((index, check_sketches(kept(output, positions, valid, matrix), matrix,
                                             truth, re_positions, re_valid, TOLERANCE)))
    liar, honest = checks[0][1], checks[1][1]
    assert (liar.failed, liar.first_failure) == (1, (row, position))
    assert honest.first_failure is None or honest.first_failure[1] >= position
    assert earliest_failure(checks) == (0, row, position)


def test_earliest_failure_breaks_ties_toward_the_lower_stage() -> None:
    def failing(row: int, position: int) -> CommitCheck:
        return CommitCheck(10, 1, 1.0, 0.1, (row, position))

    passing = CommitCheck(10, 0, 0.01, 0.01, None)
    assert earliest_failure([(0, passing), (1, passing)]) is None
    assert earliest_failure([(0, failing(1, 9)), (1, failing(0, 4))]) == (1, 0, 4)
    assert earliest_failure([(0, failing(3, 4)), (1, failing(0, 4))]) == (0, 3, 4)
    assert earliest_failure([(1, failing(0, 5)), (2, passing)]) == (1, 0, 5)


def test_a_lie_the_matrix_cannot_see_passes_only_if_the_matrix_is_known(
        tiny_model: LoadedModel) -> None:
    """A liar that knew R would hide a large change in its null space (hidden 32 > 16 dims
    here); with the secret drawn afresh per session and stage it cannot: the same lie fails
    every other session's matrix."""
    seqs = sequences(tiny_model)
    hidden, positions, valid = decoded(stage(tiny_model, torch.float32), seqs)
    truth = teacher_forced(stage(tiny_model, torch.float32), seqs, 0)
    known = sketch_matrix(MATRIX_SEED, 16, tiny_model.spec.hidden_size)
    null = torch.linalg.svd(known, full_matrices=True).Vh[16:]  # [H - 16, H]: R @ null.T = 0
    lie = hidden + 2 * hidden.norm(dim=-1, keepdim=True) * (torch.randn(
        *hidden.shape[:2], null.shape[0], generator=torch.Generator().manual_seed(2)) @ null
        / null.shape[0] ** 0.5)
    assert check_sketches(kept(lie, positions, valid, known), known, *truth, TOLERANCE).failed \
        == 0
    for stage_record in Provenance.empty(3).stages:
        secret = stage_record.matrix(16, tiny_model.spec.hidden_size)
        assert check_sketches(kept(lie, positions, valid, secret), secret, *truth,
                              TOLERANCE).failed == sum(LENGTHS)


def test_seeds_are_secret_draws_and_regenerate_the_same_matrix() -> None:
    seeds = {record.seed for record in Provenance.empty(8).stages}
    assert len(seeds) == 8
    record = Provenance.empty(1).stages[0]
    assert torch.equal(record.matrix(DIMS, 64), record.matrix(DIMS, 64))
    assert not torch.equal(record.matrix(DIMS, 64), sketch_matrix(record.seed + 1, DIMS, 64))


def test_positions_the_recomputation_lacks_are_not_checked(tiny_model: LoadedModel) -> None:
    seqs = sequences(tiny_model)
    matrix = sketch_matrix(MATRIX_SEED, DIMS, tiny_model.spec.hidden_size)
    sketches = kept(*decoded(stage(tiny_model, torch.float32), seqs), matrix)
    # The verifier re-executes the first 20 tokens of every row (a segment of the session).
    prefix = [seq[:20] for seq in seqs]
    check = check_sketches(sketches, matrix,
                           *teacher_forced(stage(tiny_model, torch.float32), prefix, 0),
                           TOLERANCE)
    assert check.checked == sum(min(n, 20) for n in LENGTHS)
    assert check.failed == 0
    assert len(Sketches.concat([], DIMS)) == 0


def test_replies_carry_no_commitment_and_no_secret() -> None:
    """The reply is the commitment: an inference step replies hidden states (or tokens and
    log-probs), and a mixture of experts' stage the experts they went to, and nothing else; the
    sketch matrix stays with the coordinator."""
    assert set(INFERENCE_STEP.reply_tensors) == {"hidden", "tokens", "logprobs", "experts"}
    with pytest.raises(WireError, match="carries no tensors"):
        INFERENCE_STEP.check_reply_tensors({"hidden": torch.zeros(1, 1, 4),
                                            "commit_values": torch.zeros(1, 8)})


@pytest.mark.slow
def test_real_model_sketches() -> None:
    """SmolLM2's stage 0 (15 of 30 layers): honest bf16 decoding passes an fp32 recomputation
    with another padding with the 2x margin; an output scaled by 1.1 or with noise of 0.2x its
    std fails at every position."""
    real = load_model(DEFAULT_MODEL)  # converted from the wheel's GGUF on first use
    texts = ["The quick brown fox jumps over the lazy dog, twice, and then sleeps.",
             "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
             "What is 37 + 48? Let me think step by step. 37 + 48 = 85.",
             "Translate to French: 'I would like a cup of coffee, please.'"]
    seqs = [real.tokenizer(text)["input_ids"] for text in texts]
    matrix = sketch_matrix(MATRIX_SEED, DIMS, real.spec.hidden_size)
    delivered, positions, valid = decoded(stage(real, torch.bfloat16), seqs)
    verify = teacher_forced(stage(real, torch.float32), seqs, 3)
    honest = check_sketches(kept(delivered, positions, valid, matrix), matrix, *verify,
                            tight(TOLERANCE))
    assert honest.failed == 0 and honest.checked == sum(len(s) for s in seqs)
    noise = torch.randn(delivered.shape, generator=torch.Generator().manual_seed(0))
    for corrupted in (delivered * 1.1,
                      delivered + 0.2 * delivered.std(-1, keepdim=True) * noise):
        check = check_sketches(kept(corrupted, positions, valid, matrix), matrix, *verify,
                               TOLERANCE)
        assert check.failed == check.checked
