"""The CLI's one error boundary: typed errors become one line and their exit code."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from kvgraft.cli.output import safe
from kvgraft.errors import RegistryError, Unavailable

EXIT_INTERRUPTED = 130


def debug() -> bool:
    return os.environ.get("KVGRAFT_DEBUG", "") not in ("", "0")


def run_guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
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
