"""A peer process capped by a memory cgroup (launch/memory_limit.py) cannot go past its cap."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from decentrl.launch.memory_limit import MIB, MemoryCgroup, MemoryLimitUnavailable


def run_capped(memory: MemoryCgroup, megabytes: int) -> subprocess.CompletedProcess[str]:
    # Touch every page, so the memory is really held, then report.
    code = f"b = bytearray({megabytes} * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); " \
           "print('held')"
    return subprocess.run([sys.executable, "-c", code], preexec_fn=memory.preexec,
                          capture_output=True, text=True, timeout=60)


def test_a_capped_process_is_killed_past_its_cap_and_its_peak_is_read() -> None:
    memory = MemoryCgroup.create("test-cap", 96 * MIB)
    try:
        within = run_capped(memory, 24)
        assert within.returncode == 0 and "held" in within.stdout
        assert 24 * MIB < memory.peak_bytes() <= 96 * MIB
        past = run_capped(memory, 400)
        assert past.returncode == -signal.SIGKILL and "held" not in past.stdout
        assert memory.oom_kills() >= 1
        assert memory.peak_bytes() <= 96 * MIB
    finally:
        memory.remove()
    assert not memory.path.exists()


def test_a_cap_too_small_to_run_anything_is_refused() -> None:
    with pytest.raises(ValueError, match="below 16 MiB"):
        MemoryCgroup.create("tiny", 1024)


def test_a_machine_without_memory_cgroups_says_so(tmp_path: Path) -> None:
    with pytest.raises(MemoryLimitUnavailable, match="cannot make a memory cgroup"):
        MemoryCgroup.create("nowhere", 64 * MIB, root=tmp_path)
