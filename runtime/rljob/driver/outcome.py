"""How an attempt ends: every way out of start-up and the loop becomes an exit code
(`rljob_api.exits`) and, for a failure or a stop, a report the operator acts on."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import ray

from rljob.checkpoint.store import CheckpointConflict, LeaseLost
from rljob.driver.attempt import Attempt
from rljob_api import exits
from rljob_api.exits import JobError

# How long a failed attempt waits for Ray to say whether a node of it died: Ray's GCS marks a
# node dead at once when its raylet exits, and after its health checks fail (about 15-30 s
# with Ray's defaults) when the node's host vanished.
NODE_DEATH_WAIT_S = 45.0


def _say(message: str) -> None:
    print(f"rljob run: {message}", file=sys.stderr, flush=True)


def exit_code(attempt: Attempt, run: Callable[[], int]) -> int:
    """`run()`'s exit code, its failures and stops reported and turned into exit codes."""
    try:
        return run()
    except KeyboardInterrupt:  # Aborted, or what ray.get raises in its place
        return _aborted(attempt)
    except JobError as err:
        _say(str(err))
        if err.code == exits.FAILED:
            attempt.fail(str(err).split(":", 1)[0], str(err), retryable=True)
        elif err.code in (exits.INVALID, exits.ENGINES_EXHAUSTED):
            # The status says why (the field and the fix), not only the exit code.
            attempt.fail(exits.TERMINAL_REASONS[err.code], str(err), retryable=False)
        return err.code
    except (LeaseLost, CheckpointConflict) as err:
        # Another driver of this job owns the checkpoint store, and the job's status with it:
        # this one stops without publishing or reporting anything more (a report queued
        # before it lost the store may still be written).
        _say(f"CheckpointStoreLost: {err}")
        return exits.FAILED
    except ray.exceptions.RayError as err:
        _worker_failed(attempt, err)
        return exits.FAILED
    except OSError as err:
        _io_failed(attempt, err)
        return exits.FAILED


def _aborted(attempt: Attempt) -> int:
    if not attempt.stop.aborted:
        # Ctrl-C where the stop handler could not be installed (not the main thread):
        # nothing saved here; the latest checkpoint, if any, is untouched.
        _say("interrupted; nothing was saved")
        return exits.INTERRUPTED
    # During start-up, or a second signal: the step and save in progress are abandoned;
    # published checkpoints are whole (a save appears only by its final rename).
    if attempt.loop_started:
        step = attempt.checkpoints.step
        what = (f"at once; the next run resumes from the checkpoint of step {step}"
                if step is not None else "at once; no checkpoint was saved yet")
    else:
        what = "during start-up; nothing was trained"
    _say(f"stopped by {attempt.stop.name} {what}")
    attempt.report_stop(aborted=True)
    return exits.for_signal(attempt.stop.signum or 0)


def _worker_failed(attempt: Attempt, err: ray.exceptions.RayError) -> None:
    """A worker or engine died or raised: a restart from the checkpoint may help. Which pod
    went away, if one did, is what the operator needs to name the cause."""
    _say(f"a worker failed: {err}")
    # A stop (SIGTERM) takes compute away too: no time to spend asking Ray what died.
    lost = {} if attempt.stop.requested else attempt.cluster.lost_pods(NODE_DEATH_WAIT_S)
    if lost:
        pods = "; ".join(f"{pod} ({why})" for pod, why in sorted(lost.items()))
        _say(f"Ray lost the node of {pods}")
        attempt.fail("WorkerLost", f"Ray lost the node of {pods}; first error: {str(err)[:3000]}",
                     retryable=True, lost_pods=sorted(lost))
    else:
        attempt.fail(exits.WORKER_FAILED, str(err)[:4000], retryable=True)


def _io_failed(attempt: Attempt, err: OSError) -> None:
    """Storage failed under the run (full, read-only, gone), or another I/O error reached
    the loop: published checkpoints are whole, so a restart resumes from the latest."""
    workdir = attempt.options.workdir
    name = str(err.filename or "")
    in_workdir = bool(name) and Path(name).resolve().is_relative_to(workdir.resolve())
    reason = "StorageError" if in_workdir else "IOError"
    what = (f"a file operation in the workdir {workdir} failed" if in_workdir
            else "an I/O operation failed")
    where = f" ({name})" if name else ""
    message = f"{what}: {err.strerror or err}{where}; published checkpoints are unaffected"
    _say(f"{reason}: {message}")
    attempt.fail(reason, message, retryable=True)

