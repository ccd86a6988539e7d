"""The servers bench/bench_gateway.py measures, and the CPU time their processes use.

Each target is a process tree serving OpenAI's chat completions API in front of the same stub
backend (bench/stub_backend.py): the stub itself, `specgate serve` (1 or N workers), and the LiteLLM
proxy when it is installed (its own virtual environment; not a dependency of this project). Their
output goes to log files in the run's temporary directory; `log_errors` counts what looks like
errors there. CPU time comes from /proc/<pid>/stat (utime + stime) of a process and all its
descendants, found by their parent pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specgate.bench.stub_backend import MODEL, free_port

ROOT = Path(__file__).resolve().parent.parent
TICK = 1.0 / os.sysconf("SC_CLK_TCK")  # seconds per clock tick in /proc/<pid>/stat
LITELLM_VENV = Path("/work/litellm-venv/bin/litellm")
# No network for LiteLLM: the cost map from its package instead of GitHub, no telemetry, no schema
# updates (no database anyway), no master key (specgate runs without API keys here too), and logs at
# ERROR (LiteLLM's production advice; it also turns uvicorn's access log off, as specgate's is).
LITELLM_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "DISABLE_SCHEMA_UPDATE": "True",
    "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    "LITELLM_LOG": "ERROR",
}


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a live process, from /proc/<pid>/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # fields[0] is field 3 (state) of proc(5)
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK


def process_tree(root: int) -> list[int]:
    """`root` and every process descending from it (a scan of /proc for parent pids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    return {pid: st[1] for pid in pids if (st := _stat(pid)) is not None}


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    started_in: float = 0.0  # seconds from start to ready
    metrics: bool = False  # serves specgate's /metrics
    pids: list[int] = field(default_factory=list)  # the process tree, as of the last `snapshot`

    def snapshot(self) -> dict[int, float]:
        """CPU seconds so far of each process in the tree (found again, in case one was restarted)."""
        self.pids = process_tree(self.proc.pid)
        return cpu_seconds(self.pids)

    def role(self, pid: int) -> str:
        """A short name for a process of the tree: main, worker (multiprocessing), tracker, or pid."""
        if pid == self.proc.pid:
            return "main"
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return str(pid)
        return "tracker" if b"resource_tracker" in cmd else "worker" if b"spawn_main" in cmd else str(pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_errors(self) -> int:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return sum("Traceback" in line or " ERROR" in line for line in text.splitlines())


def start(
    name: str,
    cmd: list[str],
    url: str,
    ready: str,
    tmp: Path,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> Target:
    """Run `cmd` in `cwd` (its output to tmp/<name>.log) and wait until GET url+ready answers 200."""
    log = tmp / f"{name.replace(' ', '_')}.log"
    full_env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", **(env or {})}
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    target = Target(name, url, proc, log)
    while time.monotonic() - t0 < 180:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")
        try:
            if httpx.get(url + ready, timeout=2, trust_env=False).status_code == 200:
                target.started_in = time.monotonic() - t0
                target.snapshot()
                return target
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    target.stop()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"{name}: {url + ready} did not answer 200 within 180 s; its log ends:\n{tail}")


def start_stub(tmp: Path) -> Target:
    port = free_port()
    cmd = [sys.executable, str(ROOT / "bench" / "stub_backend.py"), "--port", str(port)]
    return start("direct", cmd, f"http://127.0.0.1:{port}", "/v1/models", tmp)


def start_specgate(
    name: str, stub: str, tmp: Path, workers: int, telemetry: bool, python: str = sys.executable
) -> Target:
    """`specgate serve` as served by default (routing policy on) but: the embedded engine off, the
    stub as its one backend, and the telemetry store on a throwaway SQLite file (or off). `python`:
    the interpreter of the build to run (another checkout's venv, to compare two builds)."""
    port, d = free_port(), tmp / name.replace(" ", "_")
    d.mkdir()
    store = {"url": f"sqlite:///{d}/t.db", "auto_upgrade": True, "spool_dir": str(d / "spool")}
    config = {
        "port": port,
        "embedded": {"enabled": False},
        "backends": [{"name": "stub", "base_url": f"{stub}/v1", "models": [MODEL], "health_interval": 0}],
        "telemetry": store if telemetry else {"enabled": False},
    }
    (d / "specgate.json").write_text(json.dumps(config))
    cmd = [python, "-m", "specgate.gateway.cli.main", "serve", "--config", str(d / "specgate.json")]
    target = start(name, [*cmd, "--workers", str(workers)], f"http://127.0.0.1:{port}", "/readyz", tmp)
    target.metrics = True
    return target


def find_litellm(given: str | None) -> str | None:
    if given:
        return given
    return shutil.which("litellm") or (str(LITELLM_VENV) if LITELLM_VENV.exists() else None)


def litellm_version(binary: str) -> str:
    python = Path(binary).parent / "python"
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def start_litellm(binary: str, stub: str, tmp: Path) -> Target:
    """The LiteLLM proxy with one model, the stub (`openai/` provider), one uvicorn worker."""
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {stub}/v1\n"
        "      api_key: x\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    cmd = [binary, "--config", str(config), "--port", str(port), "--host", "127.0.0.1", "--num_workers", "1"]
    return start("litellm", cmd, f"http://127.0.0.1:{port}", "/health/readiness", tmp, tmp, LITELLM_ENV)
