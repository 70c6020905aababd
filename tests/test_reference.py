from __future__ import annotations

import pytest

from kvgraft.digest import Digest
from kvgraft.errors import UsageError
from kvgraft.reference import Reference

HEX = "a" * 64


@pytest.mark.parametrize(("text", "name", "tag", "digest"), [
    ("smollm2/system-prompt", "smollm2/system-prompt", "latest", None),
    ("a:v1", "a", "v1", None),
    ("org/team.x/name_y:V1.2-rc_3", "org/team.x/name_y", "V1.2-rc_3", None),
    (f"a/b@sha256:{HEX}", "a/b", None, Digest(HEX)),
])
def test_parse_valid(text: str, name: str, tag: str | None, digest: Digest | None) -> None:
    ref = Reference.parse(text)
    assert (ref.name, ref.tag, ref.digest) == (name, tag, digest)
    assert Reference.parse(str(ref)) == ref


@pytest.mark.parametrize("text", [
    "", "Upper/case", "../etc/passwd", "a/../b", "/abs", "a//b", "a/", "-a", "a-", "a..b",
    "a:", "a:-bad", "a:" + "t" * 129, "x" * 256, "a b", "a\nb", "a@sha256:short",
    "a@md5:" + HEX, f"a@sha256:{HEX.upper()}", "a:tag:again", "a@", "ü/name",
])
def test_parse_refused(text: str) -> None:
    with pytest.raises(UsageError):
        Reference.parse(text)


def test_name_length_limit() -> None:
    assert Reference.parse("a" * 255).name == "a" * 255
    with pytest.raises(UsageError, match="longer than 255"):
        Reference.parse("a" * 256)


def test_usage_error_exit_code() -> None:
    with pytest.raises(UsageError) as e:
        Reference.parse("BAD")
    assert e.value.exit_code == 2
