"""Topic management (Hermes management API, CDAP topic lifecycle): ``/topics[/{name}]``.

=============================  ==========================================================
``GET /topics``                every defined topic (config file and API), with settings
``POST /topics``               define a topic: ``{"name": ..., <settings>}`` -> 201
``GET /topics/{name}``         one topic
``PUT /topics/{name}``         change the given settings (Hermes style), or define the topic
                               when it does not exist yet (201)
``DELETE /topics/{name}``      forget it; its buffered messages are discarded (generation)
=============================  ==========================================================

Settings are those of ``[topics.X]`` in the config file (acks, content_type, schema,
max_message_bytes, ttl_seconds, rate_limit, ack_timeout_ms, fallback_to_remote, ...);
those not given take ``[topics.default]``'s. Topics of the config file are read-only here.
Calls that change topics need the management token and must not come from another site;
reading is open on loopback (auth.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from agent import reasons
from agent.config import TopicConfig
from agent.ingest.http import auth
from agent.ingest.http.codecs import BodyError, check_topic, is_json, media_type, parse_json
from agent.ingest.http.errors import Refusal, error_body
from agent.ingest.runtime import Runtime
from agent.topics import (
    InvalidTopicName,
    TopicCatalog,
    TopicEntry,
    TopicExists,
    TopicNotFound,
    TopicReadOnly,
)

MAX_BODY_BYTES = 1024 * 1024
# What a topic's settings object may hold (the config file's names; "schema" for schema_).
SETTINGS_FIELDS = tuple(
    (f.alias or name) for name, f in TopicConfig.model_fields.items()
)


class ApiError(Refusal):
    def response(self) -> Response:
        return json_error(self.status, self.error, self.message, self.headers)


def json_error(status: int, error: str, message: str,
               headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(error, message), status_code=status,
                    media_type="application/json", headers=headers)


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    return Response(json.dumps(doc, ensure_ascii=False).encode(), status_code=status,
                    media_type="application/json", headers=headers)


def topic_doc(entry: TopicEntry) -> dict[str, Any]:
    return {"name": entry.name, "origin": entry.origin, "read_only": entry.read_only,
            **entry.settings.model_dump(by_alias=True)}


class TopicsApi:
    def __init__(self, runtime: Runtime, catalog: TopicCatalog) -> None:
        self.catalog = catalog
        self.token = auth.management_token(runtime.config.http)
        self.body_timeout = runtime.config.http.body_timeout_seconds

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/topics", self._guard(self.collection), methods=["GET", "POST"],
                  name="topics"),
            Route("/topics/{name}", self._guard(self.item), methods=["GET", "PUT", "DELETE"],
                  name="topic"),
        ]

    def _guard(self, endpoint: Any) -> Any:
        async def guarded(request: Request) -> Response:
            try:
                self._authorize(request)
                result: Response = await endpoint(request)
                return result
            except ApiError as exc:
                return exc.response()

        return guarded

    def _authorize(self, request: Request) -> None:
        client = request.client.host if request.client is not None else None
        try:
            auth.check(request.method, dict(request.headers), client, self.token)
        except auth.Refused as exc:
            raise ApiError(exc.status, exc.error, exc.message, exc.headers) from None

    # -- endpoints -------------------------------------------------------------------------
    async def collection(self, request: Request) -> Response:
        if request.method == "GET":
            return json_response({"topics": [topic_doc(e) for e in self.catalog.entries()]})
        body = await self._body(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise ApiError(400, reasons.INVALID_BODY, 'the topic needs a "name" (a string)')
        settings = self._settings(body, self.catalog.default)
        try:
            entry = await run_in_threadpool(self.catalog.create, name, settings)
        except InvalidTopicName as exc:
            raise ApiError(400, reasons.INVALID_TOPIC, str(exc)) from None
        except TopicExists as exc:
            raise ApiError(409, "topic_exists", str(exc)) from None
        except TopicReadOnly as exc:
            raise ApiError(409, "read_only", str(exc)) from None
        return json_response(topic_doc(entry), 201, {"Location": f"/topics/{name}"})

    async def item(self, request: Request) -> Response:
        name: str = request.path_params["name"]
        if request.method == "GET":
            entry = self.catalog.entry(name)
            if entry is None:
                raise ApiError(404, reasons.UNKNOWN_TOPIC, f"topic {name!r} is not defined")
            return json_response(topic_doc(entry))
        if request.method == "DELETE":
            try:
                generation = await run_in_threadpool(self.catalog.delete, name)
            except InvalidTopicName as exc:
                raise ApiError(400, reasons.INVALID_TOPIC, str(exc)) from None
            except TopicNotFound as exc:
                raise ApiError(404, reasons.UNKNOWN_TOPIC, str(exc)) from None
            except TopicReadOnly as exc:
                raise ApiError(409, "read_only", str(exc)) from None
            return json_response({"name": name, "deleted": True, "generation": generation})
        # PUT
        body = await self._body(request)
        if "name" in body and body["name"] != name:
            raise ApiError(400, reasons.INVALID_BODY,
                           f'"name" in the body ({body["name"]!r}) is not the topic of the '
                           f"path ({name!r}); topics cannot be renamed")
        current = self.catalog.entry(name)
        base = current.settings if current is not None else self.catalog.default
        settings = self._settings(body, base)
        try:
            defined, created = await run_in_threadpool(self.catalog.put, name, settings)
        except InvalidTopicName as exc:
            raise ApiError(400, reasons.INVALID_TOPIC, str(exc)) from None
        except TopicReadOnly as exc:
            raise ApiError(409, "read_only", str(exc)) from None
        if created:
            return json_response(topic_doc(defined), 201, {"Location": f"/topics/{name}"})
        return json_response(topic_doc(defined))

    # -- input -----------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict[str, Any]:
        media = media_type(request.headers.get("content-type", "").encode("latin-1"))
        if media is not None and not is_json(media):
            raise ApiError(415, reasons.UNSUPPORTED_MEDIA_TYPE,
                           f"send the topic as JSON (Content-Type: application/json), not {media}")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        raise ApiError(413, reasons.TOO_LARGE,
                                       f"a topic definition is at most {MAX_BODY_BYTES} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, reasons.REQUEST_TIMEOUT,
                           f"the body did not arrive within {self.body_timeout:g} s") from None
        try:
            doc = parse_json(b"".join(chunks))
        except BodyError as exc:
            raise ApiError(400, reasons.INVALID_BODY, str(exc)) from None
        if not isinstance(doc, dict):
            raise ApiError(400, reasons.INVALID_BODY, "the body is a JSON object of topic settings")
        return doc

    def _settings(self, body: dict[str, Any], base: TopicConfig) -> TopicConfig:
        data = base.model_dump(by_alias=True)
        for key, value in body.items():
            if key in ("name", "origin", "read_only"):
                continue  # naming the topic, or echoing what GET returned
            if key not in SETTINGS_FIELDS:
                raise ApiError(400, "invalid_settings",
                               f"unknown topic setting {key!r}; settings are "
                               f"{', '.join(SETTINGS_FIELDS)}")
            data[key] = value
        schema = data.get("schema")
        if isinstance(schema, dict | list):
            data["schema"] = json.dumps(schema)
        try:
            settings = TopicConfig.model_validate(data, strict=True)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
                for e in exc.errors())
            raise ApiError(400, "invalid_settings", problems) from None
        try:
            check_topic(settings)
        except ValueError as exc:
            raise ApiError(400, "invalid_settings", f"schema: {exc}") from None
        return settings
