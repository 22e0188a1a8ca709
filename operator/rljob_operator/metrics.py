"""Prometheus metrics of the operator, on a registry of its own (several operators can run
in one test process without clashing on the global registry)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rljob_api.status import EngineState, Phase

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
        self.engines_ready = Gauge("rljob_engines_ready",
                                   "Rollout engines serving requests, by job (as its runtime "
                                   "reports in status.engines).", ["namespace", "job"],
                                   registry=r)
        self.engines_total = Gauge("rljob_engines_total", "Rollout engines of the job.",
                                   ["namespace", "job"], registry=r)
        self.engine_weight_version = Gauge(
            "rljob_engine_weight_version",
            "The weight version each rollout engine serves (absent while it is lost).",
            ["namespace", "job", "engine"], registry=r)
        self._phases: dict[Key, str] = {}
        self._engines: dict[Key, set[str]] = {}  # engines with a version gauge, by job
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

    def set_engines(self, key: Key, engines: Mapping[str, Any] | None) -> None:
        """The job's `status.engines` as gauges; None (a job without engines, or gone)
        removes its series."""
        namespace, job = key
        with self._lock:
            for name in self._engines.pop(key, set()):
                self.engine_weight_version.remove(namespace, job, name)
            if not engines:
                for gauge in (self.engines_ready, self.engines_total):
                    with contextlib.suppress(KeyError):
                        gauge.remove(namespace, job)
                return
            self.engines_ready.labels(namespace, job).set(_count(engines.get("ready")))
            self.engines_total.labels(namespace, job).set(_count(engines.get("total")))
            serving = {str(e.get("name")): e.get("weightVersion")
                       for e in engines.get("engines") or []
                       if isinstance(e, Mapping) and e.get("state") == EngineState.serving.value}
            for name, version in serving.items():
                if isinstance(version, int) and not isinstance(version, bool):
                    self.engine_weight_version.labels(namespace, job, name).set(version)
                    self._engines.setdefault(key, set()).add(name)

    def remembered(self, sizes: Callable[[], dict[str, int]]) -> None:
        """`rljob_operator_remembered{what}`: what the operator holds per job (cached
        objects, failure hints, per-job state, tracked jobs), counted at each scrape, so a
        soak can check that nothing outlives the jobs."""
        self.registry.register(_Remembered(sizes))

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Start the /metrics HTTP server; returns it so it can be shut down."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _Remembered(Collector):
    def __init__(self, sizes: Callable[[], dict[str, int]]) -> None:
        self.sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("rljob_operator_remembered",
                                   "What the operator holds, by kind.", labels=["what"])
        for what, count in self.sizes().items():
            family.add_metric([what], count)
        yield family
