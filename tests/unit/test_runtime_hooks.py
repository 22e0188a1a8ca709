"""Hooks by import path: built-ins, user functions, and clear errors."""

from __future__ import annotations

import pytest

from rljob.rollout.hooks import HookError, as_reward, default_reward, load_generate, load_reward

pytestmark = pytest.mark.unit


def test_builtin_and_user_hooks_load() -> None:
    assert load_reward("builtin:default") is default_reward
    fn = load_reward("tests.runtime.hooks_for_tests:nan_reward")
    assert fn.__name__ == "nan_reward"


@pytest.mark.parametrize(("path", "message"), [
    ("builtin:nope", "unknown built-in"),
    ("no_such_module_xyz:f", "cannot import"),
    ("json:nope", "no attribute"),
    ("json:dumps", "async def"),
])
def test_bad_hooks_name_the_field(path: str, message: str) -> None:
    with pytest.raises(HookError, match=message) as err:
        load_reward(path)
    assert "spec.reward.function" in str(err.value)
    with pytest.raises(HookError, match=r"spec\.generate\.function"):
        load_generate(path)


def test_reward_values_are_not_replaced() -> None:
    assert as_reward(1, "f") == 1.0
    assert str(as_reward(float("nan"), "f")) == "nan"
    with pytest.raises(HookError, match="expected a float"):
        as_reward("1", "f")
