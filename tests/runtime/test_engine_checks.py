"""How the driver's engine checks judge engines whose actor lives, asked through real Ray
actors that answer `serving` as an engine in that state would: an engine slow to answer
does not hold the driver (its question is read again at the next check) and is lost only
after PING_TIMEOUT_S unanswered, three checks in a row; an engine whose /health is silent
is lost on the third check, one whose server exited at once; a serving engine is never
touched."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from rljob.cluster.engine_group import PING_TIMEOUT_S
from rljob.cluster.engine_recovery import STRIKES, EngineRecovery
from rljob.engine.launcher import EXITED, SERVING, SILENT
from rljob_api.spec import RecoverySpec
from rljob_api.status import EngineState

pytestmark = pytest.mark.runtime

HANG_S = 120.0  # an unanswered question outlives the test


class Answers:
    """An engine actor as far as `serving` goes: answers `state`, or nothing until `HANG_S`
    passed, or until `set` is called."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.released = threading.Event()

    def set(self, state: str) -> None:
        self.state = state
        self.released.set()

    def up(self) -> bool:
        return True

    def serving(self) -> str:
        if self.state == "hang":
            self.released.wait(HANG_S)
        return self.state


class Rollout:
    """The rollout worker's side of a loss: which engines it was told were lost."""

    def __init__(self) -> None:
        self.lost: list[int] = []
        self.suspects: dict[int, str] = {}

    def suspect(self, index: int, why: str) -> None:
        """A request failed on engine `index` (the worker took it out of the pool)."""
        self.suspects[index] = why

    def engines_lost(self) -> dict[int, str]:
        return dict(self.suspects)

    def engine_lost(self, index: int, why: str) -> None:
        self.lost.append(index)

    def engine_joined(self, index: int, url: str) -> None:
        pass

    def told(self) -> list[int]:
        return self.lost


def _recovery(states: list[str], clock: list[float]) -> tuple[EngineRecovery, list[int], Any]:
    replaced: list[int] = []
    # Questions left unanswered pile up on an actor: room for each.
    answers = ray.remote(Answers).options(num_cpus=0, max_concurrency=2 * STRIKES + 2)
    handles: list[Any] = [answers.remote(s) for s in states]
    ray.get([h.up.remote() for h in handles])  # started: a check measures answers, not starts
    engines = SimpleNamespace(urls=[f"http://e{i}" for i in range(len(states))],
                              handles=handles, replace=replaced.append, node=lambda i: "n",
                              replacing=lambda i: True, started=lambda i: None)
    rollout: Any = ray.remote(Rollout).options(num_cpus=0).remote()
    ray.get(rollout.told.remote())
    recovery = EngineRecovery(
        engines,  # type: ignore[arg-type]
        SimpleNamespace(kill_sidecar=lambda i: None),  # type: ignore[arg-type]
        SimpleNamespace(forget_engine=lambda name: None),  # type: ignore[arg-type]
        rollout, SimpleNamespace(engines=lambda report: None),
        RecoverySpec(max_engine_restarts=5, engine_restart_window_seconds=600), attempt=0,
        clock=lambda: clock[0])
    return recovery, replaced, (handles, rollout)


def _states(recovery: EngineRecovery) -> list[EngineState]:
    return [t.state for _, t in sorted(recovery.tracked.items())]


def test_a_slow_engine_does_not_hold_the_driver_and_is_lost_after_three_unanswered_checks(
        ray_local: None) -> None:
    clock = [0.0]
    recovery, replaced, (_, rollout) = _recovery([SERVING, "hang"], clock)
    for strike in range(1, STRIKES + 1):
        # Checks before the question is PING_TIMEOUT_S old: no verdict, and none waits for it.
        for _ in range(3):
            started = time.monotonic()
            recovery.check()
            assert time.monotonic() - started < PING_TIMEOUT_S / 2, \
                "a check waited for a silent engine"
            assert _states(recovery) == [EngineState.serving] * 2
            assert recovery.strikes.get(1, 0) == strike - 1
            clock[0] += PING_TIMEOUT_S / 4
        clock[0] += PING_TIMEOUT_S  # now the open question is overdue: one more strike
        recovery.check()
        if strike < STRIKES:
            assert recovery.strikes[1] == strike and _states(recovery)[1] == EngineState.serving
    assert _states(recovery) == [EngineState.serving, EngineState.lost]
    assert recovery.tracked[1].reason == f"it did not answer within {PING_TIMEOUT_S:.0f}s"
    assert replaced == [1] and ray.get(rollout.told.remote()) == [1]
    assert 0 not in recovery.strikes


def test_an_engine_that_answers_again_loses_its_strikes(ray_local: None) -> None:
    clock = [0.0]
    recovery, replaced, (handles, _) = _recovery(["hang"], clock)
    recovery.check()
    clock[0] += PING_TIMEOUT_S + 1
    recovery.check()
    assert recovery.strikes == {0: 1}
    ray.get(handles[0].set.remote(SERVING))
    deadline = time.monotonic() + 60
    while recovery.strikes and time.monotonic() < deadline:
        recovery.check()
    assert not recovery.strikes and not replaced
    assert _states(recovery) == [EngineState.serving]


def test_a_silent_health_is_lost_on_the_third_check_an_exited_server_at_once(
        ray_local: None) -> None:
    clock = [0.0]
    recovery, replaced, _ = _recovery([SILENT, EXITED, SERVING], clock)

    # Each engine's strikes after each check ("lost" once lost), until both are lost, without
    # repeats: a check reads at most one answer of each engine.
    seen: list[list[object]] = [[], []]
    deadline = time.monotonic() + 60
    while EngineState.serving in _states(recovery)[:2]:
        assert time.monotonic() < deadline, f"not both lost: {seen}"
        recovery.check()
        for i in (0, 1):
            now = recovery.strikes.get(i, 0) if _states(recovery)[i] == EngineState.serving \
                else "lost"
            if now != 0 and (not seen[i] or seen[i][-1] != now):
                seen[i].append(now)
    assert seen == [[*range(1, STRIKES), "lost"], ["lost"]]
    assert recovery.tracked[0].reason == "its server did not answer /health"
    assert recovery.tracked[1].reason == "its server process exited"
    assert sorted(replaced) == [0, 1] and _states(recovery)[2] == EngineState.serving


def _answered_before(recovery: EngineRecovery, index: int, handles: list[Any]) -> None:
    """Engine `index` answered a question that no check read yet (it came after the check's
    short wait)."""
    ref = handles[index].serving.remote()
    ray.get(ref)
    recovery.asked[index] = (ref, 0.0)


def test_an_answer_from_before_a_failed_delivery_does_not_keep_the_engine(
        ray_local: None) -> None:
    clock = [0.0]
    recovery, replaced, (handles, _) = _recovery([SERVING, SERVING], clock)
    _answered_before(recovery, 1, handles)
    ray.get(handles[1].set.remote(EXITED))  # then its server died; a delivery failed on it
    recovery.check(stale={"engine-1"})
    assert _states(recovery) == [EngineState.serving, EngineState.lost]
    assert recovery.tracked[1].reason == "its server process exited" and replaced == [1]


def test_an_answer_from_before_a_failed_request_does_not_return_the_engine(
        ray_local: None) -> None:
    clock = [0.0]
    recovery, replaced, (handles, rollout) = _recovery([SERVING, SERVING], clock)
    _answered_before(recovery, 0, handles)
    ray.get(handles[0].set.remote(SILENT))
    ray.get(rollout.suspect.remote(0, "a request failed: connection reset"))
    recovery.check()
    assert _states(recovery) == [EngineState.lost, EngineState.serving]
    assert recovery.tracked[0].reason == "a request failed: connection reset"
    assert replaced == [0] and ray.get(rollout.told.remote()) == [0]


@ray.remote
class Bound:
    """Stands for a CPU engine's sidecar: bound to one node, `soft=False`, as
    `sidecar_placement` binds it."""

    def health(self) -> dict[str, Any]:
        return {"state": "ready", "incarnation": "x"}


def test_a_sidecar_whose_node_is_gone_is_reported_dead_with_its_node(ray_local: None) -> None:
    """Ray cannot start a sidecar bound to a node that is gone (`ActorUnschedulableError`,
    not an actor error): the check reports it dead because its node went, for the driver
    to replace its engine, instead of raising out of the check and failing the attempt."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rljob.cluster.weight_sync import SyncSettings, WeightSyncActors

    actors = WeightSyncActors(SyncSettings())
    here = ray.get_runtime_context().get_node_id()
    gone = ("0" if here[0] != "0" else "1") + here[1:]  # a node id Ray does not know
    actors.sidecars = [
        Bound.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
        .remote(),
        Bound.options(scheduling_strategy=NodeAffinitySchedulingStrategy(gone, soft=False))
        .remote(),
    ]
    check = actors.check()
    assert check.node_gone == {1} and list(check.dead) == [1], check
    assert check.dead[1].startswith("its node is gone"), check.dead
    assert check.of_engines(["engine-1"]).node_gone == {1}
    assert check.of_engines(["engine-0"]).node_gone == set()
