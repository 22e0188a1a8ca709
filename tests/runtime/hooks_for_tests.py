"""User hooks the runtime tests name by import path (they run in the rollout worker)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rljob.rollout.hooks import HookArgs, default_generate, default_reward
from rljob.rollout.sample import Sample, Status


async def nan_reward(args: HookArgs, sample: Sample) -> float:
    """A broken reward model: every reward is NaN."""
    return float("nan")


_rewarded = 0  # samples rewarded so far in this rollout worker


async def nan_reward_first_step(args: HookArgs, sample: Sample) -> float:
    """NaN for every sample of the first rollout step, the task's reward after: a run that
    reports non-finite figures once (its optimizer steps skipped) and then trains on."""
    global _rewarded
    _rewarded += 1
    algo = args.spec.algorithm
    if _rewarded <= algo.rollout_batch_size * algo.n_samples_per_prompt:
        return float("nan")
    return await default_reward(args, sample)


async def break_mlflow_store_reward(args: HookArgs, sample: Sample) -> float:
    """The task's reward, after breaking the job's MLflow file store under its tracker: each
    run's metrics folder becomes a file, so MLflow's next write of a metric fails."""
    uri = args.spec.tracking.mlflow.tracking_uri
    assert uri is not None and uri.startswith("file:"), uri
    for metrics in Path(urlparse(uri).path).glob("*/*/metrics"):
        if metrics.is_dir():
            shutil.rmtree(metrics)
            metrics.write_text("not a folder\n")
    return await default_reward(args, sample)


async def length_reward(args: HookArgs, sample: Sample) -> float:
    """Rewards short answers: a custom hook that any policy can learn quickly."""
    return 1.0 if sample.response_length <= 2 else 0.0


GATE_ENV = "RLJOB_TEST_REWARD_GATE"  # a file path: rewards wait while it exists


async def gated_reward(args: HookArgs, sample: Sample) -> float:
    """The task's reward, held back while the file named by RLJOB_TEST_REWARD_GATE exists:
    the test decides when a step may finish. A `BLOCKED` file beside it says one waits."""
    gate = Path(os.environ[GATE_ENV])
    while gate.exists():
        (gate.parent / f"{gate.name}.BLOCKED").touch()
        await asyncio.sleep(0.1)
    return await default_reward(args, sample)


async def scripted_generate(args: HookArgs, sample: Sample, sampling_params: dict[str, Any]
                            ) -> Sample:
    """No engine: a one-token response (the prompt's first token) with a fixed log-prob, so
    a test decides every reward through the reward hook alone."""
    sample.tokens = [*sample.prompt_tokens, sample.prompt_tokens[0]]
    sample.response_length = 1
    sample.loss_mask = [1]
    sample.rollout_log_probs = [-1.0]
    sample.status = Status.completed
    return sample


async def scripted_generate_without_log_probs(
    args: HookArgs, sample: Sample, sampling_params: dict[str, Any]
) -> Sample:
    """As `scripted_generate`, but like a custom generate function that drops log-probs."""
    sample = await scripted_generate(args, sample, sampling_params)
    sample.rollout_log_probs = []
    return sample


async def label_decides_variance(args: HookArgs, sample: Sample) -> float:
    """Label `v`: the response's index as reward (the group's rewards differ); any other
    label: 1.0 for every response (a zero-variance group)."""
    return float(sample.index) if sample.label == "v" else 1.0


async def generate_to_the_limit(
    args: HookArgs, sample: Sample, sampling_params: dict[str, Any]
) -> Sample:
    """The built-in generate function with end-of-sequence ignored: a generation ends at
    maxNewTokens unless aborted, so only a step boundary can cut one short. It continues a
    carried sample as the built-in one does (it is the built-in one)."""
    return await default_generate(args, sample, dict(sampling_params, ignore_eos=True))


# Set by a test: rewards wait (polling, 30 s deadline) until it returns True.
REWARD_GATE: Callable[[], bool] | None = None


async def reward_after_gate(args: HookArgs, sample: Sample) -> float:
    """The response's index as reward, once REWARD_GATE holds: a test holds a group's last
    reward (and so the step's cut) until the engine is mid-way through another generation."""
    deadline = time.monotonic() + 30
    while REWARD_GATE is not None and not REWARD_GATE():
        if time.monotonic() > deadline:
            raise TimeoutError("REWARD_GATE did not open within 30 s")
        await asyncio.sleep(0.002)
    return float(sample.index)
REWARDED: list[Sample] = []  # every sample `recording_reward` scored in this process


async def recording_reward(args: HookArgs, sample: Sample) -> float:
    """The task's reward, with the scored sample kept in REWARDED: a test running the rollout
    worker in its own process reads back what was generated, with which seed and reward."""
    reward = await default_reward(args, sample)
    REWARDED.append(dataclasses.replace(sample, reward=reward))
    return reward


PROBE_FILE = "RLJOB_TEST_CREDENTIAL_PROBE"  # where `credential_probe_reward` writes its findings


async def credential_probe_reward(args: HookArgs, sample: Sample) -> float:
    """The task's reward, after trying once, as hostile hook code would, to get at the
    Kubernetes API: the in-cluster token file, the in-cluster config, a kubeconfig, and with
    whichever loads, a read of the job's RLJob. What each attempt gave is written as JSON to
    the file RLJOB_TEST_CREDENTIAL_PROBE names (once)."""
    out = Path(os.environ[PROBE_FILE])
    if not out.exists():
        from kubernetes import client, config

        found: dict[str, str] = {}
        try:
            Path("/var/run/secrets/kubernetes.io/serviceaccount/token").read_text()
            found["token_file"] = "read"
        except OSError as err:
            found["token_file"] = type(err).__name__
        for how, load in (("incluster", config.load_incluster_config),
                          ("kubeconfig", config.load_kube_config)):
            try:
                load()
            except Exception as err:
                found[how] = type(err).__name__
                continue
            try:
                client.CustomObjectsApi().get_namespaced_custom_object_status(
                    "rljob.io", "v1alpha1", os.environ.get("RLJOB_NAMESPACE", "default"),
                    "rljobs", os.environ.get("RLJOB_NAME", ""))
                found[how] = "read the RLJob"
            except Exception as err:
                found[how] = f"loaded, then {type(err).__name__}"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(found))
        tmp.replace(out)
    return await default_reward(args, sample)


ENGINE_LOSS_ENV = "RLJOB_TEST_ENGINE_LOSS_DIR"
_generated = 0  # generate calls so far in this rollout worker
_engine_announced = False


async def generate_on_a_lost_engine(
    args: HookArgs, sample: Sample, sampling_params: dict[str, Any]
) -> Sample:
    """The default generate, except twice. The first request of the third rollout step or
    later that goes to the last of several engines writes that engine's URL to
    `$RLJOB_TEST_ENGINE_LOSS_DIR/engine` and waits until the engine stops answering (the
    test kills its process), then is sent to that engine all the same, and fails there.
    Meanwhile the step's other requests run on, on both engines. And the requests of the
    job's last step wait until every engine serves again, so the run cannot end before the
    replacement rejoined (the driver brings it back while it waits for the batch)."""
    global _generated, _engine_announced
    _generated += 1
    directory = os.environ.get(ENGINE_LOSS_ENV)
    algo, engines = args.spec.algorithm, args.spec.rollout.engines
    per_step = algo.rollout_batch_size * algo.n_samples_per_prompt
    engine = args.engine_for(sample)
    if (directory and not _engine_announced and _generated > 2 * per_step
            and len(args.engines) > 1 and engine is args.engines[-1]):
        _engine_announced = True
        Path(directory, "engine").write_text(engine.base_url)
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(engine.healthy, 1.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {engine.base_url} still answers after 120 s")
            await asyncio.sleep(0.2)
        return await default_generate(dataclasses.replace(args, engines=[engine]), sample,
                                      sampling_params)
    if directory and _generated > (algo.total_steps - 1) * per_step:
        deadline = time.monotonic() + 300
        while len(args.engines) < engines:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(args.engines)}/{engines} engines serve after 300 s")
            await asyncio.sleep(0.2)
    return await default_generate(args, sample, sampling_params)
