"""Experiment trackers (`host.report_to`): TensorBoard, Weights & Biases and trackio, fed the
records metrics.jsonl holds. MetricsLog hands `Trackers.log` every record it writes, so a tracker
sees the training steps, supervised steps and evaluations the report reads, with the same values,
and nothing else computes them. Only the coordinator's loop opens trackers; peers never do.

Each tracker's package is imported when the tracker opens (`pip install 'decentrl[trackers]'`):
one not installed is refused before the run starts. A tracker that fails later (a full disk, a W&B
error) is switched off with one warning, and training and the other trackers go on."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import msgspec

from decentrl.config.base import ConfigError
from decentrl.config.host import TrackerName
from decentrl.observe.metrics import EvalRecord, Record, StepRecord, SupervisedRecord

log = logging.getLogger(__name__)

# The project W&B (unless WANDB_PROJECT says otherwise) and trackio file runs under; the run's
# name names the run there.
PROJECT = "decentrl"
INSTALL = "pip install 'decentrl[trackers]'"
# Each tracker's metrics under a prefix of its kind (TensorBoard and W&B group charts by it);
# the other kinds of record (the swarm's snapshots, verification events) are not series of steps.
TRACKED: dict[type[Record], str] = {StepRecord: "train", SupervisedRecord: "supervised",
                                    EvalRecord: "eval"}
# Run folder entries the trackers write into.
TENSORBOARD_DIR = "tensorboard"
TRACKIO_DIR = "trackio"


def scalars_of(record: Record) -> tuple[int, dict[str, float]] | None:
    """The step `record` belongs to and its numbers, as "PREFIX/field" (a table of numbers, such
    as the curriculum's pass rate per bucket, as "PREFIX/field/key"); None for a kind no tracker
    logs. Text (an evaluation's label and task) is left out: the step places it."""
    prefix = TRACKED.get(type(record))
    if prefix is None:
        return None
    fields = msgspec.structs.asdict(record)
    step = fields.pop("step")
    scalars: dict[str, float] = {}
    for name, value in fields.items():
        if isinstance(value, Mapping):
            scalars.update({f"{prefix}/{name}/{key}": float(number)
                            for key, number in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[f"{prefix}/{name}"] = float(value)
    return step, scalars


class Tracker(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files in RUN/tensorboard (`tensorboard --logdir RUN/tensorboard`)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.directory))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


def wandb_mode(environ: Mapping[str, str]) -> str | None:
    """Offline, unless the user chose otherwise: WANDB_MODE (W&B reads it itself), or an API key
    (then W&B's own default, online). None: W&B decides."""
    if environ.get("WANDB_MODE") or environ.get("WANDB_API_KEY"):
        return None
    return "offline"


class WandbTracker:
    """A W&B run in RUN/wandb: offline unless `wandb_mode` says otherwise, and offline too when
    starting online fails (no network); `wandb sync RUN/wandb/offline-run-*` uploads it later."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, run_config: dict[str, Any]) -> None:
        import wandb

        mode = wandb_mode(os.environ)
        options: dict[str, Any] = dict(
            project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(run_dir),
            config=run_config, reinit="create_new",
            # The run's console is in its own log already; W&B's capture would wrap the terminal
            # that the progress bars draw on.
            settings=wandb.Settings(console="off"))
        try:
            self.run = wandb.init(mode=mode, **options)
        except Exception as error:
            if mode == "offline":
                raise
            log.warning("W&B could not start online (%s); logging offline in %s instead",
                        error, run_dir / "wandb")
            self.run = wandb.init(mode="offline", **options)
        self.directory = Path(self.run.dir).parent

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def import_trackio(directory: Path) -> ModuleType:
    """trackio, storing in `directory` unless TRACKIO_DIR says otherwise. trackio reads
    TRACKIO_DIR once, when it is first imported: a process that imported it before (a second run
    in one process) keeps its first directory."""
    if "TRACKIO_DIR" in os.environ or "trackio" in sys.modules:
        import trackio
        return trackio
    # Set only for the import, so that processes this one starts (a demo's peers) do not inherit it.
    os.environ["TRACKIO_DIR"] = str(directory)
    try:
        import trackio
    finally:
        del os.environ["TRACKIO_DIR"]
    return trackio


class TrackioTracker:
    """A trackio run in RUN/trackio (`TRACKIO_DIR=RUN/trackio trackio show`), local only. A
    resumed run goes on in the trackio run of the same name."""

    name = "trackio"

    def __init__(self, run_dir: Path, run_name: str, run_config: dict[str, Any]) -> None:
        trackio = import_trackio(run_dir / TRACKIO_DIR)
        self.directory = Path(trackio.utils.TRACKIO_DIR)
        if self.directory != run_dir / TRACKIO_DIR:
            log.info("trackio stores this run in %s (TRACKIO_DIR)", self.directory)
        self.run = trackio.init(project=PROJECT, name=run_name, config=run_config,
                                resume="allow", embed=False)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


# What each tracker imports; its package on PyPI has the same name.
PACKAGES: dict[TrackerName, str] = {"tensorboard": "tensorboard", "wandb": "wandb",
                                    "trackio": "trackio"}


def require_packages(names: Sequence[TrackerName]) -> None:
    """Raise ConfigError naming every tracker of `names` whose package is not installed, and how
    to install it."""
    missing = [PACKAGES[name] for name in names if importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise ConfigError(f"host.report_to: {', '.join(missing)} not installed here; "
                          f"{INSTALL} (or pip install {' '.join(missing)})")


def open_tracker(name: TrackerName, run_dir: Path, run_name: str,
                 run_config: dict[str, Any]) -> Tracker:
    if name == "tensorboard":
        return TensorBoardTracker(run_dir)
    if name == "wandb":
        return WandbTracker(run_dir, run_name, run_config)
    return TrackioTracker(run_dir, run_name, run_config)


class Trackers:
    """The trackers a run reports to; `log` never raises (a failing tracker is dropped)."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    @classmethod
    def open(cls, names: Sequence[TrackerName], run_dir: Path, run_name: str,
             run_config: dict[str, Any]) -> Trackers:
        """Every tracker of `names` started for the run in `run_dir`, with the run's config
        (W&B and trackio keep it); ConfigError, before any starts, when a package is missing."""
        require_packages(names)
        return cls([open_tracker(name, run_dir, run_name, run_config) for name in names])

    def log(self, record: Record) -> None:
        scalars = scalars_of(record) if self.trackers else None
        if scalars is None:
            return
        step, values = scalars
        for tracker in list(self.trackers):
            try:
                tracker.log(values, step)
            except Exception as error:  # whatever it raises, training goes on without it
                self._drop(tracker, error)

    def close(self) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.close()
            except Exception as error:
                self._drop(tracker, error)
        self.trackers.clear()

    def _drop(self, tracker: Tracker, error: Exception) -> None:
        log.warning("tracker %s failed (%s: %s); the run goes on without it", tracker.name,
                    type(error).__name__, error)
        self.trackers.remove(tracker)
