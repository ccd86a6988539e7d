"""The engine-core process (`engine_process = true`): the engine and its supervised step loop in a
process of their own, so torch never competes with the event loop for the gateway's GIL.

Started with the "spawn" start method (`EngineProcess`), it builds the engine from a picklable
`EngineConfig`, sends a `ModelInfo` (or `LoadFailed`), then runs `EngineSupervisor` with commands
from the socket and one `Batch` message per step back. It exits when told to stop, and also when
the gateway's end of the socket closes: a gateway that dies, however it dies, takes its core along.
"""

from __future__ import annotations

import logging
import signal
import socket
from dataclasses import dataclass

import transformers

from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.gateway.backends.embedded.channel import Channel
from specgate.gateway.backends.embedded.messages import Batch, Command, LoadFailed
from specgate.gateway.backends.embedded.model_info import ModelInfo
from specgate.gateway.backends.embedded.supervisor import EngineSupervisor

logger = logging.getLogger("specgate.engine_core")


class _Link:
    """Both directions of the socket, as the supervisor wants them; a gateway that is gone (its end
    closed, or a send that fails) reads as a stop command."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.gone = False

    def get(self, timeout: float | None) -> Command | None:
        if not self.gone:
            try:
                command: Command | None = self.channel.get(timeout)
                return command
            except (EOFError, OSError):
                self._lost()
        return ("stop", None)

    def publish(self, batch: Batch) -> None:
        if not self.gone:
            try:
                self.channel.send(batch)
            except OSError:
                self._lost()

    def _lost(self) -> None:
        self.gone = True
        logger.warning("the gateway is gone; the engine core stops")


@dataclass(slots=True)
class LogSettings:
    """The gateway's logging, for the child to copy (a spawned process starts with none of it)."""

    level: int
    transformers_verbosity: int
    progress_bars: bool

    @classmethod
    def current(cls) -> LogSettings:
        hf = transformers.utils.logging
        return cls(logging.getLogger().getEffectiveLevel(), hf.get_verbosity(), hf.is_progress_bar_enabled())

    def apply(self) -> None:
        logging.basicConfig(level=self.level, format="%(asctime)s %(name)s[core] %(message)s")
        transformers.utils.logging.set_verbosity(self.transformers_verbosity)
        if not self.progress_bars:
            transformers.utils.logging.disable_progress_bar()


def run_core(sock: socket.socket, config: EngineConfig, log: LogSettings) -> None:
    """The engine-core process's entry point."""
    # Ctrl-C reaches the whole process group; the gateway stops its core itself, after draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.apply()
    channel = Channel(sock)
    try:
        engine = Engine(config)
        info = ModelInfo.of(engine)
    except Exception as exc:
        logger.exception("the embedded engine failed to load")
        channel.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    channel.send(info)
    link = _Link(channel)
    EngineSupervisor(engine, lambda: Engine(config), link, link.publish).run()
    logger.info("the engine core stopped")
