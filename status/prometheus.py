"""``/metrics``: the one metrics registry in Prometheus' text format, via prometheus_client.

A custom Collector reads a merged ``View`` at scrape time, so Prometheus sees the same numbers
as the status page, including the forwarder process's. Names follow Prometheus conventions:
``ferry_`` prefix, counters end in ``_total``, durations are ``_seconds`` histograms, sizes
are ``_bytes``. A private ``CollectorRegistry`` keeps prometheus_client's default process
collectors (which would describe only this one process) out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from agent.metrics import DEFINITIONS, Registry, View

PREFIX = "ferry_"


class FerryCollector(Collector):
    """Turns a registry View into metric families on every scrape."""

    def __init__(
        self,
        registry: Registry,
        *,
        version: str,
        started_at: float,
        view: Callable[[], View] | None = None,
    ) -> None:
        self.registry = registry
        self.version = version
        self.started_at = started_at
        self._view = view or registry.view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        info = GaugeMetricFamily(PREFIX + "build_info", "Ferry's version; always 1.",
                                 labels=["version"])
        info.add_metric([self.version], 1.0)
        yield info
        yield GaugeMetricFamily(PREFIX + "start_time_seconds",
                                "When the agent started, in seconds since the Unix epoch.",
                                value=self.started_at)
        for name, d in DEFINITIONS.items():
            labels = list(d.labels)
            if d.kind == "histogram":
                h = HistogramMetricFamily(PREFIX + name, d.help, labels=labels)
                for key, hist in sorted(view.hists.get(name, {}).items()):
                    values = dict(key)
                    cumulative, buckets = 0, []
                    for bound, c in zip(list(hist.buckets) + [math.inf], hist.counts,
                                        strict=True):
                        cumulative += c
                        buckets.append((_le(bound), float(cumulative)))
                    h.add_metric([values.get(lb, "") for lb in labels], buckets, hist.total)
                yield h
                continue
            series = view.values.get(name, {})
            family: CounterMetricFamily | GaugeMetricFamily
            if d.kind == "counter":
                family = CounterMetricFamily(PREFIX + name, d.help, labels=labels)
            else:
                family = GaugeMetricFamily(PREFIX + name, d.help, labels=labels)
            if not series and not labels and d.kind == "counter":
                series = {(): 0.0}  # an unlabelled counter that never moved is 0, not absent
            for key, value in sorted(series.items()):
                if not math.isfinite(value):
                    continue
                values = dict(key)
                family.add_metric([values.get(lb, "") for lb in labels], value)
            yield family
        # Metrics someone recorded without a definition (replace_gauge skips the check).
        for name in sorted(set(view.values) - set(DEFINITIONS)):
            series = view.values[name]
            labels = sorted({lb for key in series for lb, _ in key})
            g = GaugeMetricFamily(PREFIX + name, f"{name} (undocumented)", labels=labels)
            for key, value in sorted(series.items()):
                if math.isfinite(value):
                    values = dict(key)
                    g.add_metric([values.get(lb, "") for lb in labels], value)
            yield g


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class Exporter:
    """A private CollectorRegistry holding only Ferry's collector."""

    def __init__(self, collector: FerryCollector) -> None:
        # auto_describe=False: registering must not run a collection (a View) up front.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """One scrape: body and content type, negotiated from the ``Accept`` header.

        Prometheus text format 0.0.4 unless the scraper asks for OpenMetrics (or text 1.0.0).
        """
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
