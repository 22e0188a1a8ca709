"""The trainer and rollout images agree on Ray and Python, or their build fails.

Ray joins only nodes of its own Ray and Python version, and the two roles are built on
different bases: images/Dockerfile installs one exact Ray in the stage both roles share, and
hack/build-images-offline compares the two built images (hack/check-image-versions).
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.controlplane import REPO

pytestmark = pytest.mark.unit

DOCKERFILE = REPO / "images" / "Dockerfile"
CHECK = REPO / "hack" / "check-image-versions"


def _final_stage() -> str:
    """The Dockerfile from its last FROM on: what every role and variant runs."""
    text = DOCKERFILE.read_text()
    froms = [m.start() for m in re.finditer(r"^FROM ", text, re.MULTILINE)]
    stage = text[froms[-1]:]
    assert stage.startswith("FROM base-${ROLE}-${VARIANT}\n"), stage.splitlines()[0]
    return stage


def _logical_lines(text: str) -> list[str]:
    return text.replace("\\\n", " ").splitlines()


def test_both_roles_install_one_exact_ray_within_the_runtime_extra() -> None:
    stage = _final_stage()
    pins = re.findall(r"^ARG RAY_VERSION=(\S*)$", stage, re.MULTILINE)
    assert len(pins) == 1, "images/Dockerfile's last stage must pin ARG RAY_VERSION once"
    pin = pins[0]
    assert re.fullmatch(r"\d+\.\d+\.\d+", pin), f"RAY_VERSION={pin!r} is not one exact version"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["runtime"]
    ray = next(Requirement(r) for r in extras if Requirement(r).name == "ray")
    assert ray.specifier.contains(pin), f"RAY_VERSION={pin} is outside {ray}"
    installs = [ln for ln in _logical_lines(stage)
                if ln.startswith("RUN pip install") and "-r /tmp/requirements.txt" in ln]
    assert len(installs) == 1
    assert '"ray[default]==${RAY_VERSION}"' in installs[0], installs[0]
    # The image checks what it got, and records it.
    assert "ray.__version__ == sys.argv[1]" in installs[0]
    assert "/opt/rljob-versions" in installs[0]


def test_the_offline_build_compares_the_trainer_and_rollout_images() -> None:
    script = (REPO / "hack" / "build-images-offline").read_text()
    assert 'hack/check-image-versions "${TAG[trainer]}" "${TAG[rollout]}"' in script
    assert os.access(CHECK, os.X_OK)


def _check(tmp_path: Path, trainer: str, rollout: str) -> subprocess.CompletedProcess[str]:
    """hack/check-image-versions against a stand-in engine CLI that reports these versions."""
    docker = tmp_path / "docker"
    docker.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *trainer*) echo "{trainer}";; *rollout*) echo "{rollout}";; '
        "*) exit 1;; esac\n")
    docker.chmod(0o755)
    return subprocess.run(
        [str(CHECK), "example/trainer:1", "example/rollout:1"],
        env={**os.environ, "DOCKER": str(docker)}, capture_output=True, text=True,
        timeout=60, check=False)


@pytest.mark.parametrize("rollout", ["ray=2.60.0 python=3.10.12", "ray=2.59.0 python=3.12.3"])
def test_differing_versions_fail_naming_both_and_the_fix(tmp_path: Path, rollout: str) -> None:
    done = _check(tmp_path, "ray=2.60.0 python=3.12.3", rollout)
    assert done.returncode != 0
    assert "example/trainer:1: ray=2.60.0 python=3.12.3" in done.stderr
    assert f"example/rollout:1: {rollout}" in done.stderr
    assert "RAY_VERSION" in done.stderr and "rebuild both" in done.stderr


def test_equal_versions_pass(tmp_path: Path) -> None:
    done = _check(tmp_path, "ray=2.60.0 python=3.12.3", "ray=2.60.0 python=3.12.3")
    assert done.returncode == 0, done.stderr
