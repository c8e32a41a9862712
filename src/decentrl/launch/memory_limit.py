"""A memory cap a process cannot exceed: a Linux memory cgroup per peer process, set by the
launcher before the peer loads anything (`host.memory_limit_mb`).

A process joins its cgroup in `preexec` (between fork and exec), so everything it and its
children ever allocate is charged there; past the limit the kernel reclaims its page cache
and then kills it (an OOM kill, counted). The peak it reached is read back for the benchmarks.
cgroup v2 (`memory.max`, `memory.peak`) and v1 (`memory.limit_in_bytes`,
`memory.max_usage_in_bytes`) are both handled; each cgroup is made under the launcher's own
name and removed once its processes are gone."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from decentrl.errors import DecentrlError

CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1024 * 1024


class MemoryLimitUnavailable(DecentrlError, RuntimeError):
    """This machine cannot cap a process's memory (no writable memory cgroup)."""


@dataclass(frozen=True)
class MemoryCgroup:
    """One cgroup capping `limit_bytes` (made by `MemoryCgroup.create`)."""

    path: Path
    limit_bytes: int
    v2: bool

    @classmethod
    def create(cls, name: str, limit_bytes: int, root: Path = CGROUP_ROOT) -> MemoryCgroup:
        """A fresh cgroup `name` (a unique one: the launcher's pid is in it) capping
        `limit_bytes`; MemoryLimitUnavailable where the machine has none to give."""
        if limit_bytes < 16 * MIB:
            raise ValueError(f"a memory limit of {limit_bytes} bytes is below 16 MiB")
        v2 = (root / "cgroup.controllers").is_file()
        parent = root if v2 else root / "memory"
        path = parent / f"decentrl-{os.getpid()}-{name}"
        try:
            if v2:
                controllers = (root / "cgroup.subtree_control").read_text().split()
                if "memory" not in controllers:
                    raise MemoryLimitUnavailable(f"{root}: the memory controller is not enabled "
                                                 f"for child cgroups (cgroup.subtree_control)")
            path.mkdir()
            (path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(
                str(limit_bytes))
            if not v2:  # without swap accounting the file is absent: RAM is all it can use
                with contextlib.suppress(OSError):
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError as error:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise MemoryLimitUnavailable(f"cannot make a memory cgroup at {path}: {error} "
                                         f"(root and a writable {parent} are needed)") from None
        return cls(path, limit_bytes, v2)

    def preexec(self) -> None:
        """Put the calling process in this cgroup (Popen's preexec_fn: the child, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        """The most memory its processes held at once."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """Processes the kernel killed for going past the limit."""
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self, timeout_s: float = 10.0) -> None:
        """Remove the cgroup once its processes have exited (waits up to `timeout_s` for the
        kernel to let go of them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
