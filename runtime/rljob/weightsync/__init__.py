"""Weight sync: versioned, verified, acknowledged delivery of trainer weights to rollout engines.

`protocol` is the wire format every side shares, `wire` the handoff format from sidecar to
engine, `nonfinite` and `checked_copy` the NaN/Inf checks, `group` the broadcast group,
`disk` versions as directories; `publisher` is the trainer's side. The sidecar next to each
engine is `rljob.engine.sidecar`. Nothing here imports a role (trainer, engine, rollout), so
both sides of a delivery share one definition of it. See docs/weight-sync.md.
"""
