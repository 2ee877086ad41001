"""Regenerate the lock files: the exact versions a fresh install of ``.[test,megatron]`` takes, one
file per torch flavour.

    python scripts/lock_deps.py                    # writes constraints.txt and constraints-cuda.txt
    python scripts/lock_deps.py --flavour cuda     # one of them
    python scripts/lock_deps.py --check            # exit 1 where a file differs from a fresh resolve

- ``constraints.txt`` (flavour ``cpu``): torch's CPU build. The README, ``.ci/run`` and the image's
  default flavour install with it. pip takes the CPU wheel where one is on its find-links (this
  machine's pip configuration) or on ``--cpu-index`` (https://download.pytorch.org/whl/cpu); the
  resolve fails where it would take a CUDA build instead.
- ``constraints-cuda.txt`` (flavour ``cuda``): torch's CUDA build from the package index, with
  every nvidia, CUDA and triton package it pulls pinned; the image's ``FLAVOUR=cuda`` installs with
  it. Resolved with pip's configuration files and find-links ignored, so that a local CPU wheel
  cannot stand in for it.

Each is pip's own resolution (``pip install --dry-run --ignore-installed --report``: metadata only,
nothing is installed or downloaded whole), for CPython 3.11 on Linux x86_64, without the project
itself; setuptools stays in (torch imports it at run time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = "test,megatron"
TOOLING = ("pip", "wheel")
"""Never pinned: the installer's own packages (the venv's pip is whatever the machine has)."""


@dataclass(frozen=True)
class Flavour:
    """One lock file: which torch build it pins and how pip is told where to find it."""

    name: str
    """``cpu`` or ``cuda`` (the image's ``FLAVOUR`` build argument)."""
    path: Path
    """The lock file written."""
    isolated: bool
    """Ignore pip's configuration files and find-links (a local CPU wheel must not satisfy it)."""

    def header(self) -> str:
        build = "torch's CPU build" if self.name == "cpu" else "torch's CUDA build and every package it pulls"
        return (
            f"# Exact versions for a fresh install of etc-agent[{EXTRAS}] with {build}\n"
            f"# (CPython {sys.version_info.major}.{sys.version_info.minor}, Linux x86_64). Regenerate with "
            f"`python scripts/lock_deps.py --flavour {self.name}`\n"
            f"# after changing dependencies in pyproject.toml. Used as: pip install -c {self.path.name} ...\n"
        )

    def check_torch(self, version: str) -> None:
        """A resolve that took the wrong build of torch is refused, not written."""
        local = version.partition("+")[2]
        if self.name == "cpu" and local != "cpu":
            sys.exit(
                f"the cpu flavour resolved torch {version}, not a CPU build: put the CPU wheel on pip's "
                "find-links or pass --cpu-index https://download.pytorch.org/whl/cpu"
            )
        if self.name == "cuda" and local == "cpu":
            sys.exit(f"the cuda flavour resolved torch {version}, a CPU build")


FLAVOURS = {
    "cpu": Flavour("cpu", ROOT / "constraints.txt", isolated=False),
    "cuda": Flavour("cuda", ROOT / "constraints-cuda.txt", isolated=True),
}


def pip_environment(flavour: Flavour) -> dict[str, str]:
    env = dict(os.environ)
    if flavour.isolated:
        env["PIP_CONFIG_FILE"] = os.devnull
        for name in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX", "PIP_EXTRA_INDEX_URL"):
            env.pop(name, None)
    return env


def pip_report(flavour: Flavour, pip_args: list[str]) -> list[dict]:
    """What ``pip install <pip_args>`` would install, as its ``--report`` lists it (metadata only,
    nothing installed), in ``flavour``'s pip environment. tests/test_dependencies.py holds the CUDA
    lock to the same resolve."""
    with tempfile.TemporaryDirectory(prefix="etc-lock-") as tmp:
        report_path = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed"]
        command += ["--report", str(report_path), *pip_args]
        subprocess.run(command, check=True, env=pip_environment(flavour), timeout=600)
        return json.loads(report_path.read_text())["install"]


def resolve(flavour: Flavour, cpu_index: str | None) -> str:
    """The lock file's text from a fresh resolve."""
    extra = ["--extra-index-url", cpu_index] if flavour.name == "cpu" and cpu_index else []
    report = pip_report(flavour, [f"{ROOT}[{EXTRAS}]", *extra])
    pins: dict[str, str] = {}
    for item in report:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name.lower() == "torch":
            flavour.check_torch(version)
            version = version.partition("+")[0]  # the plain version matches the local build (2.13.0+cpu)
        if name.lower().replace("_", "-") == "etc-agent" or name.lower() in TOOLING:
            continue
        pins[name] = version
    lines = [f"{name}=={pins[name]}" for name in sorted(pins, key=str.lower)]
    return flavour.header() + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=[*FLAVOURS, "all"], default="all", help="which lock file (default all)")
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    parser.add_argument("--cpu-index", default=None, help="an index with torch's CPU wheels, for the cpu flavour")
    args = parser.parse_args()
    stale = []
    for flavour in FLAVOURS.values() if args.flavour == "all" else [FLAVOURS[args.flavour]]:
        text = resolve(flavour, args.cpu_index)
        if args.check:
            current = flavour.path.read_text() if flavour.path.exists() else ""
            stale += [flavour.path.name] if current != text else []
            continue
        flavour.path.write_text(text)
        print(f"wrote {flavour.path} ({len(text.splitlines()) - flavour.header().count(chr(10))} packages)")
    if stale:
        sys.exit(f"out of date: {', '.join(stale)}: run python scripts/lock_deps.py")
    if args.check:
        print("the lock files are up to date")


if __name__ == "__main__":
    main()
