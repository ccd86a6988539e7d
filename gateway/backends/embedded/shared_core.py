"""The one engine core of `specgate serve --workers N`, and the supervisor's handle on it.

The supervisor binds the Unix socket itself and hands it to each core it starts, so the socket
outlives any one core: a worker that reconnects while a core is being restarted waits in the
listen backlog until the new core accepts it, instead of finding no socket there. The core builds
the engine from a picklable `EngineConfig`, then serves every connection through `CoreHub` with the
same supervised step loop as the single-gateway core (`core.py`). An engine that cannot load is
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
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.gateway.backends.embedded.core import LogSettings
from specgate.gateway.backends.embedded.hub import CoreHub
from specgate.gateway.backends.embedded.messages import LoadFailed
from specgate.gateway.backends.embedded.model_info import ModelInfo
from specgate.gateway.backends.embedded.supervisor import EngineSupervisor
from specgate.gateway.proc_title import name_process

logger = logging.getLogger("specgate.engine_core")


def run_shared_core(
    listener: socket.socket, control: Connection, config: EngineConfig, log: LogSettings
) -> None:
    """The shared engine core's entry point (a spawned process)."""
    # Ctrl-C reaches the whole process group; the supervisor stops the core after its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process("specgate-core")
    log.apply()
    try:
        engine = Engine(config)
        info = ModelInfo.of(engine)
    except Exception as exc:
        logger.exception("the embedded engine failed to load")
        failed = CoreHub(listener, control, LoadFailed(f"{type(exc).__name__}: {exc}"))
        while (command := failed.get(1.0)) is None or command[0] != "stop":
            pass  # nothing to run: connecting workers are told why, until the supervisor stops us
        failed.close()
        return
    hub = CoreHub(listener, control, info)
    try:
        EngineSupervisor(engine, lambda: Engine(config), hub, hub.publish).run()
    finally:
        hub.close()
    logger.info("the shared engine core stopped")


class SharedCore:
    """The supervisor's side: start a core on the shared socket, see it end, stop it."""

    def __init__(self, listener: socket.socket, config: EngineConfig, log: LogSettings) -> None:
        self._listener, self._config, self._log = listener, config, log
        self.process: BaseProcess | None = None
        self._control: Connection | None = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        reader, writer = ctx.Pipe(duplex=False)
        # Daemonic: a supervisor that exits without stop() still takes its core along.
        process = ctx.Process(
            target=run_shared_core,
            args=(self._listener, reader, self._config, self._log),
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
