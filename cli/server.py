"""`kvgraft serve` and `kvgraft token`: the HTTP server and its API tokens."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvgraft.cli.common import current_registry, json_option
from kvgraft.cli.output import emit_json, emit_table, err
from kvgraft.server.settings import ServerSettings
from kvgraft.tokens import new_secret, parse_duration, parse_scopes, secret_hash

if TYPE_CHECKING:
    from kvgraft.catalog.tokens import TokenTable
    from kvgraft.client import Registry


def _tokens(reg: Registry) -> TokenTable:
    # Imported here: `kvgraft --help` reads this module and must not load SQLAlchemy.
    from kvgraft.catalog.tokens import TokenTable

    return TokenTable(reg.backends.whole_catalog(
        "managing tokens", "run `kvgraft token` on the server's host with a direct remote"))


def _token_registry(ctx: click.Context, what: str) -> Registry:
    # Tokens live in the server's own catalog, which a client reaches only through the API
    # the tokens guard: they are made on the server's host.
    reg = current_registry(ctx)
    reg.owner_only(what, "run it on the server's host with a direct remote (--catalog, "
                         "--store)")
    return reg


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=5000, show_default=True)
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True)
@click.option("--certfile", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="TLS certificate (PEM); with --keyfile, serve HTTPS.")
@click.option("--keyfile", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="TLS private key (PEM).")
@click.option("--public", "public", multiple=True, metavar="PATTERN",
              help="Repositories anyone may pull without a token (repeatable, e.g. 'demo/*').")
@click.option("--max-upload", "max_upload", type=click.IntRange(1), default=8 << 30,
              show_default=True, help="Largest blob accepted, in bytes (its decoded size).")
@click.option("--max-open-uploads", type=click.IntRange(1), default=64, show_default=True,
              help="Open uploads at once, in all.")
@click.option("--max-open-uploads-per-token", type=click.IntRange(1), default=16,
              show_default=True, help="Open uploads at once for one token.")
@click.option("--upload-ttl", type=click.FloatRange(1), default=3600, show_default=True,
              metavar="SECONDS", help="Remove an upload nothing was written to for this long.")
@click.option("--header-timeout", type=click.FloatRange(0.1), default=10, show_default=True,
              metavar="SECONDS", help="Time a connection has to send a request's headers.")
@click.option("--body-timeout", type=click.FloatRange(0.1), default=20, show_default=True,
              metavar="SECONDS", help="Window over which a request body must arrive at "
                                      "--min-body-rate (else 408 and closed).")
@click.option("--min-body-rate", type=click.IntRange(0), default=1024, show_default=True,
              metavar="BYTES/S", help="Slowest request body accepted, averaged per window.")
@click.option("--max-connections", type=click.IntRange(1), default=512, show_default=True,
              help="Connections at once per worker (lowered to fit the open-file limit).")
@click.option("--upload-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Where open uploads live (default $KVGRAFT_HOME/uploads).")
@click.option("--behind-proxy", metavar="IPS",
              help="Trust X-Forwarded-Proto/-For from these proxy addresses (comma-separated) "
                   "so links and the auth challenge name the proxy's https URL.")
@click.option("--redirect-blobs", is_flag=True,
              help="Answer kvgraft clients' blob reads with a 307 to a presigned S3 URL, so "
                   "the bytes skip the server (clients must reach the bucket: "
                   "KVGRAFT_S3_PUBLIC_ENDPOINT_URL names the endpoint they use).")
@click.option("--redirect-expiry", type=click.IntRange(1, 3600), default=300,
              show_default=True, metavar="SECONDS", help="How long a presigned URL is good for.")
@click.option("--metrics-public", is_flag=True,
              help="Let anyone scrape GET /metrics (default: a token with admin on '*').")
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, workers: int, certfile: Path | None,
          keyfile: Path | None, public: tuple[str, ...], max_upload: int,
          max_open_uploads: int, max_open_uploads_per_token: int, upload_ttl: float,
          header_timeout: float, body_timeout: float, min_body_rate: int,
          max_connections: int, upload_dir: Path | None, behind_proxy: str | None,
          redirect_blobs: bool, redirect_expiry: int, metrics_public: bool) -> None:
    """Serve the catalog and store over HTTP: the OCI distribution API and /kvgraft/v1."""
    from kvgraft.errors import UsageError
    from kvgraft.server.main import serve as run

    if (certfile is None) != (keyfile is None):
        raise UsageError("--certfile and --keyfile go together")
    config = current_registry(ctx).config
    settings = ServerSettings(upload_dir=(upload_dir or config.home / "uploads").absolute(),
                              public=public, max_upload_bytes=max_upload,
                              max_open_uploads=max_open_uploads,
                              max_open_uploads_per_token=max_open_uploads_per_token,
                              upload_ttl_seconds=upload_ttl, header_timeout=header_timeout,
                              body_timeout=body_timeout, min_body_rate=min_body_rate,
                              max_connections=max_connections,
                              redirect_blobs=redirect_blobs, redirect_seconds=redirect_expiry,
                              metrics_public=metrics_public)
    run(config, settings, host=host, port=port, workers=workers, certfile=certfile,
        keyfile=keyfile, forwarded_allow_ips=behind_proxy)


@click.group()
def token() -> None:
    """API tokens for `kvgraft serve` (the catalog keeps only their hash)."""


@token.command("create")
@click.option("--scope", "scopes", multiple=True, required=True,
              help="repository:<pattern>:<actions>, e.g. 'repository:team/*:pull,push'.")
@click.option("--name", help="Default: token-<n>.")
@click.option("--expires", help="Lifetime: 30d, 12h, 2w… (default: never).")
@json_option
@click.pass_context
def token_create(ctx: click.Context, scopes: tuple[str, ...], name: str | None,
                 expires: str | None, as_json: bool) -> None:
    """Create a token and print its secret, once."""
    reg = _token_registry(ctx, "token create")
    parsed = parse_scopes(scopes)
    table = _tokens(reg)
    expires_at = datetime.now(UTC) + parse_duration(expires) if expires else None
    name = name or f"token-{len(table.list()) + 1}"
    secret = new_secret()
    tok = table.create(name, secret_hash(secret), parsed, f"{reg.user}@{reg.host}", expires_at)
    reg.events.record("token-create", detail={
        "token": name, "scopes": [str(s) for s in parsed],
        "expires_at": expires_at.isoformat() if expires_at else None})
    if as_json:
        emit_json({**tok.to_json(datetime.now(UTC)), "secret": secret})
        return
    click.echo(secret)
    err(f"token {name!r} created; it is shown only now")


@token.command("ls")
@json_option
@click.pass_context
def token_ls(ctx: click.Context, as_json: bool) -> None:
    """List tokens (never their secrets)."""
    now = datetime.now(UTC)
    tokens = _tokens(_token_registry(ctx, "token ls")).list()
    if as_json:
        for t in tokens:
            emit_json(t.to_json(now))
        return
    emit_table(["NAME", "STATE", "SCOPES", "EXPIRES", "CREATED BY"],
               [[t.name, t.state(now), " ".join(str(s) for s in t.scopes),
                 t.expires_at.isoformat(timespec="seconds") if t.expires_at else "never",
                 t.created_by] for t in tokens])


@token.command("revoke")
@click.argument("name")
@click.pass_context
def token_revoke(ctx: click.Context, name: str) -> None:
    """Revoke a token: the server refuses it from its next request on."""
    reg = _token_registry(ctx, "token revoke")
    _tokens(reg).revoke(name)
    reg.events.record("token-revoke", detail={"token": name})
    err(f"token {name!r} revoked")


COMMANDS = [serve, token]
