"""`rljob`: validate jobs, print the CRD, and run a job on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rljob.cli import run
from rljob.reporting import tracking
from rljob_api.crd import CHART_CRD_FILE, CRD_FILE, render_crd, render_policy
from rljob_api.deprecations import CHART_POLICY_FILE, POLICY_FILE, deprecation_warnings
from rljob_api.docs import DOCS_FILE, render_reference
from rljob_api.exits import INVALID as EXIT_INVALID
from rljob_api.validate import InvalidJob, load_job, update_problems


def _validate(args: argparse.Namespace) -> int:
    """Exit 2 when any file is invalid: the code `rljob run` gives for the same file. With
    `--old`, each file is also checked as an edit of that running job's spec, by the same
    transition rules the API server applies (so a refused edit is seen before applying it).
    A tracker whose package is missing here is a warning: the driver's image is what needs it."""
    old: dict[str, object] | None = None
    if args.old:
        try:
            old = load_job(args.old)[0]["spec"]
        except InvalidJob as err:
            print(f"--old: {err}", file=sys.stderr)
            return EXIT_INVALID
    failed = 0
    for path in args.files:
        try:
            doc, spec = load_job(path)
            if old is not None:
                refused = update_problems(old, doc["spec"])
                if refused:
                    raise InvalidJob(f"{path} (as an edit of {args.old})", refused)
        except InvalidJob as err:
            print(err, file=sys.stderr)
            failed += 1
            continue
        edit = f", a valid edit of {args.old}" if old is not None else ""
        print(f"{path}: valid RLJob ({spec.trainer.backend} trainer, "
              f"{spec.rollout.backend} rollout, {spec.placement}){edit}")
        for warning in deprecation_warnings(doc):
            print(f"{path}: warning: {warning}", file=sys.stderr)
        for warning in tracking.missing_packages(spec.tracking):
            print(f"{path}: warning: {warning}", file=sys.stderr)
    return EXIT_INVALID if failed else 0


def _crd(args: argparse.Namespace) -> int:
    if args.write == CRD_FILE:
        _emit(render_crd(), CHART_CRD_FILE)
        _emit(render_policy(), POLICY_FILE)
        _emit(render_policy(), CHART_POLICY_FILE)
    return _emit(render_crd(), args.write)


def _docs(args: argparse.Namespace) -> int:
    return _emit(render_reference(), args.write)


def _emit(text: str, write: str | None) -> int:
    """Print generated text, or write it to the file `write` names."""
    if write:
        target = Path(write)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {target}")
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rljob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check RLJob files; print every problem, exit 2 if any")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--old", metavar="FILE",
                   help="the running job's manifest: also refuse edits the API server refuses "
                   "(fields that cannot change on a running job)")
    p.set_defaults(func=_validate)
    p = sub.add_parser("crd", help="print the RLJob CRD generated from the API model")
    p.add_argument("--write", nargs="?", const=CRD_FILE, metavar="PATH",
                   help=f"write it to PATH instead of stdout (default: {CRD_FILE} and the "
                   f"chart's copy {CHART_CRD_FILE}, with the deprecation-warning admission "
                   f"policy {POLICY_FILE} and its chart copy {CHART_POLICY_FILE})")
    p.set_defaults(func=_crd)
    p = sub.add_parser("docs", help="print the RLJob field reference generated from the API model")
    p.add_argument("--write", nargs="?", const=DOCS_FILE, metavar="PATH",
                   help=f"write it to PATH (default {DOCS_FILE}) instead of stdout")
    p.set_defaults(func=_docs)
    run.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
