"""What the tests share with the fixtures of conftest.py: the type of `make_registry`, and
what to do when a real service the test needs cannot be had (skip locally, fail in CI)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from kvgraft.client import Registry

if TYPE_CHECKING:
    from kvgraft.catalog import Catalog

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# make_registry(home=, catalog_url=, blob_url=, cache_dir=): all keyword-only and optional.
RegistryFactory = Callable[..., Registry]


def unavailable(what: str) -> None:
    """Skip locally, fail in CI: a missing service there is a broken set-up, not a pass."""
    if IN_CI:
        pytest.fail(f"{what} is not available (required under CI=true)")
    pytest.skip(f"{what} is not available")


def s3_base_url() -> str:
    """The bucket URL of the real S3 server on loopback (support/daemons.py), started once."""
    from tests.support.daemons import ensure_s3

    base = ensure_s3()
    if base is None:
        unavailable("an S3 server on loopback")
    assert base is not None
    return base


def sql_catalog(reg: Registry) -> Catalog:
    """The SQL catalog behind a direct registry, for tests that query or tamper with it
    below the catalog API (a Registry types its catalog as the API both kinds share)."""
    from kvgraft.catalog import Catalog

    catalog = reg.catalog
    assert isinstance(catalog, Catalog), f"{reg.config.catalog_url} is not a SQL catalog"
    return catalog
