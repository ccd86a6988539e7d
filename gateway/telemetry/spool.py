"""An append-only JSON-lines file that holds rows while the database is unreachable.

Lines are appended and fsynced per batch; replay reads them in order. A torn last line (a crash
mid-write) is skipped on read. The writer is the only user, from one thread.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("specgate.telemetry")


class Spool:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Raises OSError (disk full, ...) without having written a partial batch it knows of."""
        data = "".join(json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in entries).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def __len__(self) -> int:
        if not self.path.exists():
            return 0
        with self.path.open("rb") as f:
            return sum(1 for _ in f)

    def empty(self) -> bool:
        return not self.path.exists() or self.path.stat().st_size == 0

    def read(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            for n, line in enumerate(f):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    logger.warning("skipping torn line %d of telemetry spool %s", n + 1, self.path)

    def clear(self) -> None:
        """After a full replay: every line is in the database, so the file can go."""
        self.path.unlink(missing_ok=True)
