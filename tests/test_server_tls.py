"""`kvgraft serve --certfile --keyfile` speaks HTTPS with a certificate clients verify."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.serve import make_token, running_server, server_env


def self_signed(dir: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = dir / "cert.pem", dir / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


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
