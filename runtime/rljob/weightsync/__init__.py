"""Weight sync: versioned, verified, acknowledged delivery of trainer weights to rollout engines.

`protocol` is the wire format every side shares; `publisher` is the trainer's side,
`sidecar` the `rljob-weight-sync` process next to each engine. See docs/weight-sync.md.
"""
