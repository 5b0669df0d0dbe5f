"""Bad input, generated: spool files (binary, .jsonl, .txt), HTTP requests and datagrams against
a live agent. Never an unhandled exception, never a 500 or a dropped connection, every reject
counted; and the agent keeps taking good input.

Already covered elsewhere (and not repeated here): the datagram parser alone
(tests/ingest/test_datagram.py: arbitrary and mutated datagrams), spool format round trips and
hand-picked corruptions (tests/spool/).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import socket
import struct
import tempfile
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config import load_config
from agent.ingest import datagram
from ferry_client import FerryClient, wire
from spool.format import (
    BLOCK_HEADER,
    FILE_HEADER,
    TRAILER,
    SpoolFormatError,
    SpoolRecord,
    encode_file,
)
from spool.reader import open_spool_file, read_spool_file, verify
from spool.writer import write_spool_file
from tests.agent_harness import write_config
from tests.kafka import Broker, consume_all
from tests.reliability.harness import Agent, metric_total
from tests.waiting import wait_until

FUZZ = settings(deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
EXAMPLES = int(os.environ.get("FERRY_RELIABILITY_FUZZ_EXAMPLES", "300"))

# --------------------------------------------------------------------------------------------
# Spool reader: mutated binary files, with and without their checksums repaired
# --------------------------------------------------------------------------------------------

spool_records = st.builds(
    SpoolRecord,
    topic=st.sampled_from(["a", "b.c", "topic-1"]),
    value=st.binary(max_size=40),
    key=st.none() | st.binary(max_size=8),
    partition_key=st.none() | st.integers(-(2**31), 2**31 - 1),
    timestamp_ms=st.integers(0, 2**50),
    headers=st.lists(st.tuples(st.text(max_size=4), st.binary(max_size=4)),
                     max_size=2).map(tuple),
)

mutations = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.floats(0, 1), st.integers(0, 255)),
        st.tuples(st.just("cut"), st.floats(0, 1), st.just(0)),
        st.tuples(st.just("insert"), st.floats(0, 1), st.integers(0, 255)),
        st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 8)),
        st.tuples(st.just("int"), st.floats(0, 1), st.sampled_from(
            [0, 1, 27, 28, 255, 65535, 2**31 - 1, 2**31, 2**32 - 1])),
    ),
    min_size=1, max_size=4,
)


def _mutate(data: bytes, ops: list[tuple[str, float, int]]) -> bytes:
    buf = bytearray(data)
    for op, where, arg in ops:
        at = min(int(where * len(buf)), max(len(buf) - 1, 0))
        if op == "set" and buf:
            buf[at] = arg
        elif op == "cut":
            del buf[at:]
        elif op == "insert":
            buf.insert(at, arg)
        elif op == "delete":
            del buf[at:at + arg]
        elif op == "int" and at + 4 <= len(buf):
            buf[at:at + 4] = struct.pack("<I", arg)
    return bytes(buf)


def _reseal(data: bytes) -> bytes:
    """Recompute every checksum a mutated file's structure still lets us find, so the damage
    reaches the record decoder instead of stopping at a CRC mismatch."""
    buf = bytearray(data)
    if len(buf) < FILE_HEADER.size:
        return bytes(buf)
    crc = zlib.crc32(bytes(buf[:FILE_HEADER.size]))
    pos = FILE_HEADER.size
    while pos + BLOCK_HEADER.size <= len(buf):
        length, count, _ = BLOCK_HEADER.unpack_from(buf, pos)
        if length == 0:
            if pos + TRAILER.size <= len(buf):
                zero, magic, total, _ = TRAILER.unpack_from(buf, pos)
                TRAILER.pack_into(buf, pos, zero, magic, total, crc)
            break
        body = bytes(buf[pos + BLOCK_HEADER.size: pos + BLOCK_HEADER.size + length])
        BLOCK_HEADER.pack_into(buf, pos, length, count, zlib.crc32(body))
        crc = zlib.crc32(bytes(buf[pos:pos + BLOCK_HEADER.size]), crc)
        pos += BLOCK_HEADER.size + length
    return bytes(buf)


def _read_all_ways(path: Path) -> None:
    """Every way Ferry reads a spool file either works or raises SpoolFormatError, and they
    agree: a file that deep-verifies reads fully, and the other way round."""
    try:
        count: int | None = verify(path, deep=True)
    except SpoolFormatError:
        count = None
    try:
        records: list[SpoolRecord] | None = read_spool_file(path)
    except SpoolFormatError:
        records = None
    assert (count is None) == (records is None), (count, records)
    if records is not None:
        assert len(records) == count
    # The intake's way: a shallow verify, then decode without verifying again, maybe resuming.
    reader = open_spool_file(path)
    try:
        n = reader.verify()
    except SpoolFormatError:
        return
    for start in (0, n // 2):
        try:
            got = list(reader.iter_records(start, verify_first=False))
        except SpoolFormatError:
            assert records is None  # only a file deep verification also refuses
            continue
        if records is not None:
            assert [r for _, r in got] == records[start:]
        else:
            # Resuming skips the blocks before ``start`` undecoded (the intake committed them
            # already), so only the first pass must find the damage.
            assert start > 0, "a file deep verification refuses was read from its start"


@settings(FUZZ, max_examples=2 * EXAMPLES)
@given(records=st.lists(spool_records, max_size=12), ops=mutations, reseal=st.booleans(),
       block=st.integers(30, 400))
def test_mutated_binary_spool_files_read_or_raise_spool_format_error(
    records: list[SpoolRecord], ops: list[tuple[str, float, int]], reseal: bool, block: int
) -> None:
    data = _mutate(encode_file(records, block_bytes=block), ops)
    if reseal:
        data = _reseal(data)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.ferry"
        path.write_bytes(data)
        _read_all_ways(path)


@settings(FUZZ, max_examples=max(EXAMPLES // 3, 20))
@given(records=st.lists(spool_records, min_size=1, max_size=12), ops=mutations,
       reseal=st.booleans(), block=st.integers(30, 400))
def test_mutated_binary_spool_files_through_the_intake_are_ingested_whole_or_quarantined(
    records: list[SpoolRecord], ops: list[tuple[str, float, int]], reseal: bool, block: int
) -> None:
    """The intake itself (its bulk block path, not the reader) on a real buffer: a file the
    reader accepts is buffered exactly; one it refuses is quarantined with its reason, every
    message it left buffered is counted, and the next good file is still ingested."""
    from tests.ingest.harness import buffered, intake_only

    data = _mutate(encode_file(records, block_bytes=block), ops)
    if reseal:
        data = _reseal(data)
    with tempfile.TemporaryDirectory() as d, intake_only(Path(d)) as intake:
        spool = intake.dirs[0]
        path = spool / "fuzzed.ferry"
        path.write_bytes(data)
        past = time.time() - 60  # past the grace a broken binary file gets
        os.utime(path, (past, past))
        try:
            expected: list[SpoolRecord] | None = read_spool_file(path)
        except SpoolFormatError:
            expected = None
        intake.scan_once()
        view = intake.registry.view()
        got = {t: buffered(intake.store, t) for t in intake.store.topics()}
        stored = sum(len(v) for v in got.values())
        assert view.total("messages_accepted", source="spool") == stored
        if expected is not None:
            assert not path.exists() and view.total("spool_files_ingested") == 1
            for topic in {r.topic for r in expected}:
                assert [m.record.value for m in got[topic]] == [
                    r.value for r in expected if r.topic == topic]
            assert stored == len(expected)
        else:
            assert not path.exists(), "a refused file stays in the spool directory"
            assert (spool / "quarantine" / "fuzzed.ferry.reason").read_text().strip()
            assert view.total("spool_files_quarantined") == 1
        good = write_spool_file(spool, "good.ferry", [SpoolRecord("after", b"ok")])
        intake.scan_once()
        assert not good.exists()
        assert [m.record.value for m in buffered(intake.store, "after")] == [b"ok"]


# -- hand-made files ---------------------------------------------------------------------------

# Any code point, lone surrogates included: JSON text can carry them as \ud800 escapes.
any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF,
                                 exclude_categories=[]), max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=6,
)
jsonl_objects = st.dictionaries(
    st.sampled_from(["value", "key", "partition_key", "timestamp", "headers", "other"]),
    json_values | st.dictionaries(any_text, any_text, max_size=2), max_size=5,
)
jsonl_lines = st.one_of(
    jsonl_objects.map(lambda o: json.dumps(o).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=30).filter(lambda b: b"\n" not in b),
    st.integers(1, 3000).map(lambda n: b'{"value": ' + b"[" * n + b"]" * n + b"}"),
)


@settings(FUZZ, max_examples=EXAMPLES)
@given(lines=st.lists(jsonl_lines, min_size=1, max_size=5), kind=st.sampled_from([".jsonl",
                                                                                  ".txt"]))
def test_hand_made_spool_files_read_or_raise_spool_format_error(
    lines: list[bytes], kind: str
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "some-topic" / f"f{kind}"
        path.parent.mkdir()
        path.write_bytes(b"\n".join(lines) + b"\n")
        _read_all_ways(path)


def test_jsonl_with_lone_surrogates_or_deep_nesting_is_a_format_error(tmp_path: Path) -> None:
    """Found by the fuzzing above: JSON may escape lone surrogates ("\\ud800"), which have no
    UTF-8 form, and may nest deeper than the recursion limit. Both must be refused as a bad
    line (SpoolFormatError), not escape as UnicodeEncodeError / RecursionError."""
    topic_dir = tmp_path / "topic"
    topic_dir.mkdir()
    cases = {
        "value": b'{"value": "\\ud800"}',
        "key": b'{"value": "v", "key": "\\udfff"}',
        "header": b'{"value": "v", "headers": {"h": "\\ud83d"}}',
        "nesting": b'{"value": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    }
    escaped = {}
    for name, line in cases.items():
        path = topic_dir / f"{name}.jsonl"
        path.write_bytes(line + b"\n")
        try:
            read_spool_file(path)
        except SpoolFormatError:
            continue
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            escaped[name] = f"{type(exc).__name__}: {str(exc)[:80]}"
    assert not escaped, f"not SpoolFormatError: {escaped}"


# --------------------------------------------------------------------------------------------
# A live agent: HTTP requests and datagrams
# --------------------------------------------------------------------------------------------

AVRO = json.dumps({"type": "record", "name": "R", "fields": [
    {"name": "n", "type": "int"}, {"name": "s", "type": ["null", "string"], "default": None}]})
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                          "required": ["n"]})
CONFIG_TOPICS: dict[str, dict[str, object]] = {
    "fz-json": {"content_type": "json", "schema": JSON_SCHEMA},
    "fz-avro": {"content_type": "avro", "schema": AVRO},
    "fz-limited": {"rate_limit": 5},
    "fz-small": {"max_message_bytes": 64},
}


@pytest.fixture(scope="module")
def live_agent(tmp_path_factory: pytest.TempPathFactory, session_broker: Broker
               ) -> Iterator[Agent]:
    root = tmp_path_factory.mktemp("fuzz-agent")
    topics: dict[str, dict[str, Any]] = {"default": {"ack_timeout_ms": 0}}
    for name, settings_ in CONFIG_TOPICS.items():
        topics[name] = {"ack_timeout_ms": 0, **settings_}
    config = write_config(root, session_broker.bootstrap, spool=True, topics=topics)
    with Agent(config) as agent:
        yield agent


# Header values: visible latin-1 and spaces/tabs (what HTTP allows), sometimes empty.
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                    exclude_characters="\x7f"), max_size=40)
KNOWN_TOPICS = st.sampled_from([*CONFIG_TOPICS, "fz-bin", "fz-other"])
topics = st.one_of(  # one_of picks a branch uniformly: known topics most of the time
    KNOWN_TOPICS, KNOWN_TOPICS, KNOWN_TOPICS, KNOWN_TOPICS,
    st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
    st.text(max_size=30),  # anything: percent-encoded into the path
    st.sampled_from([".", "..", "a" * 250, "a/b", "a%2Fb", "x y", "ü", "\x00"]),
)
int32_text = st.integers(-(2**31), 2**31 - 1).map(str)
content_types = st.one_of(
    st.none(),
    st.sampled_from(["application/json", "application/x-ndjson", "avro/binary",
                     "application/avro", "text/plain", "application/json; charset=utf-8",
                     "APPLICATION/JSON", "application/vnd.x+json", "application/jsonl", ""]),
    header_text,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(json_values, max_size=5).map(lambda vs: b"\n".join(json.dumps(v).encode()
                                                                for v in vs)),
    st.builds(lambda n, s: json.dumps({"n": n, "s": s}).encode(), st.integers(-(2**40), 2**40),
              st.none() | st.text(max_size=5)),
    st.just(b"\x02\x00"),  # Avro binary of {"n": 1, "s": null}
    st.integers(60, 2000).map(lambda n: b"x" * n),
)


@dataclass
class FuzzRequest:
    topic: str
    batch: bool
    body: bytes
    headers: dict[str, str]

    @property
    def path(self) -> str:
        return "/topics/" + urllib.parse.quote(self.topic, safe="") + ("/batch" if self.batch
                                                                          else "")

    def route(self) -> str | None:
        """Which publish route the agent sees, as agent/ingest/http/app.py matches it."""
        rest = urllib.parse.unquote(self.path)[len("/topics/"):]
        slash = rest.find("/")
        if slash < 0:
            return "publish" if rest else None
        return "batch" if slash > 0 and rest[slash:] == "/batch" else None

    def messages_at_most(self) -> int:
        lines = sum(1 for line in self.body.split(b"\n") if line.strip())
        try:
            items = json.loads(self.body)
        except ValueError:
            items = None
        return max(1, lines, len(items) if isinstance(items, list) else 0)


fuzz_requests = st.builds(
    FuzzRequest,
    topic=topics,
    batch=st.booleans(),
    body=bodies,
    headers=st.fixed_dictionaries({}, optional={
        "Content-Type": content_types.filter(lambda c: c is not None),
        "Partition-Key": header_text,
        "Ferry-Partition-Key": st.one_of(int32_text, int32_text, int32_text,
                                         st.integers(-(2**33), 2**33).map(str), header_text),
        "Idempotency-Key": st.one_of(st.sampled_from(["k1", "k2"]),
                                     st.from_regex(r"[!-~]{1,20}", fullmatch=True),
                                     header_text, st.text("ab", min_size=250, max_size=300)),
        "X-Anything": header_text,
    }).map(lambda h: {k: v for k, v in h.items() if v is not None}),
)


@dataclass
class HttpTally:
    by_route_status: collections.Counter[tuple[str, int]] = field(
        default_factory=collections.Counter)
    accepted: int = 0
    rejected_min: int = 0
    rejected_max: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


class _Connection:
    """One keep-alive connection; a new one only when the agent said Connection: close."""

    def __init__(self, agent: Agent) -> None:
        self.host, self.port = agent.config.http.host, agent.config.http.port
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=15)

    def request(self, r: FuzzRequest) -> tuple[int, dict[str, str], bytes]:
        self.conn.putrequest("POST", r.path, skip_accept_encoding=True)
        for name, value in r.headers.items():
            self.conn.putheader(name, value.encode("latin-1"))
        self.conn.putheader("Content-Length", str(len(r.body)))
        self.conn.endheaders(r.body)
        response = self.conn.getresponse()
        body = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
        if headers.get("connection", "").lower() == "close":
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=15)
        return response.status, headers, body

    def close(self) -> None:
        self.conn.close()


ALLOWED = {201, 202, 400, 404, 413, 415, 422, 429}  # never 5xx: nothing here is overload


def test_fuzzed_http_requests_are_answered_never_500_and_every_reject_is_counted(
    live_agent: Agent,
) -> None:
    agent = live_agent
    before = agent.counters()
    base_accepted = metric_total(before, "messages_accepted", source="http")
    base_rejected = metric_total(before, "messages_rejected", source="http")
    tally = HttpTally()
    conn = _Connection(agent)

    @settings(FUZZ, max_examples=2 * EXAMPLES)
    @given(r=fuzz_requests)
    def one(r: FuzzRequest) -> None:
        try:
            status, headers, body = conn.request(r)
        except (http.client.HTTPException, OSError) as exc:
            raise AssertionError(f"connection dropped on {r}: {exc!r}") from exc
        route = r.route() or "other"
        tally.by_route_status[(route, status)] += 1
        assert status in ALLOWED or (route == "other" and status in (404, 405)), (
            status, body[:300], r)
        doc = json.loads(body)
        if status in (201, 202):
            if headers.get("idempotent-replayed") != "true":  # a replay stores nothing
                tally.accepted += doc["count"] if r.batch else 1
            assert len(doc["ids"] if r.batch else [doc["id"]]) >= 1
        else:
            assert doc["error"] and doc["message"], doc
            if status in (429,):
                assert int(headers["retry-after"]) >= 1
            if route != "other":
                tally.rejected_min += 1
                tally.rejected_max += r.messages_at_most() if r.batch else 1

    try:
        one()
    finally:
        conn.close()
    print(f"\nHTTP fuzz: {sum(tally.by_route_status.values())} requests, "
          f"statuses {dict(collections.Counter(s for (_, s) in tally.by_route_status.elements()))}")

    def counted() -> tuple[float, float]:
        doc = agent.counters()
        return (metric_total(doc, "messages_accepted", source="http") - base_accepted,
                metric_total(doc, "messages_rejected", source="http") - base_rejected)

    def requests_short() -> list[tuple[str, int, int, float]]:
        """Answers per route and status that the agent has not counted (yet)."""
        doc = agent.counters()
        short = []
        for (route, status), n in tally.by_route_status.items():
            if route in ("publish", "batch"):
                got = metric_total(doc, "http_requests", route=route, status=str(status))
                if got < n:
                    short.append((route, status, n, got))
        return short

    def matches() -> bool:
        accepted, rejected = counted()
        return accepted == tally.accepted and \
            tally.rejected_min <= rejected <= tally.rejected_max and not requests_short()

    # The publish path hands its request counters to the registry in bulk, up to 0.2 s after
    # the answer (agent/ingest/http/counters.py): wait for them as for the others.
    with contextlib.suppress(AssertionError):
        wait_until(matches, timeout=10)
    accepted, rejected = counted()
    assert accepted == tally.accepted, f"accepted: {accepted} counted, {tally.accepted} answered"
    assert tally.rejected_min <= rejected <= tally.rejected_max, (
        f"{rejected} rejects counted; the answers say {tally.rejected_min} to "
        f"{tally.rejected_max}: {tally}")
    # Requests answered, per route and status, as counted by the agent.
    assert requests_short() == []
    assert agent.alive
    # Everything accepted leaves the buffer delivered, not discarded.
    wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
               message="buffer drained")
    assert metric_total(agent.counters(), "messages_discarded") == 0


@st.composite
def fuzz_datagrams(draw: st.DrawFn) -> bytes:
    topic = draw(st.sampled_from(["fz-dgram", "fz-small", "bad topic", "x" * 250]))
    value = draw(st.binary(max_size=100))
    key = draw(st.none() | st.binary(max_size=10))
    try:
        if draw(st.booleans()):
            data = wire.encode_any_partition(topic, value, key, 1)
        else:
            data = wire.encode_partition_key(topic, draw(st.integers(-(2**31), 2**31 - 1)),
                                             value, key, 1)
    except ValueError:
        data = draw(st.binary(max_size=60))
    kind = draw(st.sampled_from(["as is", "mutated", "random"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "mutated":
        data = _mutate(data, draw(mutations))
        if draw(st.booleans()) and len(data) >= 4:
            data = struct.pack(">i", len(data)) + data[4:]
    return data


def test_fuzzed_datagrams_each_counted_accepted_or_rejected_by_reason(
    live_agent: Agent,
) -> None:
    agent = live_agent
    config = load_config(agent.config_path)
    before = agent.counters()
    expected: collections.Counter[str] = collections.Counter()
    sent = 0
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.connect(str(agent.socket_path))

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(data=fuzz_datagrams())
    def one(data: bytes) -> None:
        nonlocal sent
        try:
            datagram.parse(data, lambda t: config.topic(t).max_message_bytes)
            expected["accepted"] += 1
        except datagram.Reject as exc:
            expected[exc.reason] += 1
        raw.send(data)
        sent += 1

    try:
        one()
    finally:
        raw.close()
    with FerryClient(agent.socket_path) as client:
        client.send("fz-dgram", b"still served")
    expected["accepted"] += 1
    sent += 1

    def counts() -> dict[str, float]:
        doc = agent.counters()
        out = {"received": metric_total(doc, "messages_received", source="socket")
               - metric_total(before, "messages_received", source="socket"),
               "accepted": metric_total(doc, "messages_accepted", source="socket")
               - metric_total(before, "messages_accepted", source="socket")}
        for reason in expected:
            if reason != "accepted":
                out[reason] = (
                    metric_total(doc, "messages_rejected", source="socket", reason=reason)
                    - metric_total(before, "messages_rejected", source="socket", reason=reason))
        return out

    want = {"received": sent, **expected}
    wait_until(lambda: counts() == want, timeout=15, message=f"datagram counters {want}")
    assert agent.alive


def test_a_spool_file_the_reader_chokes_on_is_quarantined_and_blocks_nothing(
    live_agent: Agent, session_broker: Broker, unique_topic: str
) -> None:
    """A hand-made file that breaks the reader in an unexpected way (here a lone surrogate in
    a .jsonl value) must be quarantined like any corrupt file, and the files after it in the
    spool directory still ingested."""
    agent = live_agent
    spool = Path(agent.config.spool.dirs[0])
    topic_dir = spool / unique_topic
    topic_dir.mkdir()
    bad = topic_dir / "a-bad.jsonl"
    bad.write_bytes(b'{"value": "\\ud800"}\n')
    past = time.time() - 60  # hand-made files are left alone while they may still be written
    os.utime(bad, (past, past))
    good = write_spool_file(spool, "z-good.ferry", [SpoolRecord(unique_topic, b"after bad")])
    stuck = []
    try:
        wait_until(lambda: not good.exists()
                   and not (spool / ".ingesting" / good.name).exists(), timeout=20,
                   message="the good file after the bad one ingested")
    except AssertionError as exc:
        stuck.append(str(exc))
    quarantined = list((spool / "quarantine").rglob("a-bad.jsonl"))
    # Clean up so the shared agent's spool scan is not stuck for later tests.
    bad.unlink(missing_ok=True)
    assert not stuck, f"{stuck[0]}; agent log: {agent.log_tail(8)}"
    assert quarantined, "the bad file is quarantined"
    got = {m.value for m in consume_all(session_broker.bootstrap, unique_topic, 1, timeout=20)}
    assert b"after bad" in got
