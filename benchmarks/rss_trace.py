"""Where a streamed replay's peak resident set is reached: RSS sampled every 5 ms, by phase.

    python benchmarks/rss_trace.py CAPTURE OUT [--max-memory 16G] [--pages 4k|huge] [--dtype fp64|bf16|amp-bf16|fp32]

Runs ``oracle replay CAPTURE --out OUT --max-memory SIZE --dtype D`` (the float64 truth by default; a
band member's precision to trace a member) in this process (with huge pages, as the
command line does, unless ``--pages 4k``) while a thread samples /proc/self/statm every 5 ms and
notes the phase (and the file-backed part of the resident set): each unit's forward and backward,
the head's vocabulary chunks, the final write. Prints the peak RSS of each phase (the top 8), the
overall sampled peak, ru_maxrss and VmHWM (the
kernel's high-water marks; ru_maxrss also carries the RSS of the process that started this one, so
run this from a shell, not from a process holding memory). A gap between the sampled peak and VmHWM
is a spike shorter than the sampling period.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    args = sys.argv[1:]
    pages = "huge"
    if "--pages" in args:
        i = args.index("--pages")
        pages = args[i + 1]
        del args[i : i + 2]
    dtype = "fp64"
    if "--dtype" in args:
        i = args.index("--dtype")
        dtype = args[i + 1]
        del args[i : i + 2]
    budget = "16G"
    if "--max-memory" in args:
        i = args.index("--max-memory")
        budget = args[i + 1]
        del args[i : i + 2]
    cap, out = args
    if pages == "huge":
        from oracle.replay.streaming.pages import restart

        restart(sys.orig_argv)  # restarts this process once with the tunable set
    import resource

    import cli
    from oracle.replay.streaming import driver, engine, head

    phase = ["start"]
    peaks: dict[str, int] = {}
    files: dict[str, int] = {}  # the file-backed part (statm "shared": mapped capture pages) at each phase's peak
    page = os.sysconf("SC_PAGE_SIZE")
    stop = threading.Event()

    def sample():
        with open("/proc/self/statm") as f:
            while not stop.is_set():
                f.seek(0)
                fields = f.read().split()
                rss, shared = int(fields[1]) * page, int(fields[2]) * page
                p = phase[0]
                if rss > peaks.get(p, 0):
                    peaks[p], files[p] = rss, shared
                time.sleep(0.005)

    def label(name, fn):
        def wrapped(self, call, *a, **k):
            phase[0] = f"{name} {call.unit}"
            return fn(self, call, *a, **k)

        return wrapped

    engine.StreamEngine._forward_unit = label("forward", engine.StreamEngine._forward_unit)
    engine.StreamEngine._backward_unit = label("backward", engine.StreamEngine._backward_unit)
    for m in ("rows", "grad"):
        orig = getattr(head.CaptureHead, m)

        def w(self, *a, _o=orig, _m=m, **k):
            phase[0] = f"head {_m}"
            return _o(self, *a, **k)

        setattr(head.CaptureHead, m, w)
    orig_enter = driver.BundleWriter.__enter__

    def enter(self):
        phase[0] = "publish"
        return orig_enter(self)

    driver.BundleWriter.__enter__ = enter
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    cli.app(["replay", cap, "--out", out, "--max-memory", budget, "--dtype", dtype, "--overwrite"], standalone_mode=False)
    stop.set()
    t.join()
    G = 2**30
    top = sorted(peaks.items(), key=lambda kv: -kv[1])[:8]
    print(f"pages {pages}, --dtype {dtype}: {time.perf_counter() - t0:.0f} s; sampled peak {max(peaks.values()) / G:.2f} GiB, "
          f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / G:.2f} GiB, "
          f"VmHWM {engine.max_rss_bytes() / G:.2f} GiB")  # fmt: skip
    for p, v in top:
        print(f"  {v / G:6.2f} GiB (file-backed {files[p] / G:.2f})  {p}")


if __name__ == "__main__":
    main()
