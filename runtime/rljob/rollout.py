"""The rollout worker: prompts → samples with rewards, through the user's hooks.

It owns the data source (cursor and buffer) and the engine clients, and runs as a Ray
actor so user hooks execute in a worker process. Each sample gets a sampling seed fixed
by (job seed, rollout step, group, index), so a resumed run regenerates exactly what an
uninterrupted one would have.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob import worker_metrics
from rljob.data_source import DataSource
from rljob.engine.client import EngineClient
from rljob.hooks import HookArgs, HookError, as_reward, load_generate, load_reward
from rljob.sample import Sample, Status
from rljob.tasks import DatasetError, Prompt, load_task
from rljob.text_codec import load_codec
from rljob.whereabouts import Locatable
from rljob_api.spec import RLJobSpec

CONCURRENCY_PER_ENGINE = 64
MAX_REFILLS = 8


class NotEnoughSamples(RuntimeError):
    """Too many generations were aborted to fill one rollout batch."""


def _finished(group: list[Sample]) -> bool:
    return all(s.status in (Status.completed, Status.truncated) for s in group)


def _zero_variance(group: list[Sample]) -> bool:
    """Every response of the prompt got the same reward: a group baseline gives each of them
    zero advantage, so the group adds no policy gradient (DAPO's dynamic sampling)."""
    return len({s.reward for s in group}) == 1


def sample_seed(seed: int, step: int, group: int, index: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + group * 101 + index) % (2**63 - 1)


def eval_seed(seed: int, prompt: int, index: int) -> int:
    """The sampling seed of eval sample `index` of eval prompt `prompt`: the same at every
    evaluation, and hashed apart from the training seeds (`sample_seed`, a small linear
    combination of its arguments), so an eval never replays a training sample's draws."""
    digest = hashlib.blake2b(f"rljob-eval:{seed}:{prompt}:{index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") % (2**63 - 1)


@dataclass(frozen=True)
class EvalResult:
    """One evaluation over the held-out prompts (spec.eval)."""

    reward: float  # mean reward over every eval sample
    best_reward: float  # mean over prompts of the best sample's reward (pass@n for 0/1 rewards)
    prompts: int
    samples_per_prompt: int
    aborted: int  # samples the generate function aborted; each scored 0
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The metrics.jsonl figures: `eval_reward_max` only when there is a best of several,
        `eval_aborted` only when a sample was aborted."""
        row = {"eval_reward": self.reward, "eval_seconds": self.seconds}
        if self.samples_per_prompt > 1:
            row["eval_reward_max"] = self.best_reward
        if self.aborted:
            row["eval_aborted"] = float(self.aborted)
        return row


class RolloutWorker(Locatable):
    def __init__(self, spec_json: str, model_dir: str, engine_urls: list[str]) -> None:
        self.spec = RLJobSpec.model_validate_json(spec_json)
        self.model_dir = model_dir
        self.engine_urls = engine_urls

    def setup(self) -> list[str]:
        """Load data and hooks here, in the worker; return the problems instead of raising."""
        data = self.spec.data
        try:
            self.task = load_task(data.dataset, data.prompt_key, data.label_key)
            eval_dataset = self.spec.eval.dataset
            self.eval_task = (load_task(eval_dataset, data.prompt_key, data.label_key,
                                        field="spec.eval.dataset")
                              if eval_dataset else None)
            self.generate_fn = load_generate(self.spec.generate.function)
            self.reward_fn = load_reward(self.spec.reward.function)
        except (DatasetError, HookError) as err:
            return [str(err)]
        self.source = DataSource(self.task.prompts, self.spec.algorithm.seed, data.shuffle)
        self.codec = load_codec(Path(self.model_dir))
        self.metrics_port = worker_metrics.serve()
        return []

    def _sampling(self) -> dict[str, Any]:
        s = self.spec.rollout.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                "max_new_tokens": s.max_new_tokens, "stop": list(s.stop)}

    async def _run_group(
        self, args: HookArgs, prompt: Prompt, group: int, step: int, sem: asyncio.Semaphore
    ) -> list[Sample]:
        n = self.spec.algorithm.n_samples_per_prompt

        async def one(index: int) -> Sample:
            sample = Sample(prompt=prompt.prompt, label=prompt.label, group_index=group,
                            index=index, prompt_tokens=self.codec.encode(prompt.prompt),
                            seed=sample_seed(self.spec.algorithm.seed, step, group, index))
            async with sem:
                sample = await self.generate_fn(args, sample, self._sampling())
                if sample.status in (Status.completed, Status.truncated):
                    path = self.spec.reward.function
                    sample.reward = as_reward(await self.reward_fn(args, sample), path)
            return sample

        return list(await asyncio.gather(*(one(i) for i in range(n))))

    async def generate(self, step: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """One rollout step: rolloutBatchSize complete groups, as JSON-able sample dicts.

        Groups with an aborted sample go back to the data source and are generated again
        (up to MAX_REFILLS rounds). With dynamic sampling, groups whose rewards are all equal
        are set aside and replaced by new prompts for up to maxRounds rounds; if the batch is
        still short then, the set-aside groups fill it. Every group of the step gets its own
        sampling seeds (a counter over the step's groups), and dropped prompts stay consumed,
        so the checkpointed data cursor and buffer resume exactly where this step left off.
        """
        started = time.monotonic()
        want = self.spec.algorithm.rollout_batch_size
        dynamic = self.spec.algorithm.dynamic_sampling
        filter_rounds = dynamic.max_rounds if dynamic.enabled else 0
        done: list[list[Sample]] = []
        uniform: list[list[Sample]] = []
        attempted = rounds = uniform_kept = 0
        engines = [EngineClient(u) for u in self.engine_urls]
        try:
            args = HookArgs(self.spec, engines, self.codec, self.task)
            sem = asyncio.Semaphore(CONCURRENCY_PER_ENGINE * len(engines))
            while len(done) < want:
                if rounds == MAX_REFILLS + max(filter_rounds - 1, 0):
                    raise NotEnoughSamples(
                        f"step {step}: only {len(done)}/{want} groups finished after {rounds} "
                        "attempts; the generate function keeps aborting samples")
                prompts = self.source.take(want - len(done))
                groups = await asyncio.gather(*(
                    self._run_group(args, p, attempted + i, step, sem)
                    for i, p in enumerate(prompts)))
                attempted += len(prompts)
                rounds += 1
                self.source.give_back([p for p, g in zip(prompts, groups, strict=True)
                                       if not _finished(g)])
                for g in groups:
                    if not _finished(g):
                        continue
                    (uniform if rounds <= filter_rounds and _zero_variance(g) else done).append(g)
                if rounds == filter_rounds:  # no more filtering: set-aside groups fill the gap
                    uniform_kept = min(len(uniform), want - len(done))
                    done += uniform[:uniform_kept]
        finally:
            await asyncio.gather(*(e.aclose() for e in engines))
        samples = [s for g in done for s in g]
        for index, g in enumerate(done):
            for s in g:
                s.group_index = index
        self._check_log_probs(samples)
        seconds = time.monotonic() - started
        tokens = sum(s.response_length for s in samples)
        worker_metrics.record_rollout(len(samples), tokens)
        stats = {"rollout_seconds": seconds, "response_tokens": float(tokens),
                 "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
                 "generation_rounds": float(rounds), "generated_groups": float(attempted)}
        if dynamic.enabled:
            stats["filtered_groups"] = float(len(uniform))
            stats["filtered_groups_kept"] = float(uniform_kept)
        return [s.to_json() for s in samples], stats

    def _check_log_probs(self, samples: list[Sample]) -> None:
        """TIS weighs every token by the engine's log-prob: a sample without them would be
        weighed against 0 and silently get a wrong weight, so it stops the run instead."""
        if not self.spec.algorithm.tis.enabled:
            return
        missing = sum(1 for s in samples if len(s.rollout_log_probs) != s.response_length)
        if missing:
            raise HookError(
                f"spec.algorithm.tis is enabled but {missing} of {len(samples)} samples lack "
                "the engine's log-prob of every response token; the generate function "
                f"{self.spec.generate.function} must set Sample.rollout_log_probs (one per "
                "response token), or set spec.algorithm.tis.enabled false")

    def _eval_sampling(self) -> dict[str, Any]:
        """The training sampling settings, made greedy (temperature 0: the engines take the
        most likely token, in the hf engine and in SGLang alike) and capped as spec.eval says."""
        params = self._sampling()
        ev = self.spec.eval
        if ev.greedy:
            params.update(temperature=0.0, top_p=1.0, top_k=-1)
        if ev.max_new_tokens is not None:
            params["max_new_tokens"] = ev.max_new_tokens
        return params

    async def evaluate(self) -> EvalResult:
        """Every prompt of spec.eval.dataset, answered samplesPerPrompt times and rewarded.

        Seeds depend only on (job seed, prompt, sample), never on the step, so two
        evaluations differ only by the weights. A sample the generate function aborted
        scores 0 and is counted, so a flaky hook cannot lift the eval reward by dropping
        hard prompts."""
        if self.eval_task is None:
            raise ValueError("no spec.eval.dataset configured; set spec.eval.dataset")
        started = time.monotonic()
        n = self.spec.eval.samples_per_prompt
        sampling = self._eval_sampling()
        engines = [EngineClient(u) for u in self.engine_urls]
        try:
            args = HookArgs(self.spec, engines, self.codec, self.eval_task)
            sem = asyncio.Semaphore(CONCURRENCY_PER_ENGINE * len(engines))

            async def one(i: int, p: Prompt, index: int) -> tuple[float, bool]:
                sample = Sample(prompt=p.prompt, label=p.label, group_index=i, index=index,
                                prompt_tokens=self.codec.encode(p.prompt),
                                seed=eval_seed(self.spec.algorithm.seed, i, index))
                async with sem:
                    sample = await self.generate_fn(args, sample, dict(sampling))
                    if sample.status not in (Status.completed, Status.truncated):
                        return 0.0, True
                    return as_reward(await self.reward_fn(args, sample),
                                     self.spec.reward.function), False

            async def prompt_rewards(i: int, p: Prompt) -> list[tuple[float, bool]]:
                return list(await asyncio.gather(*(one(i, p, j) for j in range(n))))

            per_prompt = await asyncio.gather(*(prompt_rewards(i, p)
                                                for i, p in enumerate(self.eval_task.prompts)))
        finally:
            await asyncio.gather(*(e.aclose() for e in engines))
        rewards = [[r for r, _ in group] for group in per_prompt]
        return EvalResult(
            reward=sum(sum(g) for g in rewards) / (len(rewards) * n),
            best_reward=sum(max(g) for g in rewards) / len(rewards),
            prompts=len(rewards), samples_per_prompt=n,
            aborted=sum(a for group in per_prompt for _, a in group),
            seconds=time.monotonic() - started)

    def state(self) -> dict[str, Any]:
        return self.source.state()

    def load(self, state: dict[str, Any]) -> None:
        self.source.load(state)
