"""When to restart a crashed child process, and when to stop trying: the forwarder's policy.

A run that ends without being asked to is a crash. Crashes are restarted with exponential
back-off (``backoff``, doubling up to ``backoff_max``); a run that lasted ``healthy_after``
seconds was healthy, and the crash that ends it starts the count and the back-off afresh.
``max_crashes`` crashes in a row with no healthy run between them (each within
``healthy_after`` seconds of its start) give up: :func:`supervise` raises :class:`GaveUp`,
and the daemon exits non-zero so that its service manager restarts it and shows the failure.
With the defaults, a forwarder that dies at once gives up after about two minutes.

tenacity does the counting, the back-off arithmetic and the stop rule; each healthy run ends
one tenacity loop and begins the next, which is how the back-off decays. The sleep is the
caller's (an Event's wait), so a stop request cuts a back-off short.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_exponential,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    backoff: float = 0.5
    backoff_max: float = 30.0
    healthy_after: float = 60.0
    max_crashes: int = 10  # 0: never give up


@dataclass(frozen=True)
class Exit:
    """How one run of the child ended: its exit code and how long it had run."""

    exitcode: int | None
    seconds: float


class ShortRun(Exception):
    """A run that crashed before it counted as healthy."""

    def __init__(self, exit: Exit) -> None:
        super().__init__(f"exit code {exit.exitcode} after {exit.seconds:.1f} s")
        self.exit = exit


class GaveUp(Exception):
    """``max_crashes`` short runs in a row: restarting again would not help."""

    def __init__(self, name: str, policy: RestartPolicy, last: Exit) -> None:
        super().__init__(
            f"the {name} process crashed {policy.max_crashes} times in a row, each within "
            f"{policy.healthy_after:g} s of starting (last: exit code {last.exitcode} after "
            f"{last.seconds:.1f} s); giving up")
        self.last = last


def supervise(
    name: str,
    run: Callable[[], Exit | None],
    policy: RestartPolicy,
    sleep: Callable[[float], None],
) -> None:
    """Call ``run`` over and over until it returns None (asked to stop); raise :class:`GaveUp`.

    ``run`` starts the child if it is not running, waits for it to end, and returns how it
    ended, or None once the child was asked to stop. It is called again at once after a
    healthy run, after a back-off after a short one.
    """

    def attempt() -> Exit | None:
        ended = run()
        if ended is not None and ended.seconds < policy.healthy_after:
            raise ShortRun(ended)
        return ended

    def before_sleep(state: RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        crash = state.outcome.exception()
        log.error("%s process crashed (%s); restarting it in %.3g s (%d in a row%s)", name,
                  crash, state.next_action.sleep, state.attempt_number,
                  f" of at most {policy.max_crashes}" if policy.max_crashes else "")

    while True:
        retrying = Retrying(
            retry=retry_if_exception_type(ShortRun),
            wait=wait_exponential(multiplier=policy.backoff, max=policy.backoff_max),
            stop=stop_after_attempt(policy.max_crashes) if policy.max_crashes else stop_never,
            sleep=sleep,
            before_sleep=before_sleep,
        )
        try:
            ended = retrying(attempt)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            assert isinstance(last, ShortRun)
            raise GaveUp(name, policy, last.exit) from last
        if ended is None:
            return
        log.error("%s process crashed (exit code %s) after a healthy %.0f s; restarting it",
                  name, ended.exitcode, ended.seconds)
