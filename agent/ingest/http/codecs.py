"""Request bodies to stored message values, per the topic's ``content_type``.

- ``binary``: any body, stored as sent.
- ``json``: the body must be one JSON value (RFC 8259: no NaN/Infinity); it is stored as
  sent. With a ``schema`` (a JSON Schema) the value must also validate against it.
- ``avro``: ``avro/binary`` bodies must decode with the topic's schema, exactly (no trailing
  bytes) and are stored as sent; ``application/json`` bodies are plain JSON (unions written
  as the bare value, bytes/fixed as strings of code points 0-255, missing fields take their
  defaults) converted to Avro binary with fastavro.

Batches (``/batch``) are NDJSON or one JSON array; each message is one JSON value: for json
topics its JSON text, for avro topics the value converted to Avro binary, for binary topics a
JSON string's UTF-8 bytes or any other value's JSON text (NDJSON lines of a binary topic are
stored exactly as sent, without parsing).

Every refusal is ``BodyError`` (-> 400) or ``MediaTypeError`` (-> 415) with a message that
says what is wrong and where.
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import fastavro
import jsonschema
from jsonschema.exceptions import best_match
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

from agent.config import TopicConfig


class BodyError(Exception):
    """The body is not acceptable for the topic (400). ``count``: messages it held, as far
    as they are known (a batch that does not parse counts as one)."""

    count = 1


class TooManyMessages(Exception):
    """A batch of more messages than its limit (-> 413); found before the rest is read."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the batch holds more than {limit} messages "
                         "(http.max_batch_messages); split it")
        self.limit = limit


class MediaTypeError(Exception):
    """The body's Content-Type is not one the topic accepts (415)."""


class SchemaUnusable(Exception):
    """The topic's schema cannot judge this message (a reference below a nested ``$id`` that
    does not resolve): the topic's definition is at fault, not the message."""


JSON = "application/json"
AVRO_BINARY = "avro/binary"
_AVRO_BINARY_TYPES = frozenset({AVRO_BINARY, "application/avro", "avro/bytes"})
NDJSON_TYPES = frozenset({
    "application/x-ndjson", "application/ndjson", "application/jsonl",
    "application/x-jsonlines", "application/jsonlines",
})


@functools.lru_cache(maxsize=256)
def media_type(header: bytes | None) -> str | None:
    """The bare media type of a Content-Type header value, lower case; None when absent."""
    if not header:
        return None
    text = header.split(b";", 1)[0].strip().lower()
    return text.decode("latin-1") or None


def is_json(media: str) -> bool:
    return media == JSON or media.endswith("+json")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_json(data: bytes, what: str = "body") -> Any:
    # Strictly UTF-8 (RFC 8259 section 8.1): json.loads on bytes would also take UTF-16 or
    # UTF-32 and skip a byte order mark, and Kafka consumers would get bytes that are not
    # the JSON the topic promises. Decoded first, a BOM is refused by the parser.
    text = _utf8(data, what)
    try:
        return json.loads(text, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        # A few KB of "[[[[..." is enough to exhaust Python's stack in the decoder.
        raise BodyError(f"{what} is nested too deeply to be read as JSON") from None


def _not_unicode(where: str, exc: UnicodeEncodeError, count: int = 1) -> BodyError:
    # JSON's \uXXXX escapes can spell lone surrogates, which no UTF-8 text can hold.
    error = BodyError(f"{where} holds a string that is not valid Unicode ({exc.reason}: "
                      f"{exc.object[exc.start:exc.end]!r}); a \\uD800-\\uDFFF escape must "
                      "be half of a surrogate pair")
    error.count = count
    return error


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


# -- topic settings checks ---------------------------------------------------------------------
def check_topic(settings: TopicConfig) -> None:
    """Raise ValueError when a topic's content_type/schema cannot be used."""
    if settings.content_type == "avro":
        if not settings.schema_:
            raise ValueError("content_type 'avro' needs a schema: an Avro schema as JSON")
        _avro_schema(settings.schema_)
    elif settings.content_type == "json" and settings.schema_:
        _json_schema_validator(settings.schema_)


def _avro_schema(text: str) -> tuple[Any, dict[str, Any]]:
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the Avro schema is not JSON: {exc}") from None
    named: dict[str, Any] = {}
    try:
        parsed = fastavro.parse_schema(raw, named_schemas=named)
    except Exception as exc:  # noqa: BLE001 - fastavro raises many kinds for bad schemas
        raise ValueError(f"not a valid Avro schema: {exc}") from None
    return parsed, named


def _json_schema_validator(text: str) -> Any:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the JSON Schema is not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON Schema is an object (or true/false), not {_json_type(schema)}")
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
    _check_refs(schema)
    return cls(schema)


def _check_refs(schema: Any) -> None:
    """Refuse a schema whose ``$ref``s do not resolve: otherwise it is accepted here and every
    message that reaches the reference fails. Ferry fetches nothing over the network, so
    only references into the schema itself can resolve. References below a nested ``$id``
    (another base URI) are left to the validator."""
    dialect = schema.get("$schema", "") if isinstance(schema, dict) else ""
    spec = specification_with(dialect, default=DRAFT202012)
    resolver = Registry().resolver_with_root(spec.create_resource(schema))
    for ref in _refs(schema):
        try:
            resolver.lookup(ref)
        except Unresolvable as exc:
            raise ValueError(f"$ref {ref!r} does not resolve within the schema ({exc})"
                             ) from None


def _refs(node: Any) -> Iterator[str]:
    """The ``$ref`` strings of a schema, outside nested resources (``$id``) and values."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref
        for key, value in node.items():
            if key in ("enum", "const", "examples", "default"):
                continue  # instances, not schemas
            yield from _refs_below(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs_below(item)


def _refs_below(node: Any) -> Iterator[str]:
    if isinstance(node, dict) and "$id" in node:
        return  # a nested resource with its own base URI
    yield from _refs(node)


# -- codecs ------------------------------------------------------------------------------------
class TopicCodec:
    """Checks and converts the bodies of one topic (content type + schema)."""

    def __init__(self, settings: TopicConfig) -> None:
        self.content_type = settings.content_type
        self._avro: tuple[Any, dict[str, Any]] | None = None
        self._json_validator: Any = None
        if self.content_type == "avro":
            if not settings.schema_:
                raise ValueError("content_type 'avro' needs a schema")
            self._avro = _avro_schema(settings.schema_)
        elif self.content_type == "json" and settings.schema_:
            self._json_validator = _json_schema_validator(settings.schema_)

    # -- single messages -------------------------------------------------------------------
    def single(self, media: str | None, body: bytes) -> bytes:
        try:
            return self._single(media, body)
        except UnicodeEncodeError as exc:
            raise _not_unicode("the body", exc) from None

    def _single(self, media: str | None, body: bytes) -> bytes:
        if self.content_type == "binary":
            return body
        if self.content_type == "json":
            if media is not None and not is_json(media):
                raise MediaTypeError(
                    f"topic takes JSON: send Content-Type: {JSON}, not {media}")
            self._check_json(parse_json(body))
            return body
        # avro
        if media is None or media in _AVRO_BINARY_TYPES:
            self._check_avro_binary(body)
            return body
        if is_json(media):
            return self._to_avro(parse_json(body), "body")
        raise MediaTypeError(
            f"topic takes Avro: send Content-Type: {AVRO_BINARY} (Avro binary) or {JSON} "
            f"(converted with the topic's schema), not {media}")

    # -- batches ---------------------------------------------------------------------------
    def batch(self, media: str | None, body: bytes, max_messages: int = 1 << 62
              ) -> list[bytes]:
        """The messages of a batch; ``TooManyMessages`` as soon as there are more than
        ``max_messages``, before the rest is parsed or converted (#37 N6: a 4 MiB JSON
        array of 2.1 million messages cost 756 MiB and 20 s of the event loop)."""
        if media in NDJSON_TYPES:
            values = self._ndjson(body, max_messages)
        elif media is not None and is_json(media):
            values = self._array(body, max_messages)
        else:
            raise MediaTypeError(
                "a batch is NDJSON (Content-Type: application/x-ndjson, one message per line) "
                f"or a JSON array (Content-Type: {JSON}), not {media or 'unspecified'}")
        if not values:
            raise BodyError("the batch has no messages")
        return values

    def _ndjson(self, body: bytes, max_messages: int) -> list[bytes]:
        lines = _lines(body, max_messages)
        if self.content_type == "binary":
            return [line for _, line in lines]
        out: list[bytes] = []
        number = 0
        try:
            for number, line in lines:
                value = parse_json(line, f"line {number}")
                if self.content_type == "json":
                    self._check_json(value, f"line {number}")
                    out.append(line)
                else:
                    out.append(self._to_avro(value, f"line {number}"))
        except UnicodeEncodeError as exc:
            raise _not_unicode(f"line {number}", exc, len(lines)) from None
        except BodyError as exc:
            exc.count = len(lines)
            raise
        return out

    def _array(self, body: bytes, max_messages: int) -> list[bytes]:
        items = _array_items(body, max_messages)
        out: list[bytes] = []
        where = "the batch"
        try:
            for index, value in enumerate(items):
                where = f"message [{index}]"
                if self.content_type == "binary":
                    out.append(value.encode() if isinstance(value, str) else _compact(value))
                elif self.content_type == "json":
                    self._check_json(value, where)
                    out.append(_compact(value))
                else:
                    out.append(self._to_avro(value, where))
        except UnicodeEncodeError as exc:
            raise _not_unicode(where, exc, len(items)) from None
        except BodyError as exc:
            exc.count = len(items)
            raise
        return out

    # -- checks ----------------------------------------------------------------------------
    def _check_json(self, value: Any, where: str = "body") -> None:
        if self._json_validator is None:
            return
        try:
            error = best_match(self._json_validator.iter_errors(value))
        except Unresolvable as exc:
            raise SchemaUnusable(f"its JSON Schema has a $ref that does not resolve: {exc}"
                                 ) from None
        if error is not None:
            path = "".join(f"[{p!r}]" for p in error.absolute_path)
            raise BodyError(f"{where}{path} does not match the topic's JSON Schema: "
                            f"{error.message}")

    def _check_avro_binary(self, body: bytes) -> None:
        assert self._avro is not None
        stream = io.BytesIO(body)
        try:
            fastavro.schemaless_reader(stream, self._avro[0], None)
        except Exception as exc:  # noqa: BLE001 - any decode failure is a bad body
            raise BodyError(
                f"body is not Avro binary of the topic's schema: {type(exc).__name__}: {exc}"
            ) from None
        extra = len(body) - stream.tell()
        if extra:
            raise BodyError(f"body is Avro binary of the topic's schema followed by {extra} "
                            "more bytes")

    def _to_avro(self, value: Any, where: str) -> bytes:
        assert self._avro is not None
        parsed, named = self._avro
        datum = _Converter(named).convert(parsed, value, where)
        out = io.BytesIO()
        try:
            fastavro.schemaless_writer(out, parsed, datum)
        except Exception as exc:  # noqa: BLE001 - e.g. logical types fastavro cannot encode
            raise BodyError(f"{where} cannot be encoded with the topic's Avro schema: {exc}"
                            ) from None
        return out.getvalue()


class Codecs:
    """``TopicCodec`` per (content_type, schema), built once and reused."""

    def __init__(self, limit: int = 1024) -> None:
        self._cache: dict[tuple[str, str | None], TopicCodec] = {}
        self._limit = limit

    def get(self, settings: TopicConfig) -> TopicCodec:
        key = (settings.content_type, settings.schema_)
        codec = self._cache.get(key)
        if codec is None:
            if len(self._cache) >= self._limit:
                self._cache.clear()
            codec = self._cache[key] = TopicCodec(settings)
        return codec


# -- plain JSON -> Avro datum ------------------------------------------------------------------
_INT_RANGE = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


# Blank lines are skipped; a body is split a window at a time, so a body of nothing but
# newlines is never one list of millions of empty lines.
_LINES_WINDOW = 1024 * 1024


def _lines(body: bytes, max_messages: int) -> list[tuple[int, bytes]]:
    """The non-blank lines of an NDJSON body with their numbers; TooManyMessages past
    ``max_messages``."""
    out: list[tuple[int, bytes]] = []
    number = 0
    start = 0
    end = len(body)
    while start < end:
        stop = body.find(b"\n", min(start + _LINES_WINDOW, end))
        stop = end if stop < 0 else stop + 1
        for raw in body[start:stop].split(b"\n")[: None if stop == end else -1]:
            number += 1
            if line := raw.strip():
                out.append((number, line))
        if len(out) > max_messages:
            raise TooManyMessages(max_messages)
        start = stop
    return out


_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace (RFC 8259 §2)
_DECODER = json.JSONDecoder(parse_constant=_no_constants)
# Under this a JSON batch is parsed in one call (exactly json.loads' errors); over it, one
# element at a time, so the message limit stops it early.
_WHOLE_ARRAY_BYTES = 64 * 1024
_TYPES_BY_FIRST = {"{": "an object", '"': "a string", "t": "a boolean", "f": "a boolean",
                   "n": "null"}


def _array_items(body: bytes, max_messages: int) -> list[Any]:
    """The elements of a JSON array body; TooManyMessages past ``max_messages`` elements,
    found after parsing at most one more than that."""
    if len(body) <= _WHOLE_ARRAY_BYTES:
        whole = parse_json(body)
        if not isinstance(whole, list):
            raise BodyError(f"a JSON batch is an array of messages, not {_json_type(whole)}")
        if len(whole) > max_messages:
            raise TooManyMessages(max_messages)
        return whole
    text = _utf8(body, "body")
    pos = _SPACE.match(text).end()  # type: ignore[union-attr]  # matches the empty string
    if text[pos:pos + 1] != "[":
        what = _TYPES_BY_FIRST.get(text[pos:pos + 1], "a number")
        raise BodyError(f"a JSON batch is an array of messages, not {what}")
    items: list[Any] = []
    pos = _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
    if text[pos:pos + 1] == "]":
        return _end_of_array(text, pos + 1, items)
    while True:
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError as exc:
            raise BodyError(f"body is not valid JSON: {exc}") from None
        except RecursionError:
            raise BodyError("body is nested too deeply to be read as JSON") from None
        items.append(value)
        if len(items) > max_messages:
            raise TooManyMessages(max_messages)
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        sep = text[pos:pos + 1]
        if sep == "]":
            return _end_of_array(text, pos + 1, items)
        if sep != ",":
            error = json.JSONDecodeError("Expecting ',' delimiter", text, pos)
            raise BodyError(f"body is not valid JSON: {error}")
        pos = _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]


def _end_of_array(text: str, pos: int, items: list[Any]) -> list[Any]:
    pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
    if pos != len(text):
        error = json.JSONDecodeError("Extra data", text, pos)
        raise BodyError(f"body is not valid JSON: {error}")
    return items


def _utf8(data: bytes, what: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start}); JSON "
                        "bodies are UTF-8, without a byte order mark") from None
    if text.startswith("\ufeff"):
        raise BodyError(f"{what} starts with a byte order mark; JSON bodies are UTF-8 "
                        "without one")
    return text


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


class _Converter:
    """Plain JSON value -> the Python datum fastavro writes, checking it against the schema."""

    def __init__(self, named: dict[str, Any]) -> None:
        self.named = named

    def convert(self, schema: Any, value: Any, path: str) -> Any:
        if isinstance(schema, str):
            if schema in self.named:
                return self.convert(self.named[schema], value, path)
            return self._primitive(schema, value, path)
        if isinstance(schema, list):
            return self._union(schema, value, path)
        kind = schema.get("type")
        if kind == "record" or kind == "error":
            return self._record(schema, value, path)
        if kind == "enum":
            if not isinstance(value, str) or value not in schema["symbols"]:
                raise BodyError(f"{path}: expected one of {schema['symbols']}, got "
                                f"{_show(value)}")
            return value
        if kind == "array":
            if not isinstance(value, list):
                raise BodyError(f"{path}: expected an array, got {_json_type(value)}")
            return [self.convert(schema["items"], v, f"{path}[{i}]") for i, v in enumerate(value)]
        if kind == "map":
            if not isinstance(value, dict):
                raise BodyError(f"{path}: expected an object (map), got {_json_type(value)}")
            return {k: self.convert(schema["values"], v, f"{path}.{k}") for k, v in value.items()}
        if kind == "fixed":
            data = _latin1(value, path)
            if len(data) != schema["size"]:
                raise BodyError(f"{path}: fixed {schema.get('name')} has {schema['size']} bytes, "
                                f"got {len(data)}")
            return data
        return self.convert(kind, value, path)  # {"type": "int", "logicalType": ...} etc.

    def _primitive(self, kind: str, value: Any, path: str) -> Any:
        check = _PRIMITIVES.get(kind)
        if check is None:
            raise BodyError(f"{path}: the schema names an unknown type {kind!r}")
        return check(value, path)

    def _union(self, branches: list[Any], value: Any, path: str) -> Any:
        errors = []
        for branch in branches:
            try:
                return self.convert(branch, value, path)
            except BodyError as exc:
                errors.append(str(exc))
        raise BodyError(f"{path}: matches no branch of the union: " + "; ".join(errors))

    def _record(self, schema: dict[str, Any], value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise BodyError(f"{path}: expected an object (record {schema.get('name')}), got "
                            f"{_json_type(value)}")
        fields = schema["fields"]
        names = {f["name"] for f in fields}
        unknown = [k for k in value if k not in names]
        if unknown:
            raise BodyError(f"{path}: record {schema.get('name')} has no field "
                            f"{', '.join(map(repr, unknown))}")
        out: dict[str, Any] = {}
        for f in fields:
            name = f["name"]
            where = f"{path}.{name}"
            if name in value:
                out[name] = self.convert(f["type"], value[name], where)
            elif "default" in f:
                ftype = f["type"]
                # A union's default is a value of its first branch (Avro spec).
                out[name] = self.convert(ftype[0] if isinstance(ftype, list) else ftype,
                                         f["default"], where)
            else:
                raise BodyError(f"{where}: missing (the field has no default)")
        return out


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _null(value: Any, path: str) -> None:
    if value is not None:
        raise BodyError(f"{path}: expected null, got {_json_type(value)}")


def _boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise BodyError(f"{path}: expected a boolean, got {_json_type(value)}")
    return value


def _integer(kind: str) -> Callable[[Any, str], int]:
    low, high = _INT_RANGE[kind]

    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BodyError(f"{path}: expected an integer ({kind}), got {_show(value)}")
        if not low <= value <= high:
            raise BodyError(f"{path}: {value} does not fit in an Avro {kind}")
        return value

    return check


def _real(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BodyError(f"{path}: expected a number, got {_json_type(value)}")
    try:
        return float(value)
    except OverflowError:
        raise BodyError(f"{path}: {value} is too large for a floating-point number") from None


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise BodyError(f"{path}: expected a string, got {_json_type(value)}")
    return value


def _latin1(value: Any, path: str) -> bytes:
    if not isinstance(value, str):
        raise BodyError(f"{path}: expected a string of bytes, got {_json_type(value)}")
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        raise BodyError(f"{path}: bytes are written as a string of code points 0-255 "
                        "(\\u0000-\\u00ff)") from None


_PRIMITIVES: dict[str, Callable[[Any, str], Any]] = {
    "null": _null,
    "boolean": _boolean,
    "int": _integer("int"),
    "long": _integer("long"),
    "float": _real,
    "double": _real,
    "string": _string,
    "bytes": _latin1,
}
