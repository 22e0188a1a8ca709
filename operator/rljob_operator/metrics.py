"""Prometheus metrics of the operator, on a registry of its own (several operators can run
in one test process without clashing on the global registry)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rljob_api.status import Phase

Key = tuple[str, str]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("rljob_operator_reconciles", "Reconciles by result.",
                                  ["result"], registry=r)
        self.reconcile_seconds = Histogram(
            "rljob_operator_reconcile_seconds", "Wall time of one reconcile.", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.status_writes = Counter("rljob_operator_status_writes",
                                     "Status writes (only when the operator's fields change).",
                                     registry=r)
        self.restarts = Counter("rljob_operator_restarts", "Job restarts by failure kind.",
                                ["reason"], registry=r)
        self.jobs = Gauge("rljob_jobs", "RLJobs by phase.", ["phase"], registry=r)
        self.time_to_running = Histogram(
            "rljob_time_to_running_seconds", "Seconds from an RLJob's creation to Running.",
            registry=r, buckets=(5, 15, 30, 60, 120, 300, 600, 1800, 3600))
        self._phases: dict[Key, str] = {}
        self._lock = threading.Lock()

    def set_phase(self, key: Key, phase: str | None) -> None:
        with self._lock:
            if phase is None:
                self._phases.pop(key, None)
            else:
                self._phases[key] = phase
            for p in Phase:
                self.jobs.labels(phase=p.value).set(
                    sum(1 for v in self._phases.values() if v == p.value))

    def remembered(self, sizes: Callable[[], dict[str, int]]) -> None:
        """`rljob_operator_remembered{what}`: what the operator holds per job (cached
        objects, failure hints, per-job state, tracked jobs), counted at each scrape, so a
        soak can check that nothing outlives the jobs."""
        self.registry.register(_Remembered(sizes))

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Start the /metrics HTTP server; returns it so it can be shut down."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server


class _Remembered(Collector):
    def __init__(self, sizes: Callable[[], dict[str, int]]) -> None:
        self.sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("rljob_operator_remembered",
                                   "What the operator holds, by kind.", labels=["what"])
        for what, count in self.sizes().items():
            family.add_metric([what], count)
        yield family
