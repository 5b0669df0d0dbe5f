"""Group commit: one writer thread turns many small submissions into few durable transactions.

Sources call ``submit()`` with a group of records and a callback. The writer thread takes
everything submitted since its last commit, writes it in one LMDB transaction, fsyncs, and then
calls each callback with the group's ids (or the reason it was refused). While one fsync is in
progress the next group accumulates, so the commit rate adapts to the disk: one fsync per
group, not per message. No source thread ever waits for an fsync unless it asks to.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.buffer.appender import EncodedGroup
from agent.buffer.generations import GENERATIONS_MAX_AGE
from agent.buffer.packing import Pack
from agent.buffer.refusals import BufferFull, BufferUnavailable, Refusal
from agent.buffer.state import StateChange
from agent.buffer.store import Store
from agent.buffer.weight import records_weight, runs_weight
from agent.metrics import REGISTRY, Registry
from agent.reasons import BUFFER_FULL, DISK_ERROR, DISK_FULL, SPACE
from agent.records import Record, Source

log = logging.getLogger(__name__)

# What a callback receives: the ids of the group's messages, or the refusal (refusals.py).
Result = list[bytes] | Refusal
Callback = Callable[[Result], None]
# One all-or-nothing group for ``submit_groups()``: its records, and optionally state to store
# with them, derived from the ids they get (e.g. an idempotency key and its answer).
Group = tuple[Sequence[Record], Callable[[list[bytes]], Mapping[bytes, bytes]] | None]
# After this long, a refusal no longer counts as "full" for readiness unless a commit says so
# again (a refusal by the filesystem rather than by the buffer's size need not shrink it).
FULL_RECHECK_SECONDS = 5.0
# A refusal episode ends (and is logged as over) once this long has passed without a refusal:
# near the limit, commits alternate between stored and refused, which must not log each time.
REFUSING_QUIET_SECONDS = 5.0

class ShuttingDown(Exception):
    """Submitted after ``close()``; nothing was stored."""


@dataclass(slots=True)
class _Submission:
    records: Sequence[Record] | EncodedGroup
    source: str
    callback: Callback | None
    state_puts: Mapping[bytes, bytes] | None = None
    state_deletes: Sequence[bytes] = ()
    weight: int = 0
    derive: Callable[[list[bytes]], Mapping[bytes, bytes]] | None = None
    # A pack (packing.py) and the hand-over it answers: split if it does not fit.
    pack: tuple[Pack, _Collect] | None = None


class _Collect:
    """Gathers the results of ``submit_groups()``'s groups; calls back once, with all."""

    __slots__ = ("results", "remaining", "callback")

    def __init__(self, n: int, callback: Callable[[list[Result]], None]) -> None:
        self.results: list[Result] = [[] for _ in range(n)]
        self.remaining = n
        self.callback = callback

    def __call__(self, index: int, result: Result) -> None:
        # Only the writer thread calls this, so counting needs no lock.
        self.results[index] = result
        self.remaining -= 1
        if self.remaining == 0:
            self.callback(self.results)


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None

    def __call__(self, result: Result) -> None:
        self.result = result
        self.event.set()


class Committer:
    """The buffer's single writer thread in this process."""

    def __init__(
        self,
        store: Store,
        *,
        registry: Registry = REGISTRY,
        max_pending_bytes: int = 64 * 1024 * 1024,
        max_batch_messages: int = 20000,
        linger_ms: float = 0.0,
        name: str = "ingest",
        nice: int = 0,
        committed: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        # Called on the writer thread after a commit that stored messages (the daemon
        # wakes the forwarder with it: agent/signals/commit.py).
        self.committed = committed
        self.registry = registry
        self.max_pending_bytes = max_pending_bytes
        self.max_batch_messages = max_batch_messages
        self.linger = linger_ms / 1000.0
        self.name = name
        self.nice = nice
        self._cond = threading.Condition()
        self._pending: list[_Submission] = []
        self._pending_bytes = 0
        self._closed = False
        self._full = False
        self._used_at_refusal = 0
        self._refused_at = 0.0
        self._full_by_size = False  # refused for max_bytes (BufferFull), not by the disk
        self._full_reason = BUFFER_FULL  # why, while full: buffer_full, disk_full, disk_error
        self._refusing = _Refusing()  # the current refusal episode, for the log
        # Topic generations as last read, for packs (submit_groups): when, and what.
        self._generations_at = -GENERATIONS_MAX_AGE
        self._generations: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"committer-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def full(self) -> bool:
        """True after a refusal for lack of space, until there is room again.

        Room comes back as the forwarder deletes; re-checking here (not only at the next
        commit) lets /status/ready recover by itself, so load balancers send traffic again.
        A refusal that did not come from the buffer's own size (the filesystem full, a disk
        error: room may come back without the buffer shrinking) is given up on after
        ``FULL_RECHECK_SECONDS``: the next commit tells whether it is still true."""
        if self._full and (
                self.store.used_bytes() < self._used_at_refusal * 0.9
                or (not self._full_by_size
                    and time.monotonic() - self._refused_at >= FULL_RECHECK_SECONDS)):
            self._full = False
            self.registry.set("buffer_full", 0.0)
        return self._full

    @property
    def full_reason(self) -> str:
        """Why the last refusal happened (meaningful while ``full``): ``buffer_full`` (the
        buffer's max_bytes), ``disk_full`` (the filesystem's reserve) or ``disk_error``."""
        return self._full_reason

    def submit(
        self,
        records: Sequence[Record],
        source: str,
        callback: Callback | None = None,
        *,
        state_puts: Mapping[bytes, bytes] | None = None,
        state_deletes: Sequence[bytes] = (),
        state_from_ids: Callable[[list[bytes]], Mapping[bytes, bytes]] | None = None,
        block: bool = True,
    ) -> bool:
        """Queue a group for the next commit. The group is stored entirely or not at all.

        When the queue is over ``max_pending_bytes`` this waits (``block=True``, for sources
        whose senders should feel back-pressure) or returns False at once.
        """
        sub = _Submission(records, source, callback, state_puts, state_deletes,
                          records_weight(records), state_from_ids)
        return self._enqueue(sub, block)

    def submit_groups(
        self,
        groups: Sequence[Group],
        source: str,
        callback: Callable[[list[Result]], None],
    ) -> bool:
        """Queue several independent groups at once; ``callback`` gets every group's result.

        For a source that gathers many small requests before handing them over (the HTTP
        event loop, once per loop iteration): one lock, one wake-up of the writer and one
        callback for all of them, instead of one each. Each group is still stored entirely
        or not at all, on its own: one refused group does not refuse the others. Groups of
        one message without state are the exception: they are packed and stored, or refused,
        together (packing.py says why and what that changes). The callback runs on the writer
        thread once the last group's commit is durable (the groups may span commits), with
        the results in the order of ``groups``.

        Never waits: returns False at once (nothing queued) when the queue is over
        ``max_pending_bytes``. Raises ShuttingDown after ``close()``.
        """
        if not groups:
            raise ValueError("submit_groups() needs at least one group")
        collect = _Collect(len(groups), callback)
        # Submissions in hand-over order; a pack takes the place of its first group.
        subs: list[_Submission | Pack] = []
        total = 0
        pack: Pack | None = None
        generations = self._topic_generations()
        for i, (records, derive) in enumerate(groups):
            if derive is None and len(records) == 1:
                if pack is None or len(pack) >= self.max_batch_messages:
                    pack = Pack()
                    subs.append(pack)
                record = records[0]
                if pack.add(i, record, generations.get(record.topic, 0)):
                    continue
            weight = records_weight(records)
            total += weight
            subs.append(_Submission(records, source, functools.partial(collect, i), None, (),
                                    weight, derive))
        queued: list[_Submission] = []
        for sub in subs:
            if isinstance(sub, Pack):
                if not sub:
                    continue  # its one message could not be encoded: a group of its own
                total += sub.weight
                sub = _Submission(sub.group(), source, functools.partial(sub.fan_out, collect),
                                  None, (), sub.weight, pack=(sub, collect))
            queued.append(sub)
        with self._cond:
            if self._closed:
                raise ShuttingDown("the buffer is closing")
            if self._pending_bytes > self.max_pending_bytes:
                return False
            self._pending += queued
            self._pending_bytes += total
            self._cond.notify_all()
        return True

    def _topic_generations(self) -> dict[str, int]:
        """The buffer's topic generations, read at most every GENERATIONS_MAX_AGE (what a
        pack encodes under; a stale one is re-encoded in the transaction)."""
        now = time.monotonic()
        if now - self._generations_at > GENERATIONS_MAX_AGE:
            try:
                self._generations = self.store.generations()
            except Exception as exc:  # noqa: BLE001 - the commit reports a disk really gone
                log.warning("could not read topic generations (using the last known): %s",
                            exc)
            self._generations_at = now
        return self._generations

    def submit_encoded(
        self, group: EncodedGroup, source: str, callback: Callback | None = None
    ) -> None:
        """Queue messages already encoded for the buffer (``EncodedGroup``), all or nothing.

        For the datagram socket, whose thread encodes while this one commits. Waits, as
        ``submit(block=True)`` does, while the queue is over ``max_pending_bytes``.
        """
        self._enqueue(_Submission(group, source, callback, None, (), runs_weight(group.runs)),
                      block=True)

    def _enqueue(self, sub: _Submission, block: bool) -> bool:
        with self._cond:
            while self._pending_bytes > self.max_pending_bytes and not self._closed:
                if not block:
                    return False
                self._cond.wait()
            if self._closed:
                raise ShuttingDown("the buffer is closing")
            self._pending.append(sub)
            self._pending_bytes += sub.weight
            self._cond.notify_all()
        return True

    def commit(
        self,
        records: Sequence[Record],
        source: str,
        *,
        state_puts: Mapping[bytes, bytes] | None = None,
        state_deletes: Sequence[bytes] = (),
        timeout: float | None = None,
    ) -> Result:
        """Submit and wait until the group is durable (or refused). For callers that can block."""
        waiter = _Waiter()
        self.submit(records, source, waiter, state_puts=state_puts, state_deletes=state_deletes)
        if not waiter.event.wait(timeout):
            raise TimeoutError("the buffer did not commit in time")
        assert waiter.result is not None
        return waiter.result

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then stop. Later submissions raise ShuttingDown."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- writer thread ---------------------------------------------------------------------
    def _take(self) -> list[_Submission] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return None
            if self.linger and not self._closed:
                # Let a burst finish arriving; bounded, and only when asked for.
                deadline = time.monotonic() + self.linger
                while (remaining := deadline - time.monotonic()) > 0 and not self._closed:
                    if sum(len(s.records) for s in self._pending) >= self.max_batch_messages:
                        break
                    self._cond.wait(remaining)
            pending = self._pending
            cut, n = 0, 0
            while cut < len(pending) and (
                cut == 0 or n + len(pending[cut].records) <= self.max_batch_messages
            ):
                n += len(pending[cut].records)
                cut += 1
            taken = pending[:cut]
            del pending[:cut]
            self._pending_bytes -= sum(s.weight for s in taken)
            self._cond.notify_all()
            return taken

    @property
    def native_id(self) -> int | None:
        """The writer thread's id in the kernel (once started)."""
        return self._thread.native_id

    def _run(self) -> None:
        if self.nice:
            _set_own_nice(self.nice, self._thread.name)
        while True:
            taken = self._take()
            if taken is None:
                return
            self._commit(taken)
            # Not kept while waiting for the next: the groups' records and callbacks (an
            # HTTP publish's, with its connection and body) would stay in memory until then.
            del taken

    def _commit(self, taken: list[_Submission]) -> None:
        states = [StateChange(s.state_puts or {}, s.state_deletes, s.derive)
                  if s.state_puts or s.state_deletes or s.derive else None for s in taken]
        started = time.perf_counter()
        results: list[Result]
        full = by_size = False
        try:
            appended = self.store.append([s.records for s in taken], states=states)
            results = list(appended)
            reasons = {r.reason for r in results if isinstance(r, BufferFull)}
            full = bool(reasons & SPACE)
            by_size = BUFFER_FULL in reasons
            if full:
                # The disk's reasons first: they are what an operator has to act on.
                self._full_reason = min(reasons & SPACE,
                                        key=(DISK_FULL, DISK_ERROR, BUFFER_FULL).index)
        except (BufferFull, BufferUnavailable) as exc:
            # The transaction was aborted: nothing of it is on disk. (Logged once per
            # episode by _account, not per commit.)
            results = [exc] * len(taken)
            full = True
            by_size = exc.reason == BUFFER_FULL
            self._full_reason = exc.reason if exc.reason in SPACE else DISK_ERROR
        except Exception as exc:  # noqa: BLE001 - never let the writer thread die silently
            log.exception("buffer commit failed")
            results = [BufferUnavailable(DISK_ERROR, f"commit failed: {exc}")] * len(taken)
        elapsed = time.perf_counter() - started
        # Outside the try: the groups' fate is settled; a failure to measure the buffer now
        # must not be reported as a failed commit of groups that are stored.
        self._full = full
        self._full_by_size = by_size
        if full:
            self._refused_at = time.monotonic()
            try:
                self._used_at_refusal = self.store.used_bytes()
            except Exception:  # noqa: BLE001 - readiness falls back to the time re-check
                self._used_at_refusal = 0
        taken, results = self._split_refused_packs(taken, results)
        self._account(taken, results, elapsed)
        if self.committed is not None and any(type(r) is list and r for r in results):
            self.committed()
        for sub, result in zip(taken, results, strict=True):
            if sub.callback is not None:
                try:
                    sub.callback(result)
                except Exception:  # noqa: BLE001 - a bad callback must not stop the writer
                    log.exception("commit callback failed")

    def _split_refused_packs(self, taken: list[_Submission], results: list[Result]
                             ) -> tuple[list[_Submission], list[Result]]:
        """Packs refused for room go back to the queue's front, a group per message, for the
        next commit: near the limit, those that fit are stored, as they would have been
        without packing. The rest of ``taken``, with their results."""
        kept: list[tuple[_Submission, Result]] = []
        retry: list[_Submission] = []
        for sub, result in zip(taken, results, strict=True):
            if sub.pack is not None and isinstance(result, BufferFull) and len(sub.pack[0]) > 1:
                pack, collect = sub.pack
                for index, group in pack.split():
                    retry.append(_Submission(group, sub.source,
                                             functools.partial(collect, index), None, (),
                                             runs_weight(group.runs)))
            else:
                kept.append((sub, result))
        if not retry:
            return taken, results
        with self._cond:
            self._pending[:0] = retry
            self._pending_bytes += sum(s.weight for s in retry)
            self._cond.notify_all()
        return [sub for sub, _ in kept], [result for _, result in kept]

    def _account(self, taken: list[_Submission], results: list[Result], elapsed: float) -> None:
        reg = self.registry
        reg.inc("buffer_commits", writer=self.name)
        reg.observe("buffer_commit_seconds", elapsed, writer=self.name)
        reg.set("buffer_full", 1.0 if self._full else 0.0)
        accepted: dict[tuple[str, str], int] = {}
        refused: dict[str, int] = {}
        detail = ""
        for sub, result in zip(taken, results, strict=True):
            if isinstance(result, list):
                if isinstance(sub.records, EncodedGroup):
                    for topic, values, _ in sub.records.runs:
                        k = (sub.source, topic)
                        accepted[k] = accepted.get(k, 0) + len(values)
                    continue
                for r in sub.records:
                    k = (sub.source, r.topic)
                    accepted[k] = accepted.get(k, 0) + 1
            else:
                reason = result.reason
                if reason in SPACE and sub.source == Source.SPOOL:
                    # Not a rejection: the records wait in their file and the intake retries
                    # (spool_batches_deferred, counted and logged by the intake, once per
                    # attempt and once per pause).
                    continue
                if reason in SPACE:
                    refused[reason] = refused.get(reason, 0) + len(sub.records)
                    detail = str(result)
                reg.inc("messages_rejected", len(sub.records), source=sub.source, reason=reason)
                # The status page shows recent examples of every reject reason.
                reg.sample("rejected", reason, {"source": sub.source, "detail": str(result),
                                                "messages": len(sub.records)})
        for (source, topic), n in accepted.items():
            reg.inc("messages_accepted", n, source=source, topic=topic)
        self._refusing.update(refused, detail, sum(accepted.values()), time.monotonic())


class _Refusing:
    """Logs refusals for lack of space once per change of state, with counts: when they
    start, when a new reason joins, and when none came for REFUSING_QUIET_SECONDS. A full
    buffer or disk refuses every group; a line per refused group was thousands a second."""

    def __init__(self) -> None:
        self.since = 0.0  # 0: not refusing
        self.last = 0.0
        self.counts: dict[str, int] = {}
        self.accepted = 0  # messages stored meanwhile (commits alternate near the limit)

    def update(self, refused: Mapping[str, int], detail: str, accepted: int,
               now: float) -> None:
        if refused:
            if not self.since:
                self.since = now
                self.counts = {}
                self.accepted = 0
            for reason, n in refused.items():
                if reason not in self.counts:
                    self.counts[reason] = 0
                    log.warning("the buffer refuses new messages (%s): %s; they are counted "
                                "as messages_rejected{reason=%s} and refused until there is "
                                "room again", reason, detail, reason)
                self.counts[reason] += n
            self.last = now
            self.accepted += accepted
            return
        if not self.since:
            return
        self.accepted += accepted
        if accepted and now - self.last >= REFUSING_QUIET_SECONDS:
            counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.counts.items()))
            log.warning("the buffer accepts new messages again: %s refused over %.1f s "
                        "(%d stored meanwhile)", counts, self.last - self.since, self.accepted)
            self.since = 0.0


def _set_own_nice(nice: int, thread: str) -> bool:
    """Give the calling thread the nice value ``nice``; False when the system refuses.

    On Linux a nice value belongs to a thread, so this raises (or lowers) the priority of this
    one thread only. Why the writer gets a higher one: under full load on two cores its commits
    spent most of their 99th percentile runnable but not running (wall time several times
    the thread's CPU time within a single ``putmulti``); measured in docs/buffer.md."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.info("the %s thread keeps its nice value: setting it to %d was refused (%s); "
                 "allow it with RLIMIT_NICE (systemd: LimitNICE=%d, as the packaged unit "
                 "does) or CAP_SYS_NICE", thread, nice, exc.strerror or exc, nice)
        return False
    log.debug("the %s thread runs at nice %d", thread, nice)
    return True
