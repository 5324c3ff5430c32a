"""An emulated member's rounding as one pass over memory: a small C kernel.

Why. A band member rounds every op's result to its format (precision/mode.py): eagerly that is two
conversions, ``x`` (float32) into a bfloat16 buffer and back, and for a jittered member a third pass
that first multiplies by the factors ``1 + u``. Each is a pass over memory; on Qwen3-VL-8B's 2-layer
cut at 4096 tokens a bf16 member spent 35 of its 183 s in ``_round_values`` (28.5 G elements). Here
the round trip is one loop that reads ``x`` (and the factors) once and writes the result once, on
torch's thread count; a jittered member's test "is every value already a bfloat16 one?" (``_in_format``)
stops at the first block of 1024 that is not. ``python benchmarks/rounding.py``: a fresh 4096 x 12288
result rounded in 0.45x the eager time (round to nearest), 0.35x (jittered). In a whole replay the
member's CPU time fell less (0.92x on that cut, its wall time the same: benchmarks/RESULTS.md): what
is left of a member's time is mostly not its rounding. torch.compile (inductor) made the same one-pass
loop, but each call went through dynamo's guards, and a replay's tensors (made inside the dispatch mode
or outside it, of many sizes) recompiled it several times a process at a second or more each: a band
of 2 on a 4-layer model took 1.2x its eager time.

Numerics (bitwise torch's bfloat16 conversion; the eager path stays for everything else). Per float32 element:
  nearest    y = float32(bfloat16(x))                 round to nearest, ties to even
  jittered   y = float32(bfloat16(float32(x * f)))    f = 1 + u read from the member's pool
  with the float32's bits u: u + 0x7FFF + (bit 16 of u), low 16 bits cleared (ties to even; an overflow
  carries into the exponent and gives Inf, as torch's); a NaN becomes 0xFFFF0000, as torch's vectorised
  CPU conversion writes it. Only bfloat16 (the format of the user's devices): a float16 member keeps the
  eager conversions (C's ``_Float16`` conversion ran at 3x torch's time here, not vectorised).
The product ``x * f`` is one float32 multiplication (compiled without -ffast-math: nothing contracted
or reassociated), the same as ``torch.mul``. Whether the kernel gives torch's bits on this machine is
not assumed: before first use it is checked bit for bit against torch's own conversion on values that
discriminate (ties odd and even, one float32 ulp either side, subnormals, the largest finite values,
Inf, NaNs of either sign and payload, zeros); tests/unit/test_rounding.py checks it on random tensors,
in place and into another tensor, nearest and jittered, and a replay's gradients either way.

Switch and fallback. ``ORACLE_ROUNDING=eager`` keeps the eager conversions. Otherwise the first
rounding of ``MIN_ELEMENTS`` or more builds the kernel with the system's C compiler (``cc``; ``CC``
where set) into oracle's cache (``$XDG_CACHE_HOME`` or ``~/.cache``, ``oracle/rounding/``, named by
a hash of the source, the compiler's version and this CPU's flags: ``-march=native`` code is never
loaded on another CPU), about a second once per machine, then loaded in each process (a library of
another source, compiler or CPU unused for ``KEEP_DAYS`` is removed at the next build: ``prune``). No compiler,
a failed build or a probe that disagrees: the process keeps the eager path, and ``state()`` says
why; an emulated replay writes it into its manifest (``emulation.rounding``). Nothing here runs in a
training process: only an emulated replay rounds.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

ENV = "ORACLE_ROUNDING"  #: "eager": torch's conversions; unset or "kernel": the C kernel where it builds
# Below this the eager rounding (its tensors in cache) is as fast: python benchmarks/rounding.py
MIN_ELEMENTS = 1 << 15
KEEP_DAYS = 30  # a cached library unused this long is removed before the next build (prune)
_PER_THREAD = 1 << 21  # elements a thread takes at least (starting one costs 30-70 us here)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <pthread.h>

typedef struct { const float *x, *f; float *out; int64_t a, b; } job_t;

static inline float bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = ((u & 0x7fffffffu) > 0x7f800000u) ? 0xffff0000u : ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
    memcpy(&v, &u, 4);
    return v;
}

static void run(const job_t *j) {
    const float *x = j->x, *f = j->f;
    float *o = j->out;
    int64_t i;
    if (f) for (i = j->a; i < j->b; i++) o[i] = bf16(x[i] * f[i]);
    else for (i = j->a; i < j->b; i++) o[i] = bf16(x[i]);
}

static void *work(void *p) { run((const job_t *)p); return 0; }

/* 1 when every x[i] (i < n) is a bfloat16 value (its low 16 bits zero); stops at the first block that is not */
int oracle_in_bf16(const uint32_t *x, int64_t n) {
    int64_t a, i;
    for (a = 0; a < n; a += 1024) {
        uint32_t any = 0;
        int64_t b = a + 1024 < n ? a + 1024 : n;
        for (i = a; i < b; i++) any |= x[i] & 0xffffu;
        if (any) return 0;
    }
    return 1;
}

/* out[i] = bfloat16(x[i] (* f[i])) as float32, i < n, on ``threads`` threads; x and out may be the same memory */
int oracle_round(const float *x, const float *f, float *out, int64_t n, int threads) {
    job_t jobs[64];
    pthread_t tid[64];
    int started[64];
    int t;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    int64_t step = ((n + threads - 1) / threads + 15) & ~(int64_t)15;
    for (t = 0; t < threads; t++) {
        int64_t a = t * step < n ? t * step : n, b = (t + 1) * step < n ? (t + 1) * step : n;
        job_t j = {x, f, out, a, b};
        jobs[t] = j;
    }
    for (t = 1; t < threads; t++) {
        started[t] = pthread_create(&tid[t], 0, work, &jobs[t]) == 0;
        if (!started[t]) run(&jobs[t]);
    }
    run(&jobs[0]);
    for (t = 1; t < threads; t++)
        if (started[t]) pthread_join(tid[t], 0);
    return 0;
}
"""

_lock = threading.Lock()
_lib: list = []  # [the loaded library] or [None]: the eager path
_state: dict = {"path": "eager", "why": f"nothing rounded yet at or above {MIN_ELEMENTS} elements"}


def state() -> dict:
    """What the rounding ran as in this process: ``{"path": "c-kernel" | "eager", "why": ...}``."""
    return dict(_state)


def describe(fmt: torch.dtype | None) -> str:
    """How a replay rounding to ``fmt`` rounded, for its manifest: the kernel's state for bfloat16, else eager."""
    if fmt != torch.bfloat16:
        return f"eager: the kernel rounds to bfloat16 only, not {str(fmt).removeprefix('torch.')}"
    return "{path}: {why}".format(**_state)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build() -> Path:
    """The kernel's shared library, built once per source, compiler and CPU into oracle's cache."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join((_SOURCE, version, _cpu_flags())).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oracle" / "rounding"
    lib = base / f"round-{key}.so"
    if lib.exists():
        with contextlib.suppress(OSError):
            os.utime(lib)  # its mtime says when it was last used (a read-only cache keeps the build's)
        return lib
    base.mkdir(parents=True, exist_ok=True)
    prune(base)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        src, out = Path(tmp) / "round.c", Path(tmp) / "round.so"
        src.write_text(_SOURCE)
        r = subprocess.run([cc, "-O3", "-march=native", "-fPIC", "-shared", "-pthread", str(src), "-o", str(out)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(out, lib)  # atomic: a concurrent process sees the whole library or none
    return lib


def prune(base: Path, keep_days: float = KEEP_DAYS) -> list[str]:
    """Remove the libraries in ``base`` not used for ``keep_days`` (their mtime, touched at each use): those of
    an earlier source, compiler or CPU pile up otherwise, one per oracle version. Run before a build, so a
    cache in use by another process or machine (a shared home: other CPUs, other keys) loses only what none
    of them used for that long; one removed while loaded stays mapped, and a process that finds it gone
    builds it again (a second). Returns the names removed."""
    cutoff = time.time() - keep_days * 86400
    gone = []
    for old in base.glob("round-*.so"):
        with contextlib.suppress(OSError):
            if old.stat().st_mtime < cutoff:
                old.unlink()
                gone.append(old.name)
    return gone


def probe_values() -> torch.Tensor:
    """float32 values that tell a faithful bfloat16 rounding from a wrong one: for each base value its bits
    plus offsets around the ties (half a bfloat16 ulp, one float32 ulp either side, odd and even), subnormals,
    the largest finite values (rounding up to Inf), Inf, NaNs of either sign and payload, zeros."""
    base = torch.tensor([1.0, 1.5, -3.25, 7.0, 1e-3, 6e4, 3.3e38, 1e-40, 6e-8, -(2.0**-14)], dtype=torch.float32)
    offs = [0, 1, -1, (1 << 15) + 1, (1 << 15) - 1, (1 << 16) - 1] + [s * k for k in (1 << 15, 3 << 15) for s in (1, -1)]
    ints = (base.view(torch.int32).view(-1, 1).long() + torch.tensor(offs).view(1, -1)).view(-1)
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, -0x00400000, -0x007FFFFF], dtype=torch.int64)
    special = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1e-45, -1e-45, 3.4028235e38], dtype=torch.float32)
    return torch.cat([ints.to(torch.int32).view(torch.float32), nans.to(torch.int32).view(torch.float32), special])


def _torch_round(x: torch.Tensor, f: torch.Tensor | None) -> torch.Tensor:
    return (x if f is None else x * f).to(torch.bfloat16).to(torch.float32)


def _load():
    if os.environ.get(ENV, "kernel") == "eager":
        return None, f"{ENV}=eager"
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as e:  # no compiler, a failed build, a library that does not load: the eager path
        return None, f"building the kernel failed: {type(e).__name__}: {str(e)[:200]}"
    lib.oracle_round.restype, lib.oracle_in_bf16.restype = ctypes.c_int, ctypes.c_int
    lib.oracle_round.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    lib.oracle_in_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    v = probe_values()
    vals = v.repeat(-(-(3 * _PER_THREAD) // v.numel()))  # several threads' worth: the split checked too
    f = torch.linspace(1 - 2**-9, 1 + 2**-9, vals.numel(), dtype=torch.float32)
    for factors in (None, f):
        got = torch.empty_like(vals)
        lib.oracle_round(vals.data_ptr(), None if factors is None else factors.data_ptr(), got.data_ptr(), vals.numel(), 3)
        if not torch.equal(got.view(torch.int32), _torch_round(vals, factors).view(torch.int32)):
            return None, "the kernel's rounding differs from torch's bfloat16 conversion on the probe values"
    if lib.oracle_in_bf16(vals.data_ptr(), vals.numel()) or not lib.oracle_in_bf16(got.data_ptr(), got.numel()):
        return None, "the kernel's test for bfloat16 values is wrong on the probe values"
    return lib, f"one pass per rounding from {MIN_ELEMENTS} elements"


def _kernel():
    if not _lib:
        with _lock:
            if not _lib:
                lib, why = _load()
                _state.update(path="eager" if lib is None else "c-kernel", why=why)
                _lib.append(lib)
    return _lib[0]


def usable(x: torch.Tensor, fmt: torch.dtype) -> bool:
    """Whether ``x`` is rounded by the kernel: float32, contiguous, on CPU, of ``MIN_ELEMENTS`` or more,
    to bfloat16, and the kernel built and checked."""
    return (fmt == torch.bfloat16 and x.dtype == torch.float32 and x.numel() >= MIN_ELEMENTS and x.is_contiguous()
            and x.device.type == "cpu" and _kernel() is not None)  # fmt: skip


def _call(x: torch.Tensor, f: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    assert out.is_contiguous() and out.numel() == n and out.dtype == torch.float32, "round into a contiguous float32 tensor"
    if f is not None:
        f = f.contiguous()
        assert f.numel() == n and f.dtype == torch.float32, "one float32 factor per element"
    threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
    _kernel().oracle_round(x.data_ptr(), None if f is None else f.data_ptr(), out.data_ptr(), n, threads)
    return out


def nearest(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous, ``x``'s size; ``x`` itself allowed) = ``x`` rounded to nearest bfloat16.
    Only where ``usable``."""
    return _call(x, None, out)


def jittered(x: torch.Tensor, factors: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = ``x * factors`` (one float32 product) rounded to nearest bfloat16; as ``nearest``."""
    return _call(x, factors, out)


def in_format(x: torch.Tensor) -> bool:
    """Every value of ``x`` a bfloat16 one (its low 16 bits zero), stopping at the first 1024 that are not.
    Only where ``usable``."""
    return bool(_kernel().oracle_in_bf16(x.data_ptr(), x.numel()))
