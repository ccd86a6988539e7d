"""The workload classes the policy routes by, and what each one means for speculation."""

from __future__ import annotations

# Order is the column order of every class-probability vector in this package.
WORKLOAD_CLASSES: tuple[str, ...] = (
    "code",
    "tool_call",  # tools offered or JSON output requested
    "math_reasoning",
    "summarization",
    "rag",  # long passages plus a question about them
    "translation",
    "qa",
    "open_chat",  # creative writing, roleplay, open-ended conversation
)
CLASS_INDEX = {c: i for i, c in enumerate(WORKLOAD_CLASSES)}


def check_class(name: str) -> str:
    if name not in CLASS_INDEX:
        raise ValueError(f"unknown workload class {name!r}; expected one of {', '.join(WORKLOAD_CLASSES)}")
    return name
