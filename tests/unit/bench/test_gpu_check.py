"""`make gpu-check` on a machine without CUDA: a clear refusal, before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys


def test_gpu_check_refuses_clearly_without_cuda() -> None:
    # No GPU visible, whatever this machine has.
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "bench.gpu_check"], capture_output=True,
                            text=True, timeout=120, env=environment)
    assert result.returncode == 2
    assert "gpu-check needs a CUDA GPU" in result.stderr and "sees none" in result.stderr
    assert result.stdout == ""  # nothing ran
