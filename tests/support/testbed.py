"""A multi-host network on one machine: each "host" is a Linux network namespace with one interface,
`eth0`, joined by a veth pair to a bridge in a switch namespace of its own. The machine itself (the
root namespace, where the tests and their clients run) is on the bridge too, at .1.

Faults are made the way a network makes them: a cut link (the switch's end of the host's veth goes
down: no FIN, no RST, packets vanish), a blackhole (nftables drops everything in and out of the
host while its link stays up), a one-way block (only packets to one port from one peer are
dropped), a slow link (tc tbf on both directions of the host's link). `heal` undoes them.

    .venv/bin/python -m tests.support.testbed up router w1 w2 redis   # prints the hosts
    .venv/bin/python -m tests.support.testbed down                     # every test bed on the machine

Needs root, `ip` (iproute2), `nft` (installed if missing) and `tc`; `check_capabilities`
names what is missing. A bed's state file under /run/shoal-testbed lets `down` (and the next `up`)
remove beds whose owner died without tearing down.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.system_commands import ensure_command

STATE_DIR = Path("/run/shoal-testbed")
PREFIX = "sb"  # every namespace and interface of a bed starts with sb<id>
TBF_PROBE = ["rate", "1mbit", "burst", "32kb", "latency", "50ms"]


class BedUnavailable(RuntimeError):
    """This machine cannot build the test bed; the message names the missing capability."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result


def check_capabilities() -> None:
    """Raises BedUnavailable naming the first missing capability: root, iproute2, network
    namespaces, veth pairs, bridges, nftables, tc tbf."""
    if os.geteuid() != 0:
        raise BedUnavailable("the test bed needs root (network namespaces, veth pairs, nftables)")
    try:
        ensure_command("nft", "nftables")
    except (subprocess.SubprocessError, OSError):
        pass  # named below
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            raise BedUnavailable(f"`{tool}` is not installed")
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    steps = [
        ("network namespaces (`ip netns add`)", ["ip", "netns", "add", probe]),
        ("veth pairs", ["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "a1"]),
        ("bridges", ["ip", "-n", probe, "link", "add", "b0", "type", "bridge"]),
        ("nftables in the kernel", ["ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe"]),
        (
            "tc tbf",
            [
                "tc",
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "a0",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "32kb",
                "latency",
                "50ms",
            ],
        ),
    ]
    try:
        for capability, argv in steps:
            result = _run(*argv, check=False)
            if result.returncode != 0:
                raise BedUnavailable(f"{capability} unavailable: {result.stderr.strip()}")
    finally:
        _run("ip", "netns", "del", probe, check=False)


@dataclass
class Host:
    """One namespace of a bed: `address` is its eth0 address, `switch_port` the switch's end of its link."""

    name: str
    namespace: str
    address: str
    switch_namespace: str
    switch_port: str

    def url(self, port: int) -> str:
        return f"http://{self.address}:{port}"

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace (the process keeps its pid: ip netns exec execs it)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        out = _run("ip", "netns", "pids", self.namespace, check=False).stdout
        return [int(pid) for pid in out.split()]

    def listening(self) -> list[str]:
        """Local addresses (address:port) of the TCP sockets listening in this namespace."""
        out = _run(*self.command(["ss", "-Hltn"])).stdout
        return sorted(line.split()[3] for line in out.splitlines() if line.strip())

    def cut(self) -> None:
        """The link goes down at the switch: the host's carrier drops, nothing is sent or answered."""
        _run("ip", "-n", self.switch_namespace, "link", "set", self.switch_port, "down")

    def vanish(self) -> None:
        """The host is gone: every process in it killed, its link cut (until `heal`)."""
        _kill_in(self.namespace)
        self.cut()

    def blackhole(self) -> None:
        """Every packet in or out of eth0 is dropped; the link stays up, connections hang."""
        self._nft_drop("")

    def block(self, port: int, source: Host) -> None:
        """Packets from `source` to this host's TCP `port` are dropped; every other path (this host's
        own connections to `source`, say its heartbeats) still works."""
        self._nft_drop(f"ip saddr {source.address} tcp dport {port}", output=False)

    def slow(self, rate: str, burst: str = "16kb", latency: str = "400ms") -> None:
        """Both directions of the link limited to `rate` (tc tbf, e.g. "64kbit")."""
        shape = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        _run("tc", "-n", self.namespace, "qdisc", "replace", "dev", "eth0", *shape)
        _run("tc", "-n", self.switch_namespace, "qdisc", "replace", "dev", self.switch_port, *shape)

    def heal(self) -> None:
        """Undoes every fault: link up, drop rules and rate limits gone."""
        _run("ip", "-n", self.switch_namespace, "link", "set", self.switch_port, "up")
        _run(*self.command(["nft", "delete", "table", "inet", "testbed"]), check=False)
        _run("tc", "-n", self.namespace, "qdisc", "del", "dev", "eth0", "root", check=False)
        _run("tc", "-n", self.switch_namespace, "qdisc", "del", "dev", self.switch_port, "root", check=False)

    def _nft_drop(self, match: str, output: bool = True) -> None:
        rules = ["add table inet testbed"]
        hooks = ["input", "output"] if output else ["input"]
        for hook in hooks:
            rules.append(f"add chain inet testbed {hook} {{ type filter hook {hook} priority 0; }}")
            rules.append(
                f'add rule inet testbed {hook} {"iifname" if hook == "input" else "oifname"} "eth0" {match} drop'
            )
        script = "\n".join(rules) + "\n"
        subprocess.run(self.command(["nft", "-f", "-"]), input=script, text=True, check=True, timeout=30)


class NetworkBed:
    """Hosts `names` on a /24 of 10.250.0.0/16, each at .2, .3, ... in order; the root namespace at .1.
    Invariant after `up`: every host reaches every other and the root namespace reaches all of them."""

    def __init__(self, names: list[str]):
        self.id = secrets.token_hex(2)
        self.switch = f"{PREFIX}{self.id}sw"
        self.root_port = f"{PREFIX}{self.id}r"
        self.subnet: ipaddress.IPv4Network | None = None  # chosen by `up`, with the addresses
        self.root_address = ""
        self.hosts = {
            name: Host(name, f"{PREFIX}{self.id}-{name}", "", self.switch, f"{PREFIX}{self.id}p{i}")
            for i, name in enumerate(names)
        }

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def up(self) -> NetworkBed:
        """Builds the bed; beds built at once (pytest workers) take their subnets one at a time."""
        check_capabilities()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        with open(STATE_DIR / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            reap_orphans()
            self.subnet = _free_subnet()
            addresses = list(self.subnet.hosts())
            self.root_address = str(addresses[0])
            for i, host in enumerate(self.hosts.values()):
                host.address = str(addresses[i + 1])
            (STATE_DIR / f"{self.id}.json").write_text(json.dumps({"owner": os.getpid(), "switch": self.switch}))
            try:
                self._build()
            except BaseException:
                self.down()
                raise
        return self

    def _build(self) -> None:
        prefix = self.subnet.prefixlen
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        _run("ip", "link", "add", self.root_port, "type", "veth", "peer", "name", "uplink", "netns", self.switch)
        _run("ip", "-n", self.switch, "link", "set", "uplink", "master", "br0", "up")
        _run("ip", "addr", "add", f"{self.root_address}/{prefix}", "dev", self.root_port)
        _run("ip", "link", "set", self.root_port, "up")
        for host in self.hosts.values():
            _run("ip", "netns", "add", host.namespace)
            _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
            _run(
                "ip", "-n", host.namespace, "link", "add", "eth0", "type", "veth",
                "peer", "name", host.switch_port, "netns", self.switch,
            )  # fmt: skip
            _run("ip", "-n", self.switch, "link", "set", host.switch_port, "master", "br0", "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
            _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", host.namespace, "route", "add", "default", "via", self.root_address)

    def down(self) -> None:
        """Kills every process in the bed's hosts, then removes its namespaces (and with them its links)."""
        for host in self.hosts.values():
            _kill_in(host.namespace)
        _remove_bed(self.id, [h.namespace for h in self.hosts.values()], self.switch)

    def describe(self) -> dict:
        return {
            "id": self.id,
            "root": self.root_address,
            "hosts": {name: {"namespace": h.namespace, "address": h.address} for name, h in self.hosts.items()},
        }


def _free_subnet() -> ipaddress.IPv4Network:
    used = _run("ip", "-4", "-o", "addr").stdout
    for third in range(1, 255):
        if f" 10.250.{third}." not in used:
            return ipaddress.IPv4Network(f"10.250.{third}.0/24")
    raise BedUnavailable("no free /24 left in 10.250.0.0/16")


def _remove_bed(bed_id: str, namespaces: list[str], switch: str) -> None:
    for namespace in [*namespaces, switch]:
        _run("ip", "netns", "del", namespace, check=False)
    _run("ip", "link", "del", f"{PREFIX}{bed_id}r", check=False)  # gone with the switch already, normally
    (STATE_DIR / f"{bed_id}.json").unlink(missing_ok=True)


def _bed_namespaces(bed_id: str) -> list[str]:
    names = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}{bed_id}-")]


def _kill_in(namespace: str) -> None:
    for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap_orphans(everything: bool = False) -> list[str]:
    """Removes beds whose owner process is gone (every bed with `everything`); returns their ids."""
    removed = []
    for state in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []:
        bed_id = state.stem
        owner = json.loads(state.read_text())["owner"]
        if not everything and Path(f"/proc/{owner}").exists():
            continue
        namespaces = _bed_namespaces(bed_id)
        for namespace in namespaces:
            _kill_in(namespace)
        _remove_bed(bed_id, namespaces, f"{PREFIX}{bed_id}sw")
        removed.append(bed_id)
    return removed


def main() -> int:
    parser = argparse.ArgumentParser(description="Builds or removes a test bed of network namespaces.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="build a bed with these hosts and print it (it stays until `down`)")
    up.add_argument("hosts", nargs="+")
    commands.add_parser("down", help="remove every bed on this machine, killing what runs in it")
    commands.add_parser("check", help="say whether this machine can build a bed")
    args = parser.parse_args()
    try:
        if args.command == "check":
            check_capabilities()
            print("ok: root, iproute2, network namespaces, veth pairs, bridges, nftables, tc tbf")
        elif args.command == "up":
            bed = NetworkBed(args.hosts).up()
            state = STATE_DIR / f"{bed.id}.json"
            state.write_text(json.dumps({"owner": 1, "switch": bed.switch}))  # init owns it: kept until `down`
            print(json.dumps(bed.describe(), indent=2))
        else:
            print("removed:", " ".join(reap_orphans(everything=True)) or "nothing")
    except BedUnavailable as exc:
        print(f"test bed unavailable: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
