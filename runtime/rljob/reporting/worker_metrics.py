"""Prometheus metrics of the worker processes (trainer, rollout worker, engines).

Each worker process serves its own registry on `RLJOB_METRICS_PORT` (0 or unset: a free
port, logged by the driver), so a scraper sees the figures where they are produced.
"""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge, start_http_server

from rljob_api import env

SAMPLES = Counter("rljob_rollout_samples_total", "Samples generated and rewarded")
RESPONSE_TOKENS = Counter("rljob_rollout_response_tokens_total", "Response tokens generated")
TRAIN_STEPS = Counter("rljob_trainer_steps_total", "Optimizer steps taken")
SKIPPED_STEPS = Counter("rljob_trainer_skipped_steps_total",
                        "Optimizer steps skipped for non-finite loss or gradients")
LOSS = Gauge("rljob_trainer_loss", "Loss of the last optimizer step")
GRAD_NORM = Gauge("rljob_trainer_grad_norm", "Gradient norm of the last optimizer step")
WEIGHT_VERSION = Gauge("rljob_weight_version", "Last weight version published or installed")

_served: int | None = None


def serve() -> int:
    """Start this process's metrics endpoint once; return its port."""
    global _served
    if _served is None:
        server, _ = start_http_server(int(os.environ.get(env.METRICS_PORT, "0")))
        _served = int(server.server_address[1])
    return _served


def record_rollout(samples: int, tokens: int) -> None:
    SAMPLES.inc(samples)
    RESPONSE_TOKENS.inc(tokens)


def record_train_step(loss: float, grad_norm: float, skipped: bool) -> None:
    if skipped:
        SKIPPED_STEPS.inc()
        return
    TRAIN_STEPS.inc()
    LOSS.set(loss)
    GRAD_NORM.set(grad_norm)
