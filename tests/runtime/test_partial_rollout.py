"""Partial rollout on a real hf engine: a step's cut aborts the generations in flight, the
unfinished groups are carried with their partial responses, the next step continues them
(under the engine's new weight version, the old tokens masked when asked), and a
checkpoint carries them across a resume, also of a whole `rljob run` split in two.

The rollout worker runs in-process against the engine's HTTP server. Its generate function
is the built-in one with end-of-sequence ignored, so only the step's cut ends a generation
before maxNewTokens; the reward hook holds a finished group's rewards until the engine is
generating another request, so the cut surely lands mid-generation.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from rljob.cluster.rollout_pipeline import RolloutPipeline
from rljob.driver import checkpoints
from rljob.driver.checkpoints import Checkpoints
from rljob.driver.state import LoopState
from rljob.engine.hf_server import HFEngine, ServerThread
from rljob.model.tiny_model import write_tiny
from rljob.reporting import metrics_log
from rljob.rollout.sample import Sample, Status
from rljob.rollout.stats import RolloutStats
from rljob.rollout.tasks import load_task
from rljob.rollout.worker import RolloutWorker
from rljob_api.exits import OK as EXIT_OK
from rljob_api.spec import RLJobSpec, TinyModel
from tests.runtime import hooks_for_tests
from tests.runtime.conftest import RecordingReporter
from tests.runtime.engine_progress import GenerationProgress
from tests.runtime.jobs import job_file

pytestmark = pytest.mark.runtime

HOOKS = "tests.runtime.hooks_for_tests"
RLJOB = [sys.executable, "-m", "rljob.cli"]
MAX_NEW = 256  # long enough that the cut lands mid-generation on a loaded machine
Key = tuple[str, int]  # (prompt, sample index)
PROGRESS: dict[str, GenerationProgress] = {}  # by engine URL: its running generation's tokens


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n"
                            for i in range(10)))
    return path


@pytest.fixture
def engine(tmp_path: Path, data: Path) -> Iterator[ServerThread]:
    alphabet = load_task(str(data), "prompt", "label").alphabet
    model = write_tiny(tmp_path / "model", TinyModel(), alphabet, 0, "float32")
    server = ServerThread(HFEngine(str(model), "float32", "cpu", "0"))
    PROGRESS[server.url] = GenerationProgress(server.engine)
    try:
        yield server
    finally:
        hooks_for_tests.REWARD_GATE = None
        del PROGRESS[server.url]
        server.stop()


def _worker(server: ServerThread, data: Path, mask: bool) -> RolloutWorker:
    spec = RLJobSpec.model_validate({
        "algorithm": {"rolloutBatchSize": 1, "nSamplesPerPrompt": 2, "globalBatchSize": 2,
                      "microBatchSize": 2},
        "rollout": {"backend": "hf", "sampling": {"maxNewTokens": MAX_NEW},
                    "partialRollout": {"enabled": True, "overSampling": 2,
                                       "maskOffPolicyTokens": mask}},
        "data": {"dataset": str(data), "shuffle": False},
        "generate": {"function": f"{HOOKS}:generate_to_the_limit"},
        "reward": {"function": f"{HOOKS}:reward_after_gate"},
    })
    worker = RolloutWorker(spec.model_dump_json(by_alias=True), server.engine.model_path,
                           [server.url])
    assert worker.setup() == []
    return worker


def _cut_step(worker: RolloutWorker, server: ServerThread, step: int
              ) -> tuple[list[Sample], RolloutStats]:
    """A step whose cut waits until the engine has generated 3 tokens of another request."""
    progress = PROGRESS[server.url]
    hooks_for_tests.REWARD_GATE = lambda: progress.tokens >= 3
    try:
        return asyncio.run(worker.generate(step))
    finally:
        hooks_for_tests.REWARD_GATE = None


def _carried(worker: RolloutWorker) -> dict[Key, Sample]:
    """The carried samples as the checkpoint stores them, read back."""
    groups = json.loads(json.dumps(worker.state()))["partial_groups"]
    return {(d["prompt"], d["index"]): Sample.from_json(d) for g in groups for d in g}


def _new_version(server: ServerThread, version: str) -> None:
    """Install the same weights as `version` (a weight update, as the loop makes one)."""
    named = [(k, v.detach().clone()) for k, v in server.engine.model.state_dict().items()]
    server.engine.install(named, version)


def _check_continued(batch: list[Sample], before: dict[Key, Sample],
                     old_tokens: dict[Key, int], mask: bool) -> tuple[int, int]:
    """Every sample of `batch` that was carried (`before`: the carried samples as the last
    step left them) starts with its carried tokens and log-probs and runs on to
    maxNewTokens. Masked are exactly the `old_tokens` a sample had when the engine's
    version changed, if it got tokens of the new version. Returns (carried tokens
    resumed, tokens masked)."""
    carried_tokens = masked = 0
    for got in batch:
        prior = before.get((got.prompt, got.index))
        if prior is None:
            assert got.loss_mask == [1] * got.response_length
            continue
        n = prior.response_length
        carried_tokens += n
        assert got.response_tokens()[:n] == prior.response_tokens()
        assert got.rollout_log_probs[:n] == prior.rollout_log_probs
        assert got.response_length == MAX_NEW and got.status.value == "truncated"
        assert len(got.rollout_log_probs) == MAX_NEW == len(got.loss_mask)
        stale = old_tokens.get((got.prompt, got.index), 0)
        if stale == MAX_NEW:  # finished before the new version: nothing newer to mask for
            stale = 0
        else:
            assert got.weight_version == "1"
            assert got.first_weight_version == ("0" if stale else "1")
        if mask:
            assert got.loss_mask == [0] * stale + [1] * (MAX_NEW - stale)
            masked += stale
        else:
            assert got.loss_mask == [1] * MAX_NEW
    return carried_tokens, masked


@pytest.mark.parametrize("mask", [True, False])
def test_cut_groups_are_carried_and_continued_under_the_new_version(
        engine: ServerThread, data: Path, mask: bool) -> None:
    worker = _worker(engine, data, mask)
    batch, stats = _cut_step(worker, engine, 0)
    assert len(batch) == 2 and all(d.response_length == MAX_NEW for d in batch)
    carried = _carried(worker)
    assert stats.partial_groups_carried == len(carried) / 2 == 2
    # the cut landed mid-generation: one carried sample has some tokens, not all
    assert any(0 < s.response_length < MAX_NEW and s.status.value == "aborted"
               for s in carried.values())
    for s in carried.values():
        assert len(s.rollout_log_probs) == s.response_length == len(s.loss_mask)
    partial_prompts = {k for k, s in carried.items() if 0 < s.response_length < MAX_NEW}
    old_tokens = {k: s.response_length for k, s in carried.items()}

    _new_version(engine, "1")
    seen = total_masked = 0
    for step in (1, 2, 3):  # carried groups go first; each finishes within a step or two
        batch, stats = _cut_step(worker, engine, step)
        carried_tokens, masked = _check_continued(batch, carried, old_tokens, mask)
        assert stats.partial_tokens_resumed == carried_tokens
        assert (stats.masked_off_policy_tokens or 0.0) == masked
        total_masked += masked
        seen += len(partial_prompts & {(d.prompt, d.index) for d in batch})
        carried = {k: s for k, s in carried.items()
                   if k not in {(d.prompt, d.index) for d in batch}} | _carried(worker)
        if seen:
            break
    assert seen, "no sample cut mid-generation was ever continued"
    assert (total_masked > 0) == mask  # the one cut mid-generation had version-0 tokens


def test_async_bound_drops_carried_groups_with_older_tokens(
        engine: ServerThread, data: Path) -> None:
    """Async rollout's staleness bound: a carried group whose tokens came from a version
    older than the bound allows is not continued; its prompt is generated afresh."""
    worker = _worker(engine, data, mask=False)
    _cut_step(worker, engine, 0)
    carried = _carried(worker)
    assert len(carried) == 4 and {s.first_weight_version for s in carried.values()} == {"0"}
    _new_version(engine, "2")
    batch, stats = asyncio.run(worker.generate(1, oldest_version=1))
    assert stats.stale_groups_dropped == 2 and stats.partial_tokens_resumed == 0
    assert {d.weight_version for d in batch} == {"2"}
    assert all(not d.version_spans or d.version_spans[0][0] == "2" for d in batch)
    # the dropped groups' prompts came back first: the batch is one of them, from scratch
    assert {d.prompt for d in batch} <= {k[0] for k in carried}
    assert all(d.response_length == MAX_NEW for d in batch)


def test_a_checkpoint_carries_the_cut_groups_to_a_resumed_worker(
        engine: ServerThread, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Trainers:  # the checkpoint's trainer part, which this test does not exercise
        def save(self, path: str, hf_export: bool) -> None:
            (Path(path) / "trainer.txt").write_text("weights")

        def load(self, path: str) -> None:
            assert (Path(path) / "trainer.txt").read_text() == "weights"

    class Remote:  # the worker as the loop reaches it, a Ray actor handle, in-process
        def __init__(self, worker: RolloutWorker) -> None:
            self.state = type("M", (), {"remote": staticmethod(worker.state)})
            self.load = type("M", (), {"remote": staticmethod(worker.load)})

    monkeypatch.setattr(ray, "get", lambda value: value)
    first = _worker(engine, data, mask=True)
    _cut_step(first, engine, 0)
    carried = _carried(first)
    assert any(0 < s.response_length < MAX_NEW for s in carried.values())

    store = Checkpoints(tmp_path / "ckpt", 2, 0, RecordingReporter())
    store.take()
    store.save(LoopState(step=1), Trainers(), RolloutPipeline(Remote(first)),  # type: ignore[arg-type]
               hf_export=False)
    store.release()

    resumed = _worker(engine, data, mask=True)
    again = Checkpoints(tmp_path / "ckpt", 2, 1, RecordingReporter())
    again.take()
    restored = again.resume(Trainers(), RolloutPipeline(Remote(resumed)))  # type: ignore[arg-type]
    again.release()
    assert restored is not None and restored[1].step == 1
    assert _carried(resumed) == carried
    assert resumed.state()["index"] == first.state()["index"]

    _new_version(engine, "1")
    batch, stats = _cut_step(resumed, engine, 1)
    carried_tokens, _ = _check_continued(
        batch, carried, {k: s.response_length for k, s in carried.items()}, mask=True)
    # the step's jobs were the two carried groups and one new prompt: every carried prompt
    # is either in the batch, continued, or still carried
    kept = {(d.prompt, d.index) for d in batch} | set(_carried(resumed))
    assert set(carried) <= kept
    assert stats.partial_groups_resumed == 2
    assert stats.partial_tokens_resumed == carried_tokens


def test_carried_groups_are_generated_again_when_partial_rollout_is_turned_off(
        engine: ServerThread, data: Path) -> None:
    with_partial = _worker(engine, data, mask=False)
    _cut_step(with_partial, engine, 0)
    saved = json.loads(json.dumps(with_partial.state()))
    prompts = [[g[0]["prompt"], g[0]["label"]] for g in saved["partial_groups"]]
    assert len(prompts) == 2

    spec = RLJobSpec.model_validate_json(with_partial.spec.model_dump_json())
    spec.rollout.partial_rollout.enabled = False
    without = RolloutWorker(spec.model_dump_json(by_alias=True), engine.engine.model_path,
                            [engine.url])
    assert without.setup() == []
    without.load(saved)
    state = without.state()
    assert "partial_groups" not in state and state["buffer"] == saved["buffer"] + prompts


def test_a_run_split_by_a_resume_continues_the_carried_groups(tmp_path: Path) -> None:
    """`rljob run` with partial rollout, stopped by --max-steps at a checkpoint while groups
    are carried, then run again: the resumed process takes up exactly the groups the first
    one saved. Every figure here is one the two processes wrote: the checkpoint's carried
    groups and both runs' metrics rows."""
    path = job_file(tmp_path, {"rollout": {"partialRollout": {"enabled": True,
                                                               "overSampling": 8}}})
    workdir = tmp_path / "w"
    for args in (["--max-steps", "2"], []):
        out = subprocess.run([*RLJOB, "run", str(path), "--workdir", str(workdir), *args],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == EXIT_OK, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stdout + out.stderr

    saved = json.loads((workdir / "checkpoints" / "step_00000002" / checkpoints.ROLLOUT_FILE)
                       .read_text())["partial_groups"]
    carried = [[Sample.from_json(d) for d in g] for g in saved]
    rows = metrics_log.read(workdir / metrics_log.METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # The first run's step 2 cut its round (8 groups over the batch's 8 were started) and
    # carried what had not made the batch; its checkpoint holds exactly those groups.
    assert len(carried) == rows[1]["partial_groups_carried"] > 0
    for group in carried:
        for s in group:
            assert len(s.rollout_log_probs) == s.response_length == len(s.loss_mask)
    # The resumed process's first step started from those groups (a fresh worker carries
    # none): all of them fit its round of 8 + 8 groups, carried groups going first.
    assert rows[2]["partial_groups_resumed"] == len(carried)
    # Their tokens were continued, not generated again: a carried group that had finished
    # after the cut makes the batch as it is, with every token it brought counted as
    # resumed; no more than the checkpoint held can be.
    done = (Status.completed, Status.truncated)
    complete = sum(s.response_length for g in carried
                   if all(s.status in done for s in g) for s in g)
    assert complete <= rows[2]["partial_tokens_resumed"] <= sum(
        s.response_length for g in carried for s in g)
