"""The CLI's one error boundary: typed errors become one line and their exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import click

from kvgraft.cli.output import safe
from kvgraft.errors import RegistryError, Unavailable

EXIT_INTERRUPTED = 130


def debug() -> bool:
    return os.environ.get("KVGRAFT_DEBUG", "") not in ("", "0")


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so that every `finally` and every
    cleanup handler runs (temp files of a pull or push are removed) before exiting."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_guarded(fn: Callable[[], Any]) -> Any:
    try:
        with _signals_raise():
            return fn()
    except Terminated as e:
        _fail(f"terminated by {signal.Signals(e.signum).name}", 128 + e.signum)
    except RegistryError as e:
        _fail(f"error: {e.human()}", e.exit_code)
    except click.exceptions.Exit:
        raise
    except click.ClickException:
        raise
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)
    except OSError as e:
        _fail(f"error: {e}", Unavailable.exit_code if isinstance(e, ConnectionError) else 1)
    except Exception as e:  # the boundary: anything else is a bug, said plainly
        _fail(f"internal error: {type(e).__name__}: {e} (set KVGRAFT_DEBUG=1 for a traceback)",
              1)


def _fail(message: str, code: int) -> None:
    if debug():
        traceback.print_exc()
    click.echo(safe(message), file=sys.stderr)
    sys.exit(code)
