"""Operator settings from flags, with environment defaults (for the Helm chart)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

# How long a node must have been NotReady (its Ready condition False or Unknown, counted from
# that condition's lastTransitionTime) before the operator counts it lost: force-deletes the
# job pods bound to it and restarts their running attempts as NodeLost. The node controller
# only marks a node NotReady after its kubelet has been silent for node-monitor-grace-period
# (40-50 s), and the kubelet often returns (a restart, a network or control-plane blip),
# while a restart costs a GPU job its steps since the last checkpoint and minutes of start-up:
# two more minutes ride out such blips. It stays well under the 300 s after which Kubernetes
# evicts the pods itself (the default NoExecute toleration), which would leave them
# terminating on the unreachable node. A node that is deleted counts at once.
NODE_LOST_AFTER_SECONDS = 120.0


@dataclass(frozen=True)
class OperatorConfig:
    kubeconfig: str | None = None
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    interval: float = 10.0  # seconds between resyncs of one job (read from the watch cache)
    resync: float = 600.0  # seconds between reads of one job from the API server itself
    workers: int = 4
    server_timeout: int = 60  # watch requests end server-side after this long (seconds)
    metrics_port: int = 9090  # 0 disables /metrics
    metrics_addr: str = "0.0.0.0"
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    verbose: bool = False
    node_lost_after: float = NODE_LOST_AFTER_SECONDS  # 0: a node not Ready is lost at once
    kueue: bool = False  # queue jobs that name a LocalQueue as Kueue Workloads


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def _env_bool(name: str) -> bool:
    """A switch from the environment: unset, empty, `0`/`false` off, `1`/`true` on; any
    other value stops the operator with the variable's name (never silently off)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false"):
        return False
    if raw in ("1", "true"):
        return True
    raise SystemExit(f"rljob-operator: ${name} is {os.environ[name]!r}: set it to true or "
                     "false (or leave it unset)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rljob-operator",
        description="Reconcile RLJob objects onto KubeRay and report their state.")
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                   help="kubeconfig file (default: $KUBECONFIG, else in-cluster service account)")
    p.add_argument("--namespace", "-n", action="append", default=[], dest="namespaces",
                   help="watch only this namespace (repeatable; default: all namespaces)")
    p.add_argument("--interval", type=float,
                   default=_env_float("RLJOB_OPERATOR_INTERVAL", OperatorConfig.interval),
                   help="seconds between resyncs of each job ($RLJOB_OPERATOR_INTERVAL)")
    p.add_argument("--resync", type=float,
                   default=_env_float("RLJOB_OPERATOR_RESYNC", OperatorConfig.resync),
                   help="seconds between safety resyncs of each job, which read it and its "
                        "children from the API server instead of the watch cache "
                        "($RLJOB_OPERATOR_RESYNC)")
    p.add_argument("--workers", type=int, default=OperatorConfig.workers,
                   help="jobs reconciled in parallel")
    p.add_argument("--server-timeout", type=int,
                   default=int(os.environ.get("RLJOB_OPERATOR_SERVER_TIMEOUT", "60")),
                   help="watch timeout in seconds; the stream is re-opened after it")
    p.add_argument("--metrics-port", type=int,
                   default=int(os.environ.get("RLJOB_OPERATOR_METRICS_PORT", "9090")),
                   help="Prometheus /metrics port; 0 disables it")
    p.add_argument("--metrics-addr", default=OperatorConfig.metrics_addr)
    p.add_argument("--liveness", default=os.environ.get(
        "RLJOB_OPERATOR_LIVENESS", OperatorConfig.liveness),
                   help="liveness endpoint URL, e.g. http://0.0.0.0:8080/healthz; '' disables")
    p.add_argument("--node-lost-after", type=float,
                   default=_env_float("RLJOB_OPERATOR_NODE_LOST_AFTER",
                                      OperatorConfig.node_lost_after),
                   help="seconds a node must be NotReady before its job pods are force-deleted "
                        "and their jobs restarted; 0: at once ($RLJOB_OPERATOR_NODE_LOST_AFTER)")
    p.add_argument("--kueue", action="store_true", default=None,
                   help="queue RLJobs that name a Kueue LocalQueue (label "
                        "kueue.x-k8s.io/queue-name or spec.scheduling.queue) as Kueue "
                        "Workloads; needs Kueue's CRDs and RBAC for them "
                        "($RLJOB_OPERATOR_KUEUE=true)")
    p.add_argument("--verbose", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> OperatorConfig:
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        raise SystemExit("rljob-operator: --interval must be > 0 seconds")
    if args.resync <= 0:
        raise SystemExit("rljob-operator: --resync must be > 0 seconds")
    if args.workers < 1:
        raise SystemExit("rljob-operator: --workers must be >= 1")
    if args.node_lost_after < 0:
        raise SystemExit("rljob-operator: --node-lost-after must be >= 0 seconds")
    return OperatorConfig(
        kubeconfig=args.kubeconfig or None,
        namespaces=tuple(args.namespaces),
        interval=args.interval,
        resync=args.resync,
        workers=args.workers,
        server_timeout=args.server_timeout,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        liveness=args.liveness or None,
        verbose=args.verbose,
        node_lost_after=args.node_lost_after,
        kueue=bool(args.kueue) or _env_bool("RLJOB_OPERATOR_KUEUE"),
    )
