"""Text a peer chose (its name, the error string of its refusal, a verification detail) reaches
every surface inert: the terminal shows rich markup and escape sequences as text, a log line stays
one line, the dashboard's state carries it as bounded text, and the report and the model card
escape it as Markdown. Each surface gets the same hostile name."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import urllib.request
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import typer
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from rich.console import Console
from swarm_helpers import tiny_run_config

from decentrl.cli import fail
from decentrl.config import parse_config
from decentrl.coordinator.backend import RunSummary
from decentrl.demo import demo_summary
from decentrl.evaluate.runner import EvalResult
from decentrl.evaluate.stats import Accuracy
from decentrl.model.loading import BaseOrigin
from decentrl.net.directory import Directory, PeerState
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import PeerRecord
from decentrl.net.streams import ErrorFrame, FrameReader
from decentrl.net.text import peer_text
from decentrl.net.wire import TensorLimits
from decentrl.observe.dashboard import DashboardServer
from decentrl.observe.live import SwarmObserver
from decentrl.observe.logs import LOG_MESSAGE_CHARS, configure_logging
from decentrl.observe.metrics import (
    MetricsLog,
    PeerSnapshot,
    StepRecord,
    SwarmRecord,
    TrustRecord,
)
from decentrl.observe.report import build_report
from decentrl.observe.terminal import terminal_text
from decentrl.release.card import ModelSize, model_card
from decentrl.trust.reputation import Reputation

HOSTILE = "[bold red]x[/]\x1b[2J\n"
# How peer_text writes it: the markup as it is, the escape sequence and the newline spelled out.
INERT = "[bold red]x[/]\\x1b[2J\\n"
# The same in a message of several lines, and in Markdown (whitespace is one space there).
MULTILINE_INERT = "[bold red]x[/]\\x1b[2J\n"
MARKDOWN_INERT = "\\[bold red\\]x\\[/\\]\\\\x1b\\[2J"
CUT = re.compile(r"…\(\+\d+ chars\)$")
PEER_ID = "12D3KooWHostilePeerHostilePeerHostilePeerHostilePeer"


def assert_no_raw_controls(text: str) -> None:
    assert "\x1b" not in text and "\r" not in text, repr(text)


# ---- the shared helper --------------------------------------------------------------------

def test_peer_text_escapes_controls_and_formats_and_keeps_the_rest() -> None:
    assert peer_text(HOSTILE) == INERT
    assert peer_text("évaluation 評価 ok") == "évaluation 評価 ok"
    # A bidi override, a line separator, a NUL, a carriage return.
    assert peer_text("a\u202eb\u2028c\x00d\re") == "a\\u202eb\\u2028c\\x00d\\re"
    assert peer_text("two\nlines\x1b", multiline=True) == "two\nlines\\x1b"


def test_peer_text_cuts_long_text_with_a_marker_that_counts_what_was_cut() -> None:
    assert peer_text("x" * 1000, 10) == "x" * 10 + "…(+990 chars)"
    assert peer_text("x" * 10, 10) == "x" * 10
    # An escape is never cut in half: it counts whole against the limit.
    assert peer_text("abcdefgh\x1b", 10) == "abcdefgh…(+1 chars)"
    with pytest.raises(ValueError, match="at least 1 character"):
        peer_text("x", 0)


def test_a_peers_refusal_arrives_inert() -> None:
    """The error frame a peer answers with is its own text: what the caller raises is inert."""
    async def refusal() -> str:
        payload = RPCError(message=HOSTILE * 100).SerializeToString()
        reader = asyncio.StreamReader()
        reader.feed_data(P2P.ERROR_MARKER + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
                         + payload)
        reader.feed_eof()
        with pytest.raises(ErrorFrame) as refused:
            await FrameReader(reader, "x reply", 10**6, None).replies(runtime_pb2.ExpertResponse)
        return str(refused.value)
    text = asyncio.run(refusal())
    assert text.startswith(INERT * 2) and CUT.search(text)
    assert_no_raw_controls(text)


# ---- the terminal -------------------------------------------------------------------------

def rendered(*objects: Any) -> str:
    """What a colour terminal receives for `objects`: a style would come as an ANSI code."""
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="truecolor", width=200).print(
        *objects, highlight=False)
    return out.getvalue()


def test_a_name_on_the_terminal_shows_as_text() -> None:
    shown = rendered(f"{terminal_text(HOSTILE)} joined")
    assert shown == f"{INERT} joined\n"  # no style applied, no escape sequence sent
    assert terminal_text("n" * 100).endswith("n…(+36 chars)")


def test_the_demos_summary_shows_ban_causes_as_text() -> None:
    accuracy = Accuracy.from_counts(1, 2)
    after = EvalResult(task="sums", split="heldout", problems=2, pass1=accuracy, pass_k=None,
                       k=1, mean_completion_tokens=3.0, samples=[])
    trust = dict.fromkeys(("verified", "verify_failed", "verify_unconfirmed", "verify_skipped",
                           "verifiers_overruled", "flagged"), 0)
    summary = RunSummary(path=Path("run"), steps=1, wall_s=1.0, before=None, after=after,
                         trust=trust, banned={PEER_ID: f"malformed: {HOSTILE * 40}"})
    text = demo_summary(summary, 60.0, {PEER_ID: HOSTILE}, {}, Path("model"), Path("report"))
    shown = rendered(text)
    assert f"banned {INERT}: malformed: {INERT}" in shown
    assert_no_raw_controls(shown)
    assert "…(+" in shown


def test_an_error_quoting_a_peer_ends_in_one_escaped_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit):
        fail(f"invalid configuration:\n  {HOSTILE}: extra inputs are not permitted")
    err = capsys.readouterr().err
    assert err == (f"error: invalid configuration:\n  {MULTILINE_INERT}: extra inputs are not "
                   "permitted\n")


# ---- logs ---------------------------------------------------------------------------------

def test_log_lines_stay_one_inert_bounded_line(tmp_path: Path, restored_logging: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.jsonl"
    configure_logging("coordinator", json_file=path)
    logger = logging.getLogger("decentrl.test")
    logger.warning("peer %s refused: %s", HOSTILE, "y" * 10_000, extra={"peer_name": HOSTILE})
    console_lines = capsys.readouterr().err.splitlines()
    assert len(console_lines) == 1
    assert f"peer {INERT} refused: " in console_lines[0]
    assert CUT.search(console_lines[0]) and len(console_lines[0]) < LOG_MESSAGE_CHARS + 100
    assert_no_raw_controls(console_lines[0])
    entry = json.loads(path.read_text())
    assert entry["message"].startswith(f"peer {INERT} refused: ")
    assert CUT.search(entry["message"]) and len(entry["message"]) < LOG_MESSAGE_CHARS + 20
    assert entry["peer_name"] == INERT


def test_a_strike_logs_the_senders_error_inert(caplog: pytest.LogCaptureFixture) -> None:
    node = SwarmNode("victim", LinkProfile(), TensorLimits())
    try:
        with caplog.at_level(logging.INFO, logger="decentrl.net.strikes"):
            node.strike_book.strike(PEER_ID, "train_forward",
                                    ValueError(f"unknown field {HOSTILE * 100}"))
        [line] = [r.getMessage() for r in caplog.records]
        assert f"unknown field {INERT}" in line and CUT.search(line)
        assert len(line) < 400
        assert_no_raw_controls(line)
    finally:
        node.shutdown()


# ---- the dashboard ------------------------------------------------------------------------

class OfflineNode:
    """Directory and observer need no network here: announcements are put in by hand."""


def hostile_record() -> PeerRecord:
    return PeerRecord(name=HOSTILE * 20, stage=0, layers=(0, 2), role="inference", version=1,
                      tokens_per_s=1.0, free_sessions=1, training_ready=False)


def test_the_dashboards_state_carries_names_and_details_as_bounded_text(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    directory = Directory(cast(SwarmNode, OfflineNode()), config.name, 1, config.swarm)
    directory.peers[PEER_ID] = PeerState(hostile_record())
    reputation = Reputation(ban_score=0.5, ban_s=60.0)
    reputation.record(PEER_ID, "failed", f"<script>alert(1)</script>{HOSTILE * 50}", stage=0)
    observer = SwarmObserver(config, directory, reputation,
                             MetricsLog(tmp_path / "metrics.jsonl", 0.0), lambda: 1, lambda: 1,
                             dict)
    observer.record()
    with DashboardServer(observer.state) as server, \
            urllib.request.urlopen(server.url + "api/state", timeout=10) as response:
        body = response.read().decode()
    assert_no_raw_controls(body)
    state = json.loads(body)
    [peer] = state["stages"][0]["peers"]
    assert peer["name"].startswith(INERT) and CUT.search(peer["name"])
    assert len(peer["name"]) < 100
    [event] = state["trust_events"]
    assert event["name"] == peer["name"]
    assert event["detail"].startswith(f"<script>alert(1)</script>{INERT}")
    assert len(event["detail"]) < 350


def test_the_dashboard_page_inserts_peer_text_as_text_only() -> None:
    page = (Path(__file__).parents[3] / "src" / "decentrl" / "observe" /
            "dashboard.html").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in page, sink


# ---- the report and the model card ---------------------------------------------------------

def hostile_snapshot() -> SwarmRecord:
    return SwarmRecord(step=1, version=1, elapsed_s=70.0, peers=[PeerSnapshot(
        peer_id=f"{PEER_ID}`", name=HOSTILE, stage=0, role="inference", version=1,
        tokens_per_s=1.0, bytes_sent=10, reputation=0.2, banned=True, layers=[0, 2])])


def test_the_report_escapes_peer_names_and_details(tmp_path: Path) -> None:
    run_dir = tmp_path / "hostile"
    run_dir.mkdir()
    config = parse_config({"name": run_dir.name, "host": {"run_dir": str(tmp_path)}})
    (run_dir / "config.json").write_text(config.model_dump_json())
    records = [StepRecord(step=1, version=1, reward=0.5, accuracy=0.5, staleness_mean=0.0,
                          elapsed_s=60.0),
               hostile_snapshot(),
               TrustRecord(elapsed_s=80.0, time=1.7e9, peer=PEER_ID, name=HOSTILE, stage=0,
                           outcome="failed", detail=f"{HOSTILE} | <img src=x>")]
    (run_dir / "metrics.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n"
                                                     for r in records))
    text = build_report(run_dir).read_text()
    assert f"| {MARKDOWN_INERT} |" in text  # the peers table
    assert f"| failed | {MARKDOWN_INERT} \\| \\<img src=x\\> |" in text  # the events table
    assert not re.search(r"(?<!\\)(\[bold|<img)", text)  # none unescaped
    assert_no_raw_controls(text)


def test_the_model_card_escapes_the_swarms_peers(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1)
    base = BaseOrigin("org/tiny-base", "mit", None, {})
    size = ModelSize(1000, 900, "float32", 4000)
    card = model_card(config, base, size, 1, 1, ["ab" * 32], None, None,
                      snapshot=hostile_snapshot())
    row = next(line for line in card.splitlines() if PEER_ID in line)
    # No code span around the id: a backtick would end it.
    assert row == f"| {MARKDOWN_INERT} | 0 | inference | 1 | {PEER_ID}\\` |"
    assert_no_raw_controls(card)
