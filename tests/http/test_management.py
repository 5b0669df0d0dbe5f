"""Topic management over HTTP: lifecycle, read-only config topics, validation, the token,
cross-site refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.topics import TopicCatalog
from tests.http.harness import Served

AVRO = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]}


TOKEN = "t0ken"


@pytest.fixture
def managed(serve: Callable[..., Served]) -> Served:
    """A server with a management token, and a client that sends it."""
    served = serve(topics={"fixed": {"acks": "all", "ack_timeout_ms": 0}},
                   http={"management_token": TOKEN})
    served.client.headers["Authorization"] = f"Bearer {TOKEN}"
    return served


def test_topic_lifecycle(managed: Served) -> None:
    c = managed.client
    r = c.post("/topics", json={"name": "orders", "acks": "all", "max_message_bytes": 10,
                                "ack_timeout_ms": 0})
    assert r.status_code == 201
    assert r.headers["Location"] == "/topics/orders"
    doc = r.json()
    assert doc["name"] == "orders" and doc["origin"] == "api" and doc["read_only"] is False
    assert doc["acks"] == "all" and doc["max_message_bytes"] == 10
    # Unset settings come from [topics.default].
    assert doc["ack_timeout_ms"] == 0 and doc["ttl_seconds"] == 7 * 24 * 3600
    assert c.get("/topics/orders").json() == doc
    names = {t["name"]: t for t in c.get("/topics").json()["topics"]}
    assert set(names) == {"fixed", "orders"}
    assert names["fixed"]["read_only"] is True and names["fixed"]["origin"] == "config"

    # The settings apply to publishing at once.
    assert c.post("/topics/orders", content=b"x" * 11).status_code == 413
    r = c.put("/topics/orders", json={"max_message_bytes": 100})
    assert r.status_code == 200
    assert r.json()["max_message_bytes"] == 100 and r.json()["acks"] == "all"
    assert c.post("/topics/orders", content=b"x" * 11).status_code == 202

    r = c.delete("/topics/orders")
    assert r.status_code == 200
    assert r.json() == {"name": "orders", "deleted": True, "generation": 1}
    assert c.get("/topics/orders").status_code == 404
    assert c.delete("/topics/orders").status_code == 404


def test_delete_bumps_the_generation_of_buffered_messages(managed: Served) -> None:
    c = managed.client
    c.post("/topics", json={"name": "g"})
    assert c.post("/topics/g", content=b"old").status_code == 202
    assert c.delete("/topics/g").status_code == 200
    assert c.post("/topics/g", content=b"new").status_code == 202  # auto-created again
    [old, new] = managed.messages("g")
    assert managed.store.generation("g") == 1
    # The forwarder discards (and counts) messages of an older generation; never sends them.
    assert (old.generation, new.generation) == (0, 1)


def test_put_defines_a_missing_topic(managed: Served) -> None:
    r = managed.client.put("/topics/fresh", json={"content_type": "json"})
    assert r.status_code == 201
    assert r.json()["content_type"] == "json"
    assert managed.client.post("/topics/fresh", content=b"{bad").status_code == 400


def test_config_topics_are_read_only(managed: Served) -> None:
    c = managed.client
    for r in (c.post("/topics", json={"name": "fixed"}),
              c.put("/topics/fixed", json={"acks": "leader"}),
              c.delete("/topics/fixed"),
              c.put("/topics/default", json={"acks": "all"})):
        assert r.status_code == 409, r.text
        assert r.json()["error"] == "read_only"
    assert c.get("/topics/fixed").json()["acks"] == "all"


def test_creating_an_existing_topic_is_409(managed: Served) -> None:
    assert managed.client.post("/topics", json={"name": "dup"}).status_code == 201
    r = managed.client.post("/topics", json={"name": "dup", "acks": "all"})
    assert r.status_code == 409 and r.json()["error"] == "topic_exists"


@pytest.mark.parametrize(("body", "why"), [
    ({"name": "x", "colour": "red"}, "unknown topic setting 'colour'"),
    ({"name": "x", "acks": "some"}, "acks"),
    ({"name": "x", "ttl_seconds": "5"}, "ttl_seconds"),
    ({"name": "x", "ttl_seconds": 0}, "ttl_seconds"),
    ({"name": "x", "ack_timeout_ms": 60_001}, "ack_timeout_ms"),
    ({"name": "x", "content_type": "avro"}, "needs a schema"),
    ({"name": "x", "content_type": "avro", "schema": "{not json"}, "not JSON"),
    ({"name": "x", "content_type": "avro", "schema": {"type": "record"}}, "Avro schema"),
    ({"name": "x", "content_type": "json", "schema": {"type": 5}}, "JSON Schema"),
    ({"name": "x", "content_type": "json", "schema": "5"}, "an object (or true/false)"),
    ({"name": "x", "content_type": "json", "schema": "null"}, "an object (or true/false)"),
    ({"name": "x", "content_type": "json", "schema": {"$ref": "#/definitions/nope"}},
     "does not resolve"),
    ({"name": "x", "content_type": "json",
      "schema": {"properties": {"a": {"$ref": "https://example.com/a.json"}}}},
     "does not resolve"),
    ({"acks": "all"}, '"name"'),
    ({"name": "no spaces"}, "legal Kafka topic name"),
])
def test_invalid_definitions_are_400(managed: Served, body: dict[str, object], why: str
                                     ) -> None:
    r = managed.client.post("/topics", json=body)
    assert r.status_code == 400, r.text
    assert why in r.json()["message"]
    assert managed.client.get("/topics/x").status_code == 404


def test_schema_may_be_given_as_an_object(managed: Served) -> None:
    r = managed.client.post("/topics", json={"name": "av", "content_type": "avro",
                                             "schema": AVRO, "ack_timeout_ms": 0})
    assert r.status_code == 201
    assert json.loads(r.json()["schema"]) == AVRO
    assert managed.client.post("/topics/av", json={"a": 1}).status_code == 202
    assert managed.client.post("/topics/av", json={"a": "x"}).status_code == 400


@pytest.mark.parametrize(("content", "ctype", "status"), [
    (b"[1]", "application/json", 400),
    (b"{", "application/json", 400),
    (b"name=x", "application/x-www-form-urlencoded", 415),
    (b"[" * 5000, "application/json", 400),  # nested past Python's recursion limit
    (b'{"name": "x", "rate_limit": 1e999}', "application/json", 400),  # infinity
    (b'{"name": "x", "rate_limit": Infinity}', "application/json", 400),
    (b'{"name": "x", "rate_limit": NaN}', "application/json", 400),
])
def test_bad_bodies(managed: Served, content: bytes, ctype: str, status: int) -> None:
    r = managed.client.post("/topics", content=content, headers={"Content-Type": ctype})
    assert r.status_code == status
    assert set(r.json()) == {"error", "code", "message"}
    assert managed.client.get("/topics/x").status_code == 404


def test_oversized_definition_is_413(managed: Served) -> None:
    r = managed.client.post("/topics", content=b'{"name": "x", "schema": "' + b"a" * 2_000_000
                            + b'"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_put_cannot_rename(managed: Served) -> None:
    r = managed.client.put("/topics/a", json={"name": "b"})
    assert r.status_code == 400


def test_management_needs_the_token_when_one_is_set(serve: Callable[..., Served]) -> None:
    served = serve(http={"management_token": "s3cret"})
    c = served.client
    for r in (c.post("/topics", json={"name": "x"}),
              c.put("/topics/x", json={}, headers={"Authorization": "Bearer wrong"}),
              c.delete("/topics/x", headers={"Authorization": "Basic s3cret"})):
        assert r.status_code == 401
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert r.json()["code"] == "unauthorized"
    auth = {"Authorization": "Bearer s3cret"}
    assert c.post("/topics", json={"name": "x"}, headers=auth).status_code == 201
    # Reading from loopback needs no token.
    assert c.get("/topics").status_code == 200
    # Publishing is not management: no token needed.
    assert c.post("/topics/x", content=b"v").status_code == 202
    assert served.counter("http_requests", route="/topics", status="401") == 1


def test_management_is_closed_without_a_token(serve: Callable[..., Served]) -> None:
    served = serve()
    c = served.client
    for r in (c.post("/topics", json={"name": "x"}), c.put("/topics/x", json={}),
              c.delete("/topics/x")):
        assert r.status_code == 403 and r.json()["code"] == "management_locked", r.text
    assert c.get("/topics").status_code == 200
    assert [t["name"] for t in c.get("/topics").json()["topics"]] == []


def test_the_token_is_read_from_a_file(serve: Callable[..., Served], tmp_path: Path) -> None:
    token_file = tmp_path / "management.token"
    token_file.write_text("from-file\n")
    served = serve(http={"management_token_file": str(token_file)})
    r = served.client.post("/topics", json={"name": "f"},
                           headers={"Authorization": "Bearer from-file"})
    assert r.status_code == 201


def test_the_token_is_read_from_the_systemd_credential(
    serve: Callable[..., Served], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "management-token").write_text("cred\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    served = serve()
    r = served.client.delete("/topics/none", headers={"Authorization": "Bearer cred"})
    assert r.status_code == 404  # authorized; there was no such topic


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
], ids=["origin", "origin-null", "fetch-cross-site", "fetch-same-site"])
def test_cross_site_requests_may_not_change_topics(managed: Served,
                                                   headers: dict[str, str]) -> None:
    """Even with the token (a browser may hold it): a page of another site is refused."""
    c = managed.client
    # No Content-Type: the POST a page can send without a preflight.
    for r in (c.post("/topics", content=b'{"name": "x"}', headers=headers),
              c.put("/topics/x", json={}, headers=headers),
              c.delete("/topics/x", headers=headers)):
        assert r.status_code == 403 and r.json()["code"] == "cross_site", r.text
    assert c.get("/topics/x").status_code == 404


def test_same_origin_requests_may_change_topics(managed: Served) -> None:
    host = managed.url.removeprefix("http://")
    r = managed.client.post("/topics", json={"name": "same"},
                            headers={"Origin": managed.url, "Sec-Fetch-Site": "same-origin",
                                     "Host": host})
    assert r.status_code == 201, r.text


def test_another_process_sees_api_topics(managed: Served) -> None:
    """The forwarder process reads API-managed settings through its own TopicCatalog."""
    managed.client.post("/topics", json={"name": "shared", "acks": "all", "ttl_seconds": 60,
                                         "fallback_to_remote": True})
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from agent.buffer.store import Store\n"
        "from agent.config import FerryConfig\n"
        "from agent.topics import TopicCatalog\n"
        "store = Store(Path(sys.argv[1]), 1 << 30)\n"
        "cat = TopicCatalog(FerryConfig(), store)\n"
        "s = cat.settings('shared')\n"
        "print(json.dumps([s.acks, s.ttl_seconds, s.fallback_to_remote,"
        " cat.settings('other').acks]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(managed.store.path)],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == ["all", 60, True, "leader"]


def test_catalog_sees_changes_from_another_catalog_after_refresh(managed: Served) -> None:
    now = [0.0]
    other = TopicCatalog(managed.runtime.config, managed.store, refresh_seconds=1.0,
                         clock=lambda: now[0])
    assert other.entry("late") is None
    managed.client.post("/topics", json={"name": "late", "acks": "all"})
    assert other.entry("late") is None  # cached: the version key is read once a second
    now[0] += 1.0
    entry = other.entry("late")
    assert entry is not None and entry.settings.acks == "all"


def test_a_schema_reference_into_the_schema_itself_is_accepted(managed: Served) -> None:
    schema = {"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}}
    r = managed.client.post("/topics", json={"name": "refs", "content_type": "json",
                                             "schema": schema, "ack_timeout_ms": 0})
    assert r.status_code == 201, r.text
    assert managed.client.post("/topics/refs", json={"a": 1}).status_code == 202
    assert managed.client.post("/topics/refs", json={"a": "x"}).status_code == 400


def test_the_ferry_topics_command_reads_the_token_file(
    serve: Callable[..., Served], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.cli.main import main

    token_file = tmp_path / "management.token"
    token_file.write_text("cli-token\n")
    served = serve(http={"management_token_file": str(token_file)})
    base = ["topics", "--url", served.url]
    assert main([*base, "--token-file", str(token_file), "set", "cli",
                 '{"acks": "all"}']) == 0
    assert json.loads(capsys.readouterr().out)["acks"] == "all"
    assert main([*base, "show", "cli"]) == 0  # reading needs no token
    assert json.loads(capsys.readouterr().out)["name"] == "cli"
    wrong = tmp_path / "wrong.token"
    wrong.write_text("nope\n")
    assert main([*base, "--token-file", str(wrong), "delete", "cli", "--yes"]) == 1
    assert "401" in capsys.readouterr().err
    assert main([*base, "--token-file", str(token_file), "delete", "cli", "--yes"]) == 0
    assert served.client.get("/topics/cli").status_code == 404
