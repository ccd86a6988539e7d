"""Append-only JSON-lines files that hold rows while the database is unreachable, one per process.

Each writer owns one file in the spool directory, `spool-<pid>-<random>.jsonl`, and holds an
exclusive `flock` on it for as long as it lives: replicas on one host (or two gateways pointed at
the same directory) never write, replay or delete each other's rows. A file whose lock can be
taken belongs to a process that is gone; `orphans()` hands such files to a live writer, which
replays and then deletes them under the lock (a restarted gateway, or a sibling, takes over what a
crashed one left).

Lines are appended with every byte written (short writes are continued) and fsynced per batch;
replay reads them in order. A torn last line (a crash mid-write) is skipped on read.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("specgate.telemetry")
PATTERN = "spool-*.jsonl"


def write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a signal, a nearly full disk): go on until all is out."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError("the spool file accepted no bytes")
        view = view[n:]


def read_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for n, line in enumerate(f):
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                logger.warning("skipping torn line %d of telemetry spool %s", n + 1, path)
                continue
            if isinstance(entry, dict) and isinstance(entry.get("r"), dict):
                yield entry


class Spool:
    """This process's spool file in `directory`, locked while the process lives."""

    def __init__(self, directory: str | Path, legacy: str | Path | None = None) -> None:
        self.directory = Path(directory)
        # The single spool file of versions before one-file-per-process: adopted like an orphan.
        self.legacy = Path(legacy) if legacy is not None else None
        self.path = self.directory / f"spool-{os.getpid()}-{secrets.token_hex(4)}.jsonl"
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
        return self._fd

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Raises OSError (disk full, ...); a partial line it leaves is skipped on replay."""
        data = "".join(json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in entries)
        fd = self._open()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            write_all(fd, data.encode("utf-8", "replace"))
            os.fsync(fd)
        except OSError:
            # Cut a partial batch off again, so the next append does not glue onto a torn line.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise

    def __len__(self) -> int:
        if not self.path.exists():
            return 0
        with self.path.open("rb") as f:
            return sum(1 for _ in f)

    def empty(self) -> bool:
        return not self.path.exists() or self.path.stat().st_size == 0

    def read(self) -> Iterator[dict[str, Any]]:
        if self.path.exists():
            yield from read_lines(self.path)

    def clear(self) -> None:
        """After a full replay: every line is in the database (or quarantined)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
        else:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Release the lock; an empty file goes, one with rows stays for the next process."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self._fd).st_size == 0:
                self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    # ---- files left by processes that are gone ----------------------------------------------

    def orphans(self) -> Iterator[Orphan]:
        """Other spool files in the directory whose owner is gone, each locked for the caller."""
        paths = sorted(self.directory.glob(PATTERN)) if self.directory.is_dir() else []
        if self.legacy is not None and self.legacy.is_file():
            paths.append(self.legacy)
        for path in paths:
            if path == self.path:
                continue
            orphan = Orphan.claim(path)
            if orphan is not None:
                yield orphan


class Orphan:
    """A dead process's spool file, locked by us until `done()` (delete) or `release()`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def claim(cls, path: Path) -> Orphan | None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None  # deleted meanwhile by whoever replayed it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # its owner is alive
        if not path.exists():
            os.close(fd)
            return None
        return cls(path, fd)

    def read(self) -> Iterator[dict[str, Any]]:
        yield from read_lines(self.path)

    def done(self) -> None:
        self.path.unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        os.close(self._fd)
