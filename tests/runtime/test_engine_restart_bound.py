"""The bound on replaced engines (`spec.recovery.maxEngineRestarts` within
`engineRestartWindowSeconds`), with the Ray actors stood in by recorders and a clock the
test moves: losses inside the window are counted and replaced, one more fails the job as
`EngineRestartsExhausted` (not retryable), and losses that left the window no longer count.
A replacement that failed on the node its engine was lost on, once Ray found that node
dead, is started again within the same loss, once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

from rljob.cluster.engine_recovery import EngineRecovery
from rljob.driver.outcome import exit_code
from rljob_api.exits import ENGINES_EXHAUSTED
from rljob_api.spec import RecoverySpec
from rljob_api.status import EnginesStatus, EngineState
from tests.runtime.test_colocated_turns import Actor

pytestmark = pytest.mark.runtime


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "get", lambda value, **_: value)


def test_losses_beyond_the_bound_within_the_window_fail_the_job() -> None:
    log: list[str] = []
    now = [0.0]
    failures: list[tuple[str, str, bool]] = []
    reports: list[EnginesStatus] = []
    replaced: list[int] = []
    engines = SimpleNamespace(urls=["http://e0", "http://e1"], replace=replaced.append,
                              node=lambda i: f"node-{i}")
    recovery = EngineRecovery(
        engines, SimpleNamespace(kill_sidecar=lambda i: log.append(f"kill sidecar {i}")),  # type: ignore[arg-type]
        SimpleNamespace(forget_engine=lambda name: log.append(f"forget {name}")),  # type: ignore[arg-type]
        Actor("rollout", log, {}),
        SimpleNamespace(engines=reports.append),
        RecoverySpec(max_engine_restarts=2, engine_restart_window_seconds=600), attempt=0,
        clock=lambda: now[0])
    recovery.lose(1, "Ray lost its process")
    now[0] = 100.0
    recovery.lose(0, "its server did not answer /health")
    assert replaced == [1, 0] and not failures
    assert log[:3] == ["rollout.engine_lost", "forget engine-1", "kill sidecar 1"], log
    last = reports[-1]
    assert (last.ready, last.total, last.summary, last.restarts) == (0, 2, "0/2", 2)
    assert last.paused and [e.state for e in last.engines] == [EngineState.lost] * 2
    # The first loss leaves the window: two in it again, still within the bound.
    now[0] = 650.0
    recovery.tracked[1].state = EngineState.serving
    recovery.lose(1, "Ray lost its process")
    assert replaced == [1, 0, 1] and not failures
    now[0] = 700.0
    recovery.tracked[0].state = EngineState.serving
    # Through the run's exit path, as `rljob run` ends: reported as not retryable, so the
    # operator fails the job rather than restarting it.
    attempt = SimpleNamespace(
        fail=lambda reason, message, retryable: failures.append((reason, message, retryable)))

    def exhaust() -> int:
        recovery.lose(0, "Ray lost its process")
        return 0

    assert exit_code(attempt, exhaust) == ENGINES_EXHAUSTED  # type: ignore[arg-type]
    assert replaced == [1, 0, 1], "the loss over the bound is not replaced"
    [(reason, message, retryable)] = failures
    assert reason == "EngineRestartsExhausted" and retryable is False
    assert "3 rollout engines lost within 600s" in message and "maxEngineRestarts (2)" in message


class Starts:
    """Engine starts as the recovery sees them: each replacement fails as Ray reports one
    that could not be created (`failing`), located nowhere new."""

    def __init__(self) -> None:
        self.urls = ["http://e0", "http://e1"]
        self.started_ones: list[int] = []
        self.pending: set[int] = set()

    def replace(self, index: int) -> None:
        self.started_ones.append(index)
        self.pending.add(index)

    def replacing(self, index: int) -> bool:
        return index in self.pending

    def started(self, index: int) -> str | None:
        self.pending.discard(index)
        raise ray.exceptions.ActorDiedError()

    def node(self, index: int) -> str:
        return f"node-{index}"


@pytest.mark.parametrize("node_alive", [False, True])
def test_a_replacement_that_went_with_its_engines_node_is_not_another_loss(
        monkeypatch: pytest.MonkeyPatch, node_alive: bool) -> None:
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "node-1", "Alive": node_alive},
                                               {"NodeID": "node-0", "Alive": True}])
    log: list[str] = []
    reports: list[EnginesStatus] = []
    engines = Starts()
    recovery = EngineRecovery(
        engines, SimpleNamespace(kill_sidecar=lambda i: log.append(f"kill sidecar {i}")),  # type: ignore[arg-type]
        SimpleNamespace(forget_engine=lambda name: None),  # type: ignore[arg-type]
        Actor("rollout", log, {}), SimpleNamespace(engines=reports.append),
        RecoverySpec(max_engine_restarts=5, engine_restart_window_seconds=600), attempt=0)
    recovery.lose(1, "its server did not answer /health")
    assert engines.started_ones == [1]
    recovery.advance(0, resync=False)  # the replacement failed to start
    if node_alive:  # a failure of its own: one more loss
        assert reports[-1].restarts == 2 and reports[-1].engines[1].restarts == 2
        assert engines.started_ones == [1, 1]
        return
    # Ray found node-1 dead: the same loss, started again.
    assert reports[-1].restarts == 1 and reports[-1].engines[1].restarts == 1
    assert engines.started_ones == [1, 1]
    assert reports[-1].engines[1].state == EngineState.lost
    # Only once: a second failure there is a loss of its own.
    recovery.advance(0, resync=False)
    assert reports[-1].restarts == 2 and engines.started_ones == [1, 1, 1]
