"""Framing between a gateway worker and the engine core: messages come back whole and in order,
however the bytes are cut on the way, a send the socket cannot take at once is finished later, and
a header announcing more than the cap ends the connection before anything is allocated."""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import pytest

from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.engine_core.channel import MAX_FRAME, AsyncChannel, Frames, FrameTooLarge, frame
from specgate.gateway.engine_core.messages import AbortRequest, AddRequest

PARAMS = SamplingParams(max_tokens=3)


def test_frames_reassemble_messages_cut_anywhere() -> None:
    messages = [AddRequest(f"r{n}", list(range(n)), PARAMS, None) for n in (0, 1, 300, 70_000)]
    data = b"".join(frame(m) for m in messages)
    rng = random.Random(0)
    frames, out, pos = Frames(), [], 0
    while pos < len(data):
        step = rng.choice([1, 3, 8, 1000, 50_000])
        out.extend(frames.feed(data[pos : pos + step]))
        pos += step
    assert out == messages


def _read_messages(sock: socket.socket, count: int) -> list[object]:
    """The core's side, blocking: `count` whole messages."""
    sock.settimeout(10)
    frames, got = Frames(), []
    while len(got) < count:
        data = sock.recv(1 << 20)
        assert data, "the peer closed early"
        got.extend(frames.feed(data))
    return got


def test_a_large_send_is_buffered_not_blocking_and_arrives_whole() -> None:
    ours, theirs = socket.socketpair()
    big = AddRequest("r1", list(range(2_000_000)), PARAMS, None)  # far more than a socket buffer holds

    async def run() -> None:
        loop = asyncio.get_running_loop()
        eof = asyncio.Event()
        channel = AsyncChannel(ours, loop, lambda m: None, eof.set)
        channel.open()
        channel.send(big)  # returns at once; the rest goes out as the peer reads
        channel.send(AbortRequest("r1"))
        got = await asyncio.to_thread(_read_messages, theirs, 2)
        assert got == [big, AbortRequest("r1")]
        theirs.close()
        await asyncio.wait_for(eof.wait(), 5)  # the peer's end closing is reported once
        assert channel.closed

    asyncio.run(run())


def test_a_frame_header_over_the_cap_is_refused_before_anything_is_allocated() -> None:
    frames = Frames()
    with pytest.raises(FrameTooLarge):
        frames.feed(struct.pack("!Q", MAX_FRAME + 1) + b"x" * 16)
    ours, theirs = socket.socketpair()

    async def run() -> None:
        eof = asyncio.Event()
        channel = AsyncChannel(ours, asyncio.get_running_loop(), lambda m: None, eof.set)
        channel.open()
        theirs.sendall(struct.pack("!Q", 2**62))  # a header announcing exabytes
        await asyncio.wait_for(eof.wait(), 5)  # the connection ends, as if the core had gone
        assert channel.closed

    asyncio.run(run())
    theirs.close()
