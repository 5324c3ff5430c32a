"""One replay spread over several processes and machines with torch.distributed (gloo, CPU).

Ranks are started by torchrun (``torchrun --nnodes M --nproc-per-node N -m oracle replay ...``) or
by ``oracle replay ... --nproc N`` (oracle/parallel/launch.py: N local processes, the same environment
rendezvous over 127.0.0.1). The environment says who is who (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); without WORLD_SIZE > 1 nothing here is used and the replay is the single process one.

Who does what: work that is independent is dealt round-robin (emulated ensemble member k and the
k-th selected module of a local replay belong to rank k % WORLD_SIZE); each rank computes exactly
what the single process computes for that member or module (the same seeds, the same ops), so
the result is bitwise the single-process one at the same thread count per process. Rank 0 writes
the one bundle; the other ranks send their parts to it (safetensors bytes and JSON over gloo
send/recv; no pickle), so nothing is assembled by hand and no shared file system is needed.
Gloo listens on the interface that routes to MASTER_ADDR (``gloo_interface``; GLOO_SOCKET_IFNAME
where the user set it), not on whatever the host's name resolves to (often loopback).

Faults: every rank beats a heartbeat into the rendezvous store every HEARTBEAT_S; a watchdog
thread on rank 0 watches all ranks, the others watch rank 0. A rank whose heartbeat has not moved
for ``ORACLE_RANK_TIMEOUT`` seconds (default 60), or a store that no longer answers (rank 0 gone),
stops this process with a message naming the rank and exit code ``RankError.exit_code`` (11);
gloo's own timeout (the same value) bounds each transfer. A gloo connection that breaks (a peer
killed) stops this process at once, naming the rank whose heartbeat stopped (``silent_peers``). Long computations never sit inside a
collective: a rank announces in the store that its parts are ready and sends only when rank 0
asks for them, so the timeout is about silence, not about how long a rank computes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RankError

HEARTBEAT_S = 1.0
CHUNK = 64 << 20  # bytes per gloo message when a file is sent


def timeout_s() -> float:
    return float(os.environ.get("ORACLE_RANK_TIMEOUT", "60"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0")) if world() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def mine(k: int) -> bool:
    """Independent item k (ensemble member, module) belongs to this rank."""
    return k % world() == rank()


def owner(k: int) -> int:
    return k % world()


_STATE: dict[str, object] = {}


def init() -> bool:
    """Join the process group once (gloo, env rendezvous) and start the heartbeat/watchdog.
    Returns whether this run is distributed."""
    if world() <= 1:
        return False
    if dist.is_initialized():
        return True
    t = timeout_s()
    gloo_interface()
    try:
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=t))
    except (RuntimeError, ValueError) as e:  # DistStoreError and friends: a rank missing, a wrong address
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise RankError(f"rank {rank()} of {world()}: the rendezvous at {where} did not complete within {t:.0f} s "
                        f"({str(e).splitlines()[0]}): a rank did not start, or MASTER_ADDR/MASTER_PORT differ") from None  # fmt: skip
    store = dist.distributed_c10d._get_default_store()
    _STATE["store"] = store
    thread = threading.Thread(target=_watch, args=(store, rank(), world(), t), name="oracle-watchdog", daemon=True)
    thread.start()
    return True


def _route_source(host: str) -> str | None:
    """The local address this host's packets to ``host`` leave from (the kernel's route; a UDP
    "connect" sends nothing), or None where ``host`` does not resolve or no route leads there."""
    import socket

    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return None


def _interface_of(ip: str) -> str | None:
    """The name of the network interface holding address ``ip`` (Linux: SIOCGIFADDR for IPv4,
    /proc/net/if_inet6 for IPv6), or None where that cannot be told."""
    import ipaddress
    import socket

    try:
        want = ipaddress.ip_address(ip.split("%")[0])
        if want.version == 6:
            for line in Path("/proc/net/if_inet6").read_text().splitlines():
                f = line.split()
                if len(f) >= 6 and ipaddress.ip_address(bytes.fromhex(f[0])) == want:
                    return f[5]
            return None
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    r = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:  # an interface without an IPv4 address
                    continue
                if ipaddress.ip_address(r[20:24]) == want:
                    return name
    except (OSError, ValueError, ImportError):
        return None
    return None


def gloo_interface() -> str | None:
    """Point gloo at the interface that routes to MASTER_ADDR (``GLOO_SOCKET_IFNAME``, unless set).
    Left alone, gloo advertises to its peers the address this host's *name* resolves to, and falls
    back to loopback where that address cannot be bound; on a host whose name resolves to 127.0.0.1
    or 127.0.1.1 (a common /etc/hosts) the other machines are then told to connect to their own
    loopback and the rendezvous never completes. The interface holding the source address of the
    route to MASTER_ADDR is one every peer reaches, since MASTER_ADDR must be reachable from every
    host (docs/distributed.md, Several machines); where it cannot be told, gloo's own choice stays."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not os.environ.get("MASTER_ADDR"):
        return os.environ.get("GLOO_SOCKET_IFNAME")
    src = _route_source(os.environ["MASTER_ADDR"])
    name = _interface_of(src) if src else None
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def _die(msg: str) -> None:
    print(f"error: rank {rank()}: {msg}", file=sys.stderr, flush=True)
    os._exit(RankError.exit_code)


def _watch(store, me: int, n: int, t: float) -> None:
    """Heartbeat and watchdog in one thread: beat, then check the peers' beats moved within t."""
    peers = range(1, n) if me == 0 else [0]
    beat = 0
    last: dict[int, tuple[bytes, float]] = {}
    while not _STATE.get("finished"):
        beat += 1
        now = time.monotonic()
        try:
            store.set(f"oracle/hb/{me}", str(beat))
            for p in peers:
                v = store.get(f"oracle/hb/{p}") if store.check([f"oracle/hb/{p}"]) else b""
                if p not in last or last[p][0] != v:
                    last[p] = (v, now)
                elif now - last[p][1] > t:
                    _die(f"rank {p} stopped answering: no heartbeat for {t:.0f} s (hung or killed); "
                         "the run is stopped; run the same command again to resume from the journals")  # fmt: skip
        except Exception as e:  # the store lives in rank 0: it is gone
            if _STATE.get("finished"):
                return
            _die(f"rank 0 is gone (the rendezvous store does not answer: {type(e).__name__}); the run is stopped; "
                 "run the same command again to resume from the journals")  # fmt: skip
        time.sleep(HEARTBEAT_S)


def finish() -> None:
    """The run is over on this rank: the watchdog stops watching (rank 0 leaves last), and the process
    group is destroyed before the interpreter's teardown."""
    if world() > 1 and dist.is_initialized():
        store = _STATE["store"]
        if rank() == 0:  # keep the store up until every rank has read that the bundle is out
            store.set("oracle/published", "1")
            _wait(store, [f"oracle/finished/{r}" for r in range(1, world())])
            _STATE["finished"] = True
        else:
            _wait(store, ["oracle/published"])
            _STATE["finished"] = True
            store.set(f"oracle/finished/{rank()}", "1")
        # The process group is destroyed here, while the interpreter is whole. Left to the interpreter's
        # teardown, gloo's worker threads can meet a half-finalized interpreter and abort the rank with
        # SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489) after its work
        # is done, which the launcher must read as a lost rank (seen once in a CI rehearsal of --nproc 3).
        # Rank 0 gets here last (it waited for every rank's finished key), so its store outlives their use.
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()


def _wait(store, keys: list[str]) -> None:
    """Wait for keys in the store; the watchdog thread ends the process if a peer goes silent."""
    while not store.check(keys):
        time.sleep(0.02)


@contextlib.contextmanager
def collectives(what: str):
    """Gloo errors inside ``what`` (a peer that left: connection closed, or gloo's timeout) end this
    process at once with a message naming this rank and what it was doing, and exit code
    ``RankError.exit_code`` (11), as the watchdog does: the process group is broken, and an
    ordinary exit runs its destructors, which can abort (SIGABRT) and then look like the cause to
    the launcher. Anything else passes unchanged."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if world() > 1 and any(k in text.lower() for k in ("gloo", "connection closed", "connection reset", "timed out")):
            lost = silent_peers()
            who = (f"{'ranks' if len(lost) > 1 else 'rank'} {', '.join(map(str, lost))} of {world()} left (no heartbeat "
                   f"since the connection broke)" if lost else "a peer left")  # fmt: skip
            _die(f"{who} during {what} ({text.splitlines()[0][:200]}); the run is stopped; run the same command again "
                 "to resume from the journals")  # fmt: skip
        raise


def silent_peers(wait: float = 3 * HEARTBEAT_S) -> list[int]:
    """The other ranks whose heartbeat does not move within ``wait`` seconds (a live rank beats every
    HEARTBEAT_S): who is gone when a gloo connection breaks. Gloo's error names only the peer's
    address, which several ranks of one host share; the heartbeats name the rank. Empty where the
    store does not answer (it lives in rank 0 or its launcher) or every peer still beats."""
    store = _STATE.get("store")
    if store is None:
        return []
    peers = [p for p in range(world()) if p != rank()]

    def beats() -> dict[int, bytes]:
        return {p: store.get(f"oracle/hb/{p}") if store.check([f"oracle/hb/{p}"]) else b"" for p in peers}

    try:
        first, silent = beats(), set(peers)
        deadline = time.monotonic() + wait
        while silent and time.monotonic() < deadline:
            time.sleep(HEARTBEAT_S / 5)
            now = beats()
            silent = {p for p in silent if now[p] == first[p]}
    except Exception:  # the store is gone too
        return []
    return sorted(silent)


def barrier(tag: str) -> None:
    """Every rank reached ``tag``: a wait in the store, not in a gloo collective, so ranks that get
    here minutes apart (building a large model) do not hit gloo's timeout; silence is the watchdog's."""
    if world() <= 1:
        return
    store = _STATE["store"]
    store.set(f"oracle/barrier/{tag}/{rank()}", "1")
    _wait(store, [f"oracle/barrier/{tag}/{r}" for r in range(world())])


# -- parts sent to rank 0 -----------------------------------------------------------------------------
def _send_bytes(data: bytes, dst: int) -> None:
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.send(n, dst)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def _recv_bytes(src: int) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src)
    if int(n) == 0:
        return b""
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(buf, src)
    return buf.numpy().tobytes()


def _send_file(path: Path, dst: int) -> None:
    size = path.stat().st_size
    dist.send(torch.tensor([size], dtype=torch.int64), dst)
    buf = torch.empty(min(CHUNK, size), dtype=torch.uint8)  # read into and sent from, piece by piece
    with open(path, "rb") as f:
        left = size
        while left:
            n = f.readinto(memoryview(buf.numpy())[: min(CHUNK, left)])
            if not n:
                raise OSError(f"{path} ended {left} bytes short of its {size}")
            dist.send(buf[:n], dst)
            left -= n


def _recv_pieces(src: int, write: Callable[[memoryview], None]) -> None:
    """One file's bytes from ``src``, handed to ``write`` piece by piece (CHUNK bytes at most) as they arrive."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src)
    left = int(n)
    while left:
        buf = torch.empty(min(CHUNK, left), dtype=torch.uint8)
        dist.recv(buf, src)
        write(memoryview(buf.numpy()))
        left -= buf.numel()


def _recv_file(path: Path, src: int) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        _recv_pieces(src, f.write)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def parts_dir(out: Path):
    """A private folder beside ``out`` for parts in transit (same file system: adopting is a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.parts-r{rank()}-") as tmp:
        yield Path(tmp)


def save_part(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, dict]:
    """Write ``tensors`` as one safetensors file; return the manifest entries BundleWriter.adopt takes."""
    from safetensors.torch import save_file

    from ..bundle.store import entry_hashes

    clean = {n: t.detach().contiguous() for n, t in tensors.items()}
    save_file(clean, str(path))
    return {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), **entry_hashes(t)}
            for n, t in clean.items()}  # fmt: skip


def send_parts(tag: str, meta: dict, files: list[Path] = (), dst: int = 0) -> None:  # type: ignore[assignment]
    """From a rank other than ``dst`` (rank 0 unless said): announce its parts ``tag`` are ready, wait until
    ``dst`` asks, send ``meta`` (JSON) and ``files`` (their bytes, in order; their names unique)."""
    store = _STATE["store"]
    me = rank()
    store.set(f"oracle/ready/{tag}/{me}", "1")
    _wait(store, [f"oracle/go/{tag}/{me}"])
    try:
        _send_bytes(json.dumps({**meta, "files": [p.name for p in files]}).encode(), dst)
        for p in files:
            _send_file(p, dst)
    except RuntimeError as e:  # gloo: the peer closed, or the transfer timed out
        raise RankError(
            f"rank {me}: sending {tag} to rank {dst} failed ({str(e).splitlines()[0]}); run the same command again to resume"
        ) from None


def recv_parts(tag: str, src: int, into: Path | None = None, sink: Callable[[dict, str], Any] | None = None) -> dict:
    """On the rank ``src`` sends to (rank 0, or ``send_parts``' ``dst``): wait until ``src`` has its parts
    ``tag`` ready, take its JSON and its files (written under ``into``, by their names; or, with ``sink``, each
    file's bytes handed as they arrive to ``sink(meta, name)``'s ``write`` and then its ``close``)."""
    store = _STATE["store"]
    _wait(store, [f"oracle/ready/{tag}/{src}"])
    store.set(f"oracle/go/{tag}/{src}", "1")
    try:
        meta = json.loads(_recv_bytes(src).decode())
        for name in meta["files"]:
            if sink is not None:
                w = sink(meta, name)
                _recv_pieces(src, w.write)
                w.close()
                continue
            assert into is not None and "/" not in name and name not in (".", ".."), name
            _recv_file(into / name, src)
    except RuntimeError as e:  # gloo: the peer closed, or the transfer timed out
        raise RankError(
            f"rank {src} died while sending {tag} ({str(e).splitlines()[0]}); run the same command again to resume"
        ) from None
    return meta


def spread(tag: str, items: list, compute) -> list | None:
    """Independent JSON-able results over the ranks: ``compute(own_items) -> own results`` on every
    rank for items k with k % ranks == rank; rank 0 returns all results in item order, the other
    ranks send theirs to it and return None. One rank: ``compute(items)``."""
    if world() <= 1:
        return compute(items)
    own = [x for k, x in enumerate(items) if mine(k)]
    rows = compute(own) if own else []
    if not is_main():
        send_parts(tag, {"rows": rows})
        return None
    by_k = dict(zip([k for k in range(len(items)) if mine(k)], rows))
    for r in range(1, world()):
        theirs = [k for k in range(len(items)) if owner(k) == r]
        by_k.update(zip(theirs, recv_parts(tag, r)["rows"]))
    return [by_k[k] for k in range(len(items))]
