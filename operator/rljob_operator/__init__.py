"""The RLJob operator: reconciles `RLJob` objects onto KubeRay and reports their state.

It never imports torch, ray, megatron or sglang. Modules:

Pure (values in, values out; no API calls):
- `names`: child names, labels and annotations, derived from the job's name alone.
- `builders`: an RLJob spec → the Kubernetes objects that run it, and their revisions.
- `observe`: raw child objects → compact views of the pods, RayCluster and nodes.
- `situation`: the stored job, its observed children and the clock → facts a decision shares.
- `failures`: what broke a running attempt or keeps one from starting.
- `status`: the operator's status fields and conditions, and whether they need a write.
- `phases`: `decide`: the job's phase, its status and the actions that follow.
- `decision`: what a decision hands the reconciler (status, `Actions`, `Event`).

With state or I/O:
- `kube`: the operator's API calls, idempotent, telling the watch cache of its writes.
- `cache`: the watch cache (`Store`) and the shared node list (`NodeCache`).
- `memory`: what is remembered of each job between reconciles, one record per job.
- `support`: the objects a job's pods need before they start, made together.
- `reconciler`: one reconcile: read, decide, write status, act.
- `controller`: schedules reconciles: a deduplicating queue with a per-job resync.
- `metrics`: the operator's Prometheus metrics.
- `config`: operator settings from flags and the environment.
- `handlers`: kopf wiring: watch events fill the cache and kick the controller.
- `__main__`: the `rljob-operator` command.
"""
