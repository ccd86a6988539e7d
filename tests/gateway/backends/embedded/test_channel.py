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
