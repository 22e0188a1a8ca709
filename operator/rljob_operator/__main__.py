"""`rljob-operator` / `python -m rljob_operator`: run the operator in a cluster or against a
kubeconfig."""

from __future__ import annotations

import logging
import sys

import kopf

from rljob_operator import handlers
from rljob_operator.config import parse_args


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    kopf.configure(verbose=cfg.verbose)
    if not cfg.verbose:
        # One line per watch event and per probe drowns the transitions worth reading.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    assert handlers.rljob_event is not None  # importing `handlers` registers them with kopf
    if cfg.kueue:
        from rljob_operator import kueue_handlers  # registers the Workload watch
        assert kueue_handlers.workload_event is not None
    kopf.run(
        standalone=True,
        clusterwide=not cfg.namespaces,
        namespaces=cfg.namespaces,
        liveness_endpoint=cfg.liveness,
        memo=kopf.Memo(config=cfg),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
