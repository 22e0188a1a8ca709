"""The support objects: what a job's pods need before they start (RBAC, the Ray token, the
NetworkPolicy that lets only the job's own pods reach them, the checkpoint claim and the spec
ConfigMap), made together, each once.

While pods wait, what they mount is made again (if missing) at most this often per job,
and at once when the job starts waiting; creates of what exists are no-op writes otherwise.
The reconciler schedules the checks (`Reconciler._support_due`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from rljob_api.spec import RLJobSpec
from rljob_operator import builders
from rljob_operator.builders import JobRef, Obj
from rljob_operator.kube import Kube

SUPPORT_RECHECK_SECONDS = 10.0  # the first recheck; each later one waits twice as long,
SUPPORT_RECHECK_MAX_SECONDS = 300.0  # up to this


def spec_version(ref: JobRef, generation: object) -> str:
    """Which job and spec a support check was for: a new job of the same name, or an edited
    spec, is checked again."""
    return f"{ref.uid}/{generation}"


class Support:
    """The support objects of one reconcile, made (if missing) at most once, all of them
    before the RayCluster, so that a job whose child's name is taken starts no pods (and
    holds no GPUs) at all. The creates go out together: a new job's RayCluster waits for one
    round trip, not six. Each is created once (an existing one is kept as it is: the token
    and the checkpoints must survive restarts); only the spec is refreshed. `all_made` says
    whether every create made its object just now (none existed already)."""

    def __init__(self, kube: Kube, ref: JobRef, body: Obj, spec: RLJobSpec,
                 pool: ThreadPoolExecutor) -> None:
        self.kube, self.ref, self.body, self.spec, self.pool = kube, ref, body, spec, pool
        self._done = False
        self.all_made = False
        self.ran = False  # whether this object's ensure() made sure of every one

    def ensure(self) -> bool:
        """Returns whether the Ray token was made by this call (the first time, or after
        someone deleted its Secret)."""
        if self._done:
            return False
        self._done = True
        ref = self.ref
        # A fresh token only matters the first time: the create of an existing Secret is a
        # no-op, so the job keeps the token its Ray processes already use.
        token = builders.build_ray_token_secret(ref, secrets.token_hex(32))
        claim = builders.build_checkpoint_claim(ref, self.spec)
        spec = builders.build_configmap(ref, self.body.get("spec") or {})
        calls: list[Callable[[], object]] = [
            *(partial(self.kube.create, obj, ref.uid) for obj in builders.build_rbac(ref)),
            partial(self.kube.create, builders.build_network_policy(ref), ref.uid),
            *([partial(self.kube.create, claim, ref.uid)] if claim is not None else []),
            partial(self.kube.sync_configmap, spec, ref.uid)]
        made = self.pool.submit(self.kube.create, token, ref.uid)
        # .result() raises what the call raised (ObjectInTheWay, API errors)
        others = [bool(done.result()) for done in [self.pool.submit(call) for call in calls]]
        token_made = bool(made.result())
        self.all_made = token_made and all(others)
        self.ran = True
        return token_made
