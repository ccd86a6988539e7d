"""The processes of `specgate serve` other than the engine core never import torch: the supervisor
(cli/serve.py, serve/supervisor.py) and each worker (serve/worker.py, the app it builds) load
modules that name no engine internals, and what a worker unpickles from the core (its ModelInfo,
the tokenizer included, and each step's Batch) imports none either. Checked in a fresh interpreter,
since this one has torch loaded already. The running fleet is checked too (test_workers.py)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from specgate.engine.engine import Engine
from specgate.engine.errors import RequestError
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import LoadSnapshot
from specgate.gateway.engine_core.messages import Batch, EngineUnavailable, Item
from specgate.gateway.engine_core.model_info import ModelInfo


@pytest.mark.slow
def test_the_supervisor_and_a_worker_import_no_torch(
    make_engine: Callable[..., Engine], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    engine = make_engine()
    engine.add_request("r", engine.tokenizer.encode("the sea"), SamplingParams(max_tokens=2))
    outputs = engine.step()
    deliveries: list[tuple[str, Item]] = [(o.request_id, o) for o in outputs]
    deliveries += [("x", RequestError("too long")), ("y", EngineUnavailable("rebuilding"))]
    batch = Batch(deliveries, 1, LoadSnapshot(num_running=1))
    messages = tmp_path / "from_the_core.pickle"
    messages.write_bytes(pickle.dumps([ModelInfo.of(engine), batch]))
    script = textwrap.dedent(
        f"""
        import pickle, sys
        import specgate.gateway.cli.serve, specgate.gateway.serve.supervisor
        from specgate.gateway.serve.worker import run_worker
        from specgate.gateway.http.app import create_app
        from specgate.gateway.settings import Settings
        from specgate.gateway.worker_context import WorkerContext

        settings = Settings(embedded={{"model": {str(tiny_llama_dir)!r}}}, telemetry={{"enabled": False}})
        where = WorkerContext(0, 2, "/nonexistent", engine_socket="/nonexistent/engine.sock")
        create_app(settings, worker=where)
        info, batch = pickle.loads(open({str(messages)!r}, "rb").read())
        assert info.tokenizer.decode(info.tokenizer.encode("the sea")).strip() == "the sea", info
        assert len(batch.deliveries) == 3
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
