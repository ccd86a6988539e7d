"""A body that is not JSON is refused with what is wrong and where, never with the body echoed."""

from __future__ import annotations

import pytest

from specgate.gateway.http.body import loads
from specgate.gateway.protocol.errors import GatewayError


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"secret-key": nope}', "expecting value (line 1, column 16)"),
        (b'{"a": 1}} sk-secret', "extra data (line 1, column 9)"),
        (b'{"a": NaN}', "NaN is not a JSON value"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON value"),
        (b'{"a": 1e400}', "the number 1e400 is out of range"),
        (b'{"a": 1' + b"0" * 500 + b"e999}", "the number 1000000000000000...0000e999 is out of range"),
        (b'{"a": ' + b"9" * 10_000 + b"}", "a number has too many digits"),
        (b'{"secret": "\xff"}', "it is not UTF-8 (byte 12)"),
    ],
)
def test_the_reason_is_given_and_nothing_of_the_body(raw: bytes, reason: str) -> None:
    with pytest.raises(GatewayError) as caught:
        loads(raw)
    err = caught.value
    assert err.status == 400 and err.code == "invalid_json"
    assert str(err.message) == f"the request body is not valid JSON: {reason}"
    assert "secret" not in str(err.message)


def test_valid_bodies_parse_the_same_on_both_paths() -> None:
    assert loads(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    big = loads(b'{"seed": 123456789012345678901234567890}')  # past 64 bits: the standard library's path
    assert big == {"seed": 123456789012345678901234567890}
