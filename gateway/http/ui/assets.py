"""The dashboard's files: read from the package (they ship in the wheel; no build step), served with
their content type and headers that keep pages from being framed, cached, or running any script
but our own."""

from __future__ import annotations

import html
import re
from functools import cache
from importlib import resources
from string import Template

from starlette.responses import Response

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}\.(js|css|svg)$")
# Scripts and styles from this origin only (no inline script, no eval); forms post here only.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",  # Origin stays readable on our own posts
    "cache-control": "no-store",
}


@cache
def _read(name: str) -> bytes | None:
    path = resources.files("specgate.gateway.http.ui").joinpath("static", name)
    return path.read_bytes() if path.is_file() else None


def asset(name: str) -> Response | None:
    """A static file by name (only plain names of the static folder), or None."""
    if not _NAME.match(name):
        return None
    data = _read(name)
    if data is None:
        return None
    kind = _TYPES["." + name.rsplit(".", 1)[1]]
    # Revalidated on each load: a gateway upgrade must never leave a browser on old scripts.
    headers = {**SECURITY_HEADERS, "cache-control": "no-cache"}
    return Response(data, media_type=kind, headers=headers)


def page(name: str, status: int = 200, **values: str) -> Response:
    """An HTML page of the static folder, its $placeholders filled with escaped text."""
    data = _read(name)
    assert data is not None, name
    text = Template(data.decode()).safe_substitute({k: html.escape(v) for k, v in values.items()})
    return Response(text, status_code=status, media_type=_TYPES[".html"], headers=dict(SECURITY_HEADERS))
