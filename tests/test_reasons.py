"""One vocabulary of reasons (agent/reasons.py): every source counts, samples, answers and logs
with the same words, named only through the module's constants, and docs/status.md holds the
code's table. Every production module is read with ``ast``, so a reason written as a string
literal, or a new reason that is not in the vocabulary, fails here wherever it is added."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent import reasons
from agent.buffer.store import BufferFull, BufferUnavailable, DiskFull, InvalidGroup
from agent.metrics import DEFINITIONS

REPO = Path(__file__).resolve().parents[1]
WORDS = frozenset(w for table in reasons.VOCABULARY.values() for w in table)

# Literals equal to a word that do not name a reason: (module, word) -> what they are.
NOT_A_REASON: dict[tuple[str, str], str] = {
    ("agent/ingest/runtime.py", "starting"):
        "Phase.STARTING's value (the /ready reason is the phase)",
    ("agent/ingest/http/openapi.py", "starting"): "the phase enum of the Ready schema",
    ("agent/ingest/http/openapi.py", "generation"): "a field of the Deleted schema",
    ("agent/ingest/http/management.py", "generation"): "a field of DELETE /topics/{name}'s answer",
    ("agent/forwarder/discard_log.py", "attempts"): "a field of a discard-log line",
    ("agent/cli/replay.py", "attempts"): "a field of a discard-log line",
}
# A word may be a metric's name as well (buffer_full, the gauge): as a call's positional
# argument to these it is the metric, not the reason.
METRIC_NAME_CALLS = frozenset({"MetricDef", "set", "inc", "observe", "by", "_gauge", "_problem"})
# The metrics whose reason label is a vocabulary word.
VOCABULARY_METRICS = frozenset({"messages_rejected", "messages_discarded",
                                "spool_files_quarantined", "spool_batches_deferred"})
# Where a call takes its reason as a positional argument: callee name -> argument index.
REASON_ARGUMENT = {"discard": 1, "Discard": 0, "_quarantine": 3, "Reject": 0,
                   "BufferUnavailable": 0}
# HTTP refusals: the error code at argument 1 is the reason word when it is one (docs/http.md).
ERROR_CALLS = frozenset({"HttpError", "ApiError", "Refusal"})


@dataclass(frozen=True)
class Finding:
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}"


def _production() -> list[Path]:
    files = [*(REPO / "agent").rglob("*.py"), *(REPO / "status").rglob("*.py")]
    return sorted(p for p in files if p != REPO / "agent/reasons.py")


def _name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else \
        func.attr if isinstance(func, ast.Attribute) else None


def _word(node: ast.AST) -> str | None:
    """The word, if ``node`` is a string literal that is one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in WORDS:
        return node.value
    return None


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
        else None


def _reason_sites(nodes: list[ast.AST]) -> Iterator[tuple[ast.expr, bool]]:
    """Every expression that names a reason, and whether it must be a vocabulary word (False:
    only a word must not be written as a literal there, as other reasons share the spot)."""
    for node in nodes:
        if isinstance(node, ast.Call):
            name = _name(node)
            first = _literal(node.args[0]) if node.args else None
            counted = name in ("HttpError", "Outcome") or first in VOCABULARY_METRICS
            for kw in node.keywords:
                if kw.arg == "reason":
                    yield kw.value, counted
            if name in ERROR_CALLS and len(node.args) > 1:
                yield node.args[1], False
            index = REASON_ARGUMENT.get(name or "")
            if index is not None and len(node.args) > index:
                yield node.args[index], True
            if name == "sample" and first in reasons.VOCABULARY and len(node.args) > 1:
                yield node.args[1], True
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                pairs = zip(target.elts, node.value.elts, strict=False) \
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                    else [(target, node.value)]
                for t, v in pairs:
                    label = t.id if isinstance(t, ast.Name) else \
                        t.attr if isinstance(t, ast.Attribute) else ""
                    if v is not None and label.endswith("reason"):
                        yield v, False


def _reasons_names(tree: ast.AST) -> set[str]:
    """The names a module imported from agent.reasons (``from agent.reasons import X``)."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "agent.reasons"
            for alias in node.names}


def literal_reasons(tree: ast.AST, where: str) -> list[Finding]:
    """(a) A reason written as a string literal: in a reason's place, any literal that is a
    word, or that should be one and is not; anywhere else, any literal that is a word and is
    neither a metric's name nor listed in NOT_A_REASON."""
    found: list[Finding] = []
    placed: set[int] = set()
    nodes = list(ast.walk(tree))
    for expr, must in _reason_sites(nodes):
        placed.add(id(expr))
        word, text = _word(expr), _literal(expr)
        if word is not None:
            found.append(Finding(where, expr.lineno, f"reason {word!r} written as a literal: "
                                 f"use reasons.{word.upper()}"))
        elif must and text is not None:
            found.append(Finding(where, expr.lineno, f"reason {text!r} is not in the "
                                 "vocabulary (agent/reasons.py)"))
    metric_names: set[int] = set()
    for node in nodes:
        if isinstance(node, ast.Call) and _name(node) in METRIC_NAME_CALLS:
            metric_names |= {id(a) for a in node.args if _literal(a) in DEFINITIONS}
    for node in nodes:
        word = _word(node)
        if word is None or id(node) in placed or id(node) in metric_names \
                or (where, word) in NOT_A_REASON:
            continue
        found.append(Finding(where, getattr(node, "lineno", 0),
                             f"{word!r} is a reason word written as a literal: use "
                             f"reasons.{word.upper()} (or, if it is not a reason here, say so "
                             "in NOT_A_REASON)"))
    return found


def unknown_names(tree: ast.AST, where: str) -> list[Finding]:
    """(b) A ``reasons.X`` or ``from agent.reasons import X`` that the module does not hold."""
    found = [Finding(where, node.lineno, f"reasons.{node.attr} does not exist")
             for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
             and node.value.id == "reasons" and not hasattr(reasons, node.attr)]
    found += [Finding(where, node.lineno, f"agent.reasons has no {alias.name}")
              for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module == "agent.reasons"
              for alias in node.names if not hasattr(reasons, alias.name)]
    return found


@functools.cache
def _modules() -> tuple[tuple[str, ast.AST], ...]:
    return tuple((str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path)))
                 for path in _production())


def test_no_reason_is_written_as_a_literal() -> None:
    found = [f for where, tree in _modules() for f in literal_reasons(tree, where)]
    assert not found, "\n".join(map(str, found))


def test_every_reason_named_exists() -> None:
    found = [f for where, tree in _modules() for f in unknown_names(tree, where)]
    assert not found, "\n".join(map(str, found))


def test_the_vocabulary_is_used() -> None:
    """The rule is not met by nobody naming reasons: the sources do, through the module."""
    users = {where for where, tree in _modules()
             if _reasons_names(tree) or any(isinstance(n, ast.Attribute)
                                            and isinstance(n.value, ast.Name)
                                            and n.value.id == "reasons" for n in ast.walk(tree))}
    assert {"agent/ingest/datagram.py", "agent/ingest/socket_server.py",
            "agent/ingest/http/publish.py", "agent/ingest/http/protocol.py"} <= users, users


def test_the_checks_find_what_they_are_for() -> None:
    """Each rule above, shown failing on the kinds of code it was written against."""
    bad = ast.parse(
        'raise HttpError(413, "too_large", "m", reason="too_large")\n'
        'self.leaving.discard(f, "ttl", "old")\n'
        'Discard("corrupt", topic)\n'
        'self._quarantine(root, path, key, "unreadable", "x")\n'
        'raise Reject("malformed", "short")\n'
        'reg.inc("messages_rejected", 1, reason="bogus")\n'
        'reg.sample("discarded", "ttl", {})\n'
        'class Full(Exception):\n    reason = "buffer_full"\n'
        'reason, detail = "generation", "deleted"\n'
        'if refusal.reason == "disk_full": pass\n'
        'SPACE = frozenset({"disk_error"})\n')
    lines = sorted(f.line for f in literal_reasons(bad, "x.py"))
    assert lines == [1, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12], lines
    good = ast.parse(
        'raise HttpError(413, reasons.TOO_LARGE, "m", reason=reasons.TOO_LARGE)\n'
        'raise HttpError(404, "not_found", "m")\n'
        'reg.inc("transactions_aborted", reason="failed")\n'
        'reg.set("buffer_full", 1.0)\n'
        'MetricDef("buffer_full", "gauge", "1 while full")\n')
    assert literal_reasons(good, "x.py") == []
    assert [f.line for f in literal_reasons(ast.parse('x = {"attempts": 1}'),
                                            "agent/cli/replay.py")] == []
    missing = ast.parse("from agent.reasons import TTL, NO_SUCH\nx = reasons.NOPE\n")
    assert sorted(f.line for f in unknown_names(missing, "x.py")) == [1, 2]


def test_http_answers_with_the_word_it_counts() -> None:
    """An HTTP refusal's error code is its messages_rejected reason (the page shows that):
    where both name a word, they name the same one."""
    checked = 0
    for where, tree in _modules():
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or _name(call) != "HttpError" \
                    or len(call.args) < 2:
                continue
            reason = next((k.value for k in call.keywords if k.arg == "reason"), None)
            code = call.args[1]
            if reason is None or not isinstance(code, ast.Attribute):
                continue  # not counted here, or a code that is not a word (a 505)
            assert ast.dump(code) == ast.dump(reason), \
                f"{where}:{call.lineno}: answers {ast.unparse(code)} but counts " \
                f"{ast.unparse(reason)}"
            checked += 1
    assert checked >= 20


def test_each_word_has_its_constant() -> None:
    constants = {name: value for name, value in vars(reasons).items()
                 if name.isupper() and isinstance(value, str)}
    assert constants == {w.upper(): w for w in WORDS}
    assert set(reasons.REJECTED) >= reasons.SPACE


def test_buffer_refusals_are_in_the_vocabulary() -> None:
    for word in (BufferFull.reason, DiskFull.reason, InvalidGroup.reason,
                 BufferUnavailable(reasons.DISK_ERROR, "x").reason):
        assert word in reasons.REJECTED, word
    assert InvalidGroup.reason in reasons.QUARANTINED


def test_status_md_holds_the_code_s_table() -> None:
    assert reasons.table() in (REPO / "docs/status.md").read_text()
