"""The shared engine core's protocol, in one process: an `EngineCore` loop over `SocketConnections` on a
thread with the tiny engine, and `SocketClient`s on the event loop, as the workers of `specgate serve`
hold them. Each connection gets its model on connect and only its own requests'
outputs (greedy, token for token what the engine alone answers); a connection that closes has its
requests aborted while the other's go on; a stopped core costs the waiters a retryable error; and
`connect` waits for a core that is not there yet; the socket is this user's alone. The core as a
process is test_process.py; the whole of `serve`, tests/gateway/serve/test_supervisor.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.engine_core.client import EngineLoadFailed, SocketClient, connect
from specgate.gateway.engine_core.core import EngineCore
from specgate.gateway.engine_core.messages import EngineUnavailable, LoadFailed
from specgate.gateway.engine_core.model_info import ModelInfo
from specgate.gateway.engine_core.sockets import SocketConnections, same_user
from specgate.gateway.serve.supervisor import bind_unix

pytestmark = pytest.mark.timeout(60)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@dataclass
class Core:
    path: str
    engine: Engine
    hub: SocketConnections
    control: Connection  # the supervisor's end
    thread: threading.Thread

    def stop(self) -> None:
        self.control.send("stop")
        self.thread.join(10)


def _listen(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(8)
    return sock


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # Short: a Unix socket's path must fit in about 100 bytes, which pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="sg-") as d:
        yield d


@pytest.fixture
def core(make_engine: Callable[..., Engine], sock_dir: str) -> Iterator[Core]:
    engine = make_engine()
    path = os.path.join(sock_dir, "engine.sock")
    reader, writer = multiprocessing.Pipe(duplex=False)
    hub = SocketConnections(_listen(path), reader, ModelInfo.of(engine))

    def run() -> None:
        try:
            EngineCore(engine, None, hub).run()
        finally:
            hub.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    live = Core(path, engine, hub, writer, thread)
    yield live
    if thread.is_alive():
        live.stop()


def _prompt(engine: Engine, text: str) -> list[int]:
    ids: list[int] = engine.tokenizer.encode(text)
    return ids


async def _collect(q: asyncio.Queue[Any]) -> list[Any]:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), 30)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def _alone(make_engine: Callable[..., Engine], prompt: list[int]) -> list[int]:
    engine = make_engine()
    engine.add_request("alone", prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_each_connection_gets_its_model_and_only_its_own_outputs(
    core: Core, make_engine: Callable[..., Engine]
) -> None:
    prompts = [_prompt(core.engine, "tell me about the sea"), _prompt(core.engine, "zebras!")]

    async def run() -> list[list[Any]]:
        loop = asyncio.get_running_loop()
        (a, info_a), (b, info_b) = await asyncio.gather(connect(core.path, loop), connect(core.path, loop))
        assert info_a.vocab_size == info_b.vocab_size == 96 and a.ready and b.ready
        # The same request id on both connections: ids are the connection's own.
        qa = a.submit("same-id", prompts[0], GREEDY, None)
        qb = b.submit("same-id", prompts[1], GREEDY, None)
        outs = await asyncio.gather(_collect(qa), _collect(qb))
        assert a.num_waiting == b.num_waiting == 0 and a.load.num_steps > 0  # taken, counted per connection
        await a.close()
        await b.close()
        return list(outs)

    outs_a, outs_b = asyncio.run(run())
    assert {o.request_id for o in outs_a + outs_b} == {"same-id"}
    assert [t for o in outs_a for t in o.new_token_ids] == _alone(make_engine, prompts[0])
    assert [t for o in outs_b for t in o.new_token_ids] == _alone(make_engine, prompts[1])


def test_every_sequence_of_an_n_request_reaches_its_connection(
    core: Core, make_engine: Callable[..., Engine]
) -> None:
    """A request with n > 1 is over for the connection (and its client) when its last sequence is;
    its sequences may finish in different steps."""
    prompt = _prompt(core.engine, "tell me about the sea")
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[Any], list[Any]]:
        loop = asyncio.get_running_loop()
        client, _ = await connect(core.path, loop)
        q = client.submit(
            "three", prompt, SamplingParams(max_tokens=12, n=3, temperature=0.0, ignore_eos=True), None
        )
        q_short = client.submit(
            "two", prompt, SamplingParams(max_tokens=4, n=2, temperature=0.0, ignore_eos=True), None
        )
        outs: list[Any] = []
        while sum(o.finished for o in outs) < 3:
            outs.append(await asyncio.wait_for(q.get(), 30))
        outs_short: list[Any] = []
        while sum(o.finished for o in outs_short) < 2:
            outs_short.append(await asyncio.wait_for(q_short.get(), 30))
        assert not client.orphans() and not client.in_engine  # both requests over, nothing left behind
        assert not any(c.owned or c.unfinished for c in core.hub._conns.values())
        await client.close()
        return outs, outs_short

    outs, outs_short = asyncio.run(asyncio.wait_for(run(), 30))
    alone = _alone(make_engine, prompt)
    for i in range(3):
        assert [t for o in outs if o.index == i for t in o.new_token_ids] == alone
    for i in range(2):
        assert [t for o in outs_short if o.index == i for t in o.new_token_ids] == alone[: short.max_tokens]


def test_a_closed_connection_aborts_its_requests_and_the_other_goes_on(core: Core) -> None:
    prompt = _prompt(core.engine, "the sea")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        (a, _), (b, _) = await asyncio.gather(connect(core.path, loop), connect(core.path, loop))
        a.submit("gone", prompt, LONG, None)
        qb = b.submit("stays", prompt, GREEDY, None)
        while b.load.num_running < 2:
            await asyncio.sleep(0.01)
        await a.close()  # what a worker's exit does to its end
        outs = await _collect(qb)
        assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 12
        while core.engine.request_ids() or core.hub.connections != 1:
            await asyncio.sleep(0.01)
        assert b.load.num_running == 0 and b.alive
        await b.close()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_stopped_core_fails_the_waiters_with_a_retryable_error(core: Core) -> None:
    prompt = _prompt(core.engine, "the sea")

    async def run() -> None:
        client, _ = await connect(core.path, asyncio.get_running_loop())
        q = client.submit("r", prompt, LONG, None)
        while client.load.num_running < 1:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(core.stop)  # as the supervisor stops it (or its process dies)
        items = await _collect(q)
        assert isinstance(items[-1], EngineUnavailable) and not client.alive
        await client.close()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_connect_waits_for_a_core_and_stops_at_one_that_cannot_load(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "engine.sock")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(connect(path, loop, backoff=0.02))
        await asyncio.sleep(0.2)  # no socket yet: it retries
        assert not waiting.done()
        reader, writer = multiprocessing.Pipe(duplex=False)
        hub = SocketConnections(_listen(path), reader, LoadFailed("no weights"))
        polling = asyncio.to_thread(lambda: [hub.get(0.05) for _ in range(40)])  # the core's loop
        with pytest.raises(EngineLoadFailed, match="no weights"):
            await asyncio.gather(asyncio.wait_for(waiting, 10), polling)
        hub.close()
        writer.close()

    asyncio.run(run())


def test_the_supervisor_gone_stops_the_core(core: Core) -> None:
    core.control.close()  # the supervisor's end closing, however it died
    core.thread.join(10)
    assert not core.thread.is_alive()


def test_a_client_that_never_started_is_not_alive() -> None:
    async def run() -> None:
        client = SocketClient("/nonexistent/engine.sock", asyncio.get_running_loop())
        assert not client.alive
        with pytest.raises(OSError):
            await client.start()
        await client.close()

    asyncio.run(run())


def test_the_core_socket_is_private_and_refuses_other_users(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    listener = bind_unix(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)
        conn, _ = listener.accept()
        assert same_user(conn)  # the same uid: accepted
        conn.close()
        client.close()
    finally:
        listener.close()
    if os.getuid() != 0:
        return  # only root can make a connection from another uid to check the second guard
    # With the file's mode opened up, a process of another user reaches the socket: its uid says no.
    where = tempfile.mkdtemp()  # under /tmp: a directory the other user can pass through
    os.chmod(where, 0o755)
    open_path = os.path.join(where, "open.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(open_path)
    os.chmod(open_path, 0o777)
    listener.listen(1)
    listener.settimeout(10)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child only drops its uid and connects)
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(open_path)
            s.recv(1)
        finally:
            os._exit(0)
    try:
        conn, _ = listener.accept()
        assert not same_user(conn)
        conn.close()
    finally:
        os.waitpid(pid, 0)
        listener.close()
        os.unlink(open_path)
        os.rmdir(where)
