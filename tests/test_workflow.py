"""The release workflow parses; its one build covers every kernel family with targets its toolkit accepts,
compiles the kernels once (the kernel cache), names no local version (PyPI refuses those), tests that each wheel
loads its kernels, and publishes on tags."""

from pathlib import Path

import pytest

from cuteflash import _arch, _families

yaml = pytest.importorskip("yaml")
WORKFLOW = Path(__file__).resolve().parents[1] / ".github" / "workflows" / "wheels.yml"
pytestmark = pytest.mark.skipif(not WORKFLOW.exists(), reason="needs the source tree")


@pytest.fixture(scope="module")
def workflow():
    return yaml.safe_load(WORKFLOW.read_text())


def build_env(workflow) -> dict:
    """CIBW_ENVIRONMENT_LINUX as a dict, and the other cibuildwheel settings."""
    step = next(s for s in workflow["jobs"]["wheels"]["steps"] if "cibuildwheel" in s.get("uses", ""))
    env = dict(step["env"])
    variables = {}
    for item in env["CIBW_ENVIRONMENT_LINUX"].split():
        name, _, value = item.partition("=")
        variables[name] = value.strip('"')
    return env, variables


def test_one_build_covers_every_family(workflow):
    env, variables = build_env(workflow)
    cuda = tuple(int(x) for x in variables["CUDACXX"].split("cuda-")[1].split("/")[0].split("."))
    assert cuda[0] == 12  # CUDA 13 dropped Volta
    assert f"cuda-nvcc-{cuda[0]}-{cuda[1]}" in env["CIBW_BEFORE_ALL_LINUX"]
    selection = _arch.parse(variables["TORCH_CUDA_ARCH_LIST"], cuda=cuda)  # raises if the toolkit cannot build one
    assert {70, 72} == {t.cc for t in selection.targets["sm70"]}
    assert {75} == {t.cc for t in selection.targets["sm75"]}
    assert {80, 86, 89, 90, 100, 120} == {t.cc for t in selection.targets["sm80"]}
    assert ["9.0a"] == [str(t) for t in selection.targets["sm90"]]
    assert selection.targets["sm80"][-1].ptx  # PTX of the newest target, for GPUs after it


def test_kernels_compiled_once_and_wheels_checked(workflow):
    env, variables = build_env(workflow)
    assert variables["CUTEFLASH_KERNEL_CACHE"].startswith("/project/")  # shared by the Pythons' builds
    assert "--check" in env["CIBW_TEST_COMMAND"]
    assert all(f"--family {f.name}" in env["CIBW_TEST_COMMAND"] for f in _families.FAMILIES if f.released)
    assert "--exclude libcuda.so.1" in env["CIBW_REPAIR_WHEEL_COMMAND_LINUX"]


def test_no_local_version(workflow):
    text = WORKFLOW.read_text()
    assert "pyproject.toml" not in text  # the version is the project's, unchanged
    assert "+cu" not in text


def test_jobs_have_timeouts(workflow):
    for name, job in workflow["jobs"].items():
        assert 0 < job.get("timeout-minutes", 0) <= 360, f"{name} has no timeout within GitHub's limit"


def test_publishes_on_tags_by_trusted_publishing(workflow):
    publish = workflow["jobs"]["publish"]
    assert set(publish["needs"]) == {"wheels", "sdist"}
    assert "refs/tags/v" in publish["if"]
    assert publish["permissions"]["id-token"] == "write"
    assert any("pypi-publish" in s.get("uses", "") for s in publish["steps"])


def test_sdist_job(workflow):
    assert any("--sdist" in s.get("run", "") for s in workflow["jobs"]["sdist"]["steps"])


def test_triggers(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert "workflow_dispatch" in triggers and triggers["push"]["tags"] == ["v*"]
