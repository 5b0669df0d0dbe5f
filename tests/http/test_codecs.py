"""Bodies to stored values: plain JSON -> Avro conversion and its error messages."""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.config import TopicConfig
from agent.ingest.http.codecs import BodyError, MediaTypeError, TopicCodec, check_topic

SCHEMA: dict[str, Any] = {
    "type": "record", "name": "Event", "namespace": "ns",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "ratio", "type": "double", "default": 0.5},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
        {"name": "raw", "type": "bytes", "default": "\u00ff"},
        {"name": "digest", "type": {"type": "fixed", "name": "D", "size": 2},
         "default": "ab"},
        {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []},
        {"name": "attrs", "type": {"type": "map", "values": "int"}, "default": {}},
        {"name": "maybe", "type": ["null", "int", "string"], "default": None},
        {"name": "child", "type": ["null", {
            "type": "record", "name": "Child", "fields": [{"name": "n", "type": "int"}]}],
         "default": None},
        {"name": "again", "type": ["null", "ns.Child"], "default": None},
        {"name": "flag", "type": "boolean", "default": False},
        {"name": "small", "type": "float", "default": 1},
    ],
}


def avro_codec(schema: Any = SCHEMA) -> TopicCodec:
    return TopicCodec(TopicConfig(content_type="avro", schema=json.dumps(schema)))


def decode(value: bytes, schema: Any = SCHEMA) -> Any:
    return fastavro.schemaless_reader(io.BytesIO(value), fastavro.parse_schema(schema), None)


def test_plain_json_converts_with_defaults_unions_and_named_types() -> None:
    value = avro_codec().single("application/json", json.dumps({
        "id": 1, "kind": "B", "tags": ["x"], "attrs": {"k": 3}, "maybe": "s",
        "child": {"n": 4}, "again": {"n": 5}, "raw": "\u0000\u00e9", "flag": True,
    }).encode())
    assert decode(value) == {
        "id": 1, "ratio": 0.5, "kind": "B", "raw": b"\x00\xe9", "digest": b"ab",
        "tags": ["x"], "attrs": {"k": 3}, "maybe": "s", "child": {"n": 4},
        "again": {"n": 5}, "flag": True, "small": 1.0,
    }


@pytest.mark.parametrize(("doc", "message"), [
    ({"kind": "A"}, "body.id: missing"),
    ({"id": 1, "kind": "C"}, "body.kind: expected one of ['A', 'B']"),
    ({"id": 2**63, "kind": "A"}, "does not fit in an Avro long"),
    ({"id": True, "kind": "A"}, "body.id: expected an integer"),
    ({"id": 1.5, "kind": "A"}, "body.id: expected an integer"),
    ({"id": 1, "kind": "A", "raw": "\u0100"}, "body.raw: bytes are written"),
    ({"id": 1, "kind": "A", "digest": "abc"}, "has 2 bytes, got 3"),
    ({"id": 1, "kind": "A", "tags": "x"}, "body.tags: expected an array"),
    ({"id": 1, "kind": "A", "tags": [1]}, "body.tags[0]: expected a string"),
    ({"id": 1, "kind": "A", "attrs": {"k": "v"}}, "body.attrs.k: expected an integer"),
    ({"id": 1, "kind": "A", "maybe": [1]}, "body.maybe: matches no branch"),
    ({"id": 1, "kind": "A", "child": {"n": "x"}}, "body.child"),
    ({"id": 1, "kind": "A", "flag": "yes"}, "body.flag: expected a boolean"),
    ({"id": 1, "kind": "A", "ratio": "x"}, "body.ratio: expected a number"),
    ({"id": 1, "kind": "A", "ratio": 10**400}, "too large"),
    ({"id": 1, "kind": "A", "extra": 1}, "has no field 'extra'"),
    ([1], "expected an object (record ns.Event), got array"),
])
def test_conversion_errors_say_where_and_why(doc: Any, message: str) -> None:
    with pytest.raises(BodyError) as info:
        avro_codec().single("application/json", json.dumps(doc).encode())
    assert message in str(info.value)


def test_null_schema_and_primitive_schemas() -> None:
    assert avro_codec("string").single("application/json", b'"hi"') == b"\x04hi"
    with pytest.raises(BodyError, match="expected null"):
        avro_codec("null").single("application/json", b"1")


@given(st.fixed_dictionaries({
    "id": st.integers(-(2**63), 2**63 - 1),
    "kind": st.sampled_from(["A", "B"]),
    "tags": st.lists(st.text()),
    "maybe": st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1), st.text()),
    "raw": st.binary(max_size=20),
}))
def test_conversion_round_trips(doc: dict[str, Any]) -> None:
    sent = {**doc, "raw": doc["raw"].decode("latin-1")}
    value = avro_codec().single("application/json", json.dumps(sent).encode())
    decoded = decode(value)
    assert {k: decoded[k] for k in doc} == doc
    # And the Avro binary it produced is accepted as avro/binary.
    assert avro_codec().single("avro/binary", value) == value


def test_binary_topics_take_anything() -> None:
    codec = TopicCodec(TopicConfig())
    assert codec.single("image/png", b"\x89PNG") == b"\x89PNG"
    assert codec.batch("application/x-ndjson", b"a b\r\n\n  \nc") == [b"a b", b"c"]


def test_json_topic_batch_keeps_lines_and_compacts_array_items() -> None:
    codec = TopicCodec(TopicConfig(content_type="json"))
    assert codec.batch("application/x-ndjson", b'{"a": 1}\n2\n') == [b'{"a": 1}', b"2"]
    assert codec.batch("application/json", b'[{"a": 1}, "x"]') == [b'{"a":1}', b'"x"']
    with pytest.raises(MediaTypeError):
        codec.single("text/plain", b"{}")


def test_check_topic() -> None:
    check_topic(TopicConfig())
    check_topic(TopicConfig(content_type="json", schema='{"type": "object"}'))
    with pytest.raises(ValueError, match="needs a schema"):
        check_topic(TopicConfig(content_type="avro"))
    with pytest.raises(ValueError, match="Avro schema"):
        check_topic(TopicConfig(content_type="avro", schema='{"type": "nonsense"}'))
