"""Garbage-collector settings for Ferry's long-running, allocation-heavy processes.

CPython's cyclic collector runs a young collection every 700 net allocations of container
objects and, every hundred of those, a full one that walks every tracked object the process
holds: the modules, settings and clients built at startup as well as everything in flight.
Ferry makes several such objects per message and keeps tens of thousands in flight, so with
the defaults the collector's walks become a per-message cost (the forwarder spent a fifth
of its time in them) and, with the GIL held, a latency spike.

Freezing the startup heap moves it out of every later collection, and a higher young
threshold makes collections rarer. Frozen objects are still freed by reference counting as
usual; only a reference cycle among them would outlive its use. Ferry's hot paths keep no
cycle alive: the one they make (a Flight holds the delivery-report list, which holds the
Flight's report) is broken as soon as the report is handled.
"""

from __future__ import annotations

import gc


def freeze_startup_heap(gen0_threshold: int) -> None:
    """Process-wide: collect once, freeze what exists now, and raise the young generation's
    threshold to ``gen0_threshold`` (never lower it). Call once startup is done."""
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 < gen0_threshold:
        gc.set_threshold(gen0_threshold, gen1, gen2)
