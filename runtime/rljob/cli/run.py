"""`rljob run FILE`: validate, then run the job on this machine or a given Ray cluster.

Exit codes: 0 finished; 1 runtime failure (worker or engine failed, weight sync refused,
checkpoint store held by another driver); 2 invalid job (spec, dataset, model source or
hooks; `rljob validate` gives 2 for the same file); 3 stopped on non-finite loss, gradients
or weights (evidence saved under the workdir); 130 stopped by SIGINT (Ctrl-C), 143 stopped
by SIGTERM: the first signal lets the step in progress finish and be saved, a second one
stops at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rljob.reporting.reporter import FLUSH_TIMEOUT_S, PrintReporter, Reporter, StatusReporter
from rljob_api import env
from rljob_api.deprecations import deprecation_warnings
from rljob_api.exits import INVALID as EXIT_INVALID
from rljob_api.validate import InvalidJob, load_job

DEFAULT_WORKDIR = Path("runs")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run an RLJob here (embedded Ray) or on --ray-address",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop after N more rollout steps (the job's totalSteps still bounds it)")
    p.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                   help="checkpoints, metrics.jsonl and curves.png (default runs/<job name>); "
                        "an existing one is resumed")
    p.add_argument("--plan-only", action="store_true",
                   help="place every worker as the job would, print the devices each process "
                        "would use (`device-plan:` lines) and stop, starting none of them: a "
                        "check of a GPU cluster's layout before a long run (spec.planOnly "
                        "does the same)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--join", default=None, metavar="HOST:PORT",
                       help="make this machine a Ray node of the cluster whose head (GCS) is "
                            "at HOST:PORT, run the driver on it, and stop the node at exit "
                            f"(how the operator's driver pod runs; uses ${env.POD_IP} when set)")
    where.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="use a Ray cluster this machine already is a node of (e.g. auto, "
                            "after `ray start`) instead of starting a local one")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    try:
        doc, spec = load_job(args.file)
    except InvalidJob as err:
        print(err, file=sys.stderr)
        return EXIT_INVALID
    for warning in deprecation_warnings(doc):
        print(f"{args.file}: warning: {warning}", file=sys.stderr, flush=True)
    if args.max_steps is not None and args.max_steps < 1:
        print("--max-steps must be at least 1", file=sys.stderr)
        return EXIT_INVALID
    if args.join is not None:
        from rljob.cluster.ray_node import parse_address

        try:
            parse_address(args.join)
        except ValueError as err:
            print(err, file=sys.stderr)
            return EXIT_INVALID
    from rljob.cluster.cluster import RunOptions
    from rljob.driver.run import run_job
    from rljob.reporting.startup import process_started_at

    name = str(doc["metadata"]["name"])
    reporter: Reporter = StatusReporter.from_env() or PrintReporter()
    workdir = args.workdir or DEFAULT_WORKDIR / name
    options = RunOptions(workdir, args.max_steps, args.ray_address, args.join, args.plan_only,
                         started_at=process_started_at())
    try:
        return run_job(name, spec, options, reporter)
    finally:
        # The last reports (a failure, a stop) matter most; the API server gets a deadline.
        reporter.close(FLUSH_TIMEOUT_S)
