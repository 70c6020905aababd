"""hash-chained events, append-only triggers, blob deletion log for gc

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

Events gain `seq` (their position in the chain), `prev_hash` and `hash`, so a row deleted
or edited behind the library's back breaks the chain where `kvgraft audit` looks. Rows
written before this revision are chained here, in id order, with the same hash the library
computes (frozen below: a migration must not change meaning when the library does).

The database itself refuses UPDATE and DELETE on events (triggers), so an accident cannot
rewrite history; someone who drops the triggers is caught by the chain instead. SQLite's
batch mode copies a table and loses its triggers: a later migration that batch-alters
`events` must create them again (see `_create_triggers`).

`blob_deletions` records every blob gc removed, in the transaction that removed it, so a
push that committed around a gc can ask the catalog whether any blob it relied on went away
instead of asking the store about every blob.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

GENESIS = "sha256:" + "0" * 64


def _event_hash(seq: int, prev: str, at: datetime, row: Any) -> str:
    # Frozen copy of kvgraft.catalog.events.event_hash (tests keep the two equal).
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    body = {"v": 1, "seq": seq, "prev": prev,
            "at": at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "actor": row.actor, "host": row.host, "action": row.action,
            "repository": row.repository, "tag": row.tag, "digest": row.digest,
            "outcome": row.outcome, "detail": row.detail}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                     allow_nan=False).encode("utf-8")
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _chain_existing_events() -> None:
    events = sa.table(
        'events', sa.column('id', sa.Integer()), sa.column('at', sa.DateTime(timezone=True)),
        sa.column('actor', sa.String()), sa.column('host', sa.String()),
        sa.column('action', sa.String()), sa.column('repository', sa.String()),
        sa.column('tag', sa.String()), sa.column('digest', sa.String()),
        sa.column('outcome', sa.String()), sa.column('detail', sa.Text()),
        sa.column('seq', sa.BigInteger()), sa.column('prev_hash', sa.String()),
        sa.column('hash', sa.String()))
    conn = op.get_bind()
    prev = GENESIS
    rows = conn.execute(sa.select(events).order_by(events.c.id)).all()
    for seq, row in enumerate(rows, start=1):
        digest = _event_hash(seq, prev, row.at, row)
        conn.execute(events.update().where(events.c.id == row.id).values(
            seq=seq, prev_hash=prev, hash=digest))
        prev = digest


def _create_triggers() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for verb in ("UPDATE", "DELETE"):
            op.execute(f"CREATE TRIGGER events_append_only_{verb.lower()} BEFORE {verb} ON "
                       "events BEGIN SELECT RAISE(ABORT, 'kvgraft events are append-only'); "
                       "END")
        return
    op.execute("CREATE FUNCTION kvgraft_events_append_only() RETURNS trigger "
               "LANGUAGE plpgsql AS $$ BEGIN "
               "RAISE EXCEPTION 'kvgraft events are append-only'; END $$")
    op.execute("CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events "
               "FOR EACH ROW EXECUTE FUNCTION kvgraft_events_append_only()")
    op.execute("CREATE TRIGGER events_append_only_truncate BEFORE TRUNCATE ON events "
               "FOR EACH STATEMENT EXECUTE FUNCTION kvgraft_events_append_only()")


def _drop_triggers() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS events_append_only_update")
        op.execute("DROP TRIGGER IF EXISTS events_append_only_delete")
        return
    op.execute("DROP TRIGGER IF EXISTS events_append_only ON events")
    op.execute("DROP TRIGGER IF EXISTS events_append_only_truncate ON events")
    op.execute("DROP FUNCTION IF EXISTS kvgraft_events_append_only()")


def upgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('seq', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('prev_hash', sa.String(length=71), nullable=True))
        batch_op.add_column(sa.Column('hash', sa.String(length=71), nullable=True))
    _chain_existing_events()
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.alter_column('seq', existing_type=sa.BigInteger(), nullable=False)
        batch_op.alter_column('prev_hash', existing_type=sa.String(length=71), nullable=False)
        batch_op.alter_column('hash', existing_type=sa.String(length=71), nullable=False)
        batch_op.create_index(batch_op.f('ix_events_seq'), ['seq'], unique=True)
    _create_triggers()

    op.create_table('blob_deletions',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('digest', sa.String(length=71), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_blob_deletions'))
    )
    with op.batch_alter_table('blob_deletions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_blob_deletions_digest'), ['digest'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('blob_deletions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_blob_deletions_digest'))
    op.drop_table('blob_deletions')
    _drop_triggers()
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_seq'))
        batch_op.drop_column('hash')
        batch_op.drop_column('prev_hash')
        batch_op.drop_column('seq')
