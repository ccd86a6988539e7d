"""The dashboard's files ship in the package and refer only to each other: every script and style a
page loads, and every module a script imports, is a served asset with its content type; the pages
run no inline script (the Content-Security-Policy would block it); package data covers the folder."""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from pathlib import Path

from specgate.gateway.http.ui.assets import CSP, asset, page

STATIC = resources.files("specgate.gateway.http.ui").joinpath("static")
ROOT = Path(__file__).resolve().parents[4]


def names() -> list[str]:
    return sorted(p.name for p in STATIC.iterdir() if p.is_file())


def test_every_reference_resolves_to_a_served_asset() -> None:
    referenced: set[str] = set()
    for name in names():
        text = STATIC.joinpath(name).read_text()
        referenced |= set(re.findall(r"/admin/ui/static/([\w.-]+)", text))
        referenced |= set(re.findall(r"""from\s+["']\./([\w.-]+)["']""", text))
    assert {"app.js", "style.css", "charts.js", "api.js"} <= referenced
    types = {"js": "text/javascript", "css": "text/css"}
    for name in referenced:
        response = asset(name)
        assert response is not None, name
        assert response.headers["content-type"].startswith(types[name.rsplit(".", 1)[1]])
        assert response.headers["x-content-type-options"] == "nosniff"
    # Everything in the folder is used by something (no stale file ships).
    assert set(names()) - referenced == {"index.html", "login.html"}


def test_pages_have_no_inline_script_or_style() -> None:
    for name in ("index.html", "login.html"):
        html = page(name).body.decode()
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), name
        assert " style=" not in html and "<style" not in html and "javascript:" not in html
        assert not re.search(r"\son[a-z]+=", html), name  # no inline event handlers
    assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP and "frame-ancestors 'none'" in CSP


def test_package_data_ships_the_folder() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "static/*" in config["tool"]["setuptools"]["package-data"]["specgate.gateway.http.ui"]
    assert not any(STATIC.joinpath(n).is_dir() for n in names())  # "static/*" covers one level


def test_login_page_escapes_what_it_shows() -> None:
    html = page("login.html", error="<img src=x onerror=alert(1)>", hidden="").body.decode()
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
