"""The tested dependency ranges (megatrain_ds/versions.py) agree with what the repository declares
and installs, and a version outside them is named in one warning at initialize."""

import os
import re
import tomllib
import warnings

import pytest

import megatrain_ds
from megatrain_ds import versions
from tests.models import tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pins(name: str) -> dict[str, str]:
    with open(os.path.join(ROOT, name)) as f:
        return dict(
            re.match(r"([A-Za-z0-9_.-]+)==([^\s;#]+)", line).groups()
            for line in f
            if line.strip() and not line.startswith("#")
        )


def _declared() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    return {
        m.group(1).lower(): m.group(2) for r in reqs if (m := re.match(r"([A-Za-z0-9_.-]+)(.*)", r))
    }


def test_tested_ranges_agree_with_pyproject_and_the_constraints_files():
    newest, oldest, declared = (
        _pins("constraints.txt"),
        _pins("constraints-oldest.txt"),
        _declared(),
    )
    for package, (lo, hi) in versions.TESTED.items():
        assert newest[package] == hi or (package == "torch" and newest[package].startswith(hi)), (
            package
        )
        # torch's oldest (2.11) runs on the GPU boxes; CI's only CPU wheel is 2.13.0
        if package != "torch":
            assert oldest[package] == lo, package
        spec = declared[package]
        assert f">={lo}" in spec, (
            f"pyproject.toml declares {package}{spec}, the oldest tested is {lo}"
        )
        upper = re.search(r"<(\d+\.\d+)", spec)
        if upper:  # a cap is the next minor release after the newest tested
            major, minor = map(int, hi.split(".")[:2])
            assert upper.group(1) == f"{major}.{minor + 1}", (
                f"{package}{spec} vs newest tested {hi}"
            )


def test_the_tested_set_satisfies_every_range_pyproject_declares():
    """constraints.txt (what `make test` installs) pins each declared package, extras included (trl:
    the test extra), inside the range pyproject.toml declares for it; constraints-oldest.txt
    likewise for what it pins."""
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    # (the gpu extra is installed on the GPU boxes only, outside the constraints)
    extras = [
        r for name, reqs in project["optional-dependencies"].items() if name != "gpu" for r in reqs
    ]
    reqs = [
        r for r in map(Requirement, project["dependencies"] + extras) if r.name != project["name"]
    ]
    newest, oldest = _pins("constraints.txt"), _pins("constraints-oldest.txt")
    normal = lambda pins: {k.lower().replace("_", "-"): v for k, v in pins.items()}  # noqa: E731
    newest, oldest = normal(newest), normal(oldest)
    assert "trl" in {r.name for r in reqs}
    for req in reqs:
        assert req.name in newest, f"{req.name} is declared but constraints.txt does not pin it"
        assert req.specifier.contains(newest[req.name].split("+")[0]), (
            f"constraints.txt {req.name} vs {req}"
        )
        if req.name in oldest:
            assert req.specifier.contains(oldest[req.name]), (
                f"constraints-oldest.txt {req.name} vs {req}"
            )


@pytest.mark.parametrize(
    "version,state",
    [
        ("5.2.0", "tested"),
        ("5.24.0", "tested"),
        ("5.10.1", "tested"),
        ("5.1.9", "older than tested"),
        ("5.24.1", "newer than tested"),
        ("5.25.0.dev0", "newer than tested"),
        (None, "not installed"),
    ],
)
def test_status(version, state):
    assert versions.status("transformers", version) == state


def test_one_warning_names_each_package_outside_the_range(monkeypatch):
    fake = {
        "torch": "2.13.0+cpu",
        "transformers": "5.99.0",
        "deepspeed": "0.18.0",
        "accelerate": None,
        "peft": "0.21.2",
    }
    monkeypatch.setattr(versions, "installed", lambda package: fake[package])
    monkeypatch.setattr(versions, "_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config={"train_micro_batch_size_per_gpu": 1}
        )
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config={"train_micro_batch_size_per_gpu": 1}
        )
    said = [str(w.message) for w in caught if "has not been tested with" in str(w.message)]
    assert len(said) == 1, said  # once per process, not per engine
    assert "transformers 5.99.0 (newer than tested; tested 5.2.0..5.24.0)" in said[0]
    assert "deepspeed 0.18.0 (older than tested" in said[0]
    assert "torch" not in said[0].split("tested with")[1].split(".")[0] and "peft" not in said[0]
