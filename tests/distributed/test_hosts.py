"""The streamed token-parallel float64 replay across two machines with no shared file system,
emulated on one Linux machine: each host is a network namespace (its own loopback, one end of a
veth pair: 10.77.0.1/24 and 10.77.0.2/24) and a mount namespace whose own folder is bound at one
common path (and the folders of the other host and of the test hidden under empty tmpfs mounts),
so host B cannot see host A's files and both hosts run the same command line with the same paths,
each under ``torchrun --nnodes 2 --node-rank i --nproc-per-node 1 --master-addr 10.77.0.1``. Each
host has its own copy of the capture and its own signing key for work folders (XDG_CACHE_HOME on
its own disk). Rank 1 can reach rank 0 only over the veth (gloo over TCP) and shares no file with it.

Shown: host A's oracle within 1e-12 of the single-process streamed replay, two 2-host runs bitwise
equal, host B's folder holds no bundle and host A's no rank-1 work folder; host B's rank SIGKILLed
mid-backward makes host A's rank exit 11 naming rank 1, the same commands again on both hosts
resume and end bitwise equal to the uninterrupted run.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``unshare``: skipped, saying which is
missing, elsewhere. Every namespace and veth is removed at the end even when a test fails (the
mounts live in the hosts' own mount namespaces and go with their processes)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_bitwise, assert_split_within, two_sample_qwen3_capture

from oracle.bundle.store import Bundle
from oracle.errors import RankError
from oracle.parallel import token_parallel
from oracle.replay import token_split
from oracle.replay.run import replay

ROOT = Path(__file__).resolve().parents[2]
BUDGET = "4G"
ADDR = {"a": "10.77.0.1", "b": "10.77.0.2"}
RUN_S = 240  # one 2-host run of the tiny model takes ~20 s here


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


class Hosts:
    """Two emulated hosts; ``run(out)`` runs the replay on both at once and returns their results."""

    def __init__(self, base: Path):
        self.base, self.tag = base, secrets.token_hex(3)
        self.ns = {h: f"oracle-{self.tag}-{h}" for h in "ab"}
        self.veth = {h: f"or{self.tag}{h}" for h in "ab"}  # at most 15 characters
        self.mnt = base / "mnt"  # the common path: each host sees its own folder there
        self.dirs = {h: base / "hosts" / h for h in "ab"}
        self.port = 29500
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        r = _ip("netns", "add", self.ns["a"])
        if r.returncode != 0:
            pytest.skip(f"network namespaces cannot be made here (ip netns add: {r.stderr.strip()}): "
                        "needs root (CAP_NET_ADMIN, and CAP_SYS_ADMIN for its mounts)")  # fmt: skip
        steps = [["netns", "add", self.ns["b"]],
                 ["link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"]]]  # fmt: skip
        for h in "ab":
            steps += [["link", "set", self.veth[h], "netns", self.ns[h]],
                      ["-n", self.ns[h], "addr", "add", f"{ADDR[h]}/24", "dev", self.veth[h]],
                      ["-n", self.ns[h], "link", "set", self.veth[h], "up"], ["-n", self.ns[h], "link", "set", "lo", "up"]]  # fmt: skip
        for s in steps:
            r = _ip(*s)
            if r.returncode != 0 and any(k in r.stderr for k in ("not permitted", "not supported", "Unknown device type")):
                pytest.skip(f"a veth pair between network namespaces cannot be made here (ip {' '.join(s)}: "
                            f"{r.stderr.strip()}): needs CAP_NET_ADMIN and veth support")  # fmt: skip
            assert r.returncode == 0, f"ip {' '.join(s)}: {r.stderr}"
        self.mnt.mkdir()
        (self.base / "src").mkdir()
        for d in self.dirs.values():
            d.mkdir(parents=True)
        r = self._spawn("a", ["true"], {})
        _, err = r.communicate(timeout=30)
        if r.returncode != 0:
            pytest.skip(f"private mounts cannot be made here (unshare --mount, mount --bind: {err.strip()}): needs CAP_SYS_ADMIN")

    def stop(self) -> None:
        """Every process on both hosts SIGKILLed: those the test started and the ranks torchrun
        started in sessions of their own (``ip netns pids``: whatever runs in the namespace)."""
        for h in "ab":
            for pid in _ip("netns", "pids", self.ns[h]).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for p in self.procs:
            if p.returncode is None:
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.communicate(timeout=10)
        self.procs.clear()

    def down(self) -> None:
        self.stop()
        for h in "ab":
            _ip("netns", "del", self.ns[h])  # takes its end of the veth pair with it
            if _ip("link", "show", self.veth[h]).returncode == 0:  # made, never moved into its namespace
                _ip("link", "del", self.veth[h])

    def _spawn(self, h: str, cmd: list[str], env: dict) -> subprocess.Popen:
        """``cmd`` on host ``h``: in its network namespace, its folder bound at the common path, the
        other host's folder and the test's own files (the source capture) hidden."""
        hide = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in (self.base / "hosts", self.base / "src"))
        script = f'mount --bind {self.dirs[h]} {self.mnt} && {hide} && cd {ROOT} && exec "$@"'
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[h], "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd],
            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        self.procs.append(p)
        return p

    def run(self, out: str, env: dict | None = None) -> dict[str, tuple[int, str, str]]:
        """The same command on both hosts (--node-rank 0 on a, 1 on b); {host: (code, stdout, stderr)}."""
        self.port += 1
        env = {"PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(self.mnt / "cache"), "ORACLE_RANK_TIMEOUT": "30", **(env or {})}
        procs = {}
        for i, h in enumerate("ab"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                   "--nproc-per-node", "1", "--master-addr", ADDR["a"], "--master-port", str(self.port),
                   "-m", "oracle", "replay", str(self.mnt / "cap"), "--out", str(self.mnt / out), "--dtype", "fp64",
                   "--split", "tokens", "--max-memory", BUDGET, "--threads", "1"]  # fmt: skip
            procs[h] = self._spawn(h, cmd, env)
        res = {}
        for h, p in procs.items():
            try:
                o, e = p.communicate(timeout=RUN_S)
            except subprocess.TimeoutExpired:
                self.stop()
                pytest.fail(f"host {h}: the 2-host replay did not end within {RUN_S} s")
            res[h] = (p.returncode, o, e)
        return res


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if sys.platform != "linux" or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("emulated hosts need Linux with the ip (iproute2) and unshare (util-linux) tools")
    base = tmp_path_factory.mktemp("hosts")
    h = Hosts(base)
    try:
        h.up()
        cap = two_sample_qwen3_capture(base / "src")
        for d in h.dirs.values():
            shutil.copytree(cap, d / "cap")
        h.one = Bundle(replay(cap, base / "src" / "one", max_memory=4 << 30))
        yield h
    finally:
        h.down()


def _ok(res: dict) -> None:
    for h, (code, _, err) in res.items():
        assert code == 0, f"host {h}: {err[-3000:]}"
    assert res["a"][1].count("replayed ") == 1 and "replayed " not in res["b"][1]  # rank 0 alone prints


def _names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@pytest.fixture(scope="module")
def whole(hosts):
    """One uninterrupted 2-host run."""
    _ok(hosts.run("o1"))
    return Bundle(hosts.dirs["a"] / "o1")


def test_two_hosts_within_the_bound_and_bitwise_repeatable_with_nothing_shared(hosts, whole):
    """Host A's oracle: within 1e-12 of the single-process streamed replay; a second 2-host run is
    bitwise the first. Host B's folder holds no bundle (its shards went over gloo), host A's no
    rank-1 work folder, and neither keeps a work folder after a run that ended."""
    assert_split_within(whole, hosts.one, 2, token_parallel.BOUND_REL)
    assert whole.get("token_parallel")["streamed"] and whole.get("ranks") == 2
    _ok(hosts.run("o2"))
    assert_bitwise(Bundle(hosts.dirs["a"] / "o2"), whole)
    a, b = _names(hosts.dirs["a"]), _names(hosts.dirs["b"])
    assert a == {"cap", "cache", "o1", "o2"}, a
    assert b == {"cap", "cache"}, b  # no bundle, no work folder, nothing received on host B
    assert not list((hosts.dirs["b"] / "cap").glob("grads-*"))
    keys = [(hosts.dirs[h] / "cache" / "oracle" / "work.key").read_bytes() for h in "ab"]
    assert keys[0] != keys[1]  # each host signed its work folder with its own key


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_host_killed_mid_backward_resumes_bitwise(hosts, whole):
    """Host B's rank SIGKILLed right after its 3rd journalled unit (the backward of decoder layer 2):
    host A's rank exits 11 naming rank 1 (torchrun on host A reports that exit code and itself exits
    1, as torchrun does for any failed rank); each host keeps only its own rank's work folder;
    the same commands again on both hosts resume from the journals and end bitwise equal to the
    uninterrupted run."""
    res = hosts.run("k", {token_split.KILL_ENV: "1:3"})
    (ca, _, ea), (cb, _, eb) = res["a"], res["b"]
    assert ca != 0 and cb != 0, (ea[-2000:], eb[-2000:])
    # at a broken gloo connection (seen every run) or, were rank 0 waiting in the store, by its watchdog
    assert re.search(r"error: rank 0: rank 1 (of 2 left|stopped answering)", ea), ea[-3000:]
    assert f"exitcode  : {RankError.exit_code} " in ea, ea[-3000:]  # host A's rank: exit 11
    assert "exitcode  : -9" in eb and "SIGKILL" in eb, eb[-3000:]
    a, b = _names(hosts.dirs["a"]), _names(hosts.dirs["b"])
    assert ".k.rank0.partial" in a and ".k.rank1.partial" not in a and "k" not in a, a
    assert ".k.rank1.partial" in b and ".k.rank0.partial" not in b, b
    _ok(hosts.run("k"))
    again = Bundle(hosts.dirs["a"] / "k")
    rec = again.get("token_parallel")
    assert again.get("streaming")["resumed"] is True
    assert rec["skipped_units"] and all(u.startswith("model.layers.") for u in rec["skipped_units"]), rec
    assert_bitwise(again, whole)
    assert again.get("backward_order") == whole.get("backward_order")
    assert ".k.rank0.partial" not in _names(hosts.dirs["a"]) and ".k.rank1.partial" not in _names(hosts.dirs["b"])


def test_gloo_listens_on_the_interface_that_routes_to_the_master(hosts, monkeypatch):
    """The gap these tests found: gloo advertises the address the host's name resolves to, and
    falls back to loopback (here the name resolves to 127.0.0.1), so host B was told to connect to
    its own loopback and the rendezvous never completed. distributed.gloo_interface sets
    GLOO_SOCKET_IFNAME to the interface holding the route's source address: on host B the veth,
    for a loopback master ``lo``; a GLOO_SOCKET_IFNAME the user set is left as it is."""
    code = "import os; from oracle.parallel import distributed as d; print(d.gloo_interface(), os.environ['GLOO_SOCKET_IFNAME'])"
    p = hosts._spawn("b", [sys.executable, "-c", code], {"PYTHONPATH": str(ROOT), "MASTER_ADDR": ADDR["a"]})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.split() == [hosts.veth["b"]] * 2, err
    from oracle.parallel import distributed

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert distributed.gloo_interface() == "lo" == os.environ["GLOO_SOCKET_IFNAME"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert distributed.gloo_interface() == "eth7"
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert distributed.gloo_interface() is None and "GLOO_SOCKET_IFNAME" not in os.environ
