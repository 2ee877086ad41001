"""A cluster on one machine: hosts made of network namespaces on a bridge, an etcd of 1 or 3 members
in namespaces of their own, and the faults a real network has.

    python scripts/netlab.py up --hosts 3 --etcd 3       # prints the hosts and the etcd endpoints, waits
    python scripts/netlab.py run h1 -- etcrun ...        # (from another shell) a command on host h1

As a library (the tests' ``cluster`` marker, ``scripts/bench_cluster.py``)::

    with NetLab(num_hosts=3, num_etcd=1) as lab:
        agent = lab.spawn("h1", ["etcrun", "--local-addr", lab.addr("h1"), ...])
        lab.cut("h2")                 # silent: packets dropped both ways, no RST, the link stays up
        lab.cut("h3", only="etcd")    # h3 still reaches its peers, not etcd
        lab.heal()
        lab.shape("h2", "1gbit")      # tc tbf on both directions of h2's link
        lab.kill_etcd_leader()

Each host ``hN`` is a namespace with one veth (``eth0``, 10.N0.S.N/24) on the lab's bridge; etcd
member ``eJ`` is at 10.N0.S.(200+J). The bridge itself holds .254, so this process (in the root
namespace) reaches every host and etcd. Cuts are nftables rules inside the host's namespace (an
``inet`` table of the lab's own). Everything the lab makes is removed when it closes, on every exit
(context manager, ``atexit``, SIGTERM); it kills only the processes it started, by their pid (each in
a session of its own, so their children go with them).

Needs root, ``ip`` (iproute2), ``nft`` and ``tc``; :func:`unavailable` says why a host cannot run it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
_CUT_TABLE = "etclab"


def unavailable() -> str | None:
    """Why this machine cannot host a lab (``None``: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc", "etcd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 nftables etcd-server)"
    probe = f"etclab-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass
class _Node:
    """A host or an etcd member: a namespace, its address, the bridge side of its veth."""

    name: str
    namespace: str
    addr: str
    bridge_port: str


@dataclass
class NetLab:
    """The lab; see the module's docstring."""

    num_hosts: int = 3
    num_etcd: int = 1
    lab_id: int = field(default_factory=lambda: os.getpid() % 200 + 1)
    """Picks the subnet (10.(lab_id // 250 + 70).(lab_id % 250).0/24) and the names; two labs at once need two ids."""
    hosts: dict[str, _Node] = field(default_factory=dict)
    etcd_members: dict[str, _Node] = field(default_factory=dict)
    _processes: list[subprocess.Popen] = field(default_factory=list)
    _workdir: Path | None = None
    _closed: bool = False

    @property
    def bridge(self) -> str:
        return f"etclab{self.lab_id}"

    @property
    def subnet(self) -> str:
        return f"10.{70 + self.lab_id // 250}.{self.lab_id % 250}"

    def __enter__(self) -> NetLab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- building ------------------------------------------------------------------------
    def up(self) -> None:
        """Make the bridge, the hosts and the etcd members, and start etcd."""
        atexit.register(self.close)
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: object) -> None:
            self.close()
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)

        if previous in (signal.SIG_DFL, None) or callable(previous):
            signal.signal(signal.SIGTERM, on_term)
        try:
            self._claim_bridge()
            self._workdir = Path(tempfile.mkdtemp(prefix=f"etclab{self.lab_id}-"))
            _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(1, self.num_hosts + 1):
                self._add_node(self.hosts, f"h{i}", f"{self.subnet}.{i}")
            for j in range(1, self.num_etcd + 1):
                self._add_node(self.etcd_members, f"e{j}", f"{self.subnet}.{200 + j}")
            for name in self.etcd_members:
                self.start_etcd(name)
            self.wait_etcd_healthy()
        except BaseException:
            self.close()
            raise

    def _claim_bridge(self) -> None:
        """Make the bridge under the first free id from ``lab_id`` on (another lab may hold one)."""
        for _ in range(200):
            made = _run("ip", "link", "add", self.bridge, "type", "bridge", check=False)
            if made.returncode == 0:
                return
            if "exists" not in made.stderr:
                raise RuntimeError(f"ip link add {self.bridge} type bridge: {made.stderr.strip()}")
            self.lab_id = self.lab_id % 200 + 1
        raise RuntimeError("no free lab id: 200 labs exist")

    def _add_node(self, into: dict[str, _Node], name: str, addr: str) -> None:
        namespace = f"etclab{self.lab_id}-{name}"
        bridge_port = f"el{self.lab_id}{name}"
        _run("ip", "netns", "add", namespace)
        into[name] = _Node(name, namespace, addr, bridge_port)  # close() removes it from here on
        _run("ip", "link", "add", bridge_port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _run("ip", "link", "set", bridge_port, "master", self.bridge)
        _run("ip", "link", "set", bridge_port, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{addr}/24", "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")

    # ---- etcd ----------------------------------------------------------------------------
    @property
    def etcd_endpoints(self) -> str:
        """Every member's client URL host:port, comma-separated (``--rdzv-endpoint``)."""
        return ",".join(f"{m.addr}:{ETCD_CLIENT_PORT}" for m in self.etcd_members.values())

    def start_etcd(self, name: str) -> subprocess.Popen:
        """Start (or restart, on its data) member ``name``."""
        member = self.etcd_members[name]
        assert self._workdir is not None
        cluster = ",".join(f"{m.name}=http://{m.addr}:{ETCD_PEER_PORT}" for m in self.etcd_members.values())
        data_dir = self._workdir / f"etcd-{name}"
        argv = [
            "etcd",
            "--name",
            name,
            "--data-dir",
            str(data_dir),
            "--listen-client-urls",
            f"http://{member.addr}:{ETCD_CLIENT_PORT}",
            "--advertise-client-urls",
            f"http://{member.addr}:{ETCD_CLIENT_PORT}",
            "--listen-peer-urls",
            f"http://{member.addr}:{ETCD_PEER_PORT}",
            "--initial-advertise-peer-urls",
            f"http://{member.addr}:{ETCD_PEER_PORT}",
            "--initial-cluster",
            cluster,
            "--initial-cluster-state",
            "existing" if data_dir.exists() else "new",
            "--initial-cluster-token",
            f"etclab{self.lab_id}",
            # Elections within a second of a leader's loss: the defaults (100 ms, 1 s) made explicit.
            "--heartbeat-interval",
            "100",
            "--election-timeout",
            "1000",
        ]
        log = open(self._workdir / f"etcd-{name}.log", "a")  # the process holds it
        process = self._spawn_in(member.namespace, argv, stdout=log, stderr=subprocess.STDOUT)
        setattr(process, "etcd_member", name)  # noqa: B010 - which member a process is
        return process

    def etcd_status(self, name: str, timeout: float = 1.0) -> dict | None:
        """Member ``name``'s status (its id, the leader's id), or ``None`` where it does not answer."""
        member = self.etcd_members[name]
        request = urllib.request.Request(
            f"http://{member.addr}:{ETCD_CLIENT_PORT}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read())
        except OSError:
            return None

    def wait_etcd_healthy(self, timeout: float = 30.0) -> str:
        """Wait until a member reports a leader; returns the leader's member name."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.etcd_leader()
            if leader is not None:
                return leader
            time.sleep(0.1)
        raise TimeoutError(f"etcd ({self.etcd_endpoints}) has no leader after {timeout:.0f} s")

    def etcd_leader(self) -> str | None:
        """The name of the member that leads now (``None``: no member answers with a leader)."""
        for name in self.etcd_members:
            status = self.etcd_status(name)
            if status and int(status.get("leader", 0)):
                leader_id = status["leader"]
                for other in self.etcd_members:
                    other_status = self.etcd_status(other)
                    if other_status and other_status["header"]["member_id"] == leader_id:
                        return other
        return None

    def kill_etcd(self, name: str) -> None:
        """SIGKILL member ``name`` (restart it with :meth:`start_etcd`)."""
        for process in self._processes:
            if getattr(process, "etcd_member", None) == name and process.poll() is None:
                process.kill()
                process.wait()

    def kill_etcd_leader(self) -> str:
        """SIGKILL the member that leads; returns its name."""
        leader = self.wait_etcd_healthy()
        self.kill_etcd(leader)
        return leader

    # ---- hosts ---------------------------------------------------------------------------
    def addr(self, host: str) -> str:
        return self.hosts[host].addr

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.hosts[host].namespace]

    def spawn(self, host: str, argv: list[str], **popen: object) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (a session of its own; killed by pid when the lab closes)."""
        return self._spawn_in(self.hosts[host].namespace, argv, **popen)

    def _spawn_in(self, namespace: str, argv: list[str], **popen: object) -> subprocess.Popen:
        process = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], start_new_session=True, **popen)  # type: ignore[call-overload]
        self._processes.append(process)
        return process

    # ---- faults --------------------------------------------------------------------------
    def _node(self, name: str) -> _Node:
        return self.hosts[name] if name in self.hosts else self.etcd_members[name]

    def cut(self, host: str, only: str = "all") -> None:
        """Drop ``host``'s packets silently, both ways: all of them (``only="all"``), or those to and
        from the etcd members (``only="etcd"``). Loopback inside the host keeps working. ``host``
        may be an etcd member (cutting two of three loses the quorum)."""
        namespace = self._node(host).namespace
        if only == "all":
            match_in, match_out = 'iifname "eth0"', 'oifname "eth0"'
        elif only == "etcd":
            members = ", ".join(m.addr for m in self.etcd_members.values())
            match_in, match_out = f"ip saddr {{ {members} }}", f"ip daddr {{ {members} }}"
        else:
            raise ValueError(f"cut {host} only={only!r}: all or etcd")
        rules = (
            f"table inet {_CUT_TABLE} {{\n"
            f"  chain input {{ type filter hook input priority -10; policy accept; {match_in} drop; }}\n"
            f"  chain output {{ type filter hook output priority -10; policy accept; {match_out} drop; }}\n"
            "}\n"
        )
        self.heal(host)
        subprocess.run(["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=rules, text=True, check=True)

    def heal(self, host: str | None = None) -> None:
        """Remove the cut of ``host`` (every host's and etcd member's when ``None``)."""
        for name in [host] if host else [*self.hosts, *self.etcd_members]:
            namespace = self._node(name).namespace
            _run("ip", "netns", "exec", namespace, "nft", "delete", "table", "inet", _CUT_TABLE, check=False)

    def shape(self, host: str, rate: str, burst: str = "1mb", latency: str = "50ms") -> None:
        """Shape ``host``'s link to ``rate`` (tc's units: ``1gbit``) in both directions: its own side
        (what it sends) and the bridge's side (what it receives)."""
        node = self.hosts[host]
        for where in (["ip", "netns", "exec", node.namespace], []):
            device = "eth0" if where else node.bridge_port
            _run(
                *where,
                "tc",
                "qdisc",
                "replace",
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                latency,
            )

    def unshape(self, host: str) -> None:
        node = self.hosts[host]
        _run("ip", "netns", "exec", node.namespace, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        _run("tc", "qdisc", "del", "dev", node.bridge_port, "root", check=False)

    # ---- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what the lab started (by pid, with their sessions) and remove what it made."""
        if self._closed:
            return
        self._closed = True
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for node in [*self.hosts.values(), *self.etcd_members.values()]:
            _run("ip", "link", "del", node.bridge_port, check=False)
            _run("ip", "netns", "del", node.namespace, check=False)
        if self._workdir is not None:  # the bridge is this lab's (claimed before the workdir)
            _run("ip", "link", "del", self.bridge, check=False)
            shutil.rmtree(self._workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a lab and keep it until Ctrl-C")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--etcd", type=int, default=1, choices=(1, 3))
    up.add_argument("--id", type=int, default=1, help="lab id (subnet and names)")
    run = sub.add_parser("run", help="run a command on a host of a running lab")
    run.add_argument("host")
    run.add_argument("--id", type=int, default=1)
    run.add_argument("argv", nargs=argparse.REMAINDER)
    for name in ("cut", "heal", "shape"):
        op = sub.add_parser(name, help=f"{name} a host of a running lab")
        op.add_argument("host", nargs="?" if name == "heal" else None)
        op.add_argument("--id", type=int, default=1)
        if name == "cut":
            op.add_argument("--only", choices=("all", "etcd"), default="all")
        if name == "shape":
            op.add_argument("rate")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        sys.exit(f"netlab: {reason}")
    if args.command == "up":
        lab = NetLab(num_hosts=args.hosts, num_etcd=args.etcd, lab_id=args.id)
        lab.up()
        for name, node in lab.hosts.items():
            print(f"{name}: {node.addr} (ip netns exec {node.namespace} ...)")
        print(f"etcd: {lab.etcd_endpoints}")
        print("Ctrl-C removes the lab", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        lab.close()
        return
    # The other commands act on a lab another process holds: its names follow from the id.
    lab = NetLab(lab_id=args.id)
    lab._closed = True  # never tear down what this process did not make
    for name in _nodes_of(args.id):
        number = int(name[1:])
        node = _Node(name, f"etclab{args.id}-{name}", f"{lab.subnet}.{number if name[0] == 'h' else 200 + number}", "")
        node.bridge_port = f"el{args.id}{name}"
        (lab.hosts if name[0] == "h" else lab.etcd_members)[name] = node
    if args.command == "run":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        os.execvp("ip", ["ip", "netns", "exec", lab.hosts[args.host].namespace, *argv])
    elif args.command == "cut":
        lab.cut(args.host, only=args.only)
    elif args.command == "heal":
        lab.heal(args.host)
    elif args.command == "shape":
        lab.shape(args.host, args.rate)


def _nodes_of(lab_id: int) -> list[str]:
    """The host and etcd member names of the running lab ``lab_id``, from its namespaces."""
    names = _run("ip", "netns", "list").stdout.split()
    prefix = f"etclab{lab_id}-"
    return sorted(n[len(prefix) :] for n in names if n.startswith(prefix))


if __name__ == "__main__":
    main()
