"""Continuous batching on a stage peer: the compute thread's priorities (net/compute.py), the
queue of steps and its ticks (stage/batching.py), a batched forward over several sessions
(StageModule.body_sessions), and generation through a swarm whose peers batch, token for token
what each session gets alone."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from swarm_helpers import serving, start_swarm, tiny_run_config

from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.stages import SessionStep, StageModule, StagePlan, build_stages
from decentrl.net.compute import ComputeThread, Priority
from decentrl.net.node import Reply
from decentrl.net.protocol import Empty, InferenceStep
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import Generation, generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.batching import StepBatcher, StepRequest

CPU = torch.device("cpu")
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


# ---- the compute thread -------------------------------------------------------------------

def test_the_compute_thread_runs_the_most_urgent_waiting_work_first() -> None:
    compute = ComputeThread("test")
    started, release, order = threading.Event(), threading.Event(), []
    try:
        running = compute.submit(Priority.GENERATION, lambda: started.set() or release.wait(10))
        assert started.wait(10)
        queued = [compute.submit(priority, order.append, name) for priority, name in [
            (Priority.GENERATION, "generate 1"), (Priority.VERIFICATION, "verify"),
            (Priority.GENERATION, "generate 2"), (Priority.TRAINING, "train"),
            (Priority.WEIGHTS, "weights")]]
        release.set()
        assert running.result(10) is True
        for future in queued:
            future.result(10)
        # Work already running is not interrupted; then by priority, first come first served.
        assert order == ["train", "weights", "verify", "generate 1", "generate 2"]
        failing = compute.submit(Priority.TRAINING, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(10)
        assert compute.submit(Priority.TRAINING, lambda: "still serving").result(10) \
            == "still serving"
    finally:
        compute.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        compute.submit(Priority.TRAINING, print)


def test_shutting_down_cancels_the_waiting_work() -> None:
    compute = ComputeThread("test")
    started, release = threading.Event(), threading.Event()
    running = compute.submit(Priority.TRAINING, lambda: started.set() or release.wait(10))
    assert started.wait(10)
    waiting = compute.submit(Priority.TRAINING, print)
    compute.shutdown()
    release.set()
    assert running.result(10) is True
    assert waiting.cancelled()


# ---- the queue of steps and its ticks ------------------------------------------------------

class LoopNode:
    """What StepBatcher needs of a SwarmNode: its event loop and its compute thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.compute_thread = ComputeThread("test")

    def close(self) -> None:
        self.compute_thread.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def node() -> Iterator[LoopNode]:
    node = LoopNode()
    yield node
    node.close()


def step(session: str, rows: int = 2) -> InferenceStep:
    return InferenceStep(session=session, start=1, batch=rows, max_length=16)


class Recorder:
    """A tick runner that records the sessions of every tick; a step of session "bad" fails."""

    def __init__(self) -> None:
        self.ticks: list[list[str]] = []

    def __call__(self, requests: list[StepRequest]) -> list[Reply | BaseException]:
        self.ticks.append([request.body.session for request in requests])
        return [ValueError("bad step") if request.body.session == "bad" else Reply(Empty())
                for request in requests]


def submit_together(node: LoopNode, batcher: StepBatcher, steps: list[InferenceStep],
                    hold: threading.Event) -> list[Any]:
    """Submit `steps` while the compute thread is held busy (so they all wait for one tick),
    then release it; each step's reply or error."""
    blocker = node.compute_thread.submit(Priority.TRAINING, hold.wait, 10)

    async def all_steps() -> list[Any]:
        pending = [asyncio.ensure_future(batcher.submit("caller", body, {})) for body in steps]
        await asyncio.sleep(0.05)  # every step is queued before the thread is free
        hold.set()
        return await asyncio.gather(*pending, return_exceptions=True)
    outcomes = asyncio.run_coroutine_threadsafe(all_steps(), node.loop).result(30)
    blocker.result(10)
    return outcomes


def test_steps_waiting_together_run_in_one_tick_within_the_row_limit(node: LoopNode) -> None:
    recorder = Recorder()
    batcher = StepBatcher(node, recorder, max_rows=6, wait_s=0.0)  # type: ignore[arg-type]
    outcomes = submit_together(node, batcher, [step(name) for name in "abcde"], threading.Event())
    assert all(isinstance(outcome, Reply) for outcome in outcomes)
    # Three sessions of 2 rows fill a tick of 6; the rest go in the next, in arrival order.
    assert recorder.ticks == [["a", "b", "c"], ["d", "e"]]
    assert batcher.ticks == 2 and batcher.rows_per_tick == 5.0


def test_a_failing_step_fails_alone(node: LoopNode) -> None:
    recorder = Recorder()
    batcher = StepBatcher(node, recorder, max_rows=64, wait_s=0.0)  # type: ignore[arg-type]
    outcomes = submit_together(node, batcher, [step("a"), step("bad"), step("c")],
                               threading.Event())
    assert recorder.ticks == [["a", "bad", "c"]]
    assert isinstance(outcomes[0], Reply) and isinstance(outcomes[2], Reply)
    assert isinstance(outcomes[1], ValueError) and str(outcomes[1]) == "bad step"


def test_a_tick_that_breaks_answers_each_of_its_steps_with_the_error(node: LoopNode) -> None:
    def broken(requests: list[StepRequest]) -> list[Reply | BaseException]:
        raise RuntimeError("out of memory")
    batcher = StepBatcher(node, broken, max_rows=64, wait_s=0.0)  # type: ignore[arg-type]
    outcomes = submit_together(node, batcher, [step("a"), step("b")], threading.Event())
    assert [str(outcome) for outcome in outcomes] == ["out of memory"] * 2
    # The queue still serves.
    assert isinstance(submit_together(node, StepBatcher(node, Recorder(), 64, 0.0),  # type: ignore[arg-type]
                                      [step("c")], threading.Event())[0], Reply)


def test_without_batching_a_tick_takes_one_step(node: LoopNode) -> None:
    recorder = Recorder()
    batcher = StepBatcher(node, recorder, max_rows=64, wait_s=1.0,  # type: ignore[arg-type]
                          max_steps=1)
    submit_together(node, batcher, [step("a"), step("b"), step("c")], threading.Event())
    assert recorder.ticks == [["a"], ["b"], ["c"]]


def test_a_tick_waits_for_the_sessions_due_back_and_no_longer(node: LoopNode) -> None:
    """Sessions a, b and c step together twice (their turnaround is measured: milliseconds);
    then their steps come one by one, 50 ms apart: the tick that a's step starts waits for b and
    c, due back well within the bound, instead of running a alone."""
    recorder = Recorder()
    batcher = StepBatcher(node, recorder, max_rows=64, wait_s=30.0)  # type: ignore[arg-type]
    for _ in range(2):
        submit_together(node, batcher, [step("a"), step("b"), step("c")], threading.Event())

    async def one_by_one(batcher: StepBatcher, names: str) -> None:
        pending = []
        for name in names:
            pending.append(asyncio.ensure_future(batcher.submit("caller", step(name), {})))
            await asyncio.sleep(0.05)
        await asyncio.gather(*pending)
    asyncio.run_coroutine_threadsafe(one_by_one(batcher, "abc"), node.loop).result(30)
    assert recorder.ticks[2:] == [["a", "b", "c"]]
    # A closed session is not waited for; one that is due never makes a tick wait past the bound.
    deadline = time.monotonic() + 10
    assert batcher._due_before(deadline)
    for name in "abc":
        batcher.forget("caller", name)
    assert not batcher._due_before(deadline)
    bounded = StepBatcher(node, recorder, max_rows=64, wait_s=0.2)  # type: ignore[arg-type]
    submit_together(node, bounded, [step("x"), step("y")], threading.Event())
    submit_together(node, bounded, [step("x"), step("y")], threading.Event())
    assert bounded._due_before(time.monotonic() + 0.2)
    asyncio.run_coroutine_threadsafe(one_by_one(bounded, "x"), node.loop).result(30)  # y never comes
    assert recorder.ticks[-1] == ["x"]


def test_bad_batcher_settings_are_refused(node: LoopNode) -> None:
    with pytest.raises(ValueError, match="need max_rows >= 1"):
        StepBatcher(node, Recorder(), max_rows=0, wait_s=0.0)  # type: ignore[arg-type]


# ---- one forward over several sessions -----------------------------------------------------

def sessions_of(spec: Any, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Prompts of sessions with different batch sizes, lengths and left padding."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for rows, length, padding in [(2, 5, 2), (3, 9, 0), (1, 17, 4), (4, 3, 1)]:
        ids = torch.randint(3, spec.vocab_size, (rows, length), generator=generator)
        valid = torch.ones(rows, length, dtype=torch.bool)
        valid[0, :padding] = False
        prompts.append((ids, (valid.long().cumsum(-1) - 1).clamp(min=0), valid))
    return prompts


# bf16 matmuls on this CPU compute a row the same in any batch: bit for bit. fp32 GEMM kernels
# sum in an order that depends on the batch size: the last bits differ.
EXACT_OR_CLOSE: dict[torch.dtype, dict[str, float]] = {
    torch.bfloat16: {"atol": 0.0, "rtol": 0.0}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batched_forward_gives_every_session_what_it_gets_alone(
        sharp: LoadedModel, dtype: torch.dtype) -> None:
    spec = sharp.spec
    stages = build_stages(spec, StagePlan.even(spec.num_layers, 2), sharp.tensors, CPU, dtype)
    prompts = sessions_of(spec, seed=0)
    generator = torch.Generator().manual_seed(1)
    for stage in stages:
        alone = [stage.new_cache(ids.shape[0], 64) for ids, _, _ in prompts]
        batched = [stage.new_cache(ids.shape[0], 64) for ids, _, _ in prompts]
        inputs = [ids if stage.is_first else torch.randn(*ids.shape, spec.hidden_size,
                                                         generator=generator).to(dtype)
                  for ids, _, _ in prompts]
        with torch.inference_mode():
            for x, (_, positions, valid), one, many in zip(inputs, prompts, alone, batched):
                stage.body(x, positions, valid, one)
                stage.body(x, positions, valid, many)
            # Decoding steps, then steps of 3 forced positions (an environment's reply).
            for new in [1, 1, 3, 1]:
                steps, expected = [], []
                for x, (_, positions, valid), one, many in zip(inputs, prompts, alone, batched):
                    rows = x.shape[0]
                    fed = (torch.randint(3, spec.vocab_size, (rows, new), generator=generator)
                           if stage.is_first else
                           torch.randn(rows, new, spec.hidden_size, generator=generator).to(dtype))
                    at = positions[:, -1:] + 1 + (one.length - positions.shape[1]) \
                        + torch.arange(new)
                    key_valid = torch.cat([valid, torch.ones(rows, one.length - valid.shape[1]
                                                             + new, dtype=torch.bool)], 1)
                    expected.append(stage.body(fed, at, key_valid, one))
                    steps.append(SessionStep(fed, at, key_valid, many))
                got = stage.body_sessions(steps)
                for one_hidden, batched_hidden in zip(expected, got):
                    torch.testing.assert_close(batched_hidden, one_hidden,
                                               **EXACT_OR_CLOSE[dtype])
        for one, many in zip(alone, batched):
            assert one.length == many.length
            for layer_one, layer_many in zip(one.layers, many.layers):
                for held_one, held_many in [(layer_one.keys, layer_many.keys),
                                            (layer_one.values, layer_many.values)]:
                    torch.testing.assert_close(held_one[:, :, :one.length],
                                               held_many[:, :, :many.length],
                                               **EXACT_OR_CLOSE[dtype])


def test_batched_steps_must_feed_the_same_number_of_positions(sharp: LoadedModel) -> None:
    stage: StageModule = build_stages(sharp.spec, StagePlan.even(sharp.spec.num_layers, 1),
                                      sharp.tensors, CPU, torch.float32)[0]
    steps = [SessionStep(torch.ones(1, new, dtype=torch.long), torch.arange(new)[None],
                         torch.ones(1, new, dtype=torch.bool), stage.new_cache(1, 8))
             for new in (1, 2)]
    with pytest.raises(ValueError, match="must feed the same number of positions"):
        stage.body_sessions(steps)


# ---- generation through peers that batch ---------------------------------------------------

PROMPTS = [[1, 5, 9, 2], [3, 4], [7, 7, 7, 7, 7, 1], [2, 8, 3]]


def concurrent_generations(chain: Any, sampling: SamplingConfig, sessions: int
                           ) -> list[list[Generation]]:
    """`sessions` sessions at once, each its own batch of PROMPTS and its own seed."""
    def one(index: int) -> list[Generation]:
        return generate(chain, PROMPTS, 8, sampling, set(), 0, seed=100 + index)
    with ThreadPoolExecutor(sessions) as pool:
        return list(pool.map(one, range(sessions)))


@pytest.mark.network
def test_sessions_batched_on_the_peers_match_each_session_alone(tiny_sharp_dir: Path,
                                                                 sharp: LoadedModel) -> None:
    config = tiny_run_config(tiny_sharp_dir, 2, codec="bf16", host={"dtype": "bf16"},
                             swarm={"batch_wait_s": 0.05})
    local = LocalChain(build_stages(sharp.spec, StagePlan.even(sharp.spec.num_layers, 2),
                                    sharp.tensors, CPU, torch.bfloat16))
    with start_swarm(config, [(0, "inference"), (1, "inference")]) as swarm:
        chain = swarm.chain(sharp.spec)
        for sampling in (GREEDY, SAMPLED):
            got = concurrent_generations(chain, sampling, sessions=6)
            for index, generations in enumerate(got):
                expected = generate(local, PROMPTS, 8, sampling, set(), 0, seed=100 + index)
                assert [g.tokens for g in generations] == [g.tokens for g in expected]
                assert [g.logprobs for g in generations] == [g.logprobs for g in expected]
        # Rows x positions served, the same count on both stages (hidden states are not tokens):
        # 6 sessions x 2 samplings x 4 rows x (a prompt padded to 6 + 7 more steps).
        assert [serving(peer).served_tokens for peer in swarm.peers] == [6 * 2 * 4 * 13] * 2
        batchers = [serving(peer).batcher for peer in swarm.peers]
        # Some ticks ran several sessions at once (each session is 4 rows).
        assert all(batcher.rows_per_tick > len(PROMPTS) for batcher in batchers)
        assert chain.failovers == 0
