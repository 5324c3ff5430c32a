import math

import pytest
import torch

from oracle.bundle.store import Bundle
from oracle.metrics import tensor_metrics
from oracle.replay.run import replay, run_step


def _errors(capture, oracle):
    c, o = Bundle(capture), Bundle(oracle)
    return {n: tensor_metrics(c.load("grads", n), o.load("grads", n))["rel_l2"] for n in o.names("grads")}


def test_oracle_is_float64_certified_and_covers_every_parameter(oracle_bundle, fp32_capture):
    o = Bundle(oracle_bundle)
    assert o.kind == "oracle" and o.get("precision") == "fp64"
    assert {o.entry("grads", n)["dtype"] for n in o.names("grads")} == {"float64"}
    assert sorted(o.names("grads")) == sorted(Bundle(fp32_capture).names("grads"))
    assert o.get("certificate")["fd_rel_residual"] < 1e-6
    assert o.get("numerics")["promotions"] > 0  # transformers' own float32 casts were promoted


def test_fp32_capture_is_within_1e_4_everywhere(fp32_capture, oracle_bundle):
    errs = _errors(fp32_capture, oracle_bundle)
    assert max(errs.values()) <= 1e-4, max(errs.items(), key=lambda kv: kv[1])


def test_amp_bf16_is_clearly_worse_than_fp32_but_below_10_percent(amp_capture, fp32_capture, oracle_bundle):
    amp, fp32 = _errors(amp_capture, oracle_bundle), _errors(fp32_capture, oracle_bundle)
    assert max(amp.values()) < 0.10
    assert min(amp[n] / max(fp32[n], 1e-300) for n in amp) > 100  # every parameter, by orders of magnitude


def test_two_replays_are_bitwise_identical(fp32_capture, oracle_bundle, tmp_path):
    again = replay(fp32_capture, tmp_path / "again", dtype="fp64", verify="off")
    a, b = Bundle(oracle_bundle), Bundle(again)
    assert all(a.entry("grads", n)["sha256"] == b.entry("grads", n)["sha256"] for n in a.names("grads"))


def test_oracle_matches_independent_central_differences(fp32_capture):
    """Independent of the built-in certificate: perturb two single parameters in the test."""
    cap = Bundle(fp32_capture)
    model, inputs, _, _ = run_step(cap, "fp64")
    recipe_forward = __import__("oracle.replay.setup", fromlist=["recipe_of"]).recipe_of(cap).forward_loss
    from oracle.precision.mode import PrecisionMode

    gen = torch.Generator().manual_seed(7)
    params = dict(model.named_parameters())
    for name in ("model.language_model.layers.1.self_attn.q_norm.weight", "model.visual.blocks.0.attn.qkv.weight"):
        p = params[name]
        v = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        v /= v.norm()
        ad = float((p.grad * v).sum())
        h = 1e-3  # rounding noise eps*L/h ~ 5e-13; truncation h^2 * L''' well below the tolerance
        base = p.detach().clone()
        vals = []
        with torch.no_grad():
            for s in (1, -1):
                p.copy_(base + s * h * v)
                with PrecisionMode(torch.float64):
                    vals.append(float(recipe_forward(model, inputs, "mean")[0]))
            p.copy_(base)
        fd = (vals[0] - vals[1]) / (2 * h)
        assert math.isclose(fd, ad, rel_tol=1e-6, abs_tol=1e-11), (name, fd, ad)


def test_emulated_ensemble_members_spread_like_independent_honest_runs(band, oracle_bundle):
    """Members differ from each other by about as much as each differs from the truth (independent
    rounding errors: ||g_i - g_j|| ~ sqrt(2) ||g_i - t||), and each is at amp-bf16's error level."""
    from oracle.metrics import rel_l2

    b, o = Bundle(band("amp-bf16")), Bundle(oracle_bundle)
    assert b.kind == "emulation" and b.get("members") == 3
    assert {"grads", "grads.1", "grads.2"} <= set(b.groups())
    names = o.names("grads")
    truth = [o.load("grads", n) for n in names]
    members = [[b.load(g, n) for n in names] for g in ("grads", "grads.1", "grads.2")]
    errs = [rel_l2(m, truth) for m in members]
    assert all(1e-3 < e < 5e-2 for e in errs), errs
    assert max(errs) / min(errs) < 1.5, errs  # equally legitimate runs
    for i in range(3):
        for j in range(i + 1, 3):
            spread = rel_l2(members[i], members[j]) / errs[i]
            assert 0.7 < spread < 2.2, (i, j, spread)


def test_replay_refuses_unknown_dtype(fp32_capture, tmp_path):
    from oracle.errors import UsageError

    with pytest.raises(UsageError, match="unknown precision 'fp8'"):
        replay(fp32_capture, tmp_path / "x", dtype="fp8")
