"""Debian's headless Chromium for page tests: the DOM a page builds, and screenshots."""

from __future__ import annotations

import os
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_TIMEOUT_S = 60


def chromium(url: str, profile: Path, *flags: str) -> str:
    """Chromium's stdout for `url`. It runs in a session of its own, and the whole session is
    killed afterwards: its renderer and GPU helpers are children that outlive a killed parent."""
    assert CHROMIUM.exists(), "the dashboard test needs Debian's chromium (make test installs it)"
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
               "--virtual-time-budget=6000", *flags, url]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=CHROMIUM_TIMEOUT_S)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, f"chromium exited with {process.returncode}:\n{stderr[-3000:]}"
    return stdout


class _PageReader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []
        self._in_code = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self._in_code = tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._in_code = False

    def handle_data(self, data: str) -> None:
        if not self._in_code:
            self.text.append(data)


def read_page(dom: str) -> tuple[str, list[str]]:
    """The page's visible text (entities decoded, whitespace collapsed) and its elements' tags."""
    reader = _PageReader()
    reader.feed(dom)
    return " ".join(" ".join(reader.text).split()), reader.tags
