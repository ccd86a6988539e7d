"""How deep a parsed JSON value nests: one bound for what clients send and what upstreams answer
(json parses up to the interpreter's recursion limit; everything after it walks these values)."""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64


def nests_deeper(root: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether objects and arrays in `root` nest more than `limit` levels (no recursion)."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(node, dict | list):
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def text_nests_deeper(text: bytes | str, root: Any, limit: int = MAX_DEPTH) -> bool:
    """`nests_deeper` for `root` parsed from the JSON `text`. Each object or array is one opening
    bracket of the text, so a text with at most `limit` of them cannot nest deeper and the walk is
    skipped: nearly every body, at the cost of two byte counts."""
    if isinstance(text, bytes):
        opening = text.count(b"[") + text.count(b"{")
    else:
        opening = text.count("[") + text.count("{")
    return opening > limit and nests_deeper(root, limit)
