"""Ed25519 signing keys and the trust store, under $KVGRAFT_HOME.

    keys/NAME.key       private key, PKCS#8 PEM, mode 0600 (keys/ itself is 0700)
    keys/NAME.pub       its public key document (what `kvgraft key export` prints)
    trusted/KEYID.pub   public keys whose signatures this configuration accepts

The trust store is the set of files in trusted/: a key generated here is written there at
once, others arrive with `kvgraft trust add`. A public key document is securesystemslib's
key format (keytype, scheme, keyval.public = raw key in hex) plus `keyid` and `name`; the
keyid is securesystemslib's default keyid (SHA-256 of the canonical key fields), so every
DSSE tool built on securesystemslib names the key the same way. A document whose keyid
does not match its key is refused: a keyid is never taken on trust.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from securesystemslib.signer import CryptoSigner, SSlibKey

from kvgraft import strictjson
from kvgraft.errors import Conflict, IntegrityError, NotFound, UsageError
from kvgraft.fsutil import atomic_writer, read_bounded

KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KEYID = re.compile(r"[0-9a-f]{64}")
MAX_KEY_FILE = 64 * 1024  # a PEM or JSON key is well under 1 KiB
ED25519 = "ed25519"


def check_key_name(name: str) -> str:
    if not KEY_NAME.fullmatch(name):
        raise UsageError(f"invalid key name {name!r}",
                         hint="letters, digits, '.', '_' and '-', at most 64")
    return name


@dataclass(frozen=True, slots=True)
class PublicKey:
    keyid: str
    public: bytes  # the raw 32-byte Ed25519 public key
    name: str = ""

    def __post_init__(self) -> None:
        if self.keyid != _keyid(self.public):
            raise IntegrityError(f"key document names keyid {self.keyid}, but its key has "
                                 f"keyid {_keyid(self.public)}")

    @classmethod
    def of(cls, public: bytes, name: str = "") -> PublicKey:
        return cls(_keyid(public), public, name)

    @property
    def short(self) -> str:
        return self.keyid[:16]

    def sslib(self) -> SSlibKey:
        return SSlibKey(self.keyid, ED25519, ED25519, {"public": self.public.hex()})

    def to_json(self) -> dict[str, Any]:
        return {"keyid": self.keyid, "keytype": ED25519, "scheme": ED25519,
                "keyval": {"public": self.public.hex()}, "name": self.name}

    def pem(self) -> bytes:
        return Ed25519PublicKey.from_public_bytes(self.public).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    @classmethod
    def from_json(cls, data: Any) -> PublicKey:
        if not isinstance(data, dict):
            raise UsageError("a public key document is a JSON object")
        if data.get("keytype") != ED25519 or data.get("scheme") != ED25519:
            raise UsageError(f"unsupported key type {data.get('keytype')!r} / scheme "
                             f"{data.get('scheme')!r}: kvgraft keys are ed25519")
        public = (data.get("keyval") or {}).get("public")
        if not isinstance(public, str) or not re.fullmatch(r"[0-9a-f]{64}", public):
            raise UsageError("keyval.public must be 64 lowercase hex characters")
        raw = bytes.fromhex(public)
        keyid = data.get("keyid") or _keyid(raw)
        name = data.get("name") or ""
        if not isinstance(keyid, str) or not isinstance(name, str):
            raise UsageError("keyid and name must be strings")
        return cls(keyid, raw, name)

    @classmethod
    def parse(cls, raw: bytes, name: str = "") -> PublicKey:
        """A key document (JSON) or a PEM SubjectPublicKeyInfo Ed25519 key."""
        if raw.lstrip().startswith(b"-----BEGIN"):
            try:
                key = serialization.load_pem_public_key(raw)
            except (ValueError, UnsupportedAlgorithm) as e:
                raise UsageError(f"not a PEM public key: {e}") from None
            if not isinstance(key, Ed25519PublicKey):
                raise UsageError("only Ed25519 public keys are supported")
            return cls.of(key.public_bytes_raw(), name)
        try:
            data = strictjson.loads(raw)
        except ValueError as e:
            raise UsageError(f"not a public key document (JSON or PEM): {e}") from None
        doc = cls.from_json(data)
        return cls(doc.keyid, doc.public, doc.name or name)


def _keyid(public: bytes) -> str:
    try:
        key = Ed25519PublicKey.from_public_bytes(public)
    except ValueError as e:
        raise IntegrityError(f"not an Ed25519 public key: {e}") from None
    keyid: str = SSlibKey.from_crypto(key).keyid
    return keyid


@dataclass(frozen=True, slots=True)
class KeyInfo:
    name: str
    keyid: str
    private: bool  # the private key is in this keyring
    trusted: bool


class Keyring:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.keys_dir = home / "keys"
        self.trusted_dir = home / "trusted"

    # --- own keys ----------------------------------------------------------------------

    def generate(self, name: str) -> PublicKey:
        check_key_name(name)
        self.keys_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.keys_dir, 0o700)
        private = Ed25519PrivateKey.generate()
        pem = private.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        path = self.keys_dir / f"{name}.key"
        try:
            # O_EXCL: never overwrite a key; 0600 from the first byte, not chmod after.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise Conflict(f"a key named {name!r} already exists in {self.keys_dir}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        public = PublicKey.of(private.public_key().public_bytes_raw(), name)
        self._write(self.keys_dir / f"{name}.pub", public)
        self.trust(public)
        return public

    def public(self, name: str) -> PublicKey:
        path = self.keys_dir / f"{check_key_name(name)}.pub"
        try:
            return PublicKey.parse(read_bounded(path, MAX_KEY_FILE, "key file", IntegrityError),
                                   name)
        except FileNotFoundError:
            raise NotFound(f"no key named {name!r} in {self.keys_dir}",
                           hint="`kvgraft key ls` lists them; `kvgraft key generate` makes one"
                           ) from None

    def signer(self, name: str) -> CryptoSigner:
        public = self.public(name)
        path = self.keys_dir / f"{name}.key"
        try:
            mode = path.stat().st_mode
            raw = read_bounded(path, MAX_KEY_FILE, "private key file", IntegrityError)
        except FileNotFoundError:
            raise NotFound(f"key {name!r} has no private key in {self.keys_dir}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"private key {path} is readable by others",
                             hint=f"chmod 600 {path}")
        try:
            private = serialization.load_pem_private_key(raw, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise IntegrityError(f"private key {path} cannot be read: {e}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise IntegrityError(f"private key {path} is not an Ed25519 key")
        if private.public_key().public_bytes_raw() != public.public:
            raise IntegrityError(f"private key {path} does not match {name}.pub")
        return CryptoSigner(private, public.sslib())

    def own(self) -> list[PublicKey]:
        if not self.keys_dir.is_dir():
            return []
        return [self.public(p.stem) for p in sorted(self.keys_dir.glob("*.pub"))
                if KEY_NAME.fullmatch(p.stem)]

    # --- trust -------------------------------------------------------------------------

    def trust(self, key: PublicKey) -> bool:
        """Add `key` to the trust store; False if it was already there."""
        path = self.trusted_dir / f"{key.keyid}.pub"
        if path.is_file():
            return False
        self._write(path, key)
        return True

    def trust_file(self, path: Path) -> tuple[PublicKey, bool]:
        try:
            raw = read_bounded(path, MAX_KEY_FILE, "key file")
        except FileNotFoundError:
            raise NotFound(f"no such key file: {path}") from None
        except OSError as e:
            raise UsageError(f"cannot read key file {path}: {e}") from None
        key = PublicKey.parse(raw, path.stem if not KEYID.fullmatch(path.stem) else "")
        return key, self.trust(key)

    def trusted(self) -> dict[str, PublicKey]:
        out: dict[str, PublicKey] = {}
        if not self.trusted_dir.is_dir():
            return out
        for p in sorted(self.trusted_dir.glob("*.pub")):
            try:
                key = PublicKey.parse(read_bounded(p, MAX_KEY_FILE, "trust store file",
                                                   IntegrityError))
            except (UsageError, IntegrityError) as e:
                raise IntegrityError(f"trust store file {p} is invalid: {e.message}") from None
            if p.stem != key.keyid:
                raise IntegrityError(f"trust store file {p} holds key {key.keyid}")
            out[key.keyid] = key
        return out

    def listing(self) -> list[KeyInfo]:
        trusted = self.trusted()
        own = {k.keyid: k for k in self.own()}
        infos = [KeyInfo(k.name, k.keyid, True, k.keyid in trusted) for k in own.values()]
        infos += [KeyInfo(k.name, k.keyid, False, True) for k in trusted.values()
                  if k.keyid not in own]
        return sorted(infos, key=lambda i: (not i.private, i.name, i.keyid))

    def resolve(self, text: str) -> str:
        """A keyid from a keyid, a unique keyid prefix (8+ hex) or a key name."""
        text = text.strip()
        if KEYID.fullmatch(text):
            return text
        known = {i.keyid: i for i in self.listing()}
        if re.fullmatch(r"[0-9a-f]{8,63}", text):
            hits = [k for k in known if k.startswith(text)]
            if len(hits) == 1:
                return hits[0]
        named = [i.keyid for i in known.values() if i.name == text]
        if len(set(named)) == 1:
            return named[0]
        if len(set(named)) > 1:
            raise UsageError(f"several keys are named {text!r}: give a keyid")
        raise NotFound(f"no key {text!r} in the keyring or trust store",
                       hint="`kvgraft key ls` lists keyids and names")

    @staticmethod
    def _write(path: Path, key: PublicKey) -> None:
        with atomic_writer(path) as f:
            f.write(json.dumps(key.to_json(), indent=2, sort_keys=True).encode() + b"\n")
