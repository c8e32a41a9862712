"""Structured logs: one JSON object per line (time, level, logger, process name, message, and any
`extra=` fields), so a swarm's logs can be filtered and joined by machine; the console keeps a
short human line for warnings. Either way a message is one line, with no control character and
bounded in length: callers bound what peers chose (net/text.py), and the formatters do it again
for whatever text a caller passed on whole."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from decentrl.net.text import peer_text

# The attributes every LogRecord has; anything else on a record came from `extra=`.
STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
# Far longer than any message of ours, which name what they are about in a line or two: the
# backstop for an error whose text a peer chose and a caller logged whole.
LOG_MESSAGE_CHARS = 4000


def log_message(record: logging.LogRecord) -> str:
    """The record's message as one inert line of at most LOG_MESSAGE_CHARS (and a marker)."""
    return peer_text(record.getMessage(), LOG_MESSAGE_CHARS)


class LineFormatter(logging.Formatter):
    """logging.Formatter, with the message as log_message makes it (the traceback, when there is
    one, still follows on its own lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = log_message(record)
        return super().formatMessage(record)


class JsonLinesFormatter(logging.Formatter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name,
            "process": self.process_name, "message": log_message(record),
        }
        entry.update({key: peer_text(value, LOG_MESSAGE_CHARS) if isinstance(value, str) else value
                      for key, value in vars(record).items() if key not in STANDARD_ATTRIBUTES})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(process_name: str, json_stderr: bool = False,
                      json_file: Path | None = None) -> None:
    """decentrl's own loggers at INFO, everyone else's at WARNING. `json_stderr`: stderr carries
    JSON lines (a peer started by the launcher, whose stderr is its log file); otherwise stderr
    gets a short line per warning. `json_file`: every record, as JSON lines, appended there."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.WARNING)
    logging.getLogger("decentrl").setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    if json_stderr:
        console.setFormatter(JsonLinesFormatter(process_name))
    else:
        console.setLevel(logging.WARNING)
        console.setFormatter(LineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root.addHandler(console)
    if json_file is not None:
        json_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(json_file)
        file_handler.setFormatter(JsonLinesFormatter(process_name))
        root.addHandler(file_handler)
