"""The gateway's secret and private files: made once, 0600 in a 0700 directory; the telemetry
database, its WAL and shared memory readable by their owner only; key ids keyed by the secret."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from specgate.gateway.keyring import KeyIds, gateway_secret, private_dir
from specgate.gateway.settings import TelemetrySettings
from specgate.gateway.telemetry.schema import make_engine
from specgate.gateway.telemetry.store import TelemetryStore


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_secret_is_made_once_private_and_the_same_for_every_reader(tmp_path: Path) -> None:
    path = tmp_path / "data" / "gateway.secret"
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(gateway_secret(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got[0]) == 32  # racing creators agree on one secret
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert gateway_secret(path) == got[0]  # read back, not drawn again
    assert [p.name for p in path.parent.iterdir()] == ["gateway.secret"]  # no temporary file left


def test_a_loose_secret_file_is_tightened_and_a_short_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "gateway.secret"
    path.write_text("ab" * 32)
    os.chmod(path, 0o644)
    assert gateway_secret(path) == bytes.fromhex("ab" * 32)
    assert mode(path) == 0o600
    path.write_text("abcd")
    with pytest.raises(ValueError, match="shorter than 16 bytes"):
        gateway_secret(path)


def test_key_ids_depend_on_the_secret(tmp_path: Path) -> None:
    a = KeyIds(gateway_secret(tmp_path / "a"))
    b = KeyIds(gateway_secret(tmp_path / "b"))
    assert a.of("sk-1") != b.of("sk-1") and a.of("sk-1") == a.of("sk-1")
    assert len(a.of("sk-1")) == len("key-") + 16


def test_the_telemetry_database_and_its_side_files_are_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    monkeypatch.setenv("SPECGATE_DATA_DIR", str(data))
    old = os.umask(0o022)  # a usual umask: files would be 0644 without care
    try:
        store = TelemetryStore(TelemetrySettings())
        store.open()
        with store.engine.begin() as conn:
            conn.execute(text("SELECT count(*) FROM requests"))
        store.close()
    finally:
        os.umask(old)
    db = data / "telemetry.db"
    assert mode(data) == 0o700
    for path in (db, *(db.with_name(db.name + s) for s in ("-wal", "-shm"))):
        if path.exists():
            assert mode(path) == 0o600, path


def test_a_folder_the_operator_chose_is_left_as_it_is(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    engine = make_engine(f"sqlite:///{shared / 'tele.db'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x int)"))
    engine.dispose()
    assert mode(shared) == 0o755  # not ours to tighten
    assert mode(shared / "tele.db") == 0o600  # but the database is


def test_private_dir_tightens_only_when_asked(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, 0o755)
    private_dir(d, tighten=False)
    assert mode(d) == 0o755
    private_dir(d)
    assert mode(d) == 0o700
