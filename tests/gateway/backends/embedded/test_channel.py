"""Framing between the gateway and its engine core: messages come back whole and in order, however
the bytes are cut on the way, and a send the socket cannot take at once is finished later."""

from __future__ import annotations

import asyncio
import random
import socket

from specgate.gateway.backends.embedded.channel import AsyncChannel, Channel, Frames, frame


def test_frames_reassemble_messages_cut_anywhere() -> None:
    messages = [("add", ("r1", list(range(n)), None)) for n in (0, 1, 300, 70_000)]
    data = b"".join(frame(m) for m in messages)
    rng = random.Random(0)
    frames, out, pos = Frames(), [], 0
    while pos < len(data):
        step = rng.choice([1, 3, 8, 1000, 50_000])
        out.extend(frames.feed(data[pos : pos + step]))
        pos += step
    assert out == messages


def test_a_large_send_is_buffered_not_blocking_and_arrives_whole() -> None:
    ours, theirs = socket.socketpair()
    big = ("add", ("r1", list(range(2_000_000)), None))  # far more than a socket buffer holds

    async def run() -> None:
        loop = asyncio.get_running_loop()
        eof = asyncio.Event()
        channel = AsyncChannel(ours, loop, lambda m: None, eof.set)
        channel.open()
        channel.send(big)  # returns at once; the rest goes out as the peer reads
        channel.send(("abort", "r1"))
        peer = Channel(theirs)
        got: list[object] = []
        while len(got) < 2:
            message = await asyncio.to_thread(peer.get, 1.0)
            if message is not None:
                got.append(message)
        assert got == [big, ("abort", "r1")]
        theirs.close()
        await asyncio.wait_for(eof.wait(), 5)  # the peer's end closing is reported once
        assert channel.closed

    asyncio.run(run())


def test_a_frame_header_over_the_cap_is_refused_before_anything_is_allocated() -> None:
    import struct

    import pytest

    from specgate.gateway.backends.embedded.channel import MAX_FRAME, FrameTooLarge

    frames = Frames()
    with pytest.raises(FrameTooLarge):
        frames.feed(struct.pack("!Q", MAX_FRAME + 1) + b"x" * 16)
    ours, theirs = socket.socketpair()
    peer = Channel(theirs)
    ours.sendall(struct.pack("!Q", 2**62))  # a header announcing exabytes
    with pytest.raises(EOFError, match="limit"):
        peer.get(1.0)
    ours.close()
    theirs.close()


def test_the_core_socket_is_private_and_refuses_other_users(tmp_path: object) -> None:
    import os
    import stat
    from pathlib import Path

    from specgate.gateway.backends.embedded.hub import same_user
    from specgate.gateway.cli.workers import bind_unix

    path = str(Path(str(tmp_path)) / "engine.sock")
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
    import tempfile

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
