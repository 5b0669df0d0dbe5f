"""The status routes on the HTTP listener: HTML page, JSON documents, /metrics, tracking.

``routes(runtime)`` is what the daemon hands to ``create_app``. Every number comes from one
``registry.view()`` per request (the registry already merges the forwarder process); only
message tracking reads the buffer, because outcomes of single messages live there.

==========================  =====================================================
``GET /``                   the status page (self-contained HTML, JS and CSS)
``GET /status/static/X``    page.js, page.css
``GET /status/all``         everything the page needs, in one document (``?history=1``
                            adds the server's 10-minute ring of points)
``GET /status/info``        version, host, uptime, phase (Bruce's server info)
``GET /status/counters``    every series of every metric, and headline totals
``GET /status/discards``    discards, rejects and delivery errors by reason, with samples
``GET /status/queues``      the buffer, overall and per topic
``GET /status/topics``      per topic: accepted, delivered, buffered, discarded, errors
``GET /status/clusters``    Kafka clusters: up, brokers, latency, failures
``GET /status/spool``       spool intake: files pending, ingested, quarantined
``GET /status/schema``      the JSON Schema of all of the above (status/schema.json)
``GET /metrics``            Prometheus text format
``GET /messages/{id}``      where a recent message is: buffered, delivered or discarded
==========================  =====================================================

Every JSON answer accepts ``?pretty=1``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from agent import __version__
from agent.buffer import keys
from agent.ingest.runtime import Runtime
from status import model
from status.history import DEFAULT_INTERVAL, DEFAULT_KEEP, History, Sampler
from status.prometheus import Exporter, FerryCollector
from status.schema import schema

log = logging.getLogger(__name__)

STATIC = {
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
}

# The page may talk to this origin only: no CDN, no fonts, no beacons, no framing.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_NO_STORE = {"Cache-Control": "no-store"}


def _resource(name: str) -> bytes:
    return (resources.files("status") / name).read_bytes()


def json_response(doc: Any, status: int = 200, *, pretty: bool = False) -> Response:
    # allow_nan=False: a NaN would make the answer invalid JSON; better a 500 that says so.
    body = json.dumps(doc, allow_nan=False, ensure_ascii=False,
                      indent=2 if pretty else None,
                      separators=None if pretty else (",", ":"))
    return Response(body.encode("utf-8"), status, media_type="application/json",
                    headers=_NO_STORE)


def _error(status: int, error: str, message: str, **extra: Any) -> Response:
    # The listener's one error shape (agent/ingest/http/errors.py): ``code`` is what Hermes
    # clients read, ``error`` the same word under Ferry's older name.
    return json_response({"error": error, "code": error, "message": message, **extra}, status)


def _pretty(request: Request) -> bool:
    return request.query_params.get("pretty", "") not in ("", "0", "false")


Endpoint = Callable[[Request], Response]


def _guarded(endpoint: Endpoint) -> Endpoint:
    """Whatever goes wrong inside, the answer is still JSON (and the cause is logged)."""

    @functools.wraps(endpoint)
    def run(request: Request) -> Response:
        try:
            return endpoint(request)
        except Exception as exc:  # noqa: BLE001 - report, never crash the listener
            log.exception("status endpoint %s failed", request.url.path)
            return _error(500, "internal", f"status could not be computed: {exc}")

    return run


class StatusService:
    """The status routes of one agent, with their history sampler."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        history_interval: float = DEFAULT_INTERVAL,
        history_keep: int = DEFAULT_KEEP,
        thresholds: model.Thresholds | None = None,
    ) -> None:
        self.runtime = runtime
        self.registry = runtime.registry
        self.thresholds = thresholds or model.Thresholds()
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.history = History(history_keep)
        self.sampler = Sampler(self.history, self._point, history_interval)
        self.exporter = Exporter(FerryCollector(self.registry, version=__version__,
                                                started_at=runtime.started_at))
        self._page = _resource("static/page.html")
        self._static = {name: _resource(f"static/{name}") for name in STATIC}

    def start(self) -> StatusService:
        self.sampler.start()
        return self

    def stop(self) -> None:
        self.sampler.stop()

    # -- documents -------------------------------------------------------------------------
    def context(self) -> model.Context:
        rt = self.runtime
        cfg = rt.config
        ready, reason = rt.ready()
        clusters = {"local": cfg.kafka.local.bootstrap_servers}
        if cfg.kafka.remote is not None:
            clusters["remote"] = cfg.kafka.remote.bootstrap_servers
        return model.Context(
            version=__version__,
            hostname=self.hostname,
            pid=self.pid,
            started_at=rt.started_at,
            now=time.time(),
            phase=rt.phase.value,
            ready=ready,
            ready_reason=reason,
            clusters=clusters,
            max_bytes=cfg.buffer.max_bytes,
            track_messages=cfg.status.track_messages,
            track_seconds=cfg.status.track_seconds,
        )

    def _point(self) -> dict[str, Any]:
        return model.point(self.registry.view(), time.time())

    def everything(self, include_history: bool = False) -> dict[str, Any]:
        return model.everything(self.registry.view(), self.context(), self.history.points(),
                                self.thresholds, include_history=include_history)

    # -- routes ----------------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        def doc(build: Callable[[Any, model.Context], dict[str, Any]]) -> Endpoint:
            def endpoint(request: Request) -> Response:
                return json_response(build(self.registry.view(), self.context()),
                                     pretty=_pretty(request))
            return _guarded(endpoint)

        return [
            Route("/", self._page_endpoint, methods=["GET"], name="status_page"),
            Route("/status/static/{name}", self._static_endpoint, methods=["GET"],
                  name="status_static"),
            Route("/status/all", _guarded(self._all_endpoint), methods=["GET"],
                  name="status_all"),
            Route("/status/info", doc(model.info), methods=["GET"], name="status_info"),
            Route("/status/counters", doc(model.counters), methods=["GET"],
                  name="status_counters"),
            Route("/status/discards", doc(model.discards), methods=["GET"],
                  name="status_discards"),
            Route("/status/queues", doc(model.queues), methods=["GET"], name="status_queues"),
            Route("/status/topics", doc(model.topics), methods=["GET"], name="status_topics"),
            Route("/status/clusters", doc(model.clusters), methods=["GET"],
                  name="status_clusters"),
            Route("/status/spool", doc(model.spool), methods=["GET"], name="status_spool"),
            Route("/status/transactions", doc(model.transactions), methods=["GET"],
                  name="status_transactions"),
            Route("/status/schema", self._schema_endpoint, methods=["GET"],
                  name="status_schema"),
            Route("/metrics", self._metrics_endpoint, methods=["GET"], name="metrics"),
            Route("/messages/{id}", _guarded(self._message_endpoint), methods=["GET"],
                  name="message_tracking"),
        ]

    def _page_endpoint(self, request: Request) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8", headers={
            "Content-Security-Policy": PAGE_CSP,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
        })

    def _static_endpoint(self, request: Request) -> Response:
        name = request.path_params["name"]
        body = self._static.get(name)
        if body is None:
            return _error(404, "not_found", f"no static file {name!r}")
        return Response(body, media_type=STATIC[name], headers={
            "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})

    def _all_endpoint(self, request: Request) -> Response:
        with_history = request.query_params.get("history", "") not in ("", "0", "false")
        return json_response(self.everything(with_history), pretty=_pretty(request))

    def _schema_endpoint(self, request: Request) -> Response:
        return json_response(schema(), pretty=_pretty(request))

    def _metrics_endpoint(self, request: Request) -> Response:
        body, content_type = self.exporter.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type, **_NO_STORE})

    def _message_endpoint(self, request: Request) -> Response:
        text = request.path_params["id"]
        message_id = keys.parse_id_text(text.lower())
        if message_id is None:
            return _error(400, "malformed_id",
                          f"{text[:64]!r} is not a message id: ids are "
                          f"{keys.ID_LEN * 2} hexadecimal digits (the Ferry-Message-Id)")
        ctx = self.context()
        found = self.runtime.store.locate(message_id)
        if found is None:
            why = (f"outcomes are kept for {ctx.track_seconds} s" if ctx.track_messages
                   else "message tracking is off (status.track_messages)")
            return _error(404, "not_found",
                          f"no buffered or recent message with this id; {why}",
                          id=message_id.hex(), state="unknown")
        doc = {str(k): model.jsonable(v) for k, v in found.items()}
        doc["id"] = message_id.hex()
        doc["accepted_ms"] = keys.id_timestamp_ms(message_id)
        return json_response(doc, pretty=_pretty(request))


def routes(runtime: Runtime) -> list[BaseRoute]:
    """The status routes for the agent's HTTP listener; starts the history sampler.

    The sampler is a daemon thread that only reads the registry; it ends with the process
    (use ``StatusService`` directly to stop it earlier).
    """
    return StatusService(runtime).start().routes()
