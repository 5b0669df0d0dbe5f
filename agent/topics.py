"""Topic definitions: the config file's (read-only) and the management API's.

API-managed topics live in the buffer's ``state`` database, one key per topic
(``topic:<name>`` -> the settings as JSON), beside the messages, so they survive restarts and
every process that opens the buffer sees them: the forwarder process reads acks, TTL and
fallback of API-managed topics through its own ``TopicCatalog``.

Each change also writes a new random ``topics-version``. Readers keep the definitions in memory
and look at that one key at most every ``refresh_seconds``; only when it changed do they
re-read the definitions. The publish path therefore costs a dict lookup, and a change made
through another process's catalog is seen within ``refresh_seconds``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from agent.buffer.store import Store
from agent.config import FerryConfig, TopicConfig
from ferry_client.topic_names import illegal_topic, is_legal_topic

log = logging.getLogger(__name__)

TOPIC_PREFIX = b"topic:"
VERSION_KEY = b"topics-version"
REFRESH_SECONDS = 0.5
# The config section that is the template for other topics, not a topic of its own.
DEFAULT_SECTION = "default"

Origin = Literal["config", "api", "auto"]

# Clients publish to a handful of names millions of times: remember the verdict of the regex.
valid_topic = functools.lru_cache(maxsize=4096)(is_legal_topic)


@dataclass(frozen=True, slots=True)
class TopicEntry:
    name: str
    settings: TopicConfig
    origin: Origin

    @property
    def read_only(self) -> bool:
        return self.origin == "config"


class TopicError(Exception):
    """A management operation that cannot be done; the message says why."""


class TopicExists(TopicError):
    pass


class TopicNotFound(TopicError):
    pass


class TopicReadOnly(TopicError):
    pass


class InvalidTopicName(TopicError):
    pass


class TopicCatalog:
    """Every topic's settings, from any process that has the buffer open. Thread-safe."""

    def __init__(
        self,
        config: FerryConfig,
        store: Store,
        *,
        refresh_seconds: float = REFRESH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._config_topics = {n: t for n, t in config.topics.items() if n != DEFAULT_SECTION}
        self._default = config.topics[DEFAULT_SECTION]
        self.auto_create = config.http.auto_create_topics
        self._api: dict[str, TopicConfig] = {}
        self._version: bytes | None = None
        self._checked = float("-inf")
        self._lock = threading.RLock()

    @property
    def default(self) -> TopicConfig:
        """``[topics.default]``: the settings of topics nobody defined."""
        return self._default

    # -- reading -----------------------------------------------------------------------------
    def resolve(self, name: str) -> TopicConfig | None:
        """Settings to publish to ``name`` with, or None when it is not a topic here.

        Defined topics (config file, then API) first; any other legal name gets
        ``[topics.default]`` when ``http.auto_create_topics`` is on.
        """
        settings = self._config_topics.get(name)
        if settings is not None:
            return settings
        settings = self._current().get(name)
        if settings is not None:
            return settings
        if self.auto_create and valid_topic(name):
            return self._default
        return None

    def settings(self, name: str) -> TopicConfig:
        """What applies to buffered messages of ``name`` (the forwarder's question)."""
        return self.resolve(name) or self._default

    def entry(self, name: str) -> TopicEntry | None:
        """A defined topic (config file or API), or None."""
        settings = self._config_topics.get(name)
        if settings is not None:
            return TopicEntry(name, settings, "config")
        settings = self._current().get(name)
        if settings is not None:
            return TopicEntry(name, settings, "api")
        return None

    def entries(self) -> list[TopicEntry]:
        """Every defined topic, by name."""
        out = [TopicEntry(n, s, "config") for n, s in self._config_topics.items()]
        out += [TopicEntry(n, s, "api") for n, s in self._current().items()
                if n not in self._config_topics]
        return sorted(out, key=lambda e: e.name)

    def _current(self) -> dict[str, TopicConfig]:
        now = self._clock()
        if now - self._checked < self.refresh_seconds:
            return self._api
        with self._lock:
            if now - self._checked >= self.refresh_seconds:
                self._reload()
                self._checked = now
            return self._api

    def _reload(self) -> None:
        version = self.store.get_state(VERSION_KEY) or b""
        if version == self._version:
            return
        api: dict[str, TopicConfig] = {}
        for key, raw in self.store.state_items(TOPIC_PREFIX):
            name = key[len(TOPIC_PREFIX):].decode("ascii", "replace")
            try:
                api[name] = TopicConfig.model_validate_json(raw)
            except ValidationError as exc:
                # Written by an incompatible version; the topic falls back to the defaults.
                log.error("ignoring the stored definition of topic %r: %s", name, exc)
        self._api = api
        self._version = version

    def invalidate(self) -> None:
        """Look at the stored definitions again on the next read."""
        with self._lock:
            self._checked = float("-inf")

    # -- management --------------------------------------------------------------------------
    def create(self, name: str, settings: TopicConfig) -> TopicEntry:
        """Define a new topic; TopicExists when it is already defined."""
        with self._lock:
            self._writable(name)
            if name in self._fresh():
                raise TopicExists(f"topic {name!r} already exists")
            self._write(name, settings)
            return TopicEntry(name, settings, "api")

    def put(self, name: str, settings: TopicConfig) -> tuple[TopicEntry, bool]:
        """Define or redefine ``name``; True when it was created."""
        with self._lock:
            self._writable(name)
            created = name not in self._fresh()
            self._write(name, settings)
            return TopicEntry(name, settings, "api"), created

    def delete(self, name: str) -> int:
        """Forget ``name`` and start a new generation of it; returns the generation.

        Messages of the old generation still in the buffer are discarded by the forwarder
        (counted and logged), never sent.
        """
        with self._lock:
            self._writable(name)
            if name not in self._fresh():
                raise TopicNotFound(f"topic {name!r} is not defined")
            # Generation first: a crash between the two leaves the topic defined with its old
            # messages dropped (the delete was asked for), never deleted with them still sent.
            generation = self.store.bump_generation(name)
            version = _new_version()
            self.store.update_state({VERSION_KEY: version}, deletes=[TOPIC_PREFIX + _ascii(name)])
            api = dict(self._api)
            api.pop(name, None)
            self._api, self._version = api, version
            return generation

    def _writable(self, name: str) -> None:
        if not is_legal_topic(name):
            raise InvalidTopicName(illegal_topic(name))
        if name == DEFAULT_SECTION or name in self._config_topics:
            raise TopicReadOnly(
                f"topic {name!r} is defined in the configuration file and cannot be changed "
                "through the API")

    def _fresh(self) -> dict[str, TopicConfig]:
        self._reload()
        self._checked = self._clock()
        return self._api

    def _write(self, name: str, settings: TopicConfig) -> None:
        version = _new_version()
        doc = settings.model_dump_json(by_alias=True).encode()
        self.store.update_state({TOPIC_PREFIX + _ascii(name): doc, VERSION_KEY: version})
        self._api = {**self._api, name: settings}
        self._version = version


def settings_schema() -> dict[str, dict[str, Any]]:
    """Each topic setting as an OpenAPI 3.0 schema, generated from ``TopicConfig``: its
    types, choices and bounds are stated once, in the model (the API document used to
    restate them by hand)."""
    out: dict[str, dict[str, Any]] = {}
    for name, prop in TopicConfig.model_json_schema(by_alias=True)["properties"].items():
        prop = {k: v for k, v in prop.items() if k != "title"}
        variants = prop.pop("anyOf", None)
        if variants is not None:
            # JSON Schema's "X or null" is OpenAPI 3.0's nullable X.
            kept = [v for v in variants if v.get("type") != "null"]
            if len(kept) != 1:
                raise ValueError(f"topic setting {name}: cannot express {variants} in OpenAPI")
            prop.update(kept[0])
            prop["nullable"] = True
        out[name] = prop
    return out


def _new_version() -> bytes:
    return uuid.uuid4().hex.encode()


def _ascii(name: str) -> bytes:
    return name.encode("ascii")
