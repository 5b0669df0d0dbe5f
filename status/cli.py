"""``ferry status``: a readable summary of a running agent, usable as a Nagios check.

It fetches ``/status/all?history=1``, judges it with ``status.model.health`` (thresholds can
be tightened or loosened per host), prints Nagios plugin output and exits with the Nagios
code:

====  ==========  ===============================================================
code  state       when
====  ==========  ===============================================================
0     OK          no problem found
1     WARNING     a cluster down while another works, a topic failing to deliver
                  on a transient error for 10 s, oldest message older than
                  ``--warn-age`` (60 s), buffer over 80 % used, the agent starting or
                  stopping, messages discarded / spool files quarantined / a process
                  restarted in the last 10 minutes
2     CRITICAL    buffer full, buffer over 95 % used, oldest message older than
                  ``--crit-age`` (600 s), every configured cluster down (with the
                  reason, e.g. the connect error), a topic that only an operator can
                  unblock (an ACL, a missing topic: named with its error)
3     UNKNOWN     the agent cannot be reached, answers an HTTP error, or answers
                  something that is not a valid status document
====  ==========  ===============================================================

The first output line is the Nagios status line with performance data after ``|``; the
lines after it are the long output a person reads. Only the standard library is used for
HTTP, so the check runs wherever Ferry is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO

import jsonschema

from status import model
from status.schema import validator

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
NAMES = {OK: "OK", WARNING: "WARNING", CRITICAL: "CRITICAL", UNKNOWN: "UNKNOWN"}
DEFAULT_URL = "http://127.0.0.1:9090"


class Unusable(Exception):
    """No trustworthy status document: unreachable, HTTP error or invalid answer."""


def fetch(url: str, timeout: float) -> dict[str, Any]:
    """``/status/all?history=1`` of the agent at ``url``, validated against the schema."""
    target = url.rstrip("/") + "/status/all?history=1"
    request = urllib.request.Request(target, headers={"Accept": "application/json",
                                                      "User-Agent": "ferry-status"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise Unusable(f"{target} answered HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unusable(f"cannot reach Ferry at {target}: {reason}") from None
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise Unusable(f"{target} did not answer JSON: {exc}") from None
    error = jsonschema.exceptions.best_match(validator("all").iter_errors(doc))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise Unusable(f"{target} answered an invalid status document at {where}: "
                       f"{error.message}")
    if not isinstance(doc, dict):
        raise Unusable(f"{target} answered {type(doc).__name__}, not an object")
    return doc


def status_command(
    url: str = DEFAULT_URL,
    timeout: float = 5.0,
    *,
    thresholds: model.Thresholds | None = None,
    out: TextIO | None = None,
) -> int:
    """Print the agent's status and return the Nagios exit code (0, 1, 2 or 3)."""
    out = out if out is not None else sys.stdout
    try:
        doc = fetch(url, timeout)
    except Unusable as exc:
        print(f"FERRY UNKNOWN - {exc}", file=out)
        return UNKNOWN
    verdict = model.health(doc, thresholds or model.Thresholds())
    code = int(verdict["code"])
    print(render(doc, verdict, code), file=out)
    return code


# -- output ----------------------------------------------------------------------------------


def _n(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    v, unit = float(value), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if v < 1024:
            break
        v, unit = v / 1024, bigger
    return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _uptime(seconds: float) -> str:
    s = int(seconds)
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    return f"{m}m {s % 60}s" if m else f"{s}s"


def _perfdata(doc: dict[str, Any], verdict: dict[str, Any]) -> str:
    buf = doc["queues"]["buffer"]
    th = verdict["thresholds"]
    tot = doc["totals"]
    used = buf["used_fraction"]
    parts = [
        f"buffered={buf['messages']};;;0",
        f"buffer_bytes={buf['bytes']}B;;;0",
    ]
    if used is not None:
        parts.append(f"buffer_used={used * 100:.2f}%;{th['used_warning_fraction'] * 100:g};"
                     f"{th['used_critical_fraction'] * 100:g};0;100")
    age = buf["oldest_age_seconds"]
    parts.append(f"oldest_age={0 if age is None else age:.3f}s;"
                 f"{th['oldest_warning_seconds']:g};{th['oldest_critical_seconds']:g};0")
    for name in ("accepted", "delivered", "discarded", "rejected", "delivery_failures"):
        parts.append(f"{name}={tot[name]}c")
    return " ".join(parts)


def render(doc: dict[str, Any], verdict: dict[str, Any], code: int) -> str:
    """Nagios status line (summary | perfdata), then the long output for people."""
    info, buf, tot = doc["info"], doc["queues"]["buffer"], doc["totals"]
    problems = verdict["problems"]
    if problems:
        summary = "; ".join(p["message"] for p in problems)
    else:
        up = [c["name"] for c in doc["clusters"] if c["up"]]
        summary = (f"{_n(buf['messages'])} buffered, oldest {_age(buf['oldest_age_seconds'])}"
                   + (f", {', '.join(up)} up" if up else ""))
    lines = [f"FERRY {NAMES[code]} - {summary} | {_perfdata(doc, verdict)}"]
    lines.append(f"Ferry {info['version']} on {info['hostname']}, pid {info['pid']}, "
                 f"up {_uptime(info['uptime_seconds'])}, {info['phase']}"
                 + ("" if info["ready"] else f" (not ready: {info['ready_reason']})"))
    used = buf["used_fraction"]
    lines.append(f"Buffer:    {_n(buf['messages'])} messages, {_bytes(buf['bytes'])}"
                 + (f"; {used:.1%} of {_bytes(buf['max_bytes'])} used" if used is not None
                    else "")
                 + f"; oldest {_age(buf['oldest_age_seconds'])}"
                 + ("; FULL" if buf["full"] else ""))
    by_source = ", ".join(f"{s} {_n(n)}" for s, n in tot["accepted_by_source"].items() if n)
    lines.append(f"Messages:  accepted {_n(tot['accepted'])}"
                 + (f" ({by_source})" if by_source else "")
                 + f", delivered {_n(tot['delivered'])}, discarded {_n(tot['discarded'])}, "
                 f"rejected {_n(tot['rejected'])}")
    clusters = []
    for c in doc["clusters"]:
        state = {"down": "DOWN"}.get(c["state"], c["state"])
        extra = []
        if c["state"] == "down" and c["reason"]:
            extra.append(c["reason"])
        if c["brokers_up"] is not None:
            extra.append(f"{c['brokers_up']} brokers")
        if c["latency"]["p99_seconds"] is not None:
            extra.append(f"p99 {_age(c['latency']['p99_seconds'])}")
        if c["delivery_failures"]:
            extra.append(f"{_n(c['delivery_failures'])} failures")
        clusters.append(f"{c['name']} {state}" + (f" ({', '.join(extra)})" if extra else ""))
    lines.append("Clusters:  " + ("; ".join(clusters) if clusters else "none"))
    sp = doc["spool"]
    pending = "" if sp["files_pending"] is None else f"{_n(sp['files_pending'])} files pending, "
    lines.append(f"Spool:     {pending}{_n(sp['files_ingested'])} files ingested, "
                 f"{_n(sp['files_quarantined'])} quarantined"
                 + (", paused: waiting for room in the buffer" if sp.get("paused") else ""))
    notable = [t for t in doc["topics"] if t["buffered"] or t["last_error"] or t["stuck"]]
    if notable:
        lines.append("Topics with buffered messages or errors:")
        for t in notable[:20]:
            err = t["last_error"]
            stuck = t["stuck"]
            lines.append(f"  {t['topic']}: {_n(t['buffered'])} buffered"
                         f" (oldest {_age(t['oldest_age_seconds'])})"
                         + (f", STUCK on {stuck['error']} @{stuck['cluster']}"
                            f" ({_n(stuck['failures'])} failed sends)" if stuck else
                            (f", last error {err['error']}"
                             + (f" @{err['cluster']}" if err["cluster"] else "") if err
                             else "")))
        if len(notable) > 20:
            lines.append(f"  ... and {len(notable) - 20} more (see /status/topics)")
    groups = [g for g in doc["discards"]["groups"] if g["kind"] != "error" and g["count"]]
    if groups:
        lines.append("Discards and rejects: " + ", ".join(
            f"{g['kind']} {g['reason']} {_n(g['count'])}" for g in groups))
    if problems:
        lines.append("Problems:")
        for p in problems:
            lines.append(f"  {p['level'].upper()} {p['check']}: {p['message']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m status.cli``: the same as ``ferry status``."""
    parser = argparse.ArgumentParser(prog="ferry status", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return status_command(args.url, args.timeout, thresholds=thresholds_from(args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m status.cli``."""
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"the agent's HTTP listener (default {DEFAULT_URL})")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the agent (default 5)")
    add_threshold_arguments(parser)


def add_threshold_arguments(parser: argparse.ArgumentParser) -> None:
    """The threshold options, shared by ``ferry status`` and ``python -m status.cli``."""
    d = model.Thresholds()
    parser.add_argument("--warn-age", type=float, default=d.oldest_warning_seconds,
                        help="oldest buffered message age for WARNING, seconds (default "
                        f"{d.oldest_warning_seconds:g})")
    parser.add_argument("--crit-age", type=float, default=d.oldest_critical_seconds,
                        help="... for CRITICAL (default "
                        f"{d.oldest_critical_seconds:g})")
    parser.add_argument("--warn-used", type=float, default=d.used_warning_fraction * 100,
                        help="buffer use in percent for WARNING (default "
                        f"{d.used_warning_fraction * 100:g})")
    parser.add_argument("--crit-used", type=float, default=d.used_critical_fraction * 100,
                        help="... for CRITICAL (default "
                        f"{d.used_critical_fraction * 100:g})")


def thresholds_from(args: argparse.Namespace) -> model.Thresholds:
    return model.Thresholds(
        oldest_warning_seconds=args.warn_age,
        oldest_critical_seconds=args.crit_age,
        used_warning_fraction=args.warn_used / 100,
        used_critical_fraction=args.crit_used / 100,
    )


if __name__ == "__main__":
    sys.exit(main())
