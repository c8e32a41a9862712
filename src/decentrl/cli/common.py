"""What every `decentrl` command shares: the typer app, the console, the options several commands
take, and the one-line report of a failure (see the cli package's docstring)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console

from decentrl.observe.terminal import terminal_text

if TYPE_CHECKING:
    from decentrl.net.reach import NetworkOptions

log = logging.getLogger(__name__)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reinforcement-learning post-training of language models on a swarm of "
                       "untrusted peers.")
console = Console()
# Options that more than one command takes.
ExitWithParent = Annotated[bool, typer.Option(
    "--exit-with-parent",
    help="Stop when the process that started this one exits (the local launcher uses it).")]
LogJson = Annotated[bool, typer.Option(
    "--log-json",
    help="Log JSON lines to stderr and print machine-readable events on stdout (the local "
         "launcher reads them).")]
Settings = Annotated[Optional[list[str]], typer.Option(  # noqa: UP007 - typer needs Optional
    "--set", metavar="SECTION.FIELD=VALUE",
    help="Change one field of the config, repeatable: the value is a TOML value, a bare word a "
         "string (--set train.lr=1e-5, --set host.device=cuda, --set "
         "task.options={min_digits=3}). docs/config.md lists every field.")]
Command = TypeVar("Command", bound=Callable[..., None])
# What a user's input or a user's swarm can cause: shown as one line with exit code 2. Anything
# else is a bug: one line too, exit code 1.
USER_ERRORS = (ValueError, OSError, RuntimeError, TimeoutError)
INTERRUPTED_EXIT = 130
# An error's message on the terminal: ours name every bad field of a config in a few lines.
ERROR_CHARS = 4000
debug_mode = False


@app.callback()
def options(
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show the full traceback of an error instead of one line.")] = False,
) -> None:
    global debug_mode
    debug_mode = debug


def command(name: str | None = None, **settings: Any) -> Callable[[Command], Command]:
    """`app.command`, with every error of the command reported as one line (see the module's
    docstring) instead of a traceback."""
    def register(function: Command) -> Command:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                function(*args, **kwargs)
            except KeyboardInterrupt:
                Console(stderr=True).print("interrupted")
                raise typer.Exit(code=INTERRUPTED_EXIT) from None
            except (typer.Exit, typer.Abort):
                raise
            except Exception as error:
                if debug_mode:
                    raise
                # INFO: the terminal's handler shows warnings and up, so the traceback reaches
                # the JSON log (where one is configured) and not the screen.
                log.info("%s failed", function.__name__, exc_info=error)
                if isinstance(error, USER_ERRORS):
                    fail(str(error) or type(error).__name__)
                fail(f"unexpected {type(error).__name__}: {error} (a bug; `decentrl --debug` "
                     "shows where)", code=1)

        # Typer keeps a docstring's line breaks, which land mid-sentence at other widths.
        paragraphs = inspect.cleandoc(function.__doc__ or "").split("\n\n")
        settings.setdefault("help", "\n\n".join(" ".join(p.split()) for p in paragraphs))
        app.command(name, **settings)(run)
        return function

    return register


def fail(message: str, code: int = 2) -> None:
    # stderr: stdout is data for whoever started a peer (its ready line). The message may quote a
    # peer (a refusal, a config from the DHT): inert, bounded, its lines kept.
    Console(stderr=True, soft_wrap=True).print(
        f"[red]error:[/] {terminal_text(message, ERROR_CHARS, multiline=True)}", highlight=False)
    raise typer.Exit(code=code)


def exit_on_sigterm() -> None:
    """SIGTERM ends the process through SystemExit, so `finally` blocks stop what it started."""
    import signal

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


def network_options(make: Callable[[], NetworkOptions]) -> NetworkOptions:
    """`make()`, or exit with what is wrong with the network options given."""
    try:
        return make()
    except ValueError as error:
        fail(str(error))
        raise  # not reached: fail exits
