"""Processes as Linux's /proc shows them, for tests that start process trees (no psutil needed)."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> set[int]:
    """The live (or zombie) processes whose parent is `pid`."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # The command name (in parentheses) may hold spaces: the parent's pid follows the last ")".
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry))
    return out


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def gone(pid: int) -> bool:
    """Exited (a zombie, whose command line is empty, counts: it runs nothing any more)."""
    return not Path(f"/proc/{pid}").exists() or cmdline(pid) == b""


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped (it imported torch)."""
    try:
        return b"libtorch" in Path(f"/proc/{pid}/maps").read_bytes()
    except OSError:
        return False
