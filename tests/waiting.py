"""Poll a condition with a deadline: what tests use instead of sleeping.

A fixed ``time.sleep`` is either too short (flaky) or too long (slow); polling until a condition
holds, with a deadline that turns a hang into a clear failure, is neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_NOT_CALLED = object()


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition",
    *,
    ignore: tuple[type[Exception], ...] = (),
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that value.

    Raises ``AssertionError`` naming ``message`` and the last value returned (or the last ignored
    exception, chained) once ``timeout`` seconds have passed. The predicate is always called at
    least once, and once more at the deadline, so a slow predicate cannot be starved.

    ``ignore`` lists exception types that mean "not yet" (e.g. ``ConnectionError`` while a server
    starts); any other exception propagates at once.
    """
    if timeout < 0 or interval <= 0:
        raise ValueError(f"bad timeout={timeout} / interval={interval}")
    deadline = time.monotonic() + timeout
    last: object = _NOT_CALLED
    last_error: Exception | None = None
    while True:
        final = time.monotonic() >= deadline
        try:
            value = predicate()
        except ignore as exc:
            last_error = exc
        else:
            if value:
                return value
            last, last_error = value, None
        if final:
            break
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    if last_error is not None:
        raise AssertionError(
            f"timed out after {timeout}s waiting for {message}; last error: {last_error!r}"
        ) from last_error
    raise AssertionError(f"timed out after {timeout}s waiting for {message}; last value: {last!r}")
