"""One worker process of `specgate serve --workers N`: the whole gateway app, serving the listening
socket the supervisor bound (the kernel hands each connection to one of the workers, as with
uvicorn's own `--workers`), with what it shares with its siblings named by its `WorkerContext`.

Started with the "spawn" start method (a fresh interpreter: no threads or locks of the supervisor's
carried over), so everything it needs travels in its arguments, which must pickle. uvicorn's own
signal handling applies: SIGTERM or SIGINT is a graceful shutdown. A supervisor that dies without
stopping it (SIGKILL) closes the lifeline's other end, and the worker shuts down as if told to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from specgate.gateway.proc_title import name_process
from specgate.gateway.settings import Settings
from specgate.gateway.worker_context import WorkerContext

logger = logging.getLogger("specgate.serve")


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """How the workers run, besides the settings (the command line's, not the config file's)."""

    cache_dir: str
    verbose: bool = False
    graceful_timeout: int = 10  # seconds in-flight requests get to finish on shutdown

    def __post_init__(self) -> None:
        if self.graceful_timeout < 0:
            raise ValueError("graceful_timeout must not be negative")


def run_worker(
    sock: socket.socket,
    settings: Settings,
    ctx: WorkerContext,
    options: WorkerOptions,
    lifeline: Connection,
) -> None:
    """The worker's entry point (a spawned process)."""
    name_process(f"specgate-w{ctx.index}")
    level = logging.INFO if options.verbose else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s %(name)s[worker {ctx.index}] %(message)s")
    import transformers
    import uvicorn

    from specgate.gateway.http.app import create_app
    from specgate.gateway.http.connections import uvicorn_options

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    threading.Thread(target=_follow, args=(lifeline,), name="specgate-lifeline", daemon=True).start()
    config = uvicorn.Config(
        create_app(settings, cache_dir=options.cache_dir, worker=ctx),
        **uvicorn_options(settings, verbose=options.verbose, graceful_timeout=options.graceful_timeout),
    )
    uvicorn.Server(config).run(sockets=[sock])


def _follow(lifeline: Connection) -> None:
    """Nothing is ever sent: the only news is the supervisor's end closing."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    logger.warning("the supervisor is gone; this worker shuts down")
    os.kill(os.getpid(), signal.SIGTERM)
