"""The Kubernetes example is valid YAML and its etcrun arguments are flags etcrun knows."""

import subprocess
import sys

import yaml
from conftest import ROOT


def test_manifest_parses_and_uses_known_etcrun_flags():
    docs = list(yaml.safe_load_all((ROOT / "configs" / "k8s" / "etc-agent-job.yaml").read_text()))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Service", "Deployment", "Job"]
    job = docs[2]
    container = job["spec"]["template"]["spec"]["containers"][0]
    flags = [a.split("=")[0] for a in container["args"] if a.startswith("--")]
    help_text = subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.etcrun", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    for flag in flags:
        assert flag in help_text, flag
    assert any(a.startswith("--rdzv-endpoint=etc-agent-etcd:") for a in container["args"])
    service = docs[0]
    assert service["metadata"]["name"] == "etc-agent-etcd" and service["spec"]["ports"][0]["port"] == 2379


def test_sidecar_pod_has_trainer_and_agent_containers_with_known_flags():
    [job] = list(yaml.safe_load_all((ROOT / "configs" / "k8s" / "etc-agent-sidecar.yaml").read_text()))
    trainer, agent = job["spec"]["template"]["spec"]["containers"]
    assert trainer["command"] == ["etc-agent", "workers"] and agent["command"] == ["etc-agent", "sidecar"]
    etcrun_help = subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.etcrun", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    workers_help = subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.main", "workers", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    for flag in (a.split("=")[0] for a in agent["args"] if a.startswith("--")):
        assert flag in etcrun_help, flag
    for flag in (a.split("=")[0] for a in trainer["args"] if a.startswith("--")):
        assert flag in workers_help, flag
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
