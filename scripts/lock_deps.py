"""Regenerate ``constraints.txt``: the exact versions a fresh install of ``.[test,megatron]`` takes.

    python scripts/lock_deps.py            # writes constraints.txt
    python scripts/lock_deps.py --check    # exit 1 if constraints.txt differs from a fresh resolve

It makes a new virtual environment in a temporary directory, installs the project with every extra
(torch pinned by pyproject, so pip takes the CPU wheel where one is on its find-links), and writes
``pip freeze`` of that environment, without the project itself. The README, ``.ci/run`` and the
Dockerfile install with ``-c constraints.txt``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"
EXTRAS = "test,megatron"
HEADER = f"""\
# Exact versions for a fresh install of etc-agent[{EXTRAS}] (Python {sys.version_info.major}.{sys.version_info.minor}).
# Regenerate with `python scripts/lock_deps.py` after changing dependencies in pyproject.toml.
# Used as: pip install -c constraints.txt -e '.[{EXTRAS}]'
"""


def resolve() -> str:
    with tempfile.TemporaryDirectory(prefix="etc-lock-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.create(env_dir, with_pip=True)
        python = str(env_dir / "bin" / "python")
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-cache-dir", f"{ROOT}[{EXTRAS}]"], check=True)
        frozen = subprocess.run(
            [python, "-m", "pip", "freeze", "--all", "--exclude", "etc-agent"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    lines = []
    for line in sorted(frozen.splitlines(), key=lambda text: text.split("==")[0].lower()):
        name = line.split("==")[0].lower()
        if name in ("pip", "setuptools", "wheel") or not line.strip():
            continue
        # A local label (+cpu) is the build a find-links directory offers; the plain version
        # matches it and also PyPI's build where no local wheel exists.
        lines.append(line.split("+")[0] if name == "torch" else line)
    return HEADER + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with constraints.txt instead of writing it")
    args = parser.parse_args()
    text = resolve()
    if args.check:
        if LOCK.read_text() != text:
            sys.exit("constraints.txt is out of date: run python scripts/lock_deps.py")
        print("constraints.txt is up to date")
        return
    LOCK.write_text(text)
    print(f"wrote {LOCK} ({len(text.splitlines()) - HEADER.count(chr(10))} packages)")


if __name__ == "__main__":
    main()
