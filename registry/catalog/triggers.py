"""Are the event log's append-only triggers (migrations/versions/0002) still in place?

The triggers stop accidents; someone with write access can drop or disable them, after
which rows can be edited or deleted. The hash chain catches edits and deletions in the
middle, but not the newest events cut off together, so audit reports missing triggers too.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

SQLITE = ("events_append_only_update", "events_append_only_delete")
POSTGRESQL = ("events_append_only", "events_append_only_truncate")


def trigger_problems(s: Session) -> list[str]:
    """One message per expected trigger that is missing or disabled."""
    if s.get_bind().dialect.name == "sqlite":
        found = {name: "O" for name in s.scalars(text(
            "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'events'"))}
        expected = SQLITE
    else:
        # tgenabled: 'O' fires normally, 'D' disabled; 'R'/'A' fire only in replica modes.
        found = {name: state for name, state in s.execute(text(
            "SELECT tgname, tgenabled FROM pg_trigger "
            "WHERE tgrelid = to_regclass('events') AND NOT tgisinternal"))}
        expected = POSTGRESQL
    problems = []
    for name in expected:
        if name not in found:
            problems.append(f"append-only trigger {name} is missing from the events table "
                            "(events can be edited or deleted)")
        elif found[name] != "O":
            problems.append(f"append-only trigger {name} on the events table is disabled")
    return problems
