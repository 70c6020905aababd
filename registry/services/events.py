"""The audit trail as the Registry writes and reads it: every change is recorded as an
event under this machine's user and host (through a server, the server records it under
the token's name instead)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from kvgraft.catalog.records import EventRecord
from kvgraft.config import actor
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.services.backends import Backends


class EventLog:
    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        self.user, self.host = actor()

    @property
    def actor(self) -> str:
        return f"{self.user}@{self.host}"

    def event(self, action: str, **kw: Any) -> EventRecord:
        """An event by this machine's user, to commit with the change it describes."""
        return EventRecord(action=action, actor=self.actor, host=self.host, **kw)

    def record(self, action: str, **kw: Any) -> EventRecord:
        """Record an event on its own (what it is about already happened)."""
        event = self.event(action, **kw)
        self.backends.record(event)
        return event

    def log(self, ref: Reference | str | None = None, *, since: datetime | None = None,
            action: str | None = None) -> tuple[EventRecord, ...]:
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        # By digest even after gc removed the artifact: its history outlives it.
        digest = None if ref is None else ref.digest or self.backends.resolve(ref)
        return tuple(self.backends.catalog.events(digest=digest, action=action, since=since))
