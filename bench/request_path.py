"""Which of the project's files one chat request passes through, in the order it first enters them.

    python bench/request_path.py [--stream] [--model PATH]

Serves the embedded default model (or --model) in this process, the engine on its thread (the
same core loop that `specgate serve` runs in its engine-core process), with telemetry on a
throwaway SQLite file; sends one chat request to warm everything up, then traces a second one
with a profile hook on every thread (installed before any starts, counting only during the
second request): each project file (gateway/, engine/, policies/) is listed
the first time one of its functions runs, from the request's arrival until its record has been
written. The engine's idle loop and the writer's thread are traced too: they are on the path.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import uvicorn

import specgate.gateway
from specgate.bench.stub_backend import free_port
from specgate.gateway.http.app import create_app
from specgate.gateway.settings import Settings

# The checkout whose code runs (the interpreter's install of specgate): this script can trace
# another build's request path when run by that build's interpreter.
ROOT = Path(specgate.gateway.__file__).resolve().parents[1]
FOLDERS = ("gateway", "engine", "policies")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", action="store_true", help="trace a streamed request")
    ap.add_argument("--model", help="a model file or directory (default: the embedded default model)")
    args = ap.parse_args()
    order: dict[str, None] = {}
    active = threading.Event()
    prefixes = tuple(str(ROOT / f) + "/" for f in FOLDERS)

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and active.is_set():
            name = frame.f_code.co_filename
            if name.startswith(prefixes) and name not in order:
                order[name] = None

    threading.setprofile(hook)  # every thread started from now on: the server's, the engine's
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        embedded: dict[str, Any] = {"model": args.model} if args.model else {}
        settings = Settings(
            port=port,
            embedded=embedded,
            telemetry={"url": f"sqlite:///{tmp}/t.db", "auto_upgrade": True, "spool_dir": f"{tmp}/spool"},
        )
        app = create_app(settings, cache_dir=tmp)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
            "max_tokens": 16,
            "stream": args.stream,
        }
        store = app.state.services.store

        def one() -> None:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                for _ in r.iter_bytes():
                    pass
            deadline = time.monotonic() + 10
            while store.writer.counters.written + store.writer.counters.spooled < seen[0] + 1:
                if time.monotonic() > deadline:
                    raise SystemExit("the request's row was not written")
                time.sleep(0.005)
            seen[0] += 1

        seen = [0]
        one()  # warm-up: lazy imports, compiled graphs, caches
        active.set()
        one()
        active.clear()
        server.should_exit = True
        thread.join(10)
    files = [str(Path(f).relative_to(ROOT)) for f in order]
    kind = "streamed" if args.stream else "JSON"
    print(f"one {kind} chat request, {len(files)} project files, in the order first entered:")
    for i, f in enumerate(files, 1):
        print(f"{i:3d}  {f}")
    counts = {folder: sum(f.startswith(folder + "/") for f in files) for folder in FOLDERS}
    print("by folder: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
