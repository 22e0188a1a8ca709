"""The rollout worker: prompts → samples with rewards, through the user's hooks.

It owns the data source (cursor and buffer) and the engine clients, and runs as a Ray
actor so user hooks execute in a worker process. Each sample gets a sampling seed fixed
by (job seed, rollout step, group, index), so a resumed run regenerates exactly what an
uninterrupted one would have.

With partial rollout (`spec.rollout.partialRollout`) that exactness ends: which groups
finish before the step's cut depends on timing. A carried sample's continuation gets a
fresh seed from the step, group and index it is continued under; the checkpoint holds the
carried groups, so a resume continues the same ones and loses none, but the tokens it
generates for them are not bit-identical with an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from rljob.model.text_codec import load_codec
from rljob.reporting import worker_metrics
from rljob.reporting.locatable import Locatable
from rljob.rollout.data_source import DataSource
from rljob.rollout.engine_pool import EnginePool
from rljob.rollout.hooks import (
    GenerateManyFn,
    HookArgs,
    HookError,
    as_reward,
    load_generate,
    load_generate_many,
    load_reward,
)
from rljob.rollout.in_flight import InFlight
from rljob.rollout.sample import Sample, Status, version_number
from rljob.rollout.stats import EvalResult, RolloutStats
from rljob.rollout.tasks import DatasetError, Prompt, load_task
from rljob_api.spec import OldLogprobs, RLJobSpec

# Samples in flight per engine (`rljob.rollout.in_flight`).
CONCURRENCY_PER_ENGINE = 64
MAX_REFILLS = 8


class NotEnoughSamples(RuntimeError):
    """Too many generations were aborted to fill one rollout batch."""


def _done(sample: Sample) -> bool:
    return sample.status in (Status.completed, Status.truncated)


def _finished(group: list[Sample]) -> bool:
    return all(_done(s) for s in group)


def _carryable(group: list[Sample]) -> bool:
    """Every unfinished sample was aborted or never sent, so it can be continued; a sample
    a generate function marked failed makes the group start over from its prompt."""
    return all(_done(s) or s.status in (Status.aborted, Status.pending) for s in group)


def _prompt_of(job: Prompt | list[Sample]) -> Prompt:
    return job if isinstance(job, Prompt) else Prompt(job[0].prompt, job[0].label)


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


class RolloutWorker(Locatable):
    def __init__(self, spec_json: str, model_dir: str,
                 engine_urls: list[str] | list[ray.ObjectRef[str]]) -> None:
        # Addresses to come (the driver starts this worker while the engines load) are
        # waited for here, after this process's own start-up.
        engine_urls = [ray.get(u) if isinstance(u, ray.ObjectRef) else u for u in engine_urls]
        self.spec = RLJobSpec.model_validate_json(spec_json)
        self.model_dir = model_dir
        # Requests go to the engines serving; one lost costs its requests, sent again to
        # another, and rejoins when the driver says it has the current weights.
        self.pool = EnginePool(engine_urls, reissue=self.spec.replaces_engines())
        # Partial rollout: groups cut off at the last step boundary, continued first next step.
        self.carried: list[list[Sample]] = []

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
            self.generate_many_fn = load_generate_many(self.spec.generate.function)
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
        self, args: HookArgs, job: Prompt | list[Sample], group: int, step: int,
        in_flight: InFlight, cut: asyncio.Event,
    ) -> list[Sample]:
        """One group: a new prompt's nSamplesPerPrompt samples, or a carried group whose
        unfinished samples are continued (finished ones are kept as they are). Every sample
        generated gets the seed of (step, group, index). Once `cut` is set (partial rollout:
        the step has its groups), samples still waiting for a slot are not sent."""
        if isinstance(job, Prompt):
            tokens = self.codec.encode(job.prompt)
            samples = [Sample(prompt=job.prompt, label=job.label, index=i,
                              prompt_tokens=list(tokens))
                       for i in range(self.spec.algorithm.n_samples_per_prompt)]
        else:
            samples = job

        todo = [s for s in samples if not _done(s)]
        for sample in todo:
            sample.group_index = group
            sample.seed = sample_seed(self.spec.algorithm.seed, step, group, sample.index)

        async def rewarded(sample: Sample) -> Sample:
            if _done(sample):
                path = self.spec.reward.function
                sample.reward = as_reward(await self.reward_fn(args, sample), path)
            return sample

        async def one(sample: Sample) -> Sample:
            async def send() -> Sample:
                if cut.is_set():  # not sent, nor sent again after the cut
                    return sample
                return await self.generate_fn(args, sample, self._sampling())

            async with in_flight.rows(1):
                return await rewarded(await self.pool.run(send))

        async def together(generate_many: GenerateManyFn, part: list[Sample]) -> list[Sample]:
            async def send() -> list[Sample]:
                if cut.is_set():
                    return part
                return await generate_many(args, part, self._sampling())

            async with in_flight.rows(len(part)):
                answered = await self.pool.run(send, rows=len(part))
                return list(await asyncio.gather(*(rewarded(s) for s in answered)))

        if self.generate_many_fn is not None:
            # The built-in generate: one request per engine slot for the group's samples in
            # it, in index order (`default_generate_many`).
            parts: dict[int, list[Sample]] = {}
            for sample in todo:
                parts.setdefault(args.engine_slot(sample), []).append(sample)
            answers = await asyncio.gather(
                *(together(self.generate_many_fn, part) for part in parts.values()))
            generated = dict(zip(map(id, (s for part in parts.values() for s in part)),
                                 (s for answer in answers for s in answer), strict=True))
        else:
            answered = await asyncio.gather(*(one(s) for s in todo))
            generated = dict(zip(map(id, todo), answered, strict=True))
        # In place: a carried group stays the same list, which generate() keys it by. A
        # generate function may answer with a new Sample object in place of the one it got.
        samples[:] = [generated.get(id(s), s) for s in samples]
        return samples

    async def _round(
        self, args: HookArgs, jobs: list[Prompt | list[Sample]], first: int, step: int,
        in_flight: InFlight, cut_at: int | None, filtering: bool,
    ) -> tuple[list[list[Sample]], list[bool], bool]:
        """Generate `jobs` concurrently as groups first, first + 1, ...; return the groups
        in launch order, whether each finished, and whether the round was cut.

        With `cut_at` (partial rollout), as soon as that many groups finished and count
        for the batch (not set aside by dynamic sampling while `filtering`), the engines'
        requests are aborted: each answers at once with what it generated so far, and
        samples still waiting for a slot are not sent.
        """
        cut = asyncio.Event()
        tasks = [asyncio.create_task(self._run_group(args, job, first + i, step, in_flight, cut))
                 for i, job in enumerate(jobs)]
        try:
            if cut_at is None:
                groups = list(await asyncio.gather(*tasks))
                return groups, [_finished(g) for g in groups], False
            position = {task: i for i, task in enumerate(tasks)}
            finished = [False] * len(tasks)
            counted = 0
            pending = set(tasks)
            while pending:
                complete, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_COMPLETED)
                for task in complete:
                    group = task.result()
                    finished[position[task]] = _finished(group)
                    if finished[position[task]] and not (filtering and _zero_variance(group)):
                        counted += 1
                if counted >= cut_at and not cut.is_set():
                    cut.set()
                    await self.pool.abort_all()
            return [t.result() for t in tasks], finished, cut.is_set()
        finally:
            for task in tasks:  # only left running when one of them raised
                task.cancel()

    async def generate(self, step: int, oldest_version: int | None = None
                       ) -> tuple[list[Sample], RolloutStats]:
        """One rollout step: rolloutBatchSize complete groups of rewarded samples.

        Groups with an aborted sample go back to the data source and are generated again
        (up to MAX_REFILLS rounds). With dynamic sampling, groups whose rewards are all equal
        are set aside and replaced by new prompts for up to maxRounds rounds; if the batch is
        still short then, the set-aside groups fill it. Every group of the step gets its own
        sampling seeds (a counter over the step's groups), and dropped prompts stay consumed,
        so the checkpointed data cursor and buffer resume exactly where this step left off.

        With partial rollout, each round starts overSampling groups more than it needs,
        groups carried from the last step first; when enough are finished the round is cut
        (`_round`), and the unfinished groups of a cut round are carried to the next step
        with their partial responses (as are groups that finished after the cut) instead
        of going back as prompts. A group aborted in a round that was not cut (by its
        generate function, not by us) still starts over from its prompt. `oldest_version`
        (async rollout's staleness bound) drops carried groups with tokens of an older
        weight version: their prompts are generated again from scratch, and counted.
        """
        started = time.monotonic()
        want = self.spec.algorithm.rollout_batch_size
        dynamic = self.spec.algorithm.dynamic_sampling
        partial = self.spec.rollout.partial_rollout
        extra = partial.extra_groups(want)
        filter_rounds = dynamic.max_rounds if dynamic.enabled else 0
        done: list[list[Sample]] = []
        uniform: list[list[Sample]] = []
        attempted = rounds = uniform_kept = resumed_groups = 0
        brought: dict[int, int] = {}  # id(carried group) → response tokens it brought along
        stale = self._drop_stale_carried(oldest_version)
        reissued_before = self.pool.reissued
        try:
            args = HookArgs(self.spec, self.pool.serving, self.codec, self.task)
            in_flight = InFlight(CONCURRENCY_PER_ENGINE * len(self.pool.clients))
            while len(done) < want:
                if rounds == MAX_REFILLS + max(filter_rounds - 1, 0):
                    raise NotEnoughSamples(
                        f"step {step}: only {len(done)}/{want} groups finished after {rounds} "
                        "attempts; the generate function keeps aborting samples")
                need = want - len(done)
                resumed = self.carried[: need + extra]
                del self.carried[: len(resumed)]
                resumed_groups += len(resumed)
                brought.update({id(g): sum(s.response_length for s in g) for g in resumed})
                jobs: list[Prompt | list[Sample]] = [
                    *resumed, *self.source.take(need + extra - len(resumed))]
                filtering = rounds < filter_rounds
                groups, finished, was_cut = await self._round(
                    args, jobs, attempted, step, in_flight, need if partial.enabled else None,
                    filtering)
                attempted += len(jobs)
                rounds += 1
                again: list[Prompt] = []
                for job, g, ok in zip(jobs, groups, finished, strict=True):
                    if not ok:
                        if was_cut and _carryable(g):
                            self.carried.append(g)
                        else:
                            again.append(_prompt_of(job))
                    elif filtering and _zero_variance(g):
                        uniform.append(g)
                    elif len(done) < want:
                        done.append(g)
                    else:  # finished after the cut: the next step takes it as it is
                        self.carried.append(g)
                self.source.give_back(again)
                if rounds == filter_rounds:  # no more filtering: set-aside groups fill the gap
                    uniform_kept = min(len(uniform), want - len(done))
                    done += uniform[:uniform_kept]
        finally:
            await self.pool.aclose()
        samples = [s for g in done for s in g]
        for index, g in enumerate(done):
            for s in g:
                s.group_index = index
        self._check_log_probs(samples)
        seconds = time.monotonic() - started
        tokens = sum(s.response_length for s in samples)
        carried_tokens = sum(brought.get(id(g), 0) for g in done)  # generated in earlier steps
        generated = tokens - carried_tokens
        worker_metrics.record_rollout(len(samples), generated)
        stats = RolloutStats(
            rollout_seconds=seconds, response_tokens=float(tokens),
            tokens_per_second=generated / seconds if seconds > 0 else 0.0,
            generation_rounds=float(rounds), generated_groups=float(attempted),
            reissued_requests=float(self.pool.reissued - reissued_before))
        if dynamic.enabled:
            stats = replace(stats, filtered_groups=float(len(uniform)),
                            filtered_groups_kept=float(uniform_kept))
        if partial.enabled:
            stats = replace(
                stats, partial_groups_carried=float(len(self.carried)),
                partial_groups_resumed=float(resumed_groups),
                partial_tokens_resumed=float(carried_tokens),
                stale_groups_dropped=float(stale) if oldest_version is not None else None,
                masked_off_policy_tokens=float(sum(s.mask_older_versions() for s in samples))
                if partial.mask_off_policy_tokens else None)
        return samples, stats

    def _check_log_probs(self, samples: list[Sample]) -> None:
        """TIS weighs every token by the engine's log-prob, and `oldLogprobs: rollout` takes
        it as the old policy: a sample without them would be measured against 0 and silently
        get a wrong weight or clip, so it stops the run instead."""
        if self.spec.algorithm.tis.enabled:
            needed_by = "spec.algorithm.tis is enabled"
            fix = "set spec.algorithm.tis.enabled false"
        elif self.spec.old_logprobs() == OldLogprobs.rollout:
            needed_by = "spec.algorithm.oldLogprobs is rollout" + (
                " (the default with rollout.mode async)"
                if self.spec.algorithm.old_logprobs is None else "")
            fix = "set spec.algorithm.oldLogprobs trainer"
        else:
            return
        missing = sum(1 for s in samples if len(s.rollout_log_probs) != s.response_length)
        if missing:
            raise HookError(
                f"{needed_by} but {missing} of {len(samples)} samples lack the engine's "
                "log-prob of every response token; the generate function "
                f"{self.spec.generate.function} must set Sample.rollout_log_probs (one per "
                f"response token), or {fix}")

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
        try:
            args = HookArgs(self.spec, self.pool.serving, self.codec, self.eval_task)
            sem = asyncio.Semaphore(CONCURRENCY_PER_ENGINE * len(self.pool.clients))

            async def one(i: int, p: Prompt, index: int) -> tuple[float, bool]:
                sample = Sample(prompt=p.prompt, label=p.label, group_index=i, index=index,
                                prompt_tokens=self.codec.encode(p.prompt),
                                seed=eval_seed(self.spec.algorithm.seed, i, index))
                async with sem:
                    sample = await self.pool.run(
                        lambda: self.generate_fn(args, sample, dict(sampling)))
                    if sample.status not in (Status.completed, Status.truncated):
                        return 0.0, True
                    return as_reward(await self.reward_fn(args, sample),
                                     self.spec.reward.function), False

            async def prompt_rewards(i: int, p: Prompt) -> list[tuple[float, bool]]:
                return list(await asyncio.gather(*(one(i, p, j) for j in range(n))))

            per_prompt = await asyncio.gather(*(prompt_rewards(i, p)
                                                for i, p in enumerate(self.eval_task.prompts)))
        finally:
            await self.pool.aclose()
        rewards = [[r for r, _ in group] for group in per_prompt]
        return EvalResult(
            reward=sum(sum(g) for g in rewards) / (len(rewards) * n),
            best_reward=sum(max(g) for g in rewards) / len(rewards),
            prompts=len(rewards), samples_per_prompt=n,
            aborted=sum(a for group in per_prompt for _, a in group),
            seconds=time.monotonic() - started)

    def _drop_stale_carried(self, oldest_version: int | None) -> int:
        """Carried groups with a token older than `oldest_version` would lag the trainer by
        more than async rollout's bound: their prompts go back to be generated afresh."""
        if oldest_version is None:
            return 0
        keep: list[list[Sample]] = []
        stale: list[list[Sample]] = []
        for g in self.carried:
            versions = [version_number(s.first_weight_version) for s in g]
            old = any(v is not None and v < oldest_version for v in versions)
            (stale if old else keep).append(g)
        self.carried = keep
        self.source.give_back([_prompt_of(g) for g in stale])
        return len(stale)

    async def engine_lost(self, index: int, why: str) -> None:
        """The driver found engine `index` gone: its requests go elsewhere from now on."""
        await self.pool.lose(index, why)

    async def engine_joined(self, index: int, url: str) -> None:
        """Engine `index` serves the current weights at `url` again."""
        await self.pool.join(index, url)

    def engines_lost(self) -> dict[int, str]:
        """Engines this worker took out (a request failed, /health did not answer)."""
        return dict(self.pool.lost)

    def return_prompts(self, samples: list[Sample]) -> None:
        """A generated batch's prompts, one per group, back to be generated again first."""
        groups = {(s.group_index, s.prompt, s.label) for s in samples}
        self.source.give_back([Prompt(prompt, label) for _, prompt, label in sorted(groups)])

    def state(self) -> dict[str, Any]:
        """The data cursor and buffer; with partial rollout also the carried groups, partial
        responses, log-probs and versions included, so a resume continues them."""
        state = self.source.state()
        if self.spec.rollout.partial_rollout.enabled:
            state["partial_groups"] = [[s.to_json() for s in g] for g in self.carried]
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's state. Groups a run with partial rollout carried are
        continued; with partialRollout now disabled their prompts are generated again."""
        self.source.load(state)
        self.carried = [[Sample.from_json(d) for d in g] for g in state.get("partial_groups", [])]
        if self.carried and not self.spec.rollout.partial_rollout.enabled:
            self.source.give_back([_prompt_of(g) for g in self.carried])
            self.carried = []
