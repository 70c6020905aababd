"""Start-up: `kvgraft --version`, `--help` and `ls` on an empty registry load only what they
need. Checked in fresh interpreters with -X importtime (every module a process imports is
listed there), so nothing this test process imported can hide an import."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvgraft
from kvgraft.cli.main import DEFAULT_CODEC, LAZY_COMMANDS, cli
from tests.support.harness import RegistryFactory, sql_catalog

HEAVY = ("sqlalchemy", "alembic", "numpy", "torch", "transformers", "boto3", "botocore",
         "jsonschema", "zstandard", "cryptography", "securesystemslib")
ROOT = Path(__file__).resolve().parent.parent


def imported(env: dict[str, str], *args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvgraft.cli", *args],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    assert "kvgraft.cli.main" in names  # the listing works at all
    return names


def heavy(names: set[str], roots: tuple[str, ...] = HEAVY) -> set[str]:
    return {n for n in names if n.split(".")[0] in roots}


@pytest.mark.parametrize("args", [["--version"], ["--help"]])
def test_version_and_help_load_nothing_heavy(cli_env: dict[str, str], args: list[str]) -> None:
    names = imported(cli_env, *args)
    assert heavy(names, (*HEAVY, "rich")) == set()
    assert "kvgraft.client" not in names
    if args == ["--version"]:  # the other command modules are not even read
        assert not names & set(LAZY_COMMANDS)


def test_ls_on_an_empty_registry_loads_only_the_catalog(cli_env: dict[str, str]) -> None:
    home = Path(cli_env["KVGRAFT_HOME"])
    # Never written to: nothing to read, and listing it does not create a catalog.
    names = imported(cli_env, "ls")
    assert heavy(names) == set()
    assert not (home / "catalog.db").exists()
    # An empty catalog: SQLAlchemy Core, but not the migrations, the ORM and its mapped
    # models, or the data path.
    assert CliRunner(env=cli_env).invoke(cli, ["db", "upgrade"]).exit_code == 0
    names = imported(cli_env, "ls")
    assert "sqlalchemy" in names
    assert heavy(names) == {n for n in names if n.split(".")[0] == "sqlalchemy"}
    assert not {n for n in names if n.startswith("sqlalchemy.orm")}
    assert not names & {"kvgraft.catalog.catalog", "kvgraft.catalog.models"}


def _at_old_revision(url: str) -> None:
    from kvgraft.catalog.engine import make_engine
    from kvgraft.catalog.schema import upgrade

    engine = make_engine(url)
    upgrade(engine, "0003")
    engine.dispose()


def test_ls_still_upgrades_an_embedded_catalog_that_is_behind(
        cli_env: dict[str, str]) -> None:
    from kvgraft.catalog.reader import CatalogReader
    from kvgraft.catalog.schema import head_revision

    url = f"sqlite:///{cli_env['KVGRAFT_HOME']}/catalog.db"
    _at_old_revision(url)
    r = subprocess.run([sys.executable, "-m", "kvgraft.cli", "ls", "--json"], env=cli_env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    reader = CatalogReader.open(url)  # refuses anything but head
    assert reader.current_revision() == head_revision()
    reader.close()


def test_ls_refuses_a_shared_catalog_that_is_behind(cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    _at_old_revision(url)
    r = subprocess.run([sys.executable, "-m", "kvgraft.cli", "--catalog", url, "ls"],
                       env=cli_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 7, r.stderr
    assert "revision 0003" in r.stderr and "kvgraft db upgrade" in r.stderr


def test_lazy_command_table_matches_the_modules() -> None:
    for module, names in LAZY_COMMANDS.items():
        commands = importlib.import_module(module).COMMANDS
        assert tuple(c.name for c in commands) == names
    listed = CliRunner().invoke(cli, ["--help"]).output
    for names in LAZY_COMMANDS.values():
        for name in names:
            assert f"  {name} " in listed or f"  {name}\n" in listed, name


def test_version_and_defaults_agree_with_their_sources() -> None:
    from kvgraft.codecs.codec import DEFAULT_CODEC as codec_default
    from kvgraft.codecs.codec import push_codec_names

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert kvgraft.__version__ == pyproject["project"]["version"] == version("kvgraft")
    assert codec_default == DEFAULT_CODEC
    runner = CliRunner()
    assert kvgraft.__version__ in runner.invoke(cli, ["--version"]).output
    # The codec choice is computed when needed, and still refuses what is not a codec.
    out = runner.invoke(cli, ["push", "--help"]).output
    assert all(name in out for name in push_codec_names())
    r = runner.invoke(cli, ["push", "x.kv", "a/b", "--codec", "nope"])
    assert r.exit_code == 2 and "nope" in r.output


def test_pull_without_a_policy_does_not_load_the_signature_machinery(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    from tests.support.synthetic import write_synthetic

    src = write_synthetic(tmp_path / "a.kv", tokens=50)
    assert CliRunner(env=cli_env).invoke(cli, ["push", str(src), "t/a:v1"]).exit_code == 0
    names = imported(cli_env, "pull", "t/a:v1")
    assert heavy(names, ("securesystemslib", "cryptography", "boto3", "torch")) == set()
    # With a policy table the checks run (and refuse this unsigned artifact).
    (Path(cli_env["KVGRAFT_HOME"]) / "config.toml").write_text(
        '[policy]\nrequire_signed_by = ["' + "ab" * 32 + '"]\n')
    r = CliRunner(env=cli_env).invoke(cli, ["pull", "t/a:v1"])
    assert r.exit_code == 4, r.output


def test_a_listing_opens_no_orm_and_the_full_catalog_reuses_its_engine(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    make_registry(home=tmp_path / "h").catalog.close()  # an existing, empty catalog
    reg = make_registry(home=tmp_path / "h")
    assert reg.list() == ()
    assert reg.backends.opened == ("reader",)  # type: ignore[attr-defined]
    from kvgraft.catalog.reader import CatalogReader

    reader = reg.catalog_reader
    assert isinstance(reader, CatalogReader)
    assert sql_catalog(reg).engine is reader.engine
    assert reg.catalog.artifact_digests() == []
    reg.close()
