"""The shared engine core of `specgate serve`: the process that owns torch and the engine for every
gateway worker, and the serve supervisor's handle on it (`CoreProcess`).

The supervisor binds the Unix socket itself and hands it to each core it starts, so the socket
outlives any one core: a worker that reconnects while a core is being restarted waits in the
listen backlog until the new core accepts it, instead of finding no socket there. The core builds
the engine from its config (made in the core: the supervisor never imports torch), then serves
every connection with one `EngineCore` loop over `SocketConnections`. An engine that cannot load is
reported to each worker that connects (`LoadFailed`: they say "failed to load", as one process
would) until the supervisor stops the core. The control pipe is one-way, supervisor to core: a
message, or its end closing (the supervisor died), stops the core.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from specgate.gateway.engine_core.core import EngineCore
from specgate.gateway.engine_core.messages import LoadFailed, Shutdown
from specgate.gateway.engine_core.model_info import ModelInfo
from specgate.gateway.engine_core.sockets import SocketConnections
from specgate.gateway.proc_title import name_process

if TYPE_CHECKING:
    from specgate.engine.config import EngineConfig

logger = logging.getLogger("specgate.engine_core")


@dataclass(frozen=True, slots=True)
class LogSettings:
    """The parent's logging, for the core to copy (a spawned process starts with none of it)."""

    level: int
    transformers_verbosity: int
    progress_bars: bool

    @classmethod
    def current(cls) -> LogSettings:
        import transformers

        hf = transformers.utils.logging
        return cls(logging.getLogger().getEffectiveLevel(), hf.get_verbosity(), hf.is_progress_bar_enabled())

    def apply(self) -> None:
        import transformers

        logging.basicConfig(level=self.level, format="%(asctime)s %(name)s[core] %(message)s")
        transformers.utils.logging.set_verbosity(self.transformers_verbosity)
        if not self.progress_bars:
            transformers.utils.logging.disable_progress_bar()


def run_core_process(
    listener: socket.socket, control: Connection, make_config: Callable[[], EngineConfig], log: LogSettings
) -> None:
    """The shared engine core's entry point (a spawned process)."""
    # Ctrl-C reaches the whole process group; the supervisor stops the core after its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process("specgate-core")
    log.apply()
    from specgate.engine.engine import Engine  # torch: here, in the core, and nowhere else of serve

    try:
        config = make_config()
        engine = Engine(config)
        info = ModelInfo.of(engine)
    except Exception as exc:
        logger.exception("the embedded engine failed to load")
        failed = SocketConnections(listener, control, LoadFailed(f"{type(exc).__name__}: {exc}"))
        while not isinstance(failed.get(1.0), Shutdown):
            pass  # nothing to run: connecting workers are told why, until the supervisor stops us
        failed.close()
        return
    connections = SocketConnections(listener, control, info)
    try:
        EngineCore(engine, lambda: Engine(config), connections).run()
    finally:
        connections.close()
    logger.info("the shared engine core stopped")


class CoreProcess:
    """The supervisor's side: start a core on the shared socket, see it end, stop it.

    `make_config` builds the engine's config in the core; it must pickle (a bound method of the
    embedded settings does)."""

    def __init__(
        self, listener: socket.socket, make_config: Callable[[], EngineConfig], log: LogSettings
    ) -> None:
        self._listener, self._make_config, self._log = listener, make_config, log
        self.process: BaseProcess | None = None
        self._control: Connection | None = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        reader, writer = ctx.Pipe(duplex=False)
        # Daemonic: a supervisor that exits without stop() still takes its core along.
        process = ctx.Process(
            target=run_core_process,
            args=(self._listener, reader, self._make_config, self._log),
            name="specgate-engine-core",
            daemon=True,
        )
        process.start()
        reader.close()  # the core holds the only reading end: our exit reads as EOF there
        self.process, self._control = process, writer
        logger.info("shared engine core started (pid %s)", process.pid)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def sentinel(self) -> int | None:
        return self.process.sentinel if self.process is not None else None

    def ended(self) -> bool:
        return self.process is not None and self.process.exitcode is not None

    def reap(self) -> None:
        """After the core ended: collect its exit, close our end of its pipe; `start` may follow."""
        if self.process is not None:
            self.process.join(0)
            self.process = None
        if self._control is not None:
            self._control.close()
            self._control = None

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait up to `timeout`, then kill it. Safe to call more than once."""
        if self.process is None:
            return
        if self._control is not None:
            with contextlib.suppress(OSError):  # already gone
                self._control.send("stop")
        self.process.join(timeout)
        if self.process.exitcode is None:
            logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join(5)
        self.reap()
