"""Where one proxied request's time goes: a sequential run through `specgate serve`, profiled.

    python bench/profile_gateway.py [--requests 4000] [--no-telemetry] [--flamegraph worker|supervisor]
                                     [--collapsed]

Starts the stub backend and `specgate serve` (one worker; the embedded engine off; telemetry on a
throwaway SQLite file) as bench_gateway.py does, then sends one request at a time, alternating blocks
of 100 between the stub directly and the gateway, from a client that costs next to nothing (a
blocking socket, no HTTP library), so the added latency it prints is the gateway's and not a
Python client's competing for the same cores. It also prints the CPU time per request of each of
specgate's processes. With --flamegraph, py-spy (not a dependency: `pip install py-spy`) samples
the worker or the supervisor at 1 kHz while the measured requests run and writes an SVG flame
graph (the ones under docs/flamegraphs/ came from here).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from specgate.bench import gateway_targets as gt
from specgate.bench.stub_backend import MODEL

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
BLOCK = 100


class RawClient:
    """One kept-alive HTTP/1.1 connection; POSTs a JSON body and reads a content-length answer."""

    def __init__(self, url: str, body: dict[str, object]) -> None:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = json.dumps(body).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        self.request = f"{head}content-length: {len(data)}\r\n\r\n".encode() + data

    def call(self) -> float:
        """Seconds from sending the request to the answer's last byte."""
        start = time.perf_counter()
        self.sock.sendall(self.request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += self._recv()
        head, _, rest = buf.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"unexpected answer: {head[:80]!r}")
        lines = head.lower().split(b"\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in lines if line.startswith(b"content-length:"))
        while len(rest) < length:
            rest += self._recv()
        return time.perf_counter() - start

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spy(pid: int, out: Path, collapsed: bool) -> subprocess.Popen[bytes]:
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    fmt = "raw" if collapsed else "flamegraph"
    cmd = [binary, "record", "-p", str(pid), "-r", "1000", "--nonblocking", "-f", fmt]
    cmd += ["-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def print_top_frames(path: Path, top: int = 30) -> None:
    """The frames in the most samples, counting a sample once per frame on its stack (inclusive)."""
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        for frame in set(stack.split(";")):
            inclusive[frame] += int(count)
    print(f"{total} samples; frames by share of samples (inclusive):")
    for frame, n in inclusive.most_common(top):
        print(f"  {100 * n / max(1, total):5.1f}%  {frame[:140]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4000, help="measured requests per target")
    parser.add_argument("--no-telemetry", action="store_true", help="turn specgate's telemetry store off")
    parser.add_argument(
        "--flamegraph", choices=("worker", "supervisor"), help="profile this process with py-spy"
    )
    parser.add_argument("--out", type=Path, default=Path("gateway-flamegraph.svg"), help="the SVG's path")
    parser.add_argument(
        "--collapsed",
        action="store_true",
        help="write collapsed stacks (one line per stack: frames;...;frame count) instead of an SVG, "
        "and print the frames with the most samples",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="specgate-profile-"))
    stub = gt.start_stub(tmp)
    gateway = gt.start_specgate("specgate", stub.url, tmp, 1, not args.no_telemetry)
    try:
        roles = {pid: gateway.role(pid) for pid in gt.process_tree(gateway.proc.pid)}
        worker = next(pid for pid, role in roles.items() if role == "worker")
        direct, through = RawClient(stub.url, BODY), RawClient(gateway.url, BODY)
        for _ in range(3 * BLOCK):  # warm up both
            direct.call(), through.call()
        profiler = None
        if args.flamegraph:
            profiler = spy(
                worker if args.flamegraph == "worker" else gateway.proc.pid, args.out, args.collapsed
            )
            time.sleep(1.0)  # py-spy attaches
        before = gt.cpu_seconds(list(roles))
        times: dict[str, list[float]] = {"direct": [], "specgate": []}
        for _ in range(max(1, args.requests // BLOCK)):
            times["direct"].extend(direct.call() for _ in range(BLOCK))
            times["specgate"].extend(through.call() for _ in range(BLOCK))
        after = gt.cpu_seconds(list(roles))
        if profiler is not None:
            profiler.send_signal(2)  # py-spy writes its output on SIGINT
            profiler.wait(60)
        n = len(times["specgate"])
        print(f"{n} requests per target, one at a time; telemetry {'off' if args.no_telemetry else 'on'}")
        print("| quantile | direct ms | specgate ms | added ms |\n| --- | --- | --- | --- |")
        for q in (0.5, 0.9, 0.99, 0.999):
            d, g = quantile(times["direct"], q) * 1e3, quantile(times["specgate"], q) * 1e3
            print(f"| p{q * 100:g} | {d:.3f} | {g:.3f} | {g - d:.3f} |")
        cpu = {roles[pid]: (after[pid] - before[pid]) / n * 1e6 for pid in after if pid in before}
        print("specgate CPU per request, µs:", ", ".join(f"{role} {us:.0f}" for role, us in cpu.items()))
        if profiler is not None:
            print(f"{'stacks' if args.collapsed else 'flame graph'} of the {args.flamegraph}: {args.out}")
            if args.collapsed:
                print_top_frames(args.out)
        direct.close()
        through.close()
    finally:
        gateway.stop()
        stub.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
