"""Writing a folder whole or not at all: its files go into a private staging folder beside the
target, which the caller then moves into place; anything that fails on the way removes the
staging folder, so no half-written folder is ever left where a reader looks (model/gguf.py's
converted models, release/export.py's releases)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """A new empty folder beside `target` (same file system, so a rename is atomic), named after
    it and hidden; removed if the block raises. Moving it into place is the block's job."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
