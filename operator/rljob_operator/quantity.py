"""Kubernetes memory quantities as bytes and back: the operator adds what it runs beside an
engine (its weight-sync sidecar) to the memory the user gave that engine's container."""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIX: dict[str, int | Decimal] = {
    "m": Decimal("0.001"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([a-zA-Z]*)$")
MIB = 2**20


def memory_bytes(value: int | str) -> int:
    """Bytes of a memory quantity (`64Gi`, `512M`, `1.5Gi`, `1000`), rounded up as the
    kubelet rounds; ValueError names a suffix Kubernetes does not accept for memory."""
    match = _QUANTITY.match(str(value))
    if match is None or match.group(2) not in _SUFFIX:
        raise ValueError(f"{value!r} is not a memory quantity (e.g. 64Gi or 512M)")
    exact = Decimal(match.group(1)) * _SUFFIX[match.group(2)]
    return int(exact.to_integral_value(rounding="ROUND_CEILING"))


def mebibytes(nbytes: int) -> str:
    """`nbytes` rounded up to whole Mi, written as the API server writes it back (the largest
    binary suffix that divides it: 5Gi, not 5120Mi), so what the operator builds compares
    equal to what the pods show."""
    mib = -(-nbytes // MIB)
    for suffix, per in (("Ei", 2**40), ("Pi", 2**30), ("Ti", 2**20), ("Gi", 2**10)):
        if mib % per == 0:
            return f"{mib // per}{suffix}"
    return f"{mib}Mi"
