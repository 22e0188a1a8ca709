"""The reconcile scheduler: one reconcile per job at a time, kicks coalesce, errors back off,
resyncs keep coming; and the command line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from rljob_operator.config import parse_args
from rljob_operator.controller import Controller

pytestmark = pytest.mark.unit


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_kicks_during_a_reconcile_queue_exactly_one_more_and_never_overlap() -> None:
    calls: list[tuple[str, str]] = []
    inside = threading.Event()
    release = threading.Event()
    active = [0, 0]  # current, max

    def reconcile(ns: str, name: str) -> float | None:
        active[0] += 1
        active[1] = max(active)
        calls.append((ns, name))
        if len(calls) == 1:
            inside.set()
            release.wait(5)
        active[0] -= 1
        return None

    async def scenario() -> None:
        ctl = Controller(reconcile, interval=60, workers=4)
        task = asyncio.create_task(ctl.run())
        ctl.track(("ns", "a"))
        await _until(inside.is_set)
        for _ in range(5):
            ctl.kick(("ns", "a"))
        release.set()
        # Settled: nothing running, queued or marked for another round.
        await _until(lambda: len(calls) >= 2 and not ctl._running and not ctl._queued
                     and not ctl._dirty)
        task.cancel()

    asyncio.run(scenario())
    assert calls == [("ns", "a"), ("ns", "a")]
    assert active[1] == 1


def test_errors_back_off_and_resync_follows_requeue_hints() -> None:
    times: list[float] = []

    def reconcile(ns: str, name: str) -> float | None:
        times.append(time.monotonic())
        if len(times) == 1:
            raise RuntimeError("API server unavailable")
        return 0.1  # e.g. a backoff deadline coming up

    async def scenario() -> None:
        ctl = Controller(reconcile, interval=30, workers=1)
        task = asyncio.create_task(ctl.run())
        ctl.track(("ns", "b"))
        await _until(lambda: len(times) >= 3)
        ctl.forget(("ns", "b"))
        task.cancel()

    asyncio.run(scenario())
    assert times[1] - times[0] >= 1.5  # first error: 2 s backoff
    assert times[2] - times[1] < 1.0  # then the 0.1 s requeue, not the 30 s interval


def test_untracked_jobs_are_not_reconciled() -> None:
    calls: list[tuple[str, str]] = []

    async def scenario() -> None:
        ctl = Controller(lambda ns, n: calls.append((ns, n)), interval=60, workers=1)
        task = asyncio.create_task(ctl.run())
        ctl.kick(("ns", "unknown"))
        ctl.track(("ns", "known"))  # queued after the kick: reconciled after it would be
        await _until(lambda: bool(calls))
        task.cancel()

    asyncio.run(scenario())
    assert calls == [("ns", "known")]


def test_command_line_flags() -> None:
    cfg = parse_args(["--kubeconfig", "/k", "-n", "a", "-n", "b", "--interval", "0.5",
                      "--metrics-port", "0", "--liveness", ""])
    assert cfg.kubeconfig == "/k" and cfg.namespaces == ("a", "b")
    assert cfg.interval == 0.5 and cfg.metrics_port == 0 and cfg.liveness is None
    with pytest.raises(SystemExit, match="--interval must be > 0"):
        parse_args(["--interval", "0"])


def test_node_lost_after_defaults_to_two_minutes_and_takes_zero() -> None:
    assert parse_args([]).node_lost_after == 120.0
    assert parse_args(["--node-lost-after", "0"]).node_lost_after == 0.0
    with pytest.raises(SystemExit, match="--node-lost-after must be >= 0"):
        parse_args(["--node-lost-after", "-1"])


def test_the_kueue_switch_from_the_environment_is_on_off_or_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, on in (("true", True), ("1", True), ("TRUE", True), ("false", False), ("", False)):
        monkeypatch.setenv("RLJOB_OPERATOR_KUEUE", raw)
        assert parse_args([]).kueue is on, raw
    monkeypatch.setenv("RLJOB_OPERATOR_KUEUE", "yes")
    with pytest.raises(SystemExit, match=r"\$RLJOB_OPERATOR_KUEUE is 'yes': set it to true"):
        parse_args([])


def test_operator_imports_no_runtime_stack() -> None:
    """The operator image stays small and its start fast: no torch, ray, megatron, sglang."""
    code = ("import sys, rljob_operator.__main__; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'ray', 'megatron', 'sglang', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_a_job_whose_reconcile_finds_it_gone_leaves_the_queue() -> None:
    from rljob_operator.controller import GONE, Gone

    calls: list[str] = []

    def reconcile(ns: str, name: str) -> float | Gone | None:
        calls.append(name)
        return GONE if name == "gone" else None

    async def scenario() -> Controller:
        ctl = Controller(reconcile, interval=0.05, workers=2)
        task = asyncio.create_task(ctl.run())
        ctl.track(("ns", "gone"))
        ctl.track(("ns", "live"))
        await _until(lambda: calls.count("live") >= 5)
        task.cancel()
        return ctl

    ctl = asyncio.run(scenario())
    assert calls.count("gone") == 1
    assert ("ns", "gone") not in ctl.known and ("ns", "live") in ctl.known
