"""The chart, the images and the API defaults name the same, pinned versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rljob_api.spec import RLJobSpec
from tests.chart.helm import CHART, REPO

pytestmark = pytest.mark.unit

IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("**/Dockerfile"))
RUNTIME = IMAGES / "Dockerfile"
OCI_LABELS = ("title", "description", "version", "revision", "created", "licenses", "source")


def _version() -> str:
    found = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml has no project version"
    return found.group(1)


def _arg_defaults(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def test_the_three_images_come_from_two_dockerfiles() -> None:
    """The operator's own, and one for the trainer and rollout images, the role an argument;
    images/trainer/ and images/rollout/ say how each is built."""
    assert DOCKERFILES == [RUNTIME, IMAGES / "operator" / "Dockerfile"]
    for role in ("trainer", "rollout"):
        assert f"--build-arg ROLE={role}" in (IMAGES / role / "README.md").read_text()
    assert "FROM base-${ROLE}-${VARIANT}" in RUNTIME.read_text()


def test_chart_and_images_carry_the_project_version() -> None:
    version = _version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == version
    assert values["image"]["tag"] == version
    for dockerfile in DOCKERFILES:
        assert _arg_defaults(dockerfile.read_text())["RLJOB_VERSION"] == version, dockerfile
    defaults = RLJobSpec.model_validate({})
    assert defaults.trainer.image.endswith(f"/trainer:{version}")
    assert defaults.rollout.image.endswith(f"/rollout:{version}")
    tiny = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    assert tiny["trainer"]["image"].endswith(f"/trainer:{version}-cpu")
    assert tiny["rollout"]["image"].endswith(f"/rollout:{version}-cpu")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(IMAGES)))
def test_dockerfile_is_pinned_non_root_labelled_and_installs_the_wheel(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    args = _arg_defaults(text)
    bases = {k: v for k, v in args.items() if k.endswith(("_BASE", "_BUILDER"))}
    assert bases
    for name, image in bases.items():
        tag = image.split("@", 1)[0].rsplit(":", 1)
        assert len(tag) == 2 and tag[1] not in {"latest", "stable", "main"}, f"{name}={image}"
        assert re.search(r"\d", tag[1]), f"{name}={image} is not an exact version tag"
    for versioned in ("MEGATRON_CORE_VERSION", "TORCH_VERSION"):
        if versioned in args:
            assert re.fullmatch(r"\d+\.\d+\.\d+", args[versioned]), versioned
    user = re.findall(r"^USER (\S+)$", text, flags=re.MULTILINE)
    assert user and user[-1] not in {"0", "root"} and user[-1].split(":")[0].isdigit()
    for label in OCI_LABELS:
        assert f"org.opencontainers.image.{label}=" in text, label
    # Dependencies from pyproject.toml in their own layer, then the wheel of this checkout.
    assert "pip wheel" in text and "-r /tmp/requirements.txt" in text
    assert '--no-deps "/tmp/wheels/rljob-${RLJOB_VERSION}-py3-none-any.whl"' in text
    ignore = dockerfile.with_name("Dockerfile.dockerignore")
    assert "!runtime/" in ignore.read_text()
    documented = (IMAGES / "README.md").read_text()
    for arg in re.findall(r"^ARG (\w+)", text, flags=re.MULTILINE):
        assert f"`{arg}`" in documented, f"build arg {arg} is not in images/README.md"


@pytest.mark.parametrize("name", ["trainer", "rollout"])
def test_gpu_images_have_a_cpu_variant(name: str) -> None:
    text = RUNTIME.read_text()
    assert _arg_defaults(text)["VARIANT"] == "cuda"
    assert f"FROM ${{{name.upper()}_CUDA_BASE}} AS base-{name}-cuda" in text
    assert "FROM ${CPU_BASE} AS base-cpu" in text and f"FROM base-cpu AS base-{name}-cpu" in text


def test_trainer_image_megatron_core_is_inside_the_extra() -> None:
    """The image pins one megatron-core; the `megatron` extra bounds what rljob supports."""
    import tomllib

    from packaging.requirements import Requirement

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["megatron"]
    (req,) = [Requirement(r) for r in extra if r.startswith("megatron-core")]
    pinned = _arg_defaults(RUNTIME.read_text())[
        "MEGATRON_CORE_VERSION"]
    assert req.specifier.contains(pinned), f"{pinned} is outside {req.specifier}"
