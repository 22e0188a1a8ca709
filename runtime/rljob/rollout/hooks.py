"""User hooks (reward and generate functions) by import path, slime-style and async.

Signatures (see docs/hooks.md):
    async def reward(args: HookArgs, sample: Sample) -> float
    async def generate(args: HookArgs, sample: Sample, sampling_params: dict) -> Sample

The built-in generate function also has a batch form (`default_generate_many`), which the
rollout worker uses for a group's samples of one engine slot; a user's generate function
is called once per sample.

They are imported and called only inside the rollout worker, never in the driver or the
operator, so a user's code and its dependencies only have to exist in the job's image.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rljob.engine.client import EngineClient
from rljob.model.text_codec import TextCodec
from rljob.rollout.sample import Sample, Status
from rljob.rollout.tasks import Task
from rljob_api.spec import RLJobSpec

RewardFn = Callable[["HookArgs", Sample], Awaitable[float]]
GenerateFn = Callable[["HookArgs", Sample, dict[str, Any]], Awaitable[Sample]]
GenerateManyFn = Callable[["HookArgs", list[Sample], dict[str, Any]], Awaitable[list[Sample]]]


class HookError(ValueError):
    """A hook that cannot be used; the message names the spec field and the fix."""


@dataclass
class HookArgs:
    """What a hook may use: the job spec, the engines, the tokenizer and the task."""

    spec: RLJobSpec
    engines: list[EngineClient]
    tokenizer: TextCodec
    task: Task

    def engine_for(self, sample: Sample) -> EngineClient:
        """The engine a sample is assigned to (fixed by its position, so runs repeat)."""
        n = self.spec.algorithm.n_samples_per_prompt
        return self.engines[(sample.group_index * n + sample.index) % len(self.engines)]

    def engine_slot(self, sample: Sample) -> int:
        """The sample's place among the job's engines (samples in turn, over
        `spec.rollout.engines`), whichever of them serve now: the samples of a group that
        share a request to an engine (`default_generate_many`). Counted over the job's
        engines, not those serving, so which samples share a request never depends on an
        engine lost at the time (a row's numbers depend on the batch it is computed in)."""
        n = self.spec.algorithm.n_samples_per_prompt
        return (sample.group_index * n + sample.index) % self.spec.rollout.engine_count


async def default_reward(args: HookArgs, sample: Sample) -> float:
    """The task's exact reward of the response against the label."""
    return args.task.reward(sample.response, sample.label)


def _request(sample: Sample, sampling_params: dict[str, Any]
             ) -> tuple[list[int], dict[str, Any]] | None:
    """The sample's response so far and the sampling params of its next request: its seed,
    and for a partial response `max_new_tokens` less what it already has. None for a
    response already at full length (never aborted), which is marked truncated and sent
    nowhere."""
    prior = sample.response_tokens()
    params = dict(sampling_params, sampling_seed=sample.seed)
    if prior and params.get("max_new_tokens") is not None:
        params["max_new_tokens"] = int(params["max_new_tokens"]) - len(prior)
        if params["max_new_tokens"] <= 0:
            sample.status = Status.truncated
            return None
    return prior, params


def _take(args: HookArgs, sample: Sample, prior: list[int], out: dict[str, Any]) -> Sample:
    """The sample with the engine's answer `out` to the request for it appended."""
    meta = out["meta_info"]
    new = [int(t) for t in out["output_ids"]]
    text = str(out.get("text", args.tokenizer.decode(new)))
    if not prior:  # a fresh generation: nothing of an earlier attempt stays
        sample.response, sample.rollout_log_probs, sample.loss_mask = "", [], []
        sample.version_spans = []
    sample.tokens = list(sample.prompt_tokens) + prior + new
    sample.response_length = len(prior) + len(new)
    sample.response += text
    sample.rollout_log_probs += [float(lp[0]) for lp in meta["output_token_logprobs"]]
    sample.loss_mask += [1] * len(new)
    version = str(meta.get("weight_version", ""))
    if new or not prior:  # the version of the last token: unchanged if this call added none
        sample.weight_version = version
    if new:
        sample.add_span(version, len(prior))
    finish = (meta.get("finish_reason") or {}).get("type")
    sample.status = {"stop": Status.completed, "length": Status.truncated}.get(
        str(finish), Status.aborted
    )
    return sample


async def default_generate(
    args: HookArgs, sample: Sample, sampling_params: dict[str, Any]
) -> Sample:
    """One completion from the sample's engine, with the engine's log-probs and version.

    A sample that already holds a partial response (partial rollout aborted it at a step
    boundary) is continued rather than started over: the engine gets the prompt and the
    partial response as its input and `max_new_tokens` less what the response already
    has, and the new tokens, log-probs and loss mask are appended, the version that made
    them recorded in `Sample.version_spans`. An aborted generation keeps what it got, with
    status aborted; the rollout worker decides whether it is carried or started over.
    """
    (sample,) = await default_generate_many(args, [sample], sampling_params)
    return sample


async def default_generate_many(
    args: HookArgs, samples: list[Sample], sampling_params: dict[str, Any]
) -> list[Sample]:
    """`default_generate` of several samples in one request (SGLang's batch form of
    /generate, one sampling_params per prompt), to the engine of the first.

    The rollout worker sends each group's samples of one engine slot (`engine_slot`) this
    way: the `hf` engine, which computes one request at a time, then computes them as one
    batch instead of a forward pass per sample and token; SGLang splits the batch into one
    request per prompt, as if they came one by one. A row's numbers depend on the batch it
    is computed in, so the batch is always the same samples: those of the group still to
    generate in that slot, in index order, whichever engines serve, whether or not it is
    sent again after an engine was lost. A sample with one row to send goes alone, in
    SGLang's single form (the shape of `default_generate`'s request).
    """
    rows = [(sample, *request) for sample in samples
            if (request := _request(sample, sampling_params)) is not None]
    if not rows:
        return samples
    engine = args.engine_for(rows[0][0])
    if len(rows) == 1:
        sample, prior, params = rows[0]
        answers = [await engine.generate(list(sample.prompt_tokens) + prior, params)]
    else:
        answers = await engine.generate_many(
            [list(sample.prompt_tokens) + prior for sample, prior, _ in rows],
            [params for _, _, params in rows])
    for (sample, prior, _), answer in zip(rows, answers, strict=True):
        _take(args, sample, prior, answer)
    return samples


BUILTIN_REWARDS: dict[str, RewardFn] = {"builtin:default": default_reward}
BUILTIN_GENERATES: dict[str, GenerateFn] = {"builtin:default": default_generate}
# Built-in generate functions that take a batch of samples bound for one engine.
BUILTIN_GENERATES_MANY: dict[str, GenerateManyFn] = {"builtin:default": default_generate_many}


def _import(path: str, field: str, builtins: dict[str, Any], arity: int) -> Any:
    if path.startswith("builtin:"):
        if path not in builtins:
            raise HookError(f"{field}: unknown built-in {path!r}; use one of "
                            + ", ".join(sorted(builtins)))
        return builtins[path]
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise HookError(f"{field}: cannot import module {module_name!r} ({err}); make it "
                        "importable in the job's image (PYTHONPATH)") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise HookError(f"{field}: module {module_name!r} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(fn):
        raise HookError(f"{field}: {path} must be an `async def` function")
    if len(inspect.signature(fn).parameters) != arity:
        raise HookError(f"{field}: {path} must take {arity} arguments (see docs/hooks.md)")
    return fn


def load_reward(path: str) -> RewardFn:
    fn: RewardFn = _import(path, "spec.reward.function", BUILTIN_REWARDS, 2)
    return fn


def load_generate(path: str) -> GenerateFn:
    fn: GenerateFn = _import(path, "spec.generate.function", BUILTIN_GENERATES, 3)
    return fn


def load_generate_many(path: str) -> GenerateManyFn | None:
    """The batch form of the generate function at `path`: the built-in's; None for a user's
    function, which is called once per sample."""
    return BUILTIN_GENERATES_MANY.get(path)


def as_reward(value: Any, path: str) -> float:
    """A hook's return value as a float; NaN/Inf pass through (the trainer counts them)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HookError(f"spec.reward.function {path} returned {type(value).__name__}, "
                        "expected a float")
    return float(value)
