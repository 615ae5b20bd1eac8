"""The wheel workflow parses, and its matrix builds every kernel family the build knows, each with
arch lists the toolkit of that entry accepts and that select that family only."""

from pathlib import Path

import pytest

from cuteflash import _arch

yaml = pytest.importorskip("yaml")
WORKFLOW = Path(__file__).resolve().parents[1] / ".github" / "workflows" / "wheels.yml"
pytestmark = pytest.mark.skipif(not WORKFLOW.exists(), reason="needs the source tree")


@pytest.fixture(scope="module")
def workflow():
    return yaml.safe_load(WORKFLOW.read_text())


def targets(workflow):
    return workflow["jobs"]["wheel"]["strategy"]["matrix"]["target"]


def test_matrix_covers_every_family(workflow):
    assert {t["family"] for t in targets(workflow)} == set(_arch.FAMILIES)


@pytest.mark.parametrize("index", range(3))
def test_each_entry_selects_its_family_only(workflow, index):
    entries = targets(workflow)
    if index >= len(entries):
        pytest.skip("fewer entries")
    t = entries[index]
    cuda = tuple(int(x) for x in t["cuda"].split("."))
    sel = _arch.parse(t["arch_list"], cuda=cuda)  # raises if this toolkit cannot build an entry
    assert sel.targets[t["family"]], f"{t} builds nothing of its family"
    for other in _arch.FAMILIES:
        if other != t["family"]:
            assert not sel.targets[other], f"{t} also builds {other}"


def test_cuda_versions(workflow):
    entries = targets(workflow)
    assert all(t["cuda"].startswith("12.") for t in entries if t["family"] == "sm70")  # CUDA 13 dropped Volta
    sm80 = {t["cuda"].split(".")[0] for t in entries if t["family"] == "sm80"}
    assert sm80 == {"12", "13"}


def test_local_version_names_cuda_and_family(workflow):
    steps = workflow["jobs"]["wheel"]["steps"]
    script = next(s["run"] for s in steps if "Local version" in s.get("name", ""))
    assert "+${cuda_tag}.${{ matrix.target.family }}" in script


def test_sdist_job(workflow):
    assert any("--sdist" in s.get("run", "") for s in workflow["jobs"]["sdist"]["steps"])


def test_triggers(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert "workflow_dispatch" in triggers
