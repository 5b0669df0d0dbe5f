"""The JSON Schema of the status documents (``status/schema.json``), and validators for it."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import jsonschema


@functools.cache
def schema() -> dict[str, Any]:
    """The whole schema: one entry of ``$defs`` per document (see its description)."""
    loaded: dict[str, Any] = json.loads((resources.files("status") / "schema.json").read_bytes())
    return loaded


@functools.cache
def validator(document: str) -> jsonschema.Draft202012Validator:
    """A validator for one document, e.g. ``validator("all")`` for ``/status/all``."""
    if document not in schema()["$defs"]:
        raise KeyError(f"no status document {document!r} in schema.json")
    return jsonschema.Draft202012Validator({**schema(), "$ref": f"#/$defs/{document}"})
