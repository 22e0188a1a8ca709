"""Experiment trackers fed with the rows of metrics.jsonl: TensorBoard, W&B and MLflow.

The driver writes each finished step to metrics.jsonl first (the record a resumed run
trims and continues), then hands the same row to every tracker `spec.tracking` enables.
Each backend's package is an optional extra, imported only when its tracker starts, so a
runtime without it still runs every job.

A tracker is a convenience, not part of the run's state: one that cannot start, log or
close prints one warning that names its field and is left out for the rest of the attempt
(a tracker that failed once is not retried every step: a remote one could then stall each
step on its own timeouts). Training goes on, and metrics.jsonl still has every row.
Values are passed as the loop computed them: NaN and ±Inf reach the tracker unchanged.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from rljob_api.spec import MlflowTracking, TensorBoardTracking, TrackingSpec, WandbTracking


@dataclass(frozen=True)
class Backend:
    """A tracker's field under `spec.tracking`, the module it needs and the extra with it."""

    field: str
    module: str
    extra: str

    def missing(self) -> str:
        return (f"spec.tracking.{self.field}.enabled: the `{self.module}` package is not "
                f"installed; pip install 'rljob[{self.extra}]' (without it the job trains and "
                "writes metrics.jsonl only)")


BACKENDS = (
    Backend("tensorboard", "tensorboard", "tracking-tensorboard"),
    Backend("wandb", "wandb", "tracking-wandb"),
    Backend("mlflow", "mlflow", "tracking-mlflow"),
)


def enabled(spec: TrackingSpec) -> list[Backend]:
    return [b for b in BACKENDS if getattr(spec, b.field).enabled]


def missing_packages(spec: TrackingSpec) -> list[str]:
    """One warning per enabled tracker whose package this Python cannot import.

    A warning and not a refusal: on a cluster what counts is the driver's image, not the
    machine that validates the file, and a tracker never decides whether a job trains."""
    return [b.missing() for b in enabled(spec) if importlib.util.find_spec(b.module) is None]


class Tracker(Protocol):
    """One backend: `where` says where its records are, for the run summary."""

    where: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, exit_code: int) -> None: ...


class TensorBoard:
    """Scalars in TensorBoard event files, through torch's writer."""

    def __init__(self, settings: TensorBoardTracking, workdir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(settings.log_dir) if settings.log_dir else workdir / "tensorboard"
        # A resumed attempt redoes the steps after its checkpoint: the purge step makes
        # TensorBoard's readers drop what an earlier attempt wrote from that step on.
        self.writer = SummaryWriter(str(log_dir), purge_step=first_step + 1)
        self.where = str(log_dir)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a driver killed later leaves every logged step readable

    def close(self, exit_code: int) -> None:
        self.writer.close()


class Wandb:
    """A W&B run per attempt, grouped under the job's name; the spec is its config."""

    def __init__(self, settings: WandbTracking, job: str, workdir: Path, attempt: int,
                 config: dict[str, Any]) -> None:
        import wandb

        if settings.mode == "offline":
            # W&B's own telemetry follows the process-wide mode, not the run's: without this
            # an offline run still posts to W&B's servers from the driver.
            os.environ["WANDB_MODE"] = "offline"
            wandb.setup(settings=wandb.Settings(mode="offline"))
        else:
            _require_wandb_login()
        root = Path(settings.dir) if settings.dir else workdir
        root.mkdir(parents=True, exist_ok=True)
        # console="off": the driver's output stays the driver's (W&B would wrap stdout).
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, mode=settings.mode,
            dir=str(root), name=f"{job}-attempt-{attempt}", group=job, job_type="train",
            config=config, settings=wandb.Settings(console="off", silent=True))
        # The run's folder (what `wandb sync` takes), not its files/ subfolder.
        self.where = f"{settings.mode} run {self.run.id} in {Path(self.run.dir).parent}"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


def _require_wandb_login() -> None:
    """An online run with no API key makes W&B ask for one on the terminal, which would hold
    a local run at its prompt (and end it on EOF): fail the tracker's start instead."""
    if os.environ.get("WANDB_API_KEY"):
        return
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        login = netrc.netrc().authenticators(host)
    except (OSError, netrc.NetrcParseError):
        login = None
    if login is None:
        raise RuntimeError(
            f"mode online needs WANDB_API_KEY (on a cluster, a key of the Secret named in "
            f"spec.tracking.envSecret) or a ~/.netrc login for {host}; or set mode offline")


def _redacted(uri: str) -> str:
    """`uri` without a password in it, for the run summary."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class Mlflow:
    """An MLflow run per attempt in the job's experiment, tagged with job and attempt."""

    def __init__(self, settings: MlflowTracking, job: str, workdir: Path, attempt: int) -> None:
        uri = settings.tracking_uri or str(workdir / "mlruns")
        if "://" not in uri and not uri.startswith("file:"):
            uri = Path(uri).resolve().as_uri()  # a plain path is a file store
        if uri.startswith(("http://", "https://")):
            # MLflow retries a failing server for minutes by default; a tracker that cannot
            # reach its server should fail its start (or one step's log) within seconds.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if uri.startswith("file:"):
            # Recent MLflow refuses its file store unless this is set. It is the default here
            # on purpose: it keeps ±Inf as logged (MLflow's SQL stores clamp them to the
            # largest float) and needs no database packages; a user's own value wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        name = settings.experiment_name or job
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        run = self.client.create_run(experiment, run_name=f"{job}-attempt-{attempt}",
                                     tags={"rljob.job": job, "rljob.attempt": str(attempt)})
        self.run_id: str = run.info.run_id
        self.where = f"run {self.run_id} of experiment {name!r} at {_redacted(uri)}"

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step)
                                                    for key, value in values.items()])

    def close(self, exit_code: int) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if exit_code == 0 else "FAILED")


def _warn(field: str, what: str, err: Exception) -> str:
    """Print the one warning a tracker gets; return the short form for the run summary."""
    short = f"{what}: {type(err).__name__}: {str(err).strip()[:500]}"
    print(f"rljob run: warning: spec.tracking.{field}: {short}; training goes on without "
          "it (metrics.jsonl has every row)", file=sys.stderr, flush=True)
    return short


class Trackers:
    """The enabled trackers of one attempt, each shielding the run from its failures."""

    def __init__(self) -> None:
        self.active: dict[str, Tracker] = {}
        self.outcome: dict[str, str] = {}  # field → where its records are, or what failed

    @classmethod
    def start(cls, spec: TrackingSpec, job: str, workdir: Path, first_step: int,
              attempt: int, config: dict[str, Any]) -> Trackers:
        """Start every enabled tracker; `first_step` is the step the attempt resumes after."""
        out = cls()
        for backend in enabled(spec):
            if importlib.util.find_spec(backend.module) is None:
                print(f"rljob run: warning: {backend.missing()}", file=sys.stderr, flush=True)
                out.outcome[backend.field] = f"not installed (pip install 'rljob[{backend.extra}]')"
                continue
            tracker: Tracker
            try:
                if backend.field == "tensorboard":
                    tracker = TensorBoard(spec.tensorboard, workdir, first_step)
                elif backend.field == "wandb":
                    tracker = Wandb(spec.wandb, job, workdir, attempt, config)
                else:
                    tracker = Mlflow(spec.mlflow, job, workdir, attempt)
            except Exception as err:  # anything a third-party tracker raises
                out.outcome[backend.field] = _warn(backend.field, "could not start", err)
                continue
            out.active[backend.field] = tracker
            out.outcome[backend.field] = tracker.where
        return out

    def log(self, row: dict[str, Any]) -> None:
        """Hand one metrics.jsonl row (its numbers, keyed as in the file) to every tracker."""
        if not self.active:
            return
        step = int(row["step"])
        values = {key: float(value) for key, value in row.items()
                  if key != "step" and isinstance(value, int | float)
                  and not isinstance(value, bool)}
        for field, tracker in list(self.active.items()):
            try:
                tracker.log(step, values)
            except Exception as err:  # anything a third-party tracker raises
                del self.active[field]
                self.outcome[field] = _warn(field, f"could not log step {step}", err)
                self._close(field, tracker, exit_code=1, warn=False)

    def close(self, exit_code: int) -> None:
        """Finish every tracker still logging (a second call finds none)."""
        for field, tracker in list(self.active.items()):
            del self.active[field]
            self._close(field, tracker, exit_code)

    def _close(self, field: str, tracker: Tracker, exit_code: int, warn: bool = True) -> None:
        """Close one tracker; after a failed log it was warned about already, so a failing
        close says nothing more."""
        try:
            tracker.close(exit_code)
        except Exception as err:  # anything a third-party tracker raises
            if warn:
                self.outcome[field] = _warn(field, "could not close", err)
