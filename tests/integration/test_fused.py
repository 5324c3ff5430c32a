"""The float64 oracle's fused kernels (oracle/replay/fused.py): same numbers as today's path, an off
switch, and a silent fallback that the manifest records."""

from __future__ import annotations

import pytest
import torch

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.replay import fused
from oracle.replay.run import replay

BOUND = 1e-13  # fused vs unfused, relative: the kernels add row sums in another order (a few ulps)


def _rel(a, b) -> float:
    """The worst over parameters of max |a - b| / max |b|, and the loss's relative difference."""
    A, B = Bundle(a), Bundle(b)
    ga, gb = dict(A.iter_group("grads")), dict(B.iter_group("grads"))
    assert set(ga) == set(gb)
    worst = max(float((ga[n] - gb[n]).abs().max() / gb[n].abs().max().clamp_min(1e-300)) for n in gb)
    la, lb = A.get("loss")["value"], B.get("loss")["value"]
    return max(worst, abs(la - lb) / abs(lb))


def _bitwise(a, b) -> bool:
    ga, gb = dict(Bundle(a).iter_group("grads")), dict(Bundle(b).iter_group("grads"))
    return all(torch.equal(ga[n], gb[n]) for n in gb) and Bundle(a).get("loss")["value"] == Bundle(b).get("loss")["value"]


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """Fusion is opt-in (ORACLE_FUSED=1); the tests here turn it on unless they say otherwise."""
    monkeypatch.setenv(fused.ENV, "1")


@pytest.fixture(scope="module")
def qwen3_capture(tmp_path_factory):
    src = recipes.get("qwen3").load("tiny-qwen3")
    return capture_recipe_step(src, src.recipe.default_sample(), str(tmp_path_factory.mktemp("q3") / "cap"), precision="fp32")


@pytest.fixture(scope="module")
def unfused(fp32_capture, qwen3_capture, tmp_path_factory):
    """Today's path (ORACLE_FUSED=0) of a tiny capture ("vl" or "q3"), in memory, made when first asked."""
    root, caps = tmp_path_factory.mktemp("unfused"), {"vl": fp32_capture, "q3": qwen3_capture}

    class Lazy(dict):
        def __missing__(self, which):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(fused.ENV, "0")
                self[which] = replay(caps[which], root / which, dtype="fp64")
            return self[which]

    return Lazy()


# Fusion is opt-in, off by default: the Qwen3-VL cases (mRoPE, the ViT; a compile of their own) run with the rare tests
@pytest.mark.parametrize("which", [pytest.param("vl", marks=pytest.mark.rare), "q3"])
def test_fused_oracle_matches_the_unfused_one_within_1e_13(which, fp32_capture, qwen3_capture, unfused, tmp_path):
    """Fused RMSNorm + SwiGLU: every gradient and the loss within 1e-13 of today's path, in memory; certified."""
    cap = fp32_capture if which == "vl" else qwen3_capture
    out = replay(cap, tmp_path / "f", dtype="fp64")
    m = Bundle(out).manifest
    assert m["numerics"]["fused"]["path"] == "fused-inductor", m["numerics"]["fused"]
    assert _rel(out, unfused[which]) <= BOUND
    assert m["certificate"]["fd_rel_residual"] < 1e-5
    assert Bundle(unfused[which]).manifest["numerics"]["fused"] == {"path": "unfused", "why": "ORACLE_FUSED not 1 (off by default)", "fallbacks": []}


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_fused_streamed_oracle_matches_the_unfused_one(fp32_capture, unfused, tmp_path):
    """Streamed (--max-memory) with fused kernels: within 1e-13 of today's in-memory oracle; the manifest says fused."""
    out = replay(fp32_capture, tmp_path / "s", max_memory=8 << 30)
    assert Bundle(out).manifest["numerics"]["fused"]["path"] == "fused-inductor"
    assert _rel(out, unfused["vl"]) <= BOUND


def test_a_failed_compile_falls_back_to_todays_path_and_says_so(qwen3_capture, unfused, monkeypatch, tmp_path):
    """No compiler / a compile error: the replay runs today's path (bitwise) and records why."""

    def broken(*a, **k):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken)
    out = replay(qwen3_capture, tmp_path / "f", dtype="fp64")
    got = Bundle(out).manifest["numerics"]["fused"]
    assert got["path"] == "unfused" and got["why"] == "compiling failed: RuntimeError: no C++ compiler"
    assert _bitwise(out, unfused["q3"])


def test_a_kernel_failing_at_a_new_shape_runs_its_formula_eagerly(qwen3_capture, unfused, monkeypatch, tmp_path):
    """A compiled kernel that fails later: the same formula eagerly, within 1e-13, named in the fallbacks."""
    fused.use(torch.nn.Module(), {"X": "rms_norm"})  # compiled kernels in place

    def broken(*a):
        raise RuntimeError("compile error at this shape")

    monkeypatch.setitem(fused._compiled, "swiglu_forward", broken)
    out = replay(qwen3_capture, tmp_path / "f", dtype="fp64")
    got = Bundle(out).manifest["numerics"]["fused"]
    assert got["path"] == "fused-inductor"
    assert got["fallbacks"] == ["swiglu_forward: RuntimeError: compile error at this shape"]
    assert _rel(out, unfused["q3"]) <= BOUND


def test_emulated_members_are_never_fused(qwen3_capture, tmp_path):
    """A band member keeps every op (each rounded where its device rounds it): the fused kernels are not used."""
    from oracle.replay.setup import use_fused

    model = torch.nn.Module()
    assert use_fused(model, recipes.get("qwen3"), torch.bfloat16)["path"] == "unfused"
