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
    help_text = subprocess.run([sys.executable, "-m", "etc_agent.cli.etcrun", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for flag in flags:
        assert flag in help_text, flag
    assert any(a.startswith("--rdzv-endpoint=etc-agent-etcd:") for a in container["args"])
    service = docs[0]
    assert service["metadata"]["name"] == "etc-agent-etcd" and service["spec"]["ports"][0]["port"] == 2379
