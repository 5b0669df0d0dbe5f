"""One vocabulary of reasons (agent/reasons.py): every source counts, samples and (for HTTP)
answers with the same words, and docs/status.md holds the code's table. The sources are read
with ``ast`` so a new reason anywhere that is not in the vocabulary fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from agent import reasons
from agent.buffer.store import BufferFull, BufferUnavailable, DiskFull, InvalidGroup
from agent.ingest import datagram

REPO = Path(__file__).resolve().parents[1]


def _calls(path: Path, name: str) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def _str(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def test_http_answers_with_the_word_it_counts() -> None:
    """An HTTP refusal's error code is its messages_rejected reason (the page shows that)."""
    checked = 0
    for call in _calls(REPO / "agent/ingest/http/publish.py", "HttpError"):
        code = _str(call.args[1]) if len(call.args) > 1 else None
        reason = next((_str(k.value) for k in call.keywords if k.arg == "reason"), None)
        if reason is None:
            continue  # not counted as a reject (a 500), or counted by the committer
        assert code == reason, f"line {call.lineno}: answers {code!r} but counts {reason!r}"
        assert reason in reasons.REJECTED, f"line {call.lineno}: {reason!r}"
        checked += 1
    assert checked >= 10


def test_datagram_rejects_are_in_the_vocabulary() -> None:
    for word in (datagram.MALFORMED, datagram.UNSUPPORTED_API_KEY,
                 datagram.UNSUPPORTED_VERSION, datagram.INVALID_TOPIC, datagram.TOO_LARGE):
        assert word in reasons.REJECTED, word
    assert datagram.INVALID_TOPIC == "invalid_topic"  # as HTTP says it


def test_buffer_refusals_are_in_the_vocabulary() -> None:
    for word in (BufferFull.reason, DiskFull.reason, InvalidGroup.reason,
                 BufferUnavailable("disk_error", "x").reason, "shutting_down"):
        assert word in reasons.REJECTED, word


def test_forwarder_discards_are_in_the_vocabulary() -> None:
    found = set()
    for call in _calls(REPO / "agent/forwarder/forwarder.py", "_discard"):
        word = _str(call.args[1]) if len(call.args) > 1 else None
        assert word is not None, f"line {call.lineno}: a discard reason must be a literal"
        found.add(word)
    for call in _calls(REPO / "agent/forwarder/forwarder.py", "Discard"):
        word = _str(call.args[0]) if call.args else None
        if word is not None:
            found.add(word)
    assert found <= set(reasons.DISCARDED), found - set(reasons.DISCARDED)
    assert {"ttl", "attempts", "invalid", "generation", "corrupt"} <= found


def test_spool_quarantines_are_in_the_vocabulary() -> None:
    for call in _calls(REPO / "agent/ingest/spool_intake.py", "_quarantine"):
        word = _str(call.args[3]) if len(call.args) > 3 else None
        if word is not None:
            assert word in reasons.QUARANTINED, f"line {call.lineno}: {word!r}"
    assert InvalidGroup.reason in reasons.QUARANTINED


def test_status_md_holds_the_code_s_table() -> None:
    assert reasons.table() in (REPO / "docs/status.md").read_text()
