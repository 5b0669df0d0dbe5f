"""The HTTP listener's one ASGI app: a raw fast path for publishing, Starlette for the rest.

Publishing is the only high-rate route: Ferry's own server hands it to
``Publisher.publish`` (protocol.py), and for any other ASGI server ``POST /topics/{topic}`` and
``POST /topics/{topic}/batch`` are matched by hand here and go to ``Publisher``'s ASGI adapter,
which reads the body and publishes it the same way;
everything else (topic management, ``/status/ping|health|ready``, ``/openapi.json`` and the
status engineer's ``extra_routes``) goes to a Starlette app, where convenience matters more
than microseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent import reasons
from agent.ingest.http.codecs import check_topic
from agent.ingest.http.management import TopicsApi, json_error, json_response
from agent.ingest.http.openapi import openapi_document
from agent.ingest.http.publish import Publisher
from agent.ingest.http.ratelimit import retry_after_header
from agent.ingest.http.routing import publish_target
from agent.ingest.runtime import Phase, Runtime
from agent.metrics import Registry
from agent.topics import TopicCatalog

log = logging.getLogger(__name__)



class FerryApp:
    """``create_app()``'s result: an ASGI app, plus hooks for the server's shutdown."""

    def __init__(self, runtime: Runtime, extra_routes: Sequence[BaseRoute] = ()) -> None:
        self.runtime = runtime
        _check_config_topics(runtime)
        self.catalog = TopicCatalog(runtime.config, runtime.store)
        self.publisher = Publisher(runtime, self.catalog)
        self.topics_api = TopicsApi(runtime, self.catalog)
        routes: list[BaseRoute] = [
            Route("/status/ping", self._ping, methods=["GET"], name="ping"),
            Route("/status/health", self._health, methods=["GET"], name="health"),
            Route("/status/ready", self._ready, methods=["GET"], name="ready"),
            Route("/openapi.json", self._openapi, methods=["GET"], name="openapi"),
            *self.topics_api.routes(),
            *extra_routes,
        ]
        framework = Starlette(routes=routes, exception_handlers={
            HTTPException: _http_exception,
            Exception: _internal_error,
        })
        framework.router.redirect_slashes = False
        self.framework: ASGIApp = _Counted(framework, runtime.registry, routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = publish_target(scope["path"])
            raw = scope.get("raw_path")
            if (target is not None and isinstance(raw, bytes)
                    and publish_target(raw.decode("latin-1")) is None):
                # "/topics/t/%62atch": the route's own segments are matched as sent, as the
                # server's protocol matches them (issue #37); only the topic is decoded.
                # Otherwise the same request was a plain publish there and a batch here.
                answer = json_error(404, "not_found", f"no such resource: {scope['path']} "
                                    "(spell /batch as is, not percent-encoded)")
                await answer(scope, receive, send)
                return
            if target is not None:
                await self.publisher(scope, receive, send, *target)
                return
        await self.framework(scope, receive, send)

    def in_flight(self) -> int:
        """Work the server must wait for at shutdown besides its connections and tasks."""
        return self.publisher.in_flight

    def drain(self) -> None:
        """Shutdown began: stop holding requests for Kafka acknowledgements."""
        self.publisher.release_waits()

    def close(self) -> None:
        self.publisher.close()

    # -- status probes ---------------------------------------------------------------------
    async def _ping(self, request: Request) -> Response:
        return PlainTextResponse("pong")

    async def _health(self, request: Request) -> Response:
        return json_response({"status": "ok", "phase": self.runtime.phase.value,
                              "clusters": self._clusters()})

    async def _ready(self, request: Request) -> Response:
        ready, reason = self.runtime.ready()
        if ready:
            return json_response({"ready": True, "reason": reason, "clusters": self._clusters()})
        retry = 1.0 if self.runtime.phase is Phase.STARTING else 5.0
        return json_response(
            {"ready": False, "reason": reason, "error": "not_ready", "code": "not_ready",
             "message": _NOT_READY.get(reason, reason), "clusters": self._clusters()},
            503, {"Retry-After": retry_after_header(retry).decode()})

    def _clusters(self) -> dict[str, dict[str, Any]]:
        """Each cluster's state (unknown, up, down) and why: the forwarder's one verdict
        (agent/forwarder/health.py), as the page and `ferry status` read it. Only shown
        here: a Kafka outage does not make Ferry unready or unhealthy, as buffering through
        it is Ferry's job (docs/status.md)."""
        states = self.runtime.registry.view().info.get("cluster_state")
        if not isinstance(states, dict):
            return {}
        return {name: {"state": st.get("state", "unknown"), "reason": st.get("reason") or None}
                for name, st in sorted(states.items()) if isinstance(st, dict)}

    async def _openapi(self, request: Request) -> Response:
        return json_response(openapi_document())


# By Runtime.ready()'s reason: the phase, or the word the buffer refuses input with.
_NOT_READY = {
    Phase.STARTING.value: "Ferry is starting",
    Phase.STOPPING.value: "Ferry is shutting down",
    reasons.BUFFER_FULL: "Ferry's buffer is full; new messages are refused until it drains",
    reasons.DISK_FULL: "the filesystem of Ferry's buffer is full; new messages are refused "
                       "until the buffer drains or the disk frees up",
    reasons.DISK_ERROR: "the disk of Ferry's buffer refused a write; new messages are refused "
                        "until a write succeeds",
}


def create_app(runtime: Runtime, extra_routes: Sequence[BaseRoute] = ()) -> FerryApp:
    """The ASGI app of the HTTP listener (publishing, management, status, extra routes)."""
    return FerryApp(runtime, extra_routes)


def _check_config_topics(runtime: Runtime) -> None:
    problems = []
    for name, settings in runtime.config.topics.items():
        try:
            check_topic(settings)
        except ValueError as exc:
            problems.append(f"topics.{name}: {exc}")
    if problems:
        raise ValueError("unusable topic settings in the configuration: " + "; ".join(problems))


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    headers = dict(exc.headers or {})
    path = request.url.path
    if publish_target(path) is not None:
        # POST is served before Starlette's router (the publish path), so the router does
        # not know it; it belongs in Allow all the same.
        allow = [m.strip() for m in headers.get("Allow", "").split(",") if m.strip()]
        headers["Allow"] = ", ".join(["POST", *allow])
        status = 405
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = {404: f"no such resource: {path}",
               405: f"{request.method} is not allowed on {path}"}
    return json_error(status, codes.get(status, "http_error"),
                      message.get(status, str(exc.detail)), headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return json_error(500, "internal_error", "Ferry failed to handle this request; the error "
                      "is in Ferry's log.")


class _Counted:
    """Counts Starlette's answers as http_requests{route, status} (route: its path template)."""

    def __init__(self, app: ASGIApp, registry: Registry, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.registry = registry
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.registry.inc("http_requests", route=self._route(scope), status=str(status))

    def _route(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return str(getattr(route, "path", "other"))
        return "other"
