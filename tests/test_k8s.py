"""The Kubernetes manifests in configs/k8s: valid against Kubernetes' own schemas, and every program,
module, path, flag and user they name exists in the image the Dockerfile builds (read from the
Dockerfile and the repository; scripts/build_image.sh runs the same programs in the built image)."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import ROOT

K8S = ROOT / "configs" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
KUBERNETES_VERSION = "1.33.0"
"""The oldest release the manifests are checked against (backoffLimitPerIndex is GA from 1.33)."""
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The base image's PATH (python:3.11-slim's, and the stand-in's), which the final stage's ``$PATH`` extends."""
CUSTOM_RESOURCES = {"monitoring.coreos.com/v1": {"ServiceMonitor"}}
"""Kinds from operators, not Kubernetes itself: no schema in kubernetes-validate; checked by shape."""


@dataclass(frozen=True)
class Image:
    """What the Dockerfile's final stage holds, as far as a manifest may name it."""

    entrypoint: list[str]
    path: list[str]
    files: frozenset[str]
    user: int
    workdir: str

    def which(self, program: str) -> str | None:
        if program.startswith("/"):
            return program if program in self.files else None
        return next((f"{d}/{program}" for d in self.path if f"{d}/{program}" in self.files), None)


def _stages(text: str) -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), split into stages."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@functools.cache
def image() -> Image:
    """The final stage: its venv comes from the build stage (``python3 -m venv DIR``, the package
    installed into it), so DIR/bin holds python and pyproject's console scripts; other files are
    the COPY lines' destinations."""
    stages = _stages((ROOT / "Dockerfile").read_text())
    build, final = stages[0], stages[-1]
    [venv] = [m.group(1) for line in build if (m := re.search(r"python3 -m venv (\S+)", line))]
    assert any(line.startswith(f"ENV PATH={venv}/bin:") for line in build), "the build stage installs into its venv"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    files = {f"{venv}/bin/{name}" for name in [*scripts, "python", "python3", "pip"]}
    for line in final:
        copy = re.fullmatch(r"COPY --from=build (\S+) (\S+)", line)
        if copy and copy.group(1) != venv:
            files.add(copy.group(2))
    assert any(line == f"COPY --from=build {venv} {venv}" for line in final), "the final stage takes the venv"
    [entrypoint] = [yaml.safe_load(line.split(None, 1)[1]) for line in final if line.startswith("ENTRYPOINT ")]
    [path] = [
        m.group(1).replace("$PATH", BASE_PATH).split(":") for line in final if (m := re.search(r"\bPATH=(\S+)", line))
    ]
    [user] = [line.split()[1] for line in final if line.startswith("USER ")]
    [workdir] = [line.split()[1] for line in final if line.startswith("WORKDIR ")]
    return Image(entrypoint, path, frozenset(files), int(user.split(":")[0]), workdir)


def _documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _pod_specs() -> list[tuple[str, dict]]:
    specs = []
    for path, doc in _documents():
        template = doc.get("spec", {}).get("template")
        if template is not None:
            specs.append((f"{path.name}:{doc['metadata']['name']}", template["spec"]))
    return specs


def _our_containers() -> list[tuple[str, dict, dict]]:
    """(where, pod spec, container) for every container that runs this project's image."""
    return [
        (f"{where}/{c['name']}", spec, c)
        for where, spec in _pod_specs()
        for c in spec["containers"]
        if c["image"].split(":")[0] == "etc-agent"
    ]


def _argv(container: dict) -> list[str]:
    """What the container runs: ``command`` replaces the image's entry point, ``args`` its CMD."""
    return [*(container.get("command") or image().entrypoint), *container.get("args", [])]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schema(path):
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] in CUSTOM_RESOURCES.get(doc["apiVersion"], ()):
            assert doc["metadata"]["name"] and doc["spec"]["endpoints"], doc
            continue
        # strict: a misspelt field is an error, not silently ignored as kubectl would.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_program_module_and_script_the_manifests_run_is_in_the_image():
    img = image()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(_our_containers()) == 3  # the launcher shape's trainer; the sidecar shape's trainer and agent
    for where, spec, container in _our_containers():
        argv = _argv(container)
        assert img.which(argv[0]) == "/usr/bin/tini", f"{where}: PID 1 is tini, not {argv[0]}"
        assert argv[1] == "--", where
        program = argv[2]
        assert img.which(program) is not None, f"{where}: {program} is not in the image"
        assert program in scripts, where
        env = {e["name"] for e in container.get("env", [])}
        for arg in argv:
            for name in re.findall(r"\$\((\w+)\)", arg):
                assert name in env, f"{where}: {arg} names ${name}, which the container does not set"
        _check_script(where, spec, container, argv[3:])


def _check_script(where: str, spec: dict, container: dict, argv: list[str]) -> None:
    """The script or module a trainer runs exists in the image or on one of its volumes."""
    if argv and argv[0] == "sidecar":
        assert not any(a.endswith(".py") for a in argv), f"{where}: a sidecar runs no script"
        return
    argv = argv[1:] if argv and argv[0] == "workers" else argv
    flags_done = [i for i, a in enumerate(argv) if not a.startswith("-")]
    if "-m" in argv:
        module = argv[argv.index("-m") + 1]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{where}: no module {module} in the package"
        return
    script = argv[flags_done[0]]
    mounts = [m for m in container.get("volumeMounts", []) if script.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{where}: {script} is neither in the image nor on a volume"
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
    relative = script[len(mounts[0]["mountPath"].rstrip("/")) + 1 :]
    assert relative in [item["path"] for item in volume["configMap"]["items"]], f"{where}: the ConfigMap lacks {script}"


def test_the_manifests_run_as_the_images_user_with_the_flags_the_programs_know():
    img = image()
    helps = {
        "etcrun": [sys.executable, "-m", "etc_agent.cli.etcrun", "--help"],
        "sidecar": [sys.executable, "-m", "etc_agent.cli.etcrun", "--help"],  # etc-agent sidecar = etcrun --sidecar
        "workers": [sys.executable, "-m", "etc_agent.cli.main", "workers", "--help"],
    }
    texts = {name: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout for name, cmd in helps.items()}
    for where, spec, container in _our_containers():
        # One UID for every container of the pod: the agent may signal the workers (docs/deployment.md).
        assert spec["securityContext"]["runAsUser"] == img.user and spec["securityContext"]["runAsNonRoot"], where
        argv = _argv(container)[2:]
        kind = "etcrun" if argv[0] == "etcrun" else argv[1]
        script_at = next((i for i, a in enumerate(argv[1:], 1) if a == "-m" or not a.startswith("-")), len(argv))
        for flag in (a.split("=")[0] for a in argv[1:script_at] if a.startswith("--")):
            assert flag in texts[kind], f"{where}: {kind} has no flag {flag}"


def test_the_sidecar_shape_connects_its_two_containers():
    [job] = list(yaml.safe_load_all((K8S / "etc-agent-sidecar.yaml").read_text()))
    trainer, agent = job["spec"]["template"]["spec"]["containers"]
    assert trainer["command"][2:] == ["etc-agent", "workers"] and agent["command"][2:] == ["etc-agent", "sidecar"]
    # The workers find their agent where it listens (the pod's shared loopback).
    control = next(a.split("=", 1)[1] for a in agent["args"] if a.startswith("--control-addr="))
    assert {"name": "ETC_AGENT_ADDR", "value": control} in trainer["env"]
    assert f"--agent={control}" in trainer["args"]
    # Separate containers share no /tmp: both derive the control channel's keys from one Secret.
    secrets = [
        next(e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "ETC_AGENT_SECRET")
        for c in (trainer, agent)
    ]
    assert secrets[0] == secrets[1], secrets
    assert job["spec"]["template"]["spec"]["shareProcessNamespace"] is True


def test_the_metrics_port_is_declared_probed_and_scraped_where_an_agent_serves_it():
    scraped = {
        doc["spec"]["selector"]["app"]: doc["spec"]["ports"][0]["targetPort"]
        for _, doc in _documents()
        if doc["kind"] == "Service" and doc["metadata"]["name"].endswith("-metrics")
    }
    for where, _, container in _our_containers():
        args = _argv(container)
        port = next((a.split("=")[1] for a in args if a.startswith("--metrics-port=")), None)
        if port is None:
            continue
        assert "--metrics-addr=0.0.0.0" in args, f"{where}: the metrics endpoint must listen beyond loopback"
        [declared] = [p for p in container["ports"] if p["name"] == "metrics"]
        assert declared["containerPort"] == int(port), where
        assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}, where
    assert scraped == {"etc-agent-train": "metrics"}


def test_the_documented_commands_name_files_that_exist():
    """Each manifest's header says how to apply it: every repository path it names exists."""
    for path in MANIFESTS:
        header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        for word in shlex.split(header.replace("#", " "), posix=False):
            if word.startswith(("configs/", "scripts/", "docs/")):
                target = word.split("#")[0].rstrip(".,;:)")
                assert (ROOT / target).exists(), f"{path.name} names {target}"
