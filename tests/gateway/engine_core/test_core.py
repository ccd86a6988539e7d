"""What a client sends reaches the engine as the engine names it: an `AddRequest`'s fields, the
drafting scope and the prefix-cache salt included, whichever transport (in process, or a socket to
the shared core: both feed this loop) carries it; an abort reaches it too, and `Shutdown` stops it."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import LoadSnapshot, SpecParams
from specgate.gateway.engine_core.client import EngineCoreClient
from specgate.gateway.engine_core.core import EngineCore
from specgate.gateway.engine_core.messages import (
    AbortRequest,
    AddRequest,
    Batch,
    Item,
    Request,
    Shutdown,
)


class _Recorder(EngineCoreClient):
    """A client whose requests are kept instead of sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Request] = []

    @property
    def alive(self) -> bool:
        return True

    def _send(self, request: Request) -> None:
        self.sent.append(request)


class _Connection:
    def __init__(self, requests: list[Request]) -> None:
        self.requests = list(requests)
        self.published: list[Batch] = []

    def get(self, timeout: float | None) -> Request | None:
        return self.requests.pop(0) if self.requests else None

    def publish(self, batch: Batch) -> None:
        self.published.append(batch)


class _Engine:
    """Records what add_request and abort were given."""

    consecutive_forward_failures = 0

    def __init__(self) -> None:
        self.added: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.aborted: list[str] = []

    def add_request(self, *args: Any, **kw: Any) -> None:
        self.added.append((args, kw))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.mark.parametrize(("scope", "salt"), [("key-a", "salt:abc"), ("", ""), (None, None)])
def test_an_add_request_carries_scope_and_salt_to_the_engine(scope: str | None, salt: str | None) -> None:
    client = _Recorder()
    params = SamplingParams(max_tokens=3)
    spec = SpecParams("ngram")
    client.submit("r1", [1, 2, 3], params, spec, cache_scope=scope, prefix_salt=salt)
    engine = _Engine()
    core = EngineCore(engine, None, _Connection(client.sent))  # type: ignore[arg-type]
    deliveries: list[tuple[str, Item]] = []
    assert core._drain(False, deliveries) == 1
    assert deliveries == []  # admitted, not refused
    ((args, kw),) = engine.added
    assert args == ("r1", [1, 2, 3], params, spec)
    assert kw == {"cache_scope": scope, "prefix_salt": salt, "tenant": ""}


def test_a_client_shares_by_default_as_the_engine_does() -> None:
    client = _Recorder()
    client.submit("r1", [1], SamplingParams(max_tokens=1), None)
    (add,) = client.sent
    assert isinstance(add, AddRequest)
    assert (add.cache_scope, add.prefix_salt, add.tenant) == ("", "", "")


def test_an_abort_reaches_the_engine_and_shutdown_stops_the_loop() -> None:
    client = _Recorder()
    client.submit("r1", [1], SamplingParams(max_tokens=1), None)
    client.abort("r1")
    client.abort("r1")  # already aborted: not sent twice
    assert client.sent[1:] == [AbortRequest("r1")]
    engine = _Engine()
    core = EngineCore(engine, None, _Connection([*client.sent, Shutdown(), AbortRequest("late")]))  # type: ignore[arg-type]
    assert core._drain(False, []) == 1
    assert engine.aborted == ["r1"] and core.stopping.is_set()  # nothing after Shutdown is read


def test_messages_are_validated_when_made() -> None:
    with pytest.raises(ValueError, match="request_id"):
        AddRequest("", [1], SamplingParams(max_tokens=1), None)
    with pytest.raises(ValueError, match="state"):
        Batch([], 0, LoadSnapshot(), state="sleeping")
    with pytest.raises(ValueError, match="taken"):
        Batch([], -1, LoadSnapshot())
