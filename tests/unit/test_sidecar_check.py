"""Which lost sidecars a stale delivery is blamed on: only those of the engines left stale."""

from __future__ import annotations

import pytest

from rljob.cluster.weight_sync import SidecarCheck, engine_name

pytestmark = pytest.mark.unit


def test_only_the_stale_engines_sidecars_count() -> None:
    check = SidecarCheck(dead={2: "gone"}, restarted=[0, 1])
    stale = {engine_name(1): "no acknowledgement", engine_name(3): "unreachable"}
    assert check.of_engines(stale) == SidecarCheck({}, [1])
    assert check.of_engines([engine_name(2)]) == SidecarCheck({2: "gone"}, [])
    assert check.of_engines([]) == SidecarCheck()


def test_the_description_names_each_engine_and_what_happened() -> None:
    assert SidecarCheck({2: "its sidecar died"}, [0]).describe() == (
        "engine-2: its sidecar died; engine-0: its sidecar died and Ray started it again")
