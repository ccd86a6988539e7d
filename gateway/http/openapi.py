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


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = base()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            schema = model.model_json_schema(ref_template=REF, mode="validation")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
