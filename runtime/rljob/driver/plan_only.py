"""`rljob run --plan-only`: the job placed, each process's devices reported, nothing started."""

from __future__ import annotations

from rljob.cluster import device_plan
from rljob.cluster.placement import plan
from rljob.driver.attempt import Attempt
from rljob_api import exits
from rljob_api.exits import JobError


def plan_only(attempt: Attempt) -> int:
    """Print one `device-plan:` line per process (trainer ranks, engines, sidecars) and stop;
    a plan that breaks docs/gpu-pods.md's rule (a GPU outside its container's allocation, a
    shared GPU, a sidecar away from its engine's GPUs) stops as an invalid job, naming it."""
    if attempt.options.join:
        # As `start` does: a driver left behind by a restart holds slots until stopped.
        attempt.cluster.start_ray(plan(attempt.spec))
        attempt.cluster.stop_stale_drivers()
    reports = attempt.cluster.plan_devices(attempt.spec)
    for report in reports:
        print(report.line(), flush=True)
    found = device_plan.problems(reports)
    if found:
        raise JobError(exits.INVALID, "DevicePlanMismatch: " + "; ".join(found))
    gpus = {g for r in reports for g in r.gpus}
    stated = all(r.allocation is not None for r in reports if r.gpus)
    checked = ("each within its container's allocation" if stated else
               "no container allocation stated (NVIDIA_VISIBLE_DEVICES), none shared")
    print(f"device plan: {len(reports)} processes on {len(gpus)} GPUs, {checked}; stopped "
          "after planning (--plan-only)", flush=True)
    return exits.OK
