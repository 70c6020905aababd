from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvgraft.cli.main import cli
from kvgraft.config import Config
from kvgraft.configfile import Remote, add_remote, dumps_toml, load_remotes, remove_remote
from kvgraft.errors import Conflict, NotFound, UsageError
from tests.support.synthetic import write_synthetic


def test_remote_config_round_trip(tmp_path: Path) -> None:
    add_remote(tmp_path, Remote("team", "sqlite:////x/c.db", "s3://b/p", Path("/c")))
    add_remote(tmp_path, Remote("other.one", "postgresql+psycopg://u@h/db", "file:///s"))
    with pytest.raises(Conflict):
        add_remote(tmp_path, Remote("team", "sqlite:////y", "file:///y"))
    remotes = load_remotes(tmp_path)
    assert remotes["team"] == Remote("team", "sqlite:////x/c.db", "s3://b/p", Path("/c"))
    assert remotes["other.one"].cache_dir is None
    config = Config.from_env({"KVGRAFT_HOME": str(tmp_path)}, remote="team")
    assert (config.catalog_url, config.blob_url, config.cache_dir) == \
        ("sqlite:////x/c.db", "s3://b/p", Path("/c"))
    flagged = Config.from_env({"KVGRAFT_HOME": str(tmp_path)}, remote="team",
                              blob_url="file:///flag")
    assert flagged.blob_url == "file:///flag"  # a flag beats the remote
    remove_remote(tmp_path, "team")
    with pytest.raises(NotFound):
        Config.from_env({"KVGRAFT_HOME": str(tmp_path), "KVGRAFT_REMOTE": "team"})
    with pytest.raises(UsageError):
        Remote("Bad Name", "sqlite:///x", "file:///x")


def test_hostile_config_files(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("[remotes.x]\ncatalog = 'a'\nstor = 'b'\n")
    with pytest.raises(UsageError, match="unknown keys"):
        load_remotes(tmp_path)
    (tmp_path / "config.toml").write_text("[remotes\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_remotes(tmp_path)


def test_toml_writer_escapes() -> None:
    import tomllib

    doc = {"a": 'quo"te\\', "remotes": {"x.y": {"catalog": "c\n", "n": 3}}}
    assert tomllib.loads(dumps_toml(doc)) == doc


def test_cli_remotes_and_copy_transfer_only_missing_blobs(cli_env: dict[str, str],
                                                          tmp_path: Path) -> None:
    runner = CliRunner(env=cli_env)
    other = tmp_path / "other"
    r = runner.invoke(cli, ["remote", "add", "mirror", "--catalog",
                            f"sqlite:///{other / 'catalog.db'}", "--store",
                            (other / "blobs").as_uri()])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in runner.invoke(cli, ["remote", "ls", "--json"]).stdout
            .splitlines()]
    assert [x["name"] for x in rows] == ["mirror"]
    a = write_synthetic(tmp_path / "a.kv", tokens=900, seed=1)
    assert runner.invoke(cli, ["push", str(a), "t/a:1", "--label", "k=v"]).exit_code == 0
    # The mirror's catalog is a separate, non-embedded registry: migrate it first.
    assert runner.invoke(cli, ["--remote", "mirror", "db", "upgrade"]).exit_code == 0
    r = runner.invoke(cli, ["copy", "t/a:1", "mirror/copies/a:1", "--json"])
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout)
    assert first["blobs_copied"] == first["blobs"] == 6
    r = runner.invoke(cli, ["copy", "t/a:1", "mirror/copies/a:again", "--json"])
    assert json.loads(r.stdout)["blobs_copied"] == 0
    out = tmp_path / "from-mirror.kv"
    env = {**cli_env, "KVGRAFT_CACHE": str(tmp_path / "mirror-cache")}
    r = CliRunner(env=env).invoke(cli, ["--remote", "mirror", "pull", "copies/a:1", "-o",
                                        str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == a.read_bytes()
    info = json.loads(runner.invoke(cli, ["--remote", "mirror", "inspect", "copies/a:1",
                                          "--json"]).stdout)
    assert info["digest"] == first["digest"] and info["labels"] == {"k": "v"}
    assert runner.invoke(cli, ["copy", "t/a:1", "nowhere/x"]).exit_code == 3
    assert runner.invoke(cli, ["copy", "t/a:1", "mirror"]).exit_code == 2
    assert runner.invoke(cli, ["remote", "rm", "mirror"]).exit_code == 0
    assert runner.invoke(cli, ["remote", "rm", "mirror"]).exit_code == 3
