"""`rljob`: validate jobs, print the CRD, and run a job on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rljob_api.crd import CRD_FILE, render_crd
from rljob_api.validate import InvalidJob, load_job


def _validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            _, spec = load_job(path)
        except InvalidJob as err:
            print(err, file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: valid RLJob ({spec.trainer.backend} trainer, "
              f"{spec.rollout.backend} rollout, {spec.placement})")
    return 1 if failed else 0


def _crd(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.write:
        target = Path(args.write)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {target}")
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rljob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check RLJob files; print every problem, exit 1 if any")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=_validate)
    p = sub.add_parser("crd", help="print the RLJob CRD generated from the API model")
    p.add_argument("--write", nargs="?", const=CRD_FILE, metavar="PATH",
                   help=f"write it to PATH (default {CRD_FILE}) instead of stdout")
    p.set_defaults(func=_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
