"""The console lines of `specgate serve`: where it listens at once, and when it is ready.

Loading a model takes from seconds (the default) to minutes (a first build of the kernels, a large
file); until /readyz answers 200 a client gets 503s, so the operator is told when that changes.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

POLL_S = 0.5


def _probe_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


# Straight to our own socket, whatever proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _ready(url: str) -> bool:
    try:
        with _OPENER.open(url, timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def announce(
    host: str,
    port: int,
    what: str,
    stopping: Callable[[], bool],
    write: Callable[[str], object] = sys.stderr.write,
) -> threading.Thread:
    """Write the listening address now and a line once /readyz first answers 200 (a daemon thread
    polling it every POLL_S until then or until `stopping()`)."""
    shown = f"[{host}]" if ":" in host else host
    write(f"specgate: listening on http://{shown}:{port} ({what}); loading...\n")
    url = f"http://{_probe_host(host)}:{port}/readyz"
    start = time.monotonic()

    def watch() -> None:
        while not stopping():
            if _ready(url):
                write(f"specgate: ready after {time.monotonic() - start:.1f} s\n")
                return
            time.sleep(POLL_S)

    thread = threading.Thread(target=watch, name="specgate-announce", daemon=True)
    thread.start()
    return thread
