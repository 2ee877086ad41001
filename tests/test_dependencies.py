"""Every import is a declared dependency, every runtime range is bounded, and the lock covers them.

A fresh install gets only what pyproject declares: a module that imports an undeclared package (as
``click`` once was) works on a machine that happens to have it and breaks for every new user.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OPTIONAL_MODULES = {
    # Modules that only the megatron extra's users import.
    "megatron": {
        "etc_agent/integrations/megatron.py",
        "etc_agent/integrations/megatron_cpu.py",
        "etc_agent/examples/megatron_gpt.py",
    },
}


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


RUNTIME = _names(PYPROJECT["project"]["dependencies"])
EXTRAS = {extra: _names(reqs) for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()}


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names of absolute imports in ``path`` (function-local ones included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _local_modules() -> set[str]:
    """Modules of this repository that tests and scripts import by file name."""
    return {p.stem for folder in ("tests", "scripts") for p in (ROOT / folder).glob("*.py")}


@functools.cache
def _module_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    return {canonicalize_name(d) for d in _module_distributions().get(module, [])}


def undeclared_imports(paths: list[Path], allowed: dict[str, set[str]]) -> list[str]:
    """``file: module`` for every third-party import whose distribution is not in ``allowed[file]``."""
    local = _local_modules() | {"etc_agent"}
    problems = []
    for path in paths:
        relative = path.relative_to(ROOT).as_posix()
        for module in sorted(imported_top_levels(path)):
            if module in sys.stdlib_module_names or module in local:
                continue
            distributions = _distributions(module)
            if not distributions:
                problems.append(f"{relative}: {module} (no installed distribution provides it; is it declared?)")
            elif not distributions & allowed[relative]:
                problems.append(
                    f"{relative}: {module} (from {', '.join(sorted(distributions))}, not declared for this file)"
                )
    return problems


def _package_files() -> list[Path]:
    return sorted((ROOT / "etc_agent").rglob("*.py"))


def test_the_package_imports_only_declared_runtime_dependencies():
    allowed = {}
    for path in _package_files():
        relative = path.relative_to(ROOT).as_posix()
        allowed[relative] = set(RUNTIME)
        for extra, files in OPTIONAL_MODULES.items():
            if relative in files:
                allowed[relative] |= EXTRAS[extra]
    assert undeclared_imports(_package_files(), allowed) == []


def test_tests_and_scripts_import_only_declared_dependencies():
    paths = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])
    every = set(RUNTIME).union(*EXTRAS.values())
    assert undeclared_imports(paths, {p.relative_to(ROOT).as_posix(): every for p in paths}) == []


def test_the_check_catches_an_undeclared_import(tmp_path, monkeypatch):
    """The check itself can fail: a package installed here but not declared is reported."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "scripts").mkdir()
    module = tmp_path / "uses_pluggy.py"
    module.write_text("def f():\n    import pluggy\n    from yaml import safe_load\n")
    relative = module.relative_to(tmp_path).as_posix()
    assert undeclared_imports([module], {relative: set(RUNTIME)}) == [
        f"{relative}: pluggy (from pluggy, not declared for this file)"
    ]
    module.write_text("import no_such_package_anywhere\n")
    assert "no installed distribution" in undeclared_imports([module], {relative: set(RUNTIME)})[0]


def test_runtime_ranges_are_bounded_above():
    unbounded = []
    for text in PYPROJECT["project"]["dependencies"] + [
        r for reqs in PYPROJECT["project"]["optional-dependencies"].values() for r in reqs
    ]:
        specifiers = Requirement(text).specifier
        if not any(s.operator in ("==", "<", "<=", "~=", "===") for s in specifiers):
            unbounded.append(text)
    assert unbounded == []


LOCKS = ("constraints.txt", "constraints-cuda.txt")
"""One lock per torch flavour (scripts/lock_deps.py): the CPU build, and the CUDA build with all it pulls."""


def _lock(name: str = "constraints.txt") -> dict[str, str]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert match, f"{name}: {line!r} is not an exact pin"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


@pytest.mark.parametrize("lock", LOCKS)
def test_the_lock_pins_every_declared_dependency_within_its_range(lock):
    pins = _lock(lock)
    problems = []
    for text in PYPROJECT["project"]["dependencies"] + [
        r for reqs in PYPROJECT["project"]["optional-dependencies"].values() for r in reqs
    ]:
        requirement = Requirement(text)
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None:
            problems.append(f"{requirement.name}: not in {lock}")
        elif not requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"{requirement.name}: {lock} has {pinned}, pyproject allows {requirement.specifier}")
    assert problems == []


def test_the_installed_environment_matches_the_lock():
    """What the tests run on is what a fresh install gets (a stale machine would hide a break)."""
    drift = []
    for name, version in _lock().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            drift.append(f"{name}: not installed (lock {version})")
            continue
        if installed.split("+")[0] != version:
            drift.append(f"{name}: installed {installed}, lock {version}")
    assert drift == []


def test_the_flavours_differ_only_in_torchs_build_and_keep_setuptools():
    """The CPU and CUDA images run the same versions of everything but torch's own CUDA packages;
    setuptools is pinned in both (torch imports it at run time)."""
    cpu, cuda = _lock("constraints.txt"), _lock("constraints-cuda.txt")
    assert "setuptools" in cpu and "setuptools" in cuda
    assert {name: version for name, version in cuda.items() if name in cpu} == cpu
    cuda_only = set(cuda) - set(cpu)
    assert "triton" in cuda_only and "nvidia-nccl-cu13" in cuda_only
    assert all(name.startswith(("nvidia-", "cuda-")) or name == "triton" for name in cuda_only), cuda_only


def _index_reachable(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=15):
            return True
    except OSError:
        return False


def test_the_cuda_lock_pins_every_package_the_cuda_wheel_pulls():
    """pip's own resolve of the project with torch's CUDA wheel (metadata from the index, nothing
    installed, pip's configuration and find-links ignored as scripts/lock_deps.py resolves it), held
    to constraints-cuda.txt: it must succeed and take nothing the lock leaves out."""
    import os

    from lock_deps import EXTRAS, FLAVOURS, pip_report

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    if not _index_reachable(f"{index.rstrip('/')}/torch/"):
        pytest.skip(f"the package index {index} is not reachable from here")
    cuda = FLAVOURS["cuda"]
    report = pip_report(cuda, ["-c", str(cuda.path), f"{ROOT}[{EXTRAS}]"])
    resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in report}
    assert not resolved["torch"].endswith("+cpu")
    pins = _lock(cuda.path.name)
    unpinned = sorted(name for name in resolved if name not in pins and name not in ("etc-agent", "pip", "wheel"))
    assert unpinned == []
    assert {name: pins[name] for name in resolved if name in pins} == {
        name: version.partition("+")[0] for name, version in resolved.items() if name in pins
    }
