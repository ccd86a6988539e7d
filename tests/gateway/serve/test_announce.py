"""`specgate serve`'s console lines: the address at once, "ready" when /readyz first answers 200."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specgate.gateway.serve.announce import announce

pytestmark = pytest.mark.slow  # real waits on a polling HTTP server


def test_ready_is_announced_when_readyz_first_answers_200() -> None:
    state = {"ready": False, "probes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state["probes"] += 1
            self.send_response(200 if self.path == "/readyz" and state["ready"] else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lines: list[str] = []
    try:
        port = server.server_address[1]
        thread = announce("127.0.0.1", port, "2 workers", lambda: False, lines.append)
        assert lines == [f"specgate: listening on http://127.0.0.1:{port} (2 workers); loading...\n"]
        time.sleep(1.2)
        assert len(lines) == 1 and state["probes"] >= 2  # 503s: still loading, nothing more said
        state["ready"] = True
        thread.join(10)
        assert not thread.is_alive()
        assert len(lines) == 2 and lines[1].startswith("specgate: ready after ")
    finally:
        server.shutdown()


def test_the_watch_ends_when_the_server_stops_without_becoming_ready() -> None:
    stop = threading.Event()
    lines: list[str] = []
    thread = announce("0.0.0.0", 9, "one process", stop.is_set, lines.append)  # nothing listens on 9
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and len(lines) == 1 and "http://0.0.0.0:9" in lines[0]
