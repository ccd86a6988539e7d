"""The gateway's secret, what it keys, and the private files that hold such things.

Telemetry rows name a request's API key by a fingerprint: an HMAC of the key under the gateway's
secret, never a bare hash (a bare hash of a weak key is guessed offline from a copy of the database;
without the secret, a fingerprint tells nothing). The secret is drawn once and kept in a file of its
own, mode 0600, beside the data (`Settings.secret_file`); replicas that share one database share
that file too, so that one key has one fingerprint everywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger("specgate.gateway")
SECRET_BYTES = 32
FINGERPRINT_HEX = 16  # 64 bits: no collision between the keys of one gateway in practice


def private_dir(path: Path, *, tighten: bool = True) -> Path:
    """`path` as a directory only its owner may enter (0700), made if missing. `tighten`: an
    existing directory of ours with looser modes is tightened (only for directories the gateway
    made: a user's own folder is left as it is)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if tighten:
        _tighten(path, 0o700)
    return path


def private_file(path: Path) -> None:
    """Make sure `path` exists and only its owner may read or write it (0600); made empty if missing."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    _tighten(path, 0o600)


def _tighten(path: Path, mode: int) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & ~mode:
        os.chmod(path, mode)


def gateway_secret(path: Path) -> bytes:
    """The secret in `path`, drawn and written there (0600, atomically) the first time. Every
    process that reads the file gets the same secret, however many race to create it."""
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    private_dir(path.parent, tighten=False)
    fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES).hex().encode() + b"\n")
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs stands
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    raw = path.read_bytes().strip()
    st = path.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        logger.warning("the gateway secret %s was readable by others; it is now 0600", path)
        _tighten(path, 0o600)
    try:
        secret = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = raw
    if len(secret) < 16:
        raise ValueError(
            f"the gateway secret in {path} is shorter than 16 bytes; delete it to draw a new one"
        )
    return secret


class KeyIds:
    """API-key fingerprints under one secret: `key-<16 hex>`. The same key, the same id."""

    __slots__ = ("_mac",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the fingerprint secret must be at least 16 bytes")
        self._mac = hmac.new(secret, b"specgate/api-key-id/v1\x00", hashlib.sha256)

    def of(self, key: str) -> str:
        mac = self._mac.copy()
        mac.update(key.encode("utf-8", "surrogatepass"))
        return "key-" + mac.hexdigest()[:FINGERPRINT_HEX]
