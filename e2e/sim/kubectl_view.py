"""What a user sees: `kubectl get rljobs` read column by column, and a transcript of it.

The e2e suite checks the job through the same printed table a user reads, so a broken
printer column (a wrong jsonPath in the CRD) fails here even when `status` is right.
"""

from __future__ import annotations

import re

from tests.controlplane import ControlPlane


def parse_table(text: str) -> list[dict[str, str]]:
    """Rows of kubectl's tabular output keyed by header; an empty cell reads as ''.

    Columns are cut at the header's word offsets: kubectl pads every column to its widest
    cell, so a cell starts exactly where its header does, and an empty cell is blanks there.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    rows = []
    for line in lines[1:]:
        bounds = [*starts[1:], None]
        cells = [line[a:b].strip() for a, b in zip(starts, bounds, strict=True)]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


class RLJobsView:
    """`kubectl get rljobs -n NS`, printed (for `pytest -s`) whenever the table changes."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp = cp
        self.namespace = namespace
        self._last_printed = ""

    def get(self) -> str:
        out: str = self.cp.kubectl("get", "rljobs", "-n", self.namespace).stdout
        return out

    def row(self, name: str) -> dict[str, str]:
        """The job's row; the table is echoed when it differs from the last one shown."""
        text = self.get()
        self.show(text)
        rows = {r["NAME"]: r for r in parse_table(text)}
        if name not in rows:
            raise LookupError(f"no row for {name} in:\n{text}")
        return rows[name]

    def show(self, text: str) -> None:
        # AGE changes every second; compare the rest so the transcript shows transitions.
        key = re.sub(r"\s\S+\s*$", "", text, flags=re.M)
        if key != self._last_printed:
            self._last_printed = key
            print(f"$ kubectl get rljobs -n {self.namespace}\n{text.rstrip()}\n", flush=True)
