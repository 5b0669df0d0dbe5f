"""The OpenAPI document of publishing, topic management and the status probes.

Served at ``/openapi.json``; the test suite runs schemathesis against it, so every status code
and header an operation can answer is listed here. docs/http.md says the same in prose.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from agent import __version__
from agent.ingest.http.idempotency import MAX_KEY_LENGTH
from agent.topics import settings_schema
from ferry_client import topic_names

_REF = "#/components/schemas/"
_RESP = "#/components/responses/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _error(description: str, retry_after: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ref("Error")}},
    }
    if retry_after:
        out["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
    return out


_TOPIC_PARAM = {
    "name": "topic", "in": "path", "required": True,
    "description": "Kafka topic name",
    "schema": {"type": "string", "pattern": topic_names.PATTERN,
               "not": {"enum": [".", ".."]}},
}

_PUBLISH_HEADERS = [
    {"name": "Partition-Key", "in": "header", "required": False,
     "description": "Kafka record key (Hermes); partition by its hash",
     "schema": {"type": "string", "minLength": 1}},
    {"name": "Ferry-Partition-Key", "in": "header", "required": False,
     "description": "Bruce-style partition choice: partition = key mod partition count",
     "schema": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}},
    {"name": "Idempotency-Key", "in": "header", "required": False,
     "description": "A retry with the same key (same topic, same request) within "
                    "http.idempotency_window_seconds gets the first answer and stores nothing",
     "schema": {"type": "string", "pattern": f"^[!-~]{{1,{MAX_KEY_LENGTH}}}$"}},
]

_PUBLISH_ERRORS = {
    "400": {"$ref": _RESP + "BadRequest"},
    "404": _error("Unknown topic (http.auto_create_topics is off)"),
    "408": _error("The body did not arrive within http.body_timeout_seconds"),
    "413": _error("Over the topic's max_message_bytes (batch: http.max_batch_bytes)"),
    "415": _error("Content-Type not accepted by the topic's content_type"),
    "422": _error("Idempotency-Key already used for a different request"),
    "429": _error("Over the topic's rate_limit", retry_after=True),
    "503": {"$ref": _RESP + "Unavailable"},
}

_ID_HEADER = {"description": "The message id (24 hex digits)",
              "schema": {"type": "string", "pattern": "^[0-9a-f]{24}$"}}


def _published(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {"Ferry-Message-Id": _ID_HEADER, "Hermes-Message-Id": _ID_HEADER},
        "content": {"application/json": {"schema": _ref("Published")}},
    }


def _batch_published(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ref("BatchPublished")}}}


# Types, choices and bounds come from TopicConfig (agent/topics.py: settings_schema); only
# what the API adds is said here: descriptions, and that a schema may be sent as JSON.
_SETTINGS_PROPERTIES: dict[str, Any] = settings_schema()
_SETTINGS_PROPERTIES["schema"] = {
    "nullable": True, "description": "Avro schema (avro topics) or JSON Schema (json topics), "
    "as JSON text or as JSON (an Avro union is an array); binary topics ignore it",
    "oneOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}]}
_SETTINGS_PROPERTIES["rate_limit"]["description"] = "messages/s over HTTP; 0 = unlimited"


@functools.cache
def _document() -> dict[str, Any]:
    management: dict[str, Any] = {"security": [{"bearer": []}, {}]}
    settings_schema = {"type": "object", "additionalProperties": False,
                       "properties": _SETTINGS_PROPERTIES}
    create_schema = {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": _TOPIC_PARAM["schema"], **_SETTINGS_PROPERTIES},
    }
    topic_schema = {
        "type": "object",
        "required": ["name", "origin", "read_only", *_SETTINGS_PROPERTIES],
        "properties": {
            "name": {"type": "string"},
            "origin": {"type": "string", "enum": ["config", "api"]},
            "read_only": {"type": "boolean"},
            **_SETTINGS_PROPERTIES,
            "schema": {"type": "string", "nullable": True},
        },
    }
    auth_errors = {"401": _error("Management token missing or wrong"),
                   "403": _error("Management is closed (no token configured), or the "
                                 "request is cross-site")}
    json_body = {"required": True,
                 "content": {"application/json": {"schema": settings_schema}}}
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Ferry HTTP API",
            "version": __version__,
            "description": (
                "Publishing (Hermes-compatible) and topic management. 202 Accepted means the "
                "message is on disk and fsynced in Ferry's buffer and will be delivered; 201 "
                "Created means Kafka also acknowledged it within the topic's ack_timeout_ms."),
        },
        "paths": {
            "/topics/{topic}": {
                "parameters": [_TOPIC_PARAM],
                "post": {
                    "operationId": "publish",
                    "summary": "Publish one message (the body)",
                    "parameters": _PUBLISH_HEADERS,
                    "requestBody": {"required": False, "content": {
                        "application/json": {"schema": {}},
                        "avro/binary": {"schema": {"type": "string", "format": "binary"}},
                        "application/octet-stream": {
                            "schema": {"type": "string", "format": "binary"}},
                    }},
                    "responses": {
                        "201": _published("Stored durably and acknowledged by Kafka"),
                        "202": _published("Stored durably (fsynced); Kafka has not "
                                          "acknowledged it yet"),
                        **_PUBLISH_ERRORS,
                    },
                },
                "get": {
                    "operationId": "getTopic", "summary": "One topic's definition",
                    **management,
                    "responses": {"200": {"description": "The topic", "content": {
                        "application/json": {"schema": _ref("Topic")}}},
                        **auth_errors, "404": _error("Not a defined topic")},
                },
                "put": {
                    "operationId": "putTopic",
                    "summary": "Change the given settings, or define the topic",
                    **management,
                    "requestBody": json_body,
                    "responses": {
                        "200": {"description": "Changed", "content": {
                            "application/json": {"schema": _ref("Topic")}}},
                        "201": {"description": "Defined", "content": {
                            "application/json": {"schema": _ref("Topic")}}},
                        "400": {"$ref": _RESP + "BadRequest"},
                        **auth_errors,
                        "408": _error("The body did not arrive in time"),
                        "409": _error("Defined in the configuration file: read-only"),
                        "413": _error("Body too large"),
                        "415": _error("Not JSON"),
                    },
                },
                "delete": {
                    "operationId": "deleteTopic",
                    "summary": "Forget the topic; its buffered messages are discarded",
                    **management,
                    "responses": {
                        "200": {"description": "Deleted", "content": {"application/json": {
                            "schema": _ref("Deleted")}}},
                        **auth_errors,
                        "400": {"$ref": _RESP + "BadRequest"},
                        "404": _error("Not a defined topic"),
                        "409": _error("Defined in the configuration file: read-only"),
                    },
                },
            },
            "/topics/{topic}/batch": {
                "parameters": [_TOPIC_PARAM],
                "post": {
                    "operationId": "publishBatch",
                    "summary": "Publish many messages in one transaction, all or nothing",
                    "parameters": _PUBLISH_HEADERS,
                    "requestBody": {"required": True, "content": {
                        "application/x-ndjson": {"schema": {"type": "string",
                                                            "pattern": "\\S"}},
                        "application/json": {"schema": {"type": "array", "items": {},
                                                        "minItems": 1}},
                    }},
                    "responses": {
                        "201": _batch_published("Stored durably and acknowledged by Kafka"),
                        "202": _batch_published("Stored durably (fsynced)"),
                        **_PUBLISH_ERRORS,
                    },
                },
            },
            "/topics": {
                "get": {
                    "operationId": "listTopics", "summary": "Every defined topic",
                    **management,
                    "responses": {"200": {"description": "Topics", "content": {
                        "application/json": {"schema": _ref("TopicList")}}}, **auth_errors},
                },
                "post": {
                    "operationId": "createTopic", "summary": "Define a topic",
                    **management,
                    "requestBody": {"required": True, "content": {
                        "application/json": {"schema": create_schema}}},
                    "responses": {
                        "201": {"description": "Defined", "content": {
                            "application/json": {"schema": _ref("Topic")}}},
                        "400": {"$ref": _RESP + "BadRequest"},
                        **auth_errors,
                        "408": _error("The body did not arrive in time"),
                        "409": _error("Already defined, or defined in the configuration file"),
                        "413": _error("Body too large"),
                        "415": _error("Not JSON"),
                    },
                },
            },
            "/status/ping": {"get": {
                "operationId": "ping", "summary": "Liveness: always pong",
                "responses": {"200": {"description": "pong", "content": {
                    "text/plain": {"schema": {"type": "string", "enum": ["pong"]}}}}},
            }},
            "/status/health": {"get": {
                "operationId": "health", "summary": "The process is up and serving",
                "responses": {"200": {"description": "Healthy", "content": {
                    "application/json": {"schema": _ref("Health")}}}},
            }},
            "/status/ready": {"get": {
                "operationId": "ready",
                "summary": "Ready to take messages (not while starting, stopping or full)",
                "responses": {
                    "200": {"description": "Ready", "content": {
                        "application/json": {"schema": _ref("Ready")}}},
                    "503": {"description": "Not ready",
                            "headers": {"Retry-After": {
                                "$ref": "#/components/headers/Retry-After"}},
                            "content": {"application/json": {"schema": _ref("Ready")}}},
                },
            }},
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "This document",
                "responses": {"200": {"description": "OpenAPI 3.0", "content": {
                    "application/json": {"schema": {"type": "object"}}}}},
            }},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "headers": {"Retry-After": {"description": "Seconds to wait before retrying",
                                        "schema": {"type": "integer", "minimum": 1}}},
            "responses": {
                "BadRequest": _error("Invalid body, header or settings; the message says why"),
                "Unavailable": _error("Starting, shutting down, buffer full or disk trouble; "
                                      "nothing was stored", retry_after=True),
            },
            "schemas": {
                "Error": {"type": "object", "required": ["error", "code", "message"],
                          "properties": {"error": {"type": "string"},
                                         "code": {"type": "string"},
                                         "message": {"type": "string"}}},
                "Published": {"type": "object", "required": ["id", "delivered"], "properties": {
                    "id": {"type": "string", "pattern": "^[0-9a-f]{24}$"},
                    "delivered": {"type": "boolean"}}},
                "BatchPublished": {
                    "type": "object", "required": ["ids", "count", "delivered"], "properties": {
                        "ids": {"type": "array", "items": {
                            "type": "string", "pattern": "^[0-9a-f]{24}$"}},
                        "count": {"type": "integer", "minimum": 1},
                        "delivered": {"type": "boolean"}}},
                "Topic": topic_schema,
                "TopicList": {"type": "object", "required": ["topics"], "properties": {
                    "topics": {"type": "array", "items": _ref("Topic")}}},
                "Deleted": {"type": "object", "required": ["name", "deleted", "generation"],
                            "properties": {"name": {"type": "string"},
                                           "deleted": {"type": "boolean"},
                                           "generation": {"type": "integer"}}},
                "Health": {"type": "object", "required": ["status", "phase"], "properties": {
                    "status": {"type": "string", "enum": ["ok"]},
                    "phase": {"type": "string", "enum": ["starting", "running", "stopping"]}}},
                "Ready": {"type": "object", "required": ["ready", "reason"], "properties": {
                    "ready": {"type": "boolean"}, "reason": {"type": "string"},
                    "error": {"type": "string"}, "message": {"type": "string"}}},
            },
        },
    }


def openapi_document() -> dict[str, Any]:
    """A fresh copy of the document (callers may add to it)."""
    return copy.deepcopy(_document())
