"""The driver's colocated turns (the loop with offload on), with the Ray actors
stood in by recorders: the trainers leave the GPU before the rollout, the engines after it
and before training, the engines come back before a version is published, and an engine
that lost its weights (SGLang) gets the version again when the step made no update."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from rljob.cluster.cluster import Roles
from rljob.cluster.engine_group import EngineGroup
from rljob.cluster.placement import Devices
from rljob.cluster.rollout_pipeline import RolloutPipeline
from rljob.cluster.trainer_group import TrainerGroup
from rljob.driver import loop
from rljob.driver.job import Job
from rljob.driver.state import LoopState
from rljob.driver.stop import StopSignals
from rljob.reporting.startup import StartupClock
from rljob.reporting.tracking import Trackers
from rljob.rollout.stats import RolloutStats
from rljob.trainer.metrics import OptimizerFigures, TrainMetrics


class Actor:
    """A Ray actor handle whose `method.remote(...)` records the call and answers."""

    def __init__(self, name: str, log: list[str], answers: dict[str, Any]) -> None:
        self._name, self._log, self._answers = name, log, answers

    def __getattr__(self, method: str) -> Any:
        def remote(*args: Any) -> Any:
            self._log.append(f"{self._name}.{method}")
            return self._answers.get(method)

        return SimpleNamespace(remote=remote)


def _job(tmp_path: Path, offload: bool, optimizer_steps: int, weights_kept: bool,
         log: list[str]) -> Job:
    means = OptimizerFigures(loss=0.0, pg_loss=0.0, kl_loss=0.0, entropy=0.0, clipfrac=0.0,
                             value_loss=0.0, grad_norm=0.0)
    metrics = TrainMetrics(step_means=means, reward=0.5, kl=0.0, logprob_gap=0.0,
                           logprob_gap_max=0.0, response_length=0.0,
                           step_skipped=[False] * optimizer_steps or [True],
                           nonfinite=[] if optimizer_steps else ["skipped"])
    spec = SimpleNamespace(
        algorithm=SimpleNamespace(max_consecutive_nonfinite=3, total_steps=10,
                                  rollout_batch_size=0, n_samples_per_prompt=1),
        eval=SimpleNamespace(dataset=None, interval=0),
        checkpoint=SimpleNamespace(interval=100, format="torch"))
    attempt = SimpleNamespace(  # one step from step 3; the save at its end records nothing
        number=0, spec=spec, options=SimpleNamespace(workdir=tmp_path, max_steps=1),
        stop=StopSignals(), startup=StartupClock(time.time()),
        checkpoints=SimpleNamespace(check_writer=lambda: None, save=lambda *_, **__: None),
        reporter=SimpleNamespace(progress=lambda _: None), tracking=Trackers(),
        loop_started=False)
    rollout = Actor("rollout", log, {"generate": (
        [], RolloutStats(rollout_seconds=0.1, response_tokens=0.0, tokens_per_second=1.0,
                         generation_rounds=1.0, generated_groups=0.0))})
    engines = EngineGroup(lambda e: (Actor(f"engine{e}", log, {"resume_memory": weights_kept}),
                                     []))
    engines.start(2)
    roles = Roles(
        offload=offload,
        trainers=TrainerGroup([Actor(f"trainer{r}", log, {
            "train": metrics, "nonfinite_weights": [], "offload": 1}) for r in range(2)]),
        engines=engines,
        rollout=RolloutPipeline(rollout), devices=Devices(True, True))
    job = Job(attempt, roles,  # type: ignore[arg-type]
              state=LoopState(step=3, weight_version=3, consecutive_nonfinite=0,
                              skipped_steps=0, train_step=3, samples=0),
              resumed=True, max_staleness=None, engine_version=3,  # colocated: sync
              last_eval=None)
    job.publish = lambda again=False: log.append(  # type: ignore[method-assign]
        f"publish(again={again}, version={job.state.weight_version})")
    return job


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "get", lambda value: value)
    monkeypatch.setattr(ray, "wait", lambda refs, **_: (refs, []))


def _step(tmp_path: Path, **kw: Any) -> list[str]:
    log: list[str] = []
    loop.train(_job(tmp_path, log=log, **kw))
    return log


def test_colocated_turns_in_order(tmp_path: Path) -> None:
    assert _step(tmp_path, offload=True, optimizer_steps=1, weights_kept=True) == [
        "trainer0.offload", "trainer1.offload", "rollout.generate",
        "engine0.release_memory", "engine1.release_memory",
        "trainer0.train", "trainer1.train",
        "engine0.resume_memory", "engine1.resume_memory",
        "trainer0.nonfinite_weights", "publish(again=False, version=4)",
    ]


def test_dropped_weights_get_the_same_version_again(tmp_path: Path) -> None:
    """SGLang's resume brings memory back, not weights: with no update this step, the
    version the engines had is sent again; with an update, the new one reaches them."""
    log = _step(tmp_path, offload=True, optimizer_steps=0, weights_kept=False)
    assert log[-1] == "publish(again=True, version=3)"
    log = _step(tmp_path, offload=True, optimizer_steps=0, weights_kept=True)
    assert not any(entry.startswith("publish") for entry in log)
    log = _step(tmp_path, offload=True, optimizer_steps=2, weights_kept=False)
    assert log[-1] == "publish(again=False, version=4)"


def test_without_offload_nothing_moves(tmp_path: Path) -> None:
    """A CPU run, or GPUs not colocated: no offload, release or resume is asked."""
    log = _step(tmp_path, offload=False, optimizer_steps=1, weights_kept=False)
    assert not any(m in entry for entry in log for m in ("offload", "_memory"))
    assert log[-1] == "publish(again=False, version=4)"
