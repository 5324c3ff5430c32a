"""A band member's rounding by the C kernel (oracle/precision/rounding.py): torch's bfloat16 bits, one pass.

The tests need a C compiler (skipped without one, where the replay keeps the eager path: the fallback test checks
that with a compiler that fails). With one, a kernel that does not build or disagrees with torch fails them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from oracle.precision import rounding
from oracle.precision.mode import PrecisionMode

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the kernel cannot be built here (the eager path runs)")  # fmt: skip


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _values(n: int, seed: int) -> torch.Tensor:
    """n float32 values over many binades, with the probe's ties, subnormals, Inf and NaNs spread among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-130, 120, (n,), generator=g).float())
    p = rounding.probe_values()
    at = torch.randperm(n, generator=g)[: p.numel()]
    x[at] = p
    return x


@pytest.mark.parametrize("n", [rounding.MIN_ELEMENTS + 3, 5 * rounding._PER_THREAD + 7])  # one thread; several, odd split
def test_the_kernel_rounds_as_torch_converts_nearest_and_jittered_in_place_and_not(n):
    assert rounding.usable(torch.zeros(n), torch.bfloat16), rounding.state()["why"]
    x = _values(n, seed=n)
    f = 1 + (torch.rand(n, generator=torch.Generator().manual_seed(1)) - 0.5) * 2**-9
    want_n = x.to(torch.bfloat16).float()
    want_j = (x * f).to(torch.bfloat16).float()
    out = torch.empty_like(x)
    assert torch.equal(_bits(rounding.nearest(x, out)), _bits(want_n))
    assert torch.equal(_bits(rounding.jittered(x, f, out)), _bits(want_j))
    inplace = x.clone()
    assert rounding.nearest(inplace, inplace) is inplace and torch.equal(_bits(inplace), _bits(want_n))
    inplace = x.clone()
    assert torch.equal(_bits(rounding.jittered(inplace, f, inplace)), _bits(want_j))
    assert not torch.equal(_bits(want_n), _bits(x))  # the inputs were not already bfloat16 values


def test_the_probe_values_tell_a_wrong_rounding_from_torchs():
    """The values the kernel is checked on before first use discriminate: truncation, ties away from zero, ties
    to odd, and a NaN left as it came each differ from torch's conversion on them."""
    v = rounding.probe_values()
    u = v.view(torch.int32).long() & 0xFFFFFFFF
    want = _bits(v.to(torch.bfloat16).float()).long() & 0xFFFFFFFF
    low = u & 0xFFFF
    keep = u & 0xFFFF0000
    finite = (u & 0x7FFFFFFF) <= 0x7F800000
    nan = torch.full_like(u, 0xFFFF0000)
    nearest = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # the rule rounding.py states
    odd = torch.where(low == 0x8000, torch.where((u >> 16) & 1 == 1, keep, keep + 0x10000), (u + 0x8000) & 0xFFFF0000)
    wrong = {
        "truncate": torch.where(finite, keep, nan),
        "ties away": torch.where(finite, (u + 0x8000) & 0xFFFF0000, nan),
        "ties to odd": torch.where(finite, odd, nan),
        "NaN kept": torch.where(finite, nearest, u),
    }
    assert torch.equal(torch.where(finite, nearest, nan), want)  # the rule the kernel states is torch's on these values
    for name, w in wrong.items():
        assert not torch.equal(w, want), name


def test_in_format_reads_to_the_last_element():
    x = torch.randn(3 * rounding._PER_THREAD + 5).to(torch.bfloat16).float()
    assert rounding.in_format(x)
    x[-1] = 1.0 + 2**-10  # not a bfloat16 value, in the last (partial) block
    assert not rounding.in_format(x)
    x[-1] = 1.0
    x[0] = 1.0 + 2**-10
    assert not rounding.in_format(x)


@pytest.mark.parametrize("seed", [None, 5])
def test_the_mode_rounds_the_same_bits_with_the_kernel_as_eagerly(monkeypatch, seed):
    """A chain of ops under a member's PrecisionMode (GEMM results, elementwise, a reduction; tensors above and
    below MIN_ELEMENTS, a transposed operand): bitwise the same results with the kernel as without it."""

    def run() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        a, w = torch.randn(384, 256, generator=g), torch.randn(512, 256, generator=g)
        with PrecisionMode(torch.float32, torch.bfloat16, "all", jitter_seed=seed):
            h = a @ w.t()  # 196608 elements: the kernel
            s = torch.nn.functional.silu(h) * h
            r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)  # small: eager either way
            y = (s * r).t().contiguous() @ a[:, :64]
        return [h, s, r, y]

    calls = []
    for name in ("nearest", "jittered"):
        fn = getattr(rounding, name)
        monkeypatch.setattr(rounding, name, lambda *a, fn=fn: calls.append(a[0].numel()) or fn(*a))
    with_kernel = run()
    assert calls and min(calls) >= rounding.MIN_ELEMENTS  # the kernel rounded the large results
    monkeypatch.setattr(rounding, "_lib", [None])  # as without a compiler
    eager = run()
    for k, e in zip(with_kernel, eager):
        assert torch.equal(_bits(k), _bits(e))


def test_a_replay_of_another_format_does_not_claim_the_kernel():
    """The manifest's rounding line of an fp32 or fp16 member says eager, whatever a bf16 band of the same process
    ran (the kernel rounds to bfloat16 only)."""
    rounding.usable(torch.zeros(rounding.MIN_ELEMENTS), torch.bfloat16)  # the kernel loaded in this process
    assert rounding.describe(torch.bfloat16).startswith("c-kernel: ")
    for fmt in (torch.float32, torch.float16):
        assert rounding.describe(fmt).startswith("eager: the kernel rounds to bfloat16 only")
        assert not rounding.usable(torch.zeros(rounding.MIN_ELEMENTS), fmt)


def test_a_failed_build_keeps_the_eager_path_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no library built yet
    monkeypatch.setenv("CC", "false")
    lib, why = rounding._load()
    assert lib is None and why.startswith("building the kernel failed") and "failed" in why
    monkeypatch.setenv(rounding.ENV, "eager")
    assert rounding._load() == (None, f"{rounding.ENV}=eager")


def test_a_build_removes_only_the_libraries_unused_for_a_month(monkeypatch, tmp_path):
    """Each oracle version (its source), compiler or CPU builds its own library into the cache; before a build the
    ones not used for KEEP_DAYS go (their mtime, touched at each use), the others stay."""
    import os
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = tmp_path / "oracle" / "rounding"
    base.mkdir(parents=True)
    old, recent, other = base / "round-0000000000000000.so", base / "round-1111111111111111.so", base / "notes.txt"
    for f in (old, recent, other):
        f.write_bytes(b"x")
    month = time.time() - (rounding.KEEP_DAYS + 1) * 86400
    os.utime(old, (month, month))
    os.utime(other, (month, month))
    lib = rounding._build()  # this source's library: built now
    assert lib.exists() and lib.parent == base
    assert not old.exists() and recent.exists() and other.exists()  # only an old library of ours
    os.utime(lib, (month, month))
    assert rounding._build() == lib and lib.stat().st_mtime > time.time() - 60  # a use touches it: kept
    assert rounding.prune(base) == [] and lib.exists()


def _wide_qwen3_capture(root) -> str:
    """The tiny Qwen3 recipe widened to hidden 256 (seeded weights), one sample of ~500 byte tokens, captured in
    bf16: its activations (500 x 256 and wider) are above MIN_ELEMENTS, the kernel's path."""
    from oracle import recipe as recipes
    from oracle.capture.steps import capture_recipe_step
    from oracle.recipe import ModelSource
    from oracle_replays.tiny import tiny_weights

    r = recipes.get("qwen3")
    src = r.load("tiny-qwen3")
    cfg = {**src.config, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 768,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
    text = "the gradient of a layer is the product of what came in and what goes back out. " * 6
    sample = {"messages": [{"role": "user", "content": text[:240]}, {"role": "assistant", "content": text[240:]}]}
    source = ModelSource(r, cfg, tiny_weights(r.build, cfg), "qwen3 2 x 256", src.extra)
    return capture_recipe_step(source, sample, str(root / "cap"), precision="bf16")


def test_a_band_replayed_with_the_kernel_has_the_eager_bits_in_memory_and_streamed(tmp_path, monkeypatch):
    """A band of 2 (round to nearest, jittered) replayed in memory and streamed: with the kernel and without it,
    every member's every gradient and loss bitwise the same; the manifest says which rounding ran."""
    from oracle.bundle.store import Bundle
    from oracle.replay.run import replay

    cap = _wide_qwen3_capture(tmp_path)
    calls = []
    fn = rounding.nearest
    monkeypatch.setattr(rounding, "nearest", lambda *a: calls.append(a[0].numel()) or fn(*a))

    def band(name: str) -> Bundle:
        for how, budget in (("mem", None), ("stream", 6 << 30)):
            replay(cap, tmp_path / f"{name}-{how}", dtype="bf16", ensemble=2, verify="off", max_memory=budget)
        return Bundle(tmp_path / f"{name}-mem"), Bundle(tmp_path / f"{name}-stream")

    kernel = band("kernel")
    assert calls  # the kernel rounded
    monkeypatch.setattr(rounding, "_lib", [None])  # as without a compiler
    monkeypatch.setattr(rounding, "_state", {"path": "eager", "why": "test: no kernel"})
    eager = band("eager")
    for k, e in zip(kernel, eager):
        assert k.get("emulation")["rounding"].startswith("c-kernel: ")
        assert e.get("emulation")["rounding"] == "eager: test: no kernel"
        assert k.get("loss")["members"] == e.get("loss")["members"]
        for group in ("grads", "grads.1"):
            gk, ge = k.load_group(group), e.load_group(group)
            assert set(gk) == set(ge) and [n for n in gk if not torch.equal(_bits(gk[n]), _bits(ge[n]))] == []
