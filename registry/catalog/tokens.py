"""Token rows: create, list, revoke and look up by the hash of a secret."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select, update

from kvgraft.catalog.catalog import Catalog
from kvgraft.catalog.models import TokenRow
from kvgraft.catalog.records import aware
from kvgraft.errors import Conflict, NotFound
from kvgraft.tokens import Scope, Token


def _record(row: TokenRow) -> Token:
    return Token(row.id, row.name, tuple(Scope.parse(s) for s in row.scopes.split()),
                 aware(row.created_at), row.created_by,
                 aware(row.expires_at) if row.expires_at else None,
                 aware(row.revoked_at) if row.revoked_at else None)


class TokenTable:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def create(self, name: str, secret_hash: str, scopes: tuple[Scope, ...], created_by: str,
               expires_at: datetime | None) -> Token:
        with self.catalog._session(write=True) as s:
            if s.scalar(select(TokenRow.id).where(TokenRow.name == name)) is not None:
                raise Conflict(f"a token named {name!r} exists",
                               hint="choose another --name or revoke the old one")
            row = TokenRow(name=name, secret_hash=secret_hash,
                           scopes=" ".join(str(sc) for sc in scopes),
                           created_at=datetime.now(UTC), created_by=created_by,
                           expires_at=expires_at)
            s.add(row)
            s.flush()
            return _record(row)

    def list(self) -> list[Token]:
        with self.catalog._session() as s:
            return [_record(r) for r in s.scalars(select(TokenRow).order_by(TokenRow.id))]

    def by_hash(self, secret_hash: str) -> Token | None:
        with self.catalog._session() as s:
            row = s.scalar(select(TokenRow).where(TokenRow.secret_hash == secret_hash))
            return _record(row) if row is not None else None

    def revoke(self, name: str) -> Token:
        with self.catalog._session(write=True) as s:
            row = s.scalar(select(TokenRow).where(TokenRow.name == name))
            if row is None:
                raise NotFound(f"no token named {name!r}", hint="`kvgraft token ls` lists them")
            if row.revoked_at is None:
                s.execute(update(TokenRow).where(TokenRow.id == row.id)
                          .values(revoked_at=datetime.now(UTC)))
                s.flush()
                s.refresh(row)
            return _record(row)
