"""OpenAPI for routes that parse their own bodies: the request schema, as precise as the validation.

The inference routes read their JSON after the key check, so FastAPI does not see a body parameter;
`json_body(Model)` documents it anyway, and `install(app, models)` adds their schemas (and those they
refer to) under components, so clients and schema-driven fuzzers see exactly what is accepted.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def operation(summary: str, operation_id: str, model: type[BaseModel]) -> dict[str, Any]:
    """A POST operation for a raw ASGI route (FastAPI documents only its own routes)."""
    ok = {"description": "Successful Response", "content": {"application/json": {"schema": {}}}}
    return {"summary": summary, "operationId": operation_id, **json_body(model), "responses": {"200": ok}}


def install(
    app: FastAPI, models: list[type[BaseModel]], raw: dict[str, dict[str, Any]] | None = None
) -> None:
    """`raw`: operations of routes FastAPI does not see, by path (listed first, as they are served)."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = base()
        if raw:
            spec["paths"] = {**{path: {"post": op} for path, op in raw.items()}, **spec.get("paths", {})}
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            schema = model.model_json_schema(ref_template=REF, mode="validation")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
