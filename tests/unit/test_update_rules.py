"""`rljob validate`'s Python twins of the transition rules refuse each immutable edit with the
API server's message (the same table drives tests/apiserver/test_crd_admission.py)."""

from __future__ import annotations

import pytest

from rljob_api.validate import manifest_problems, update_problems
from tests.specs import BAD_UPDATES, BadUpdate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", BAD_UPDATES, ids=lambda b: b.id)
def test_each_immutable_edit_is_refused_with_the_api_servers_message(bad: BadUpdate) -> None:
    created, edited = bad.docs()
    assert manifest_problems(created) == [] and manifest_problems(edited) == [], \
        "both versions must be valid jobs: only the change is refused"
    assert [p.message for p in update_problems(created["spec"], edited["spec"])] == \
        [bad.message]
    assert update_problems(edited["spec"], edited["spec"]) == []
