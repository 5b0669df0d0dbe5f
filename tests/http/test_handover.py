"""The publish path's hand-over to the buffer writer, over real HTTP.

Requests of one event-loop iteration go to the writer together (``submit_groups``) and come
back together; each must still get its own ids and its own answer, only after its commit, and
a writer that cannot take them must refuse every one of them, storing nothing. The writer is
held inside a commit callback (harness.py's ``Gate``) so that requests queue up
deterministically.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from agent.buffer import keys
from agent.records import Record
from tests.http.harness import WAIT, Served, hold_writer, queued_messages
from tests.waiting import wait_until


def test_concurrent_requests_are_answered_only_after_their_commit(served: Served) -> None:
    n = 20
    gate = hold_writer(served)
    commits = served.counter("buffer_commits")
    with ThreadPoolExecutor(n) as pool, httpx.Client(base_url=served.url, timeout=WAIT) as c:
        answers = [pool.submit(c.post, "/topics/h", content=b"m%d" % i) for i in range(n)]
        wait_until(lambda: queued_messages(served) == n, timeout=WAIT,
                   message="every request queued for the writer")
        assert not any(a.done() for a in answers)  # nothing answered before the commit
        gate.release.set()
        responses = [a.result(WAIT) for a in answers]
    assert [r.status_code for r in responses] == [202] * n
    ids = [r.headers["Ferry-Message-Id"] for r in responses]
    assert len(set(ids)) == n
    stored = {keys.id_text(m.id): m.record.value for m in served.messages("h")}
    assert stored == {r.headers["Ferry-Message-Id"]: b"m%d" % i
                      for i, r in enumerate(responses)}
    # Queued behind the held commit, they are stored together: in far fewer commits.
    assert served.counter("buffer_commits") - commits < n
    assert served.counter("messages_accepted", source="http", topic="h") == n


def test_a_writer_behind_answers_503_overloaded_and_stores_nothing(served: Served) -> None:
    gate = hold_writer(served)
    served.committer.max_pending_bytes = 100
    served.committer.submit([Record("filler", b"x" * 200)], "socket")  # over the limit now
    r = served.client.post("/topics/o", content=b"v")
    assert r.status_code == 503
    assert r.json()["error"] == "overloaded"
    assert int(r.headers["Retry-After"]) >= 1
    r = served.client.post("/topics/o/batch", json=["a", "b"])
    assert r.status_code == 503 and r.json()["error"] == "overloaded"
    assert served.counter("messages_rejected", source="http", reason="overloaded") == 3
    gate.release.set()
    wait_until(lambda: queued_messages(served) == 0, timeout=WAIT, message="queue drained")
    assert served.messages("o") == []
    assert served.client.post("/topics/o", content=b"later").status_code == 202
    assert [m.record.value for m in served.messages("o")] == [b"later"]


def test_a_closed_writer_answers_503_shutting_down(served: Served) -> None:
    served.committer.close()
    r = served.client.post("/topics/c", content=b"v")
    assert r.status_code == 503 and r.json()["error"] == "shutting_down"
    assert served.counter("messages_rejected", source="http", reason="shutting_down") == 1


def test_answers_keep_flowing_after_refusals(serve: Callable[..., Served]) -> None:
    # A hand-over refused as a whole must not leave the next iteration's queue in a bad state.
    served = serve()
    gate = hold_writer(served)
    served.committer.max_pending_bytes = 100
    served.committer.submit([Record("filler", b"x" * 200)], "socket")
    assert served.client.post("/topics/a", content=b"1").status_code == 503
    served.committer.max_pending_bytes = 64 * 1024 * 1024
    gate.release.set()
    for i in range(5):
        assert served.client.post("/topics/a", content=b"%d" % i).status_code == 202
    assert len(served.messages("a")) == 5
