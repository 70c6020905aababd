"""`kvgraft serve --certfile --keyfile` speaks HTTPS with a certificate clients verify."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.support.certs import self_signed
from tests.support.serve import make_token, running_server, server_env


@pytest.mark.slow
def test_https_with_verified_certificate(tmp_path: Path) -> None:
    certfile, keyfile = self_signed(tmp_path)
    env = server_env(tmp_path / "home")
    secret = make_token(env, "tls", "repository:team/*:pull")
    with running_server(env, tmp_path / "server.log", "--certfile", str(certfile),
                        "--keyfile", str(keyfile), scheme="https",
                        verify=str(certfile)) as server:
        r = requests.get(f"{server.url}/v2/", headers={"Authorization": f"Bearer {secret}"},
                         verify=str(certfile))
        assert r.status_code == 200
        # the challenge points clients at the HTTPS token endpoint
        r = requests.get(f"{server.url}/v2/", verify=str(certfile))
        assert 'realm="https://' in r.headers["WWW-Authenticate"]
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{server.port}/v2/", timeout=5)
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{server.url}/v2/", timeout=5)  # not trusted without the cert


def test_behind_a_tls_proxy_the_challenge_names_https(tmp_path: Path) -> None:
    env = server_env(tmp_path / "home")
    with running_server(env, tmp_path / "server.log", "--behind-proxy", "127.0.0.1") as server:
        r = requests.get(f"{server.url}/v2/", headers={"X-Forwarded-Proto": "https"})
        assert r.status_code == 401
        assert 'realm="https://127.0.0.1' in r.headers["WWW-Authenticate"]
    with running_server(env, tmp_path / "server2.log") as server:  # not trusted by default
        r = requests.get(f"{server.url}/v2/", headers={"X-Forwarded-Proto": "https"})
        assert 'realm="http://127.0.0.1' in r.headers["WWW-Authenticate"]
