"""Settings: defaults, config files (TOML / YAML / JSON), env vars over the file, validation."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from specgate.gateway.settings import Settings


def test_defaults_serve_the_embedded_model_with_dynamic_ngram() -> None:
    s = Settings()
    assert s.embedded.enabled and s.embedded.model is None and s.backends == []
    assert s.embedded.spec.method == "ngram" and s.embedded.spec.controller == "goodput"
    assert s.api_keys == [] and s.admin_key is None


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_config_files(tmp_path: Path, suffix: str) -> None:
    data = {
        "port": 9001,
        "backends": [{"name": "vllm", "base_url": "http://127.0.0.1:8001/v1/", "models": ["m1", "m2"]}],
        "routes": {"m1": {"backends": ["vllm", "embedded"], "spec": {"method": "suffix", "k_max": 4}}},
    }
    path = tmp_path / f"cfg{suffix}"
    if suffix == ".toml":
        path.write_text(
            'port = 9001\n[[backends]]\nname = "vllm"\n'
            'base_url = "http://127.0.0.1:8001/v1/"\nmodels = ["m1", "m2"]\n'
            '[routes.m1]\nbackends = ["vllm", "embedded"]\n[routes.m1.spec]\nmethod = "suffix"\nk_max = 4\n'
        )
    elif suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(data))
    else:
        path.write_text(json.dumps(data))
    s = Settings.load(path)
    assert s.port == 9001
    b = s.backends[0]
    assert b.base_url == "http://127.0.0.1:8001/v1" and b.models == {"m1": "m1", "m2": "m2"}
    assert s.routes["m1"].backends == ["vllm", "embedded"] and s.routes["m1"].spec.k_max == 4  # type: ignore[union-attr]


def test_the_engine_process_key_is_refused_with_what_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text("[embedded]\nengine_process = false\n")
    with pytest.raises(ValidationError, match=r"engine_process is not a setting.*--engine-thread"):
        Settings.load(path)


def test_env_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"port": 9001, "embedded": {"dtype": "bfloat16"}}))
    monkeypatch.setenv("SPECGATE_PORT", "9002")
    monkeypatch.setenv("SPECGATE_EMBEDDED__DTYPE", "float32")
    s = Settings.load(path)
    assert s.port == 9002 and s.embedded.dtype == "float32"


@pytest.mark.parametrize(
    "data",
    [
        {"backends": [{"name": "a", "base_url": "localhost:1"}]},
        {"backends": [{"name": "embedded", "base_url": "http://x"}]},
        {"routes": {"m": {"backends": ["ghost"]}}},
        {"embedded": {"spec": {"k_min": 5, "k_max": 2}}},
        {"embedded": {"unknown_knob": 1}},
        {"embedded": {"prefix_cache_bytes": -1}},
        {"embedded": {"prefix_cache_scope": "everyone"}},
        {"embedded": {"prefix_caching": "sometimes"}},
        {"port": -1},
    ],
)
def test_invalid_settings_are_refused(data: dict) -> None:
    with pytest.raises(ValidationError):
        Settings(**data)


def test_secrets_do_not_print() -> None:
    s = Settings(api_keys=["sk-secret"], admin_key="adm-secret-0123456789")
    assert "sk-secret" not in repr(s) and "adm-secret" not in str(s.model_dump())


def test_prefix_caching_defaults_and_reaches_the_engine_config() -> None:
    e = Settings().embedded
    assert e.prefix_caching is True and e.prefix_cache_bytes is None and e.prefix_cache_scope == "tenant"
    cfg = e.engine_config()
    assert cfg.prefix_caching is True and cfg.prefix_cache_bytes is None
    e = Settings(embedded={"prefix_caching": False, "prefix_cache_bytes": 2**20}).embedded
    cfg = e.engine_config()
    assert cfg.prefix_caching is False and cfg.prefix_cache_bytes == 2**20


def test_prefix_cache_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECGATE_EMBEDDED__PREFIX_CACHE_SCOPE", "global")
    monkeypatch.setenv("SPECGATE_EMBEDDED__PREFIX_CACHE_BYTES", "0")
    e = Settings().embedded
    assert e.prefix_cache_scope == "global" and e.prefix_cache_bytes == 0


def test_a_short_admin_key_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="at least 16 characters"):
        Settings(admin_key="adm-short")
    assert Settings(admin_key="a" * 16).admin_key is not None


def test_keys_as_strings_or_with_limits_of_their_own() -> None:
    s = Settings(api_keys=["sk-plain", {"key": "sk-small", "max_in_flight": 2, "max_streams": 1}])
    plain, small = s.api_keys
    assert plain.key.get_secret_value() == "sk-plain" and plain.max_in_flight is None
    assert (small.max_in_flight, small.max_streams) == (2, 1)
    for bad in ("", " sk-spaced ", "sk\nnewline", {"key": "k", "max_in_flight": -1}, {"key": "k", "x": 1}):
        with pytest.raises(ValidationError):
            Settings(api_keys=[bad])


def test_keys_from_files_and_the_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsk-one\n\nsk-two  # the second\nsk-one\n")
    admin = tmp_path / "admin.txt"
    admin.write_text("adm-from-a-file-0123456789\n")
    s = Settings(api_keys=["sk-zero"], api_keys_file=str(keys), admin_key_file=str(admin))
    assert [k.key.get_secret_value() for k in s.api_keys] == ["sk-zero", "sk-one", "sk-two"]
    assert s.admin_key is not None and s.admin_key.get_secret_value() == "adm-from-a-file-0123456789"
    assert s.model_copy().api_keys == s.api_keys  # read once: a copy does not add them again
    with pytest.raises(ValidationError, match="cannot read the key file"):
        Settings(api_keys_file=str(tmp_path / "missing"))
    admin.write_text("one-key-0123456789\ntwo-keys-0123456789\n")
    with pytest.raises(ValidationError, match="exactly one key"):
        Settings(admin_key_file=str(admin))
    monkeypatch.setenv("SPECGATE_API_KEYS", '["sk-env"]')
    assert [k.key.get_secret_value() for k in Settings().api_keys] == ["sk-env"]


def test_the_api_key_flag_warns_that_ps_shows_it(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from specgate.gateway.cli.main import build_parser
    from specgate.gateway.cli.serve import serve_settings

    keys = tmp_path / "keys"
    keys.write_text("sk-file\n")
    with caplog.at_level(logging.WARNING):
        args = build_parser().parse_args(["serve", "--api-key-file", str(keys)])
        assert [k.key.get_secret_value() for k in serve_settings(args).api_keys] == ["sk-file"]
        assert "`ps`" not in caplog.text
        args = build_parser().parse_args(["serve", "--api-key", "sk-flag", "--api-key-file", str(keys)])
        got = [k.key.get_secret_value() for k in serve_settings(args).api_keys]
    assert got == ["sk-flag", "sk-file"]
    assert "`ps` shows it" in caplog.text and "sk-flag" not in caplog.text


@pytest.mark.parametrize("name", ["vllm:eagle", "two words", ""])
def test_a_backend_name_that_could_not_name_an_arm_is_refused(name: str) -> None:
    """Arms are "<backend>:<method>": a colon (or a space) in a backend's name is refused at start,
    never met by the router."""
    with pytest.raises(ValidationError, match="name"):
        Settings(backends=[{"name": name, "base_url": "http://127.0.0.1:9/v1"}])
    with pytest.raises(ValidationError, match="name"):
        Settings(embedded={"name": name})


def test_the_chat_template_from_the_config_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    assert Settings().embedded.chat_template is None
    config = tmp_path / "c.toml"
    config.write_text('[embedded]\nchat_template = "chatml"\n')
    assert Settings.load(config).embedded.chat_template == "chatml"
    monkeypatch.setenv("SPECGATE_EMBEDDED__CHAT_TEMPLATE", "llama3")
    assert Settings.load(config).embedded.chat_template == "llama3"
    monkeypatch.delenv("SPECGATE_EMBEDDED__CHAT_TEMPLATE")
    # A file is read once, into the template: the settings each worker unpickles carry its text.
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    s = Settings(embedded={"chat_template_file": str(template)})
    template.unlink()
    copy = pickle.loads(pickle.dumps(s))
    assert copy.embedded.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert copy.embedded.chat_template_file is None
    assert "chat_template" not in str(s.embedded.engine_config())


def test_a_chat_template_file_that_cannot_serve_is_refused_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"chat_template_file.*cannot read"):
        Settings(embedded={"chat_template_file": str(tmp_path / "missing.jinja")})
    plain = tmp_path / "plain.txt"
    plain.write_text("chatml")
    with pytest.raises(ValidationError, match=r"chat_template_file.*no Jinja"):
        Settings(embedded={"chat_template_file": str(plain)})
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    with pytest.raises(ValidationError, match="not both"):
        Settings(embedded={"chat_template": "chatml", "chat_template_file": str(tmp_path / "t.jinja")})
