"""agent/topics.py: the topic settings' schema is generated from TopicConfig, so the OpenAPI
document states each bound once, as the model does."""

from __future__ import annotations

from agent.config import MAX_ACK_TIMEOUT_MS, TopicConfig
from agent.ingest.http.openapi import openapi_document
from agent.topics import settings_schema


def test_every_setting_with_the_models_bounds() -> None:
    props = settings_schema()
    assert list(props) == [f.alias or n for n, f in TopicConfig.model_fields.items()]
    assert props["ack_timeout_ms"] == {"type": "integer", "minimum": 0,
                                       "maximum": MAX_ACK_TIMEOUT_MS, "default": 65}
    assert props["acks"]["enum"] == ["all", "leader"]
    assert props["schema"]["nullable"] is True and props["schema"]["type"] == "string"
    assert all("anyOf" not in p and "title" not in p for p in props.values())


def test_the_openapi_document_uses_the_generated_settings() -> None:
    doc = openapi_document()
    found = [s for s in _schemas(doc) if "ack_timeout_ms" in s.get("properties", {})]
    assert found, "no schema of the document holds the topic settings"
    for schema in found:
        assert schema["properties"]["ack_timeout_ms"]["maximum"] == MAX_ACK_TIMEOUT_MS
        assert schema["properties"]["ttl_seconds"]["minimum"] == 1


def _schemas(node: object) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    if isinstance(node, dict):
        out.append(node)
        for v in node.values():
            out += _schemas(v)
    elif isinstance(node, list):
        for v in node:
            out += _schemas(v)
    return out
