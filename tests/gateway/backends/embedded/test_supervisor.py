"""What the event loop's handle sends reaches the engine as the engine names it: the "add" command's
fields, the drafting scope and the prefix-cache salt included, whichever owner (thread or engine-core
process, both run this supervisor) carries it."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.backends.embedded.handle import EngineHandle
from specgate.gateway.backends.embedded.messages import Batch, Command, Item
from specgate.gateway.backends.embedded.supervisor import EngineSupervisor


class _Recorder(EngineHandle):
    """A handle whose commands are kept instead of sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Command] = []

    @property
    def alive(self) -> bool:
        return True

    def _send(self, command: Command) -> None:
        self.sent.append(command)


class _Inbox:
    def __init__(self, commands: list[Command]) -> None:
        self.commands = list(commands)

    def get(self, timeout: float | None) -> Command | None:
        return self.commands.pop(0) if self.commands else None


class _Engine:
    """Records what add_request was given."""

    consecutive_forward_failures = 0

    def __init__(self) -> None:
        self.added: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def add_request(self, *args: Any, **kw: Any) -> None:
        self.added.append((args, kw))


@pytest.mark.parametrize(("scope", "salt"), [("key-a", "salt:abc"), ("", ""), (None, None)])
def test_the_add_command_carries_scope_and_salt_to_the_engine(scope: str | None, salt: str | None) -> None:
    handle = _Recorder()
    params = SamplingParams(max_tokens=3)
    spec = SpecParams("ngram")
    handle.submit("r1", [1, 2, 3], params, spec, cache_scope=scope, prefix_salt=salt)
    engine = _Engine()
    published: list[Batch] = []
    sup = EngineSupervisor(engine, None, _Inbox(handle.sent), published.append)  # type: ignore[arg-type]
    deliveries: list[tuple[str, Item]] = []
    assert sup._drain(False, deliveries) == 1
    assert deliveries == []  # admitted, not refused
    ((args, kw),) = engine.added
    assert args == ("r1", [1, 2, 3], params, spec)
    assert kw == {"cache_scope": scope, "prefix_salt": salt, "tenant": ""}


def test_a_handle_shares_by_default_as_the_engine_does() -> None:
    handle = _Recorder()
    handle.submit("r1", [1], SamplingParams(max_tokens=1), None)
    ((kind, arg),) = handle.sent
    assert kind == "add" and (arg.cache_scope, arg.prefix_salt, arg.tenant) == ("", "", "")
