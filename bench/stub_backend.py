"""A fast stub OpenAI-compatible server for gateway benchmarks: canned answers, no model.

    python bench/stub_backend.py --port 8001

A raw ASGI app on uvicorn with uvloop and httptools, so the backend costs as little as possible
and what a benchmark measures beyond it is the gateway. Serves GET /v1/models and
POST /v1/chat/completions (JSON, or a few SSE chunks with `stream: true`, plus a usage chunk when
`stream_options.include_usage` is set). Also: `launch`, to run a server as its own process.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "stub-model"
WORDS = ["Hello", " there", "!"]
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


_MODELS = _dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]})
_USAGE = {"prompt_tokens": 9, "completion_tokens": len(WORDS), "total_tokens": 9 + len(WORDS)}


def completion() -> bytes:
    return _dumps(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(WORDS)},
                    "finish_reason": "stop",
                }
            ],
            "usage": _USAGE,
        }
    )


def chunks(include_usage: bool) -> list[bytes]:
    base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": int(time.time())}
    base["model"] = MODEL
    deltas = [{"role": "assistant", "content": ""}] + [{"content": w} for w in WORDS]
    out = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if include_usage:
        out.append({**base, "choices": [], "usage": _USAGE})
    return [b"data: " + _dumps(c) + b"\n\n" for c in out] + [b"data: [DONE]\n\n"]


async def _read_body(receive: Any) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            kind = (await receive())["type"]
            await send({"type": kind + ".complete"})
            if kind == "lifespan.shutdown":
                return
    path, method = scope["path"], scope["method"]
    if method == "GET" and path == "/v1/models":
        await _send(send, 200, _MODELS)
        return
    if method != "POST" or path != "/v1/chat/completions":
        await _send(send, 404, b'{"error":{"message":"not found","type":"not_found_error"}}')
        return
    req = json.loads(await _read_body(receive))
    if not req.get("stream"):
        await _send(send, 200, completion())
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    for event in chunks(bool((req.get("stream_options") or {}).get("include_usage"))):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cmd: list[str], ready_url: str, timeout: float = 180.0) -> subprocess.Popen[bytes]:
    """Start a server process (in the repository root) and wait until `ready_url` answers 200."""
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(ready_url, timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{ready_url} did not become ready")


def serve(port: int, host: str = "127.0.0.1") -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, loop="uvloop", http="httptools", log_level="warning")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    serve(args.port, args.host)
