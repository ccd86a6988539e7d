"""`specgate serve --workers N`: a supervisor process, N gateway workers, one engine core.

The supervisor binds the listening socket once and spawns the workers on it (worker.py);
it starts once what they share: a private run directory (removed at exit) holding the engine core's
Unix socket and the Prometheus multiprocess directory, the engine core (engine_core/process.py), and the
telemetry writer and limit tables (shared.py). The telemetry schema is checked (and, where that is
the configuration, upgraded) here once, so that N workers do not race through one upgrade.

It then watches: a worker that dies is restarted in its slot, as is a core that dies (the workers'
requests in flight get a retryable 503, and they reconnect to the new core by themselves); a child
that dies again soon after its start waits a little longer each time. SIGTERM or SIGINT stops the
workers gracefully (uvicorn's shutdown: in-flight requests finish), then the core, then the rest.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from specgate.gateway.engine_core.process import CoreProcess, LogSettings
from specgate.gateway.limits.shared import SharedLimits
from specgate.gateway.serve.announce import announce
from specgate.gateway.serve.shared import start_shared
from specgate.gateway.serve.worker import WorkerOptions, run_worker
from specgate.gateway.settings import Settings
from specgate.gateway.telemetry.multiproc import MULTIPROC_ENV, forget_process
from specgate.gateway.worker_context import WorkerContext

logger = logging.getLogger("specgate.serve")
STABLE_AFTER = 10.0  # seconds a child must have run for its death to be restarted at once
MAX_BACKOFF = 30.0
POLL = 0.5  # seconds between looks at the stop flag while nothing ends


@dataclass(slots=True)
class Restarts:
    """When a child may start again: at once after a long run, with doubling backoff after a short one."""

    started: float = 0.0
    backoff: float = 0.0
    due: float = 0.0

    def start(self, now: float) -> None:
        self.started = now

    def ended(self, now: float) -> float:
        quick = now - self.started < STABLE_AFTER
        self.backoff = min(MAX_BACKOFF, max(0.5, self.backoff * 2)) if quick else 0.0
        self.due = now + self.backoff
        return self.backoff


@dataclass(slots=True)
class Slot:
    index: int
    process: BaseProcess | None = None  # None: waiting for `restarts.due`
    restarts: Restarts = field(default_factory=Restarts)


class WorkerSupervisor:
    def __init__(self, settings: Settings, options: WorkerOptions) -> None:
        self.settings, self.options = settings, options
        self._spawn = multiprocessing.get_context("spawn")
        self._stopping = False
        self._slots = [Slot(i) for i in range(settings.workers)]
        self._core: CoreProcess | None = None
        self._core_restarts = Restarts()
        self._lifeline: Connection | None = None  # our end; closed, it tells orphaned workers to stop

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        run_dir = tempfile.mkdtemp(prefix="specgate-")
        try:
            self._serve(run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._stopping:
            logger.warning("%s: stopping the workers", signal.Signals(signum).name)
        self._stopping = True

    def _serve(self, run_dir: str) -> None:
        s = self.settings
        metrics_dir = os.path.join(run_dir, "metrics")
        os.mkdir(metrics_dir)
        # Inherited by every child spawned from now on, before any of them imports prometheus_client.
        os.environ[MULTIPROC_ENV] = metrics_dir
        http = bind_tcp(s.host, s.port)
        engine_socket, listener = None, None
        telemetry_socket, limits, close_shared = start_shared(s, run_dir)
        lifeline, self._lifeline = self._spawn.Pipe(duplex=False)  # (the workers' end, ours)
        try:
            if s.embedded.enabled:
                engine_socket = os.path.join(run_dir, "engine.sock")
                listener = bind_unix(engine_socket)
                # Built in the core (EngineConfig imports torch, which this process never does).
                make_config = functools.partial(s.embedded.engine_config, self.options.cache_dir)
                self._core = CoreProcess(listener, make_config, LogSettings.current())
                self._start_core()
            n = s.workers

            def context(i: int) -> WorkerContext:
                return WorkerContext(i, n, run_dir, engine_socket, telemetry_socket, metrics_dir, limits)

            args: dict[int, tuple[Any, ...]] = {
                i: (http, s, context(i), self.options, lifeline) for i in range(n)
            }
            for slot in self._slots:
                self._start_worker(slot, args[slot.index])
            port = http.getsockname()[1]
            logger.info("serving on http://%s:%d with %d workers (pid %d)", s.host, port, n, os.getpid())
            announce(s.host, port, f"{n} worker{'s' if n > 1 else ''}", lambda: self._stopping)
            self._watch(args, metrics_dir, limits)
        finally:
            self._stop_workers(metrics_dir)
            if self._core is not None:
                self._core.stop()
            close_shared()
            for closable in (self._lifeline, lifeline, listener, http):
                if closable is not None:
                    closable.close()

    def _start_worker(self, slot: Slot, args: tuple[Any, ...]) -> None:
        process = self._spawn.Process(
            target=run_worker, args=args, name=f"specgate-worker-{slot.index}", daemon=False
        )
        process.start()
        slot.process = process
        slot.restarts.start(time.monotonic())
        logger.info("worker %d started (pid %s)", slot.index, process.pid)

    def _start_core(self) -> None:
        assert self._core is not None
        self._core.start()
        self._core_restarts.start(time.monotonic())

    def _watch(self, args: dict[int, tuple[Any, ...]], metrics_dir: str, limits: SharedLimits) -> None:
        while not self._stopping:
            sentinels = [s.process.sentinel for s in self._slots if s.process is not None]
            core = self._core
            if core is not None and core.sentinel is not None and not core.ended():
                sentinels.append(core.sentinel)
            wait(sentinels, timeout=POLL)
            if self._stopping:
                return
            now = time.monotonic()
            for slot in self._slots:
                p = slot.process
                if p is not None and p.exitcode is not None:
                    wait_s = slot.restarts.ended(now)
                    why = f"exited ({p.exitcode})"
                    logger.error(
                        "worker %d (pid %s) %s; restarting it in %.1f s", slot.index, p.pid, why, wait_s
                    )
                    forget_process(p.pid or 0, metrics_dir)
                    # What it held in flight stops counting against its tenants' caps at once.
                    limits.attach().in_flight(slot.index, len(self._slots)).bump(slot.index)
                    slot.process = None
                if slot.process is None and now >= slot.restarts.due:
                    self._start_worker(slot, args[slot.index])
            if core is not None and core.ended():
                wait_s = self._core_restarts.ended(now)
                logger.error("the engine core (pid %s) exited; restarting it in %.1f s", core.pid, wait_s)
                core.reap()
            if core is not None and core.process is None and now >= self._core_restarts.due:
                self._start_core()

    def _stop_workers(self, metrics_dir: str) -> None:
        running = [s.process for s in self._slots if s.process is not None and s.process.exitcode is None]
        for p in running:
            p.terminate()  # SIGTERM: uvicorn's graceful shutdown
        deadline = time.monotonic() + self.options.graceful_timeout + 5
        for p in running:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in running:
            if p.exitcode is None:
                logger.warning("worker pid %s did not stop in time; killing it", p.pid)
                p.kill()
                p.join(5)
        for slot in self._slots:
            if slot.process is not None and slot.process.pid is not None:
                forget_process(slot.process.pid, metrics_dir)


def bind_tcp(host: str, port: int) -> socket.socket:
    """The listening socket every worker accepts from (bound once, here, as uvicorn does)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)  # connections that come before the workers are up wait, not refused
    sock.set_inheritable(True)
    return sock


def bind_unix(path: str) -> socket.socket:
    """The engine core's socket, readable and writable by this user only (the core also checks
    each peer's uid: engine_core/sockets.py)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # no moment at which the socket exists with looser modes
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)  # every worker's connection waits here while a core (re)starts
    return sock


def serve_workers(settings: Settings, options: WorkerOptions) -> int:
    return WorkerSupervisor(settings, options).run()
