"""/openapi.json from the request models that validate the bodies, so what the schema allows
is what the server accepts (the routes read their bodies themselves, to keep 400s that name
the field; FastAPI would not see the bodies otherwise)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve an OpenAPI document whose POST routes in `bodies` carry their request models."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            _, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                         ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            for path, model in bodies.items():
                operation = schema["paths"].get(path, {}).get("post")
                if operation is not None:
                    operation["requestBody"] = {"required": True, "content": {
                        "application/json": {"schema": {"$ref": REF.format(
                            model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
