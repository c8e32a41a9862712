"""Calibrating the simulator on this machine, and reading what a real demo measured.

`calibrate` measures the host's single-core matmul rate and memory bandwidth
(sim/hardware.py `measure_host`), then times SmolLM2-135M's real stages (model/stages.py) at the
demo's sizes and dtypes, one thread as each demo peer has: a decoding step of a batch, a
prefill, a training micro-batch's forward and backward. Each kind of work gets its own fitted
speed (measured over the roofline's prediction), printed, so a reader sees how far the roofline
is from this CPU. It then times the coordinator's real relaying of a reply, a request and its
reply between two real nodes, a seeded draw and a checkpoint's write. Nothing here is fitted to
a run: the run-level figures (steps, tokens per second, staleness) are predictions checked
against what `measured_run` reads from a run's folder."""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import msgspec
import torch

from decentrl.observe.metrics import read_metrics
from decentrl.sim.costs import Speed, StageCosts
from decentrl.sim.hardware import HardwareProfile, measure_host, median_seconds
from decentrl.sim.presets import HostCalibration
from decentrl.sim.scenario import Kill
from decentrl.sim.shapes import SMOLLM2_135M

# The demo's sizes: sessions of 8 groups of 8 rows, prompts of about 40 tokens, completions of
# about 16, training micro-batches of 32 rows.
DECODE_ROWS, CONTEXT, PROMPT, MICRO_ROWS, ROW_TOKENS = 64, 48, 40, 32, 56
REPEATS = 3


def _median_s(work: Callable[[], object], repeats: int = REPEATS) -> float:
    work()  # warm
    return median_seconds(work, repeats)


def stage_timings(threads: int = 1) -> dict[str, float]:
    """Seconds of SmolLM2-135M's stage 0 of 2 (15 layers, the embedding) on this host, in the
    dtype a demo peer picks here (device.py compute_dtype: bf16 where the CPU has it; training
    in float32 under autocast to it): a decoding step of DECODE_ROWS rows at PROMPT cached
    positions, a prefill of PROMPT tokens for DECODE_ROWS rows, and a training micro-batch
    (forward and backward) of MICRO_ROWS rows of ROW_TOKENS tokens. The decoding step is timed as
    a replica serves it, through its InferenceService, not the bare stage."""
    from decentrl.config.loading import load_config
    from decentrl.demo import EXAMPLES_DIR
    from decentrl.device import compute_dtype
    from decentrl.model.loading import load_model
    from decentrl.model.stages import StageCache, StagePlan, build_stages
    from decentrl.net.node import SwarmNode
    from decentrl.net.protocol import InferenceStep
    from decentrl.stage.inbound import InboundChecks
    from decentrl.stage.inference import InferenceService

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    dtype = compute_dtype(cpu)
    model = load_model()
    plan = StagePlan.even(model.spec.num_layers, 2)
    served = build_stages(model.spec, plan, model.tensors, cpu, dtype)[0]
    trained = build_stages(model.spec, plan, model.tensors, cpu, torch.float32)[0]
    ids = torch.randint(0, model.spec.vocab_size, (DECODE_ROWS, PROMPT))

    def prefill() -> StageCache:
        cache = StageCache(model.spec, len(served.layers), DECODE_ROWS, PROMPT + 1, dtype, cpu)
        with torch.inference_mode():
            served.body(ids, torch.arange(PROMPT).expand(DECODE_ROWS, PROMPT),
                        torch.ones(DECODE_ROWS, PROMPT, dtype=torch.bool), cache)
        return cache

    # A decoding step as a replica serves it (stage/inference.py `InferenceService.run_steps`):
    # the session's lookup and checks, the forward on its cache, the reply's tensors.
    config = load_config(EXAMPLES_DIR / "demo.toml")
    service = InferenceService(config, served, cast(SwarmNode, None),
                               InboundChecks(model.spec, 0, 2, config.swarm.max_session_tokens))
    steps = 2 + REPEATS
    session = InferenceStep(session="calibration", start=0, batch=DECODE_ROWS,
                            max_length=PROMPT + steps)
    service.infer("coordinator", session, {
        "inputs": ids, "positions": torch.arange(PROMPT).expand(DECODE_ROWS, PROMPT),
        "key_valid": torch.ones(DECODE_ROWS, PROMPT, dtype=torch.bool)})
    position = iter(range(PROMPT, PROMPT + steps))

    def decode() -> None:
        at = next(position)
        service.infer("coordinator", msgspec.structs.replace(session, start=at), {
            "inputs": ids[:, :1], "positions": torch.full((DECODE_ROWS, 1), at),
            "key_valid": torch.ones(DECODE_ROWS, at + 1, dtype=torch.bool)})

    rows = torch.randint(0, model.spec.vocab_size, (MICRO_ROWS, ROW_TOKENS))

    def train() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            hidden = trained.body(rows, torch.arange(ROW_TOKENS).expand(MICRO_ROWS, ROW_TOKENS),
                                  torch.ones(MICRO_ROWS, ROW_TOKENS, dtype=torch.bool))
        hidden.float().square().mean().backward()

    return {"decode": _median_s(decode), "prefill": _median_s(prefill),
            "train": _median_s(train)}


def predicted_timings(host: HardwareProfile) -> dict[str, float]:
    """The simulator's seconds (sim/costs.py on `host`, at speed 1) for what `stage_timings`
    measures."""
    costs = StageCosts(host, SMOLLM2_135M, SMOLLM2_135M.layers // 2, True, False)
    tokens = MICRO_ROWS * ROW_TOKENS
    return {"decode": costs.forward_s(DECODE_ROWS, 1, PROMPT),
            "prefill": costs.forward_s(DECODE_ROWS, PROMPT, 0),
            "train": costs.train_forward_s(tokens, MICRO_ROWS)
            + costs.train_backward_s(tokens, MICRO_ROWS)}


def calibrate(speed: Speed | None = None, threads: int = 1) -> HostCalibration:
    """This host, measured: its single-core profile and cores, the fitted speed of each kind of
    work (`speed` if given: the stage timings are skipped), the coordinator's relaying, a hop's
    software time, a draw's CPU and a checkpoint's write. Prints what it measured."""
    profile = measure_host(threads)
    cores = os.cpu_count() or 1
    if speed is None:
        measured, predicted = stage_timings(threads), predicted_timings(profile)
        ratios = {op: predicted[op] / measured[op] for op in measured}
        for op, ratio in ratios.items():
            print(f"calibration: {op} measured {measured[op] * 1000:.1f} ms, roofline at speed "
                  f"1 {predicted[op] * 1000:.1f} ms: speed {ratio:.2f}")
        speed = Speed(**ratios)
    host = HostCalibration(profile, cores, speed, coordinator_costs(), hop_overhead(),
                           sampling_seconds_per_logit(threads), checkpoint_seconds_per_byte())
    print(f"calibration: the coordinator relays a message in {host.relay_costs[0] * 1e6:.0f} us"
          f" + {host.relay_costs[1] * 1e9:.2f} ns a byte; a request and its reply take "
          f"{host.hop_overhead[0] * 1e3:.1f} ms + {host.hop_overhead[1] * 1e9:.1f} ns a byte "
          f"beyond their link; a draw costs "
          f"{host.sampling_s_per_logit * 1e9:.1f} ns of CPU a logit; a checkpoint "
          f"{host.checkpoint_s_per_byte * 1e9:.2f} ns a byte")
    return host


def checkpoint_seconds_per_byte(megabytes: int = 128) -> float:
    """A checkpoint's write and hash per byte here (learn/checkpoints.py `write_stage`'s save,
    model/loading.py `file_sha256`), on `megabytes` of float32 weights in a temporary folder."""
    from decentrl.learn.checkpoints import CheckpointLayout
    from decentrl.model.loading import file_sha256

    tensors = {"weights": torch.randn(megabytes * 2**20 // 4),
               "optimizer": {}, "version": 1}
    with tempfile.TemporaryDirectory() as folder:
        layout = CheckpointLayout(Path(folder))

        def save() -> None:
            file_sha256(layout.write_stage(1, 0, tensors))
        return _median_s(save) / (megabytes * 2**20)


def sampling_seconds_per_logit(rows: int = DECODE_ROWS, vocab: int = SMOLLM2_135M.vocab,
                               threads: int = 1) -> float:
    """A seeded draw's CPU seconds per logit (rollout/sampling.py `sample` at T=1, the noise on
    the CPU), over `rows` rows of `vocab` logits."""
    from decentrl.rollout.sampling import SamplingConfig, sample

    torch.set_num_threads(threads)
    logits = torch.randn(rows, vocab)
    generator = torch.Generator().manual_seed(0)
    return _median_s(lambda: sample(logits, SamplingConfig(), generator)) / (rows * vocab)


def relay_seconds(rows: int, positions: int, hidden: int) -> float:
    """The coordinator's CPU for one relayed reply of hidden states [rows, positions, hidden]
    (client/sessions.py): its signature checked and its tensors decoded, the relay checks
    (trust/relay.py), the secret sketches of every position (trust/commit.py), and the next
    hop's request encoded and signed. The real functions, timed."""
    from decentrl.net.identity import Identity
    from decentrl.net.signing import Envelope, signed_envelope, verify_envelope
    from decentrl.net.wire import decode_struct, decode_tensors, encode_tensors
    from decentrl.trust.commit import sketch_matrix, take_sketches
    from decentrl.trust.relay import check_hidden_states

    peer, coordinator = Identity.generate(), Identity.generate()
    states = torch.randn(rows, positions, hidden)
    matrix = sketch_matrix(0, 32, hidden)
    where = torch.arange(positions).expand(rows, positions)
    valid = torch.ones(rows, positions, dtype=torch.bool)
    parts, manifest = encode_tensors({"hidden": states}, "fp32")
    metadata = signed_envelope(peer, "reply", "inference_step", "r", b"", manifest, parts)

    def relay() -> None:
        envelope = decode_struct(metadata, Envelope)
        verify_envelope(peer.peer_id, "reply", "inference_step", "r", envelope, parts)
        received = decode_tensors(parts, envelope.manifest)["hidden"]
        checked = check_hidden_states(received, rows, positions, hidden)
        take_sketches(checked, where, valid, matrix)
        out_parts, out_manifest = encode_tensors({"inputs": checked}, "fp32")
        signed_envelope(coordinator, "request", "inference_step", "s", b"", out_manifest,
                        out_parts)

    return _median_s(relay)


def coordinator_costs(hidden: int = SMOLLM2_135M.hidden) -> tuple[float, float]:
    """(seconds per relayed message, seconds per relayed byte) on this host: `relay_seconds` at
    a decoding step's size and at a prefill's, a line through both."""
    small_rows, small_positions = DECODE_ROWS, 1
    large_rows, large_positions = DECODE_ROWS, PROMPT
    small = relay_seconds(small_rows, small_positions, hidden)
    large = relay_seconds(large_rows, large_positions, hidden)
    small_bytes = small_rows * small_positions * hidden * 4
    large_bytes = large_rows * large_positions * hidden * 4
    per_byte = max(0.0, (large - small) / (large_bytes - small_bytes))
    return max(0.0, small - per_byte * small_bytes), per_byte


def hop_overhead(rows: int = DECODE_ROWS, hidden: int = SMOLLM2_135M.hidden,
                 calls: int = 20) -> tuple[float, float]:
    """A hop's software cost beyond compute and the emulated link, as (seconds per request and
    reply, seconds per byte they carry): the median round trips of a signed request of hidden
    states [1, 1, hidden] and of [rows, 1, hidden], each answered with the same tensor, between
    two nodes on loopback (net/node.py: encoding, signatures, the p2p daemons, the guard's
    checks), the handler doing nothing. Starts two p2p daemons and shuts them down."""
    from decentrl.net.link import LinkProfile
    from decentrl.net.node import Reply, Request, SwarmNode
    from decentrl.net.protocol import Empty, Rpc, TensorRule
    from decentrl.net.wire import TensorLimits

    echo = Rpc("calibration_echo", Empty, Empty, "any peer", {"hidden": TensorRule("float")},
               ("hidden",), 64 * 2**20, 64 * 2**20)
    server = SwarmNode.start("calibration-server", [], LinkProfile(), TensorLimits())
    try:
        client = SwarmNode.start("calibration-client", server.addresses(), LinkProfile(),
                                 TensorLimits())
        try:
            async def answer(request: Request[Empty]) -> Reply:
                return Reply(Empty(), {"hidden": request.tensors["hidden"]})

            server.serve(echo, answer)

            def round_trip(batch: int) -> float:
                states = {"hidden": torch.randn(batch, 1, hidden)}
                return _median_s(lambda: client.call_sync(server.peer_id, echo, Empty(),
                                                          states), calls)

            small, large = round_trip(1), round_trip(rows)
        finally:
            client.shutdown()
    finally:
        server.shutdown()
    extra_bytes = 2 * (rows - 1) * hidden * 4  # the request's and the reply's
    per_byte = max(0.0, (large - small) / extra_bytes)
    return small - 2 * hidden * 4 * per_byte, per_byte


@dataclass(frozen=True)
class MeasuredRun:
    """What a demo's run folder says of the figures the simulator predicts, and the chaos kills
    it went through (times from the start of training), for the simulation to replay."""

    figures: dict[str, float]
    kills: tuple[Kill, ...]


def measured_run(run_dir: Path) -> MeasuredRun:
    """From a demo's metrics.jsonl (observe/metrics.py): optimizer steps (the last step's number:
    a rollback's steps count once), the mean staleness of trained groups, the mean training
    time of a step, the completion tokens trained per second between the first step and the
    last (the dashboard's `tokens_per_s`), what the rows-in-flight policy reported at each step
    (rows stepped per second, a decoding step's round trip), and `--chaos`'s kills."""
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = records.steps
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step events")
    first, last = steps[0], steps[-1]
    started = first.elapsed_s - (first.wait_s or 0.0) - (first.train_s or 0.0)
    groups = sum(s.groups for s in steps)
    figures = {
        "steps": float(last.step),
        "staleness_mean": sum(s.staleness_mean * s.groups for s in steps) / groups,
        "step_train_s": statistics.fmean(s.train_s or 0.0 for s in steps),
        "trained_tokens_per_s": sum(s.generated_tokens or 0.0 for s in steps[1:])
        / (last.elapsed_s - first.elapsed_s) if len(steps) > 1 else 0.0,
        # The rows-in-flight policy's own figures at each step (coordinator/inflight.py): its
        # recent peak of rows stepped per second, its floor of a decoding step's round trip.
        "policy_rows_per_s": statistics.fmean(s.rows_stepped_per_s or 0.0 for s in steps),
        "policy_round_trip_s": statistics.fmean(s.step_round_trip_s or 0.0 for s in steps),
    }
    kills = []
    for index, event in enumerate(records.chaos):
        if event.action != "killed":
            continue
        end = next((later for later in records.chaos[index + 1:] if later.peer == event.peer),
                   None)
        back_after = (end.elapsed_s - event.elapsed_s if end is not None and end.action == "back"
                      else None)  # never back within the run
        kills.append(Kill(max(0.0, event.elapsed_s - started), event.peer, back_after))
    return MeasuredRun(figures, tuple(kills))
