"""Lost rollout engines replaced while training goes on.

An engine is lost when Ray lost its actor (its process died, its pod or node went), when
its server stopped answering while the actor lives (SGLang is a process of its own), or
when the rollout worker took it out after a request failed on it and its /health stayed
silent. From then on the worker sends its requests to the engines left
(`rljob.rollout.engine_pool`), weight sync stops delivering to it, and it is started again
in its own slots (Ray places them again first when their node is gone). Its replacement
gets a new weight-sync sidecar next to it, which registers as a new incarnation and is sent
the version the other engines serve, verified by digest like any version; only once its
sidecar acknowledged that version is the worker told it serves again. More losses than
`spec.recovery.maxEngineRestarts` within `engineRestartWindowSeconds` fail the job.

The driver calls `tend` while it waits for a batch and at each step's start, and `advance`
right after each delivery: replacements move forward between its other calls, never while a
trainer works. A replacement is sent the engines' version only while the trainer's weights
are that version (always in sync mode; in async mode right after a delivery), so the
version it installs is the one its label says.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import ray

from rljob.cluster.engine_group import PING_TIMEOUT_S, EngineGroup
from rljob.cluster.trainer_group import TrainerGroup
from rljob.cluster.weight_sync import WeightSyncActors, engine_name
from rljob.engine.launcher import EXITED, SERVING
from rljob.reporting.reporter import Reporter
from rljob_api import exits
from rljob_api.exits import JobError
from rljob_api.spec import RecoverySpec
from rljob_api.status import EngineReport, EnginesStatus, EngineState, timestamp

# How often the driver looks at the engines while it waits for a batch.
TEND_INTERVAL_S = 2.0
# How long a check waits for the engines' answers before it lets the driver go on: a serving
# engine answers at once, and a question still open is read at the next check (an engine
# busy installing weights must not hold the training loop for PING_TIMEOUT_S).
ANSWER_WAIT_S = 0.5
# Checks in a row an engine whose actor lives may fail (no answer, /health silent) before it
# counts as lost: a loaded engine can be slow to answer one. An actor Ray lost, or a server
# process that exited, counts at once.
STRIKES = 3
# A replacement that does not serve the current weights this long after its loss is lost
# again (counted): its pod never came back, or its installs keep failing.
REJOIN_TIMEOUT_S = 900.0
# Deliveries to replacements that lack the version are tried at most this often.
RESYNC_INTERVAL_S = 10.0


# What status.engines.paused says, and a local run prints, while no engine serves.
PAUSED = ("no rollout engine serves: generation waits for a replacement to install the "
          "current weights")


@dataclass
class Tracked:
    state: EngineState
    since: str
    version: int | None = None
    restarts: int = 0
    reason: str | None = None
    url: str = ""
    lost_at: float = 0.0  # clock() when it was last lost
    lost_on: str = ""  # the Ray node it was last lost on
    retried: bool = False  # its replacement was started again uncounted since that loss


class EngineRecovery:
    def __init__(self, engines: EngineGroup, weight_sync: WeightSyncActors,
                 trainers: TrainerGroup, rollout: Any, reporter: Reporter,
                 recovery: RecoverySpec, attempt: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engines = engines
        self.weight_sync = weight_sync
        self.trainers = trainers
        self.rollout = rollout  # the RolloutWorker actor
        self.reporter = reporter
        self.recovery = recovery
        self.attempt = attempt
        self.clock = clock
        now = timestamp()
        self.tracked = {i: Tracked(EngineState.serving, now, url=url)
                        for i, url in enumerate(engines.urls)}
        self.losses: deque[float] = deque()  # when each loss in the window was seen
        self.strikes: dict[int, int] = {}  # failed checks in a row, by engine
        # The `serving` question open to each engine, and when it was asked.
        self.asked: dict[int, tuple[ray.ObjectRef[Any], float]] = {}
        self.last_tend = 0.0
        self.last_resync = -RESYNC_INTERVAL_S

    # ---- what the driver asks ------------------------------------------------------------

    def ready(self) -> int:
        """Engines serving requests now."""
        return sum(1 for t in self.tracked.values() if t.state == EngineState.serving)

    def total(self) -> int:
        """Engines of the job, serving or not."""
        return len(self.tracked)

    def awaiting_weights(self) -> bool:
        """No engine serves, and a replacement waits for weights with its sidecar
        registered (a delivery reaches it): nothing generates until one is sent."""
        return not self.ready() and any(
            t.state == EngineState.rejoining and self.weight_sync.acked(i) is not None
            for i, t in self.tracked.items())

    def down(self) -> set[str]:
        """Weight-sync names of the engines not serving now."""
        return {engine_name(i) for i, t in self.tracked.items()
                if t.state != EngineState.serving}

    def served(self, version: int) -> None:
        """Every serving engine acknowledged `version` (a delivery succeeded)."""
        changed = False
        for t in self.tracked.values():
            if t.state == EngineState.serving and t.version != version:
                t.version, changed = version, True
        if changed:
            self.report()

    def tend(self, version: int, *, resync: bool) -> None:
        """Find lost engines and move replacements forward, at most every TEND_INTERVAL_S.
        `version` is what the serving engines serve; `resync`: the trainer's weights are
        that version, so a replacement may be sent them now."""
        if self.clock() - self.last_tend < TEND_INTERVAL_S:
            return
        self.last_tend = self.clock()
        self.check()
        self.advance(version, resync=resync)

    # ---- finding losses --------------------------------------------------------------------

    def check(self, stale: Collection[str] = ()) -> None:
        """Engines lost since the last check are taken out and started again. `stale`:
        engines a delivery just failed to reach; one of them that does not answer (or that
        the worker took out) is lost at once, without waiting for more checks."""
        watched = [i for i, t in self.tracked.items() if t.state != EngineState.lost]
        if not watched:
            return
        suspects: dict[int, str] = ray.get(self.rollout.engines_lost.remote())
        urgent = [i for i in watched if engine_name(i) in stale or i in suspects]
        for i in watched:
            # An answer to a question asked before a delivery or a request failed on the
            # engine says nothing of it now: those engines are asked again.
            if i not in self.asked or i in urgent:
                self.asked[i] = (self.engines.handles[i].serving.remote(), self.clock())
        # An engine a delivery just failed to reach gets the whole PING_TIMEOUT_S at once;
        # the others only a moment, as at every check.
        if stale_refs := [self.asked[i][0] for i in urgent if engine_name(i) in stale]:
            ray.wait(stale_refs, num_returns=len(stale_refs), timeout=PING_TIMEOUT_S)
        refs = [self.asked[i][0] for i in watched]
        ray.wait(refs, num_returns=len(refs), timeout=ANSWER_WAIT_S)
        for i in watched:
            ref, asked_at = self.asked[i]
            answered, why, certain = self._lost(ref)
            if not answered and self.clock() - asked_at < PING_TIMEOUT_S \
                    and engine_name(i) not in stale:
                continue  # no verdict yet: read again at the next check
            del self.asked[i]
            t = self.tracked[i]
            if t.state == EngineState.rejoining:
                # Its replacement died before it served, or never got the weights.
                if why is not None and certain:
                    self.lose(i, f"its replacement was lost too: {why}")
                elif self.clock() - t.lost_at > REJOIN_TIMEOUT_S:
                    self.lose(i, f"its replacement did not install the current weights "
                                 f"within {REJOIN_TIMEOUT_S:.0f}s")
                continue
            if why is None:
                self.strikes.pop(i, None)
                if i in suspects:
                    # The worker's request failed, yet the engine answers: it serves again.
                    ray.get(self.rollout.engine_joined.remote(i, t.url))
                continue
            self.strikes[i] = self.strikes.get(i, 0) + 1
            if certain or self.strikes[i] >= STRIKES or engine_name(i) in stale \
                    or i in suspects:
                self.strikes.pop(i, None)
                self.lose(i, suspects.get(i) or why)

    @staticmethod
    def _lost(ref: ray.ObjectRef[Any]) -> tuple[bool, str | None, bool]:
        """Whether the engine of this `serving` question answered; why it looks lost (None:
        it serves); and whether that is certain (Ray lost the actor, its server process
        exited) or may pass (no answer in time, a silent /health)."""
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return False, f"it did not answer within {PING_TIMEOUT_S:.0f}s", False
        try:
            state = ray.get(ref)
        except ray.exceptions.RayError as err:
            return True, f"Ray lost its process: {str(err).splitlines()[0][:300]}", True
        if state == SERVING:
            return True, None, False
        if state == EXITED:
            return True, "its server process exited", True
        return True, "its server did not answer /health", False

    def lose(self, index: int, why: str) -> None:
        """Take engine `index` out (requests, weight sync) and start it again, or fail the
        job when the window's bound is spent."""
        t = self.tracked[index]
        name = engine_name(index)
        self.asked.pop(index, None)  # a question to what is gone; its replacement is asked anew
        print(f"engines: {name} lost: {why}", file=sys.stderr, flush=True)
        ray.get(self.rollout.engine_lost.remote(index, why))
        self.trainers.forget_engine(name)
        self.weight_sync.kill_sidecar(index)
        now = self.clock()
        self.losses.append(now)
        self._forget_old_losses()
        t.state, t.since, t.version, t.reason = EngineState.lost, timestamp(), None, why
        t.lost_at, t.lost_on, t.retried = now, self.engines.node(index), False
        if not self.ready():
            print(f"engines: {PAUSED}", file=sys.stderr, flush=True)
        exhausted = len(self.losses) > self.recovery.max_engine_restarts
        if not exhausted:
            t.restarts += 1  # replaced right below: the report already says so
        self.report()
        if exhausted:
            message = (f"{len(self.losses)} rollout engines lost within "
                       f"{self.recovery.engine_restart_window_seconds}s, more than "
                       f"spec.recovery.maxEngineRestarts ({self.recovery.max_engine_restarts});"
                       f" the last: {name}: {why}")
            raise JobError(exits.ENGINES_EXHAUSTED, f"EngineRestartsExhausted: {message}")
        self._start_again(index)

    def _replacement_failed(self, index: int, why: str) -> None:
        """A replacement that failed to start is one more loss, except once a loss when it
        was never located elsewhere (so it was put in the engine's slots on the node the
        engine was lost on) and Ray has since found that node dead. Losses are often seen
        before Ray's verdict on the node (a request that failed, a health check that went
        silent): such a replacement went with the same fault, and Ray now places the slots
        elsewhere."""
        t = self.tracked[index]
        node = self.engines.node(index)
        if t.retried or not t.lost_on or node != t.lost_on or self._alive(node):
            self.lose(index, why)
            return
        t.retried = True
        name = engine_name(index)
        print(f"engines: {name}'s replacement failed on node {node[:12]}, where {name} was "
              f"lost and which Ray now counts dead ({why}); started again within that loss",
              file=sys.stderr, flush=True)
        self._start_again(index)

    @staticmethod
    def _alive(node: str) -> bool:
        """Whether Ray counts `node` alive (a node it lost stays listed, not alive)."""
        return any(n.get("NodeID") == node and n.get("Alive") for n in ray.nodes())

    def _start_again(self, index: int) -> None:
        """A replacement for engine `index` in its slots; one that could not even be asked
        for (Ray did not answer) is asked for again at the next `advance`."""
        try:
            self.engines.replace(index)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            print(f"engines: {engine_name(index)} could not be started again yet: "
                  f"{str(err).splitlines()[0]}", file=sys.stderr, flush=True)

    # ---- bringing replacements back -------------------------------------------------------

    def advance(self, version: int, *, resync: bool) -> None:
        """Replacements that serve get their sidecar; those whose sidecar registered get
        `version` when `resync` (the trainer's weights are `version`); those that
        acknowledged it serve requests again."""
        for i, t in self.tracked.items():
            if t.state != EngineState.lost:
                continue
            if self.clock() - t.lost_at > REJOIN_TIMEOUT_S:
                self.lose(i, f"its replacement did not start within {REJOIN_TIMEOUT_S:.0f}s")
                continue
            if not self.engines.replacing(i):
                self._start_again(i)
                continue
            try:
                url = self.engines.started(i)
                if url is None:
                    continue
                self.weight_sync.replace_sidecar(i, url, self.engines.locality(i))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
                self._replacement_failed(
                    i, f"its replacement failed to start: {str(err).splitlines()[0]}")
                continue
            t.url = url
            t.state, t.since = EngineState.rejoining, timestamp()
            print(f"engines: {engine_name(i)} started again at {url}; it gets requests once "
                  "its sidecar acknowledged the current weights", file=sys.stderr, flush=True)
            self.report()
        rejoining = [i for i, t in self.tracked.items() if t.state == EngineState.rejoining]
        acked = {i: self.weight_sync.acked(i) for i in rejoining}
        due = self.clock() - self.last_resync >= RESYNC_INTERVAL_S
        if resync and due and any(v is not None and v != version for v in acked.values()):
            # Delivered to every registered engine that lacks it: the replacements.
            self.last_resync = self.clock()
            self.trainers.publish(version, again=False)
            acked = {i: self.weight_sync.acked(i) for i in rejoining}
        for i, v in acked.items():
            if v != version:
                continue
            t = self.tracked[i]
            ray.get(self.rollout.engine_joined.remote(i, t.url))
            t.state, t.since, t.version = EngineState.serving, timestamp(), version
            print(f"engines: {engine_name(i)} rejoined, serving weight version {version}",
                  file=sys.stderr, flush=True)
            self.report()

    def _forget_old_losses(self) -> None:
        """Losses that left spec.recovery.engineRestartWindowSeconds no longer count."""
        now, window = self.clock(), self.recovery.engine_restart_window_seconds
        while self.losses and now - self.losses[0] > window:
            self.losses.popleft()

    def report(self) -> None:
        self._forget_old_losses()
        ready, total = self.ready(), self.total()
        self.reporter.engines(EnginesStatus(
            attempt=self.attempt, ready=ready, total=total, summary=f"{ready}/{total}",
            restarts=len(self.losses),
            paused=None if ready else PAUSED,
            engines=[EngineReport(name=engine_name(i), state=t.state, weight_version=t.version,
                                  restarts=t.restarts, reason=t.reason, since=t.since)
                     for i, t in sorted(self.tracked.items())]))
