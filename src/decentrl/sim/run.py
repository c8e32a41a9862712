"""Run a simulated scenario and report what a real run reports (observe/ has the real ones):
generated tokens per second, optimizer steps and their time split into waiting for a batch and
training, the staleness of what was trained, groups produced, trained and dropped (and why), the
spot checks and their share of the replicas' compute, how long an update takes to reach every
replica, bytes per peer and through the coordinator, and how busy each resource was, the busiest
first: what saturates."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from decentrl.sim.checks import Checks
from decentrl.sim.generation import Generation
from decentrl.sim.scenario import Scenario
from decentrl.sim.training import Training
from decentrl.sim.world import World

MB = 1e6


@dataclass(frozen=True)
class SimReport:
    figures: dict[str, float]
    groups: dict[str, int]
    staleness: dict[int, int]  # trained groups by staleness
    utilization: dict[str, float]  # busy share of each resource, busiest first

    def saturated_first(self) -> tuple[str, float]:
        return next(iter(self.utilization.items()))


class Simulation:
    """A scenario's processes, wired as the coordinator wires its parts: generation puts every
    finished group into the inbox, training takes them out through the checks, which hand
    accepted ones to its pool."""

    def __init__(self, scenario: Scenario) -> None:
        self.world = World(scenario)
        self.training = Training(self.world)
        self.checks = Checks(self.world, self.training.add)
        self.training.on_step = self.checks.audit
        self.training.accept = self.checks.produced
        self.generation = Generation(self.world)
        self.training.after_step = self._record_policy

    def _record_policy(self) -> None:
        state, tally = self.generation.inflight.state, self.world.tally
        if state.rows_per_s is not None and state.round_trip_s is not None:
            tally.policy_rates.append(state.rows_per_s)
            tally.policy_round_trips.append(state.round_trip_s)

    def run(self) -> SimReport:
        """Until the scenario's duration, or the config's `train.steps` if they come first."""
        env = self.world.env
        env.run(until=env.any_of([self.training.finished,
                                  env.timeout(self.world.scenario.duration_s)]))
        return report(self.world)

    def groups_pending(self) -> int:
        """Groups produced and neither trained nor dropped yet: in the inbox or waiting for room
        in it, in the pool, held for a spot check, gathered for the next step, or in the step
        under way."""
        inbox = self.world.inbox
        return len(inbox.items) + len(inbox.put_queue) + len(self.training.pool) \
            + self.checks.pending + len(self.training.collecting) + self.training.in_step


def simulate(scenario: Scenario) -> SimReport:
    return Simulation(scenario).run()


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def report(world: World) -> SimReport:
    tally, duration = world.tally, world.env.now
    replicas = [r for stage in world.replicas for r in stage]
    trainers = [t for stage in world.trainers for t in stage]
    peers = [*replicas, *trainers]
    replica_busy = sum(sum(r.busy.values()) for r in replicas)
    verify_busy = sum(r.busy["verify"] for r in replicas)
    ends = [end for end, _, _ in tally.step_times]
    waits = [wait for _, wait, _ in tally.step_times]
    trains = [train for _, _, train in tally.step_times]
    coordinator = world.coordinator
    figures = {
        "steps": float(tally.steps_done),
        "generated_tokens_per_s": tally.generated_tokens / duration,
        "rows_stepped_per_s": tally.rows_stepped / duration,
        # As the dashboard reports it: the completion tokens of each step's batch after the
        # first, over the time between the first step and the last.
        "trained_tokens_per_s": sum(tally.step_tokens[1:]) / (ends[-1] - ends[0])
        if len(ends) > 1 else 0.0,
        "step_s": _mean([w + t for w, t in zip(waits, trains)]),
        "step_wait_s": _mean(waits),
        "step_train_s": _mean(trains),
        "staleness_mean": _mean([float(s) for s in tally.staleness]),
        "decode_round_trip_s": _mean(tally.session_step_s),
        # As a real run's step metrics report them (coordinator/inflight.py), averaged over steps.
        "policy_rows_per_s": _mean(tally.policy_rates),
        "policy_round_trip_s": _mean(tally.policy_round_trips),
        **{f"decode_{part}_s": tally.decode_time[part] / tally.decode_steps
           if tally.decode_steps else 0.0
           for part in ("network", "replica", "coordinator", "failover")},
        "spot_checks": float(tally.spot_checks),
        "verify_share_of_replica_compute": verify_busy / replica_busy if replica_busy else 0.0,
        "update_propagation_s": statistics.median(tally.propagation_s)
        if tally.propagation_s else 0.0,
        "update_propagation_max_s": max(tally.propagation_s, default=0.0),
        "coordinator_sent_mb": coordinator.sent / MB,
        "coordinator_received_mb": coordinator.received / MB,
        "peer_bytes_mean_mb": _mean([(p.endpoint.sent + p.endpoint.received) / MB
                                     for p in peers]),
        "peer_bytes_max_mb": max(((p.endpoint.sent + p.endpoint.received) / MB for p in peers),
                                 default=0.0),
        "relayed_mb": sum(e.relayed_bytes for e in world.network.endpoints.values()) / MB,
        "failovers": float(tally.failovers),
        "bans": float(tally.bans),
        "kills": float(tally.kills),
        "rollbacks": float(tally.rollbacks),
    }
    busy = {
        "coordinator uplink": coordinator.busy_up_s / duration,
        "coordinator downlink": coordinator.busy_down_s / duration,
        "coordinator CPU": world.coordinator_cpu_s
        / (world.coordinator_cpu.capacity * duration),
    }
    for stage, stage_replicas in enumerate(world.replicas):
        if stage_replicas and all(r.spec.host is None for r in stage_replicas):
            busy[f"stage {stage} replicas (mean)"] = _mean(
                [sum(r.busy.values()) / duration for r in stage_replicas])
            busy[f"stage {stage} replica uplinks (max)"] = max(
                r.endpoint.busy_up_s / duration for r in stage_replicas)
    for stage, stage_trainers in enumerate(world.trainers):
        if stage_trainers and stage_trainers[0].spec.host is None:
            busy[f"stage {stage} training peer"] = sum(stage_trainers[0].busy.values()) \
                / duration
            busy[f"stage {stage} training peer uplink"] = \
                stage_trainers[0].endpoint.busy_up_s / duration
    for host, resource in world.hosts.items():
        used = sum(sum(p.busy.values()) for p in peers if p.spec.host == host)
        if world.scenario.coordinator.host == host:
            used += world.coordinator_cpu_s
        used += sum(e.cpu_s for e in world.network.endpoints.values() if e.cpu is resource)
        used += world.restart_cpu_s[host]
        busy[f"host {host} cores"] = used / (resource.capacity * duration)
    staleness: dict[int, int] = {}
    for value in tally.staleness:
        staleness[value] = staleness.get(value, 0) + 1
    return SimReport(figures, dict(tally.groups), dict(sorted(staleness.items())),
                     dict(sorted(busy.items(), key=lambda item: -item[1])))
