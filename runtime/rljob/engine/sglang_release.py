"""Which SGLang releases rljob speaks to, and the refusal of any other.

The rollout image is built on `RELEASE` (images/Dockerfile's `ROLLOUT_CUDA_BASE`), and the
tests decode every request rljob sends with that release's own code
(tests/unit/test_sglang_contract.py). `NEWEST_CHECKED` is the newest release whose route
table, request types and weight-update helpers the same tests read from its source; the
contract held at both ends, so the range between them is supported. An engine reporting a
release outside it is refused at connect rather than failing its first weight update on
the user's cluster (docs/reference.md, *SGLang releases*).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from rljob_api.sglang_releases import NEWEST_CHECKED, RELEASE, SUPPORTED_RANGE

__all__ = ["NEWEST_CHECKED", "RELEASE", "SUPPORTED_RANGE", "unsupported"]


def unsupported(version: object) -> str:
    """Why `version` (the `version` field of `/get_server_info`) is refused; "" when it is
    within the supported range. A pre- or post-release counts as its release."""
    if not isinstance(version, str) or not version:
        return (f"reports no SGLang version (GET /get_server_info has no \"version\"); "
                f"rljob supports SGLang {SUPPORTED_RANGE}")
    try:
        release = Version(version).release
    except InvalidVersion:
        return f"reports SGLang version {version!r}, which is not a version; " \
               f"rljob supports SGLang {SUPPORTED_RANGE}"
    if Version(RELEASE).release <= release <= Version(NEWEST_CHECKED).release:
        return ""
    return (f"runs SGLang {version}, outside the releases rljob supports "
            f"({SUPPORTED_RANGE}): use an image built on one of them")
