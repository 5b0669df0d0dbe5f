"""ferry_client/topic_names.py: Kafka's topic-name rule, held once for the whole project."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ferry_client.topic_names import MAX_LENGTH, PATTERN, RULE, illegal_topic, is_legal_topic

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["a", "a.b_c-D9", "x" * MAX_LENGTH, "...", "__consumer"])
def test_legal_names(name: str) -> None:
    assert is_legal_topic(name)
    assert re.fullmatch(PATTERN, name)


@pytest.mark.parametrize("name", ["", ".", "..", "x" * (MAX_LENGTH + 1), "a b", "a/b", "é",
                                  "a\n", "\na", "t\x00"])
def test_illegal_names(name: str) -> None:
    assert not is_legal_topic(name)


@pytest.mark.parametrize("value", [None, 7, b"topic"])
def test_a_non_string_is_illegal(value: object) -> None:
    assert not is_legal_topic(value)


def test_the_refusal_names_the_topic_and_the_rule() -> None:
    assert illegal_topic("a b") == f"'a b' is not a legal Kafka topic name: {RULE}"
    assert "x" * 10 + "'" in illegal_topic("x" * 500, shown=10)


def test_no_other_module_writes_the_rule() -> None:
    # The rule's length bound appears in one source file; a second copy could drift. (The same
    # character class serves other names, agent and job ids, with other lengths.)
    holders = [p.relative_to(ROOT).as_posix()
               for folder in ("agent", "spool", "status", "spark_writer", "ferry_client")
               for p in (ROOT / folder).rglob("*.py")
               if "{1,249}" in p.read_text() or "1 to 249" in p.read_text()]
    assert holders == ["ferry_client/topic_names.py"]
