"""The `decentrl` command line: demo, train, coordinate, join, eval, export, report, bench.

Every failure a user can cause (a bad argument, config, address or folder; a peer that is not
there) ends in one line on stderr that names the problem, and exit code 2; an unexpected error
ends in one line and exit code 1. The traceback goes to the run's JSON log, and to the terminal
with `decentrl --debug`.

The commands live by job: runs.py (demo, train, coordinate), peers.py (relay, join),
results.py (eval, export, report, bench); common.py holds what they share."""

# Each module registers its commands, in the order --help lists them.
from decentrl.cli import runs  # noqa: F401, I001
from decentrl.cli import peers  # noqa: F401
from decentrl.cli import results  # noqa: F401
from decentrl.cli.common import app, fail
from decentrl.cli.peers import print_join_event
from decentrl.cli.results import BENCH_DIR
from decentrl.cli.runs import join_command

__all__ = ["BENCH_DIR", "app", "fail", "join_command", "print_join_event"]
