"""The score's parameters and chunks on several threads (oracle/score/pool.py): the same report at any count,
within the memory one parameter at a time held, failures raised in order."""

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import rewrite_grads

from oracle import metrics
from oracle.bundle.store import Bundle
from oracle.score import pool
from oracle.score.scorer import memory_need, score


def test_the_report_is_the_same_at_any_worker_count(amp_capture, fp32_capture, oracle_bundle, band, tmp_path, monkeypatch):
    """Chunks of 512 elements so that every matrix is many chunks on the pool; a planted 5 % error in one
    parameter found at every count; torch's own thread count restored after."""
    monkeypatch.setattr(metrics, "CHUNK", 512)
    target = "model.language_model.layers.2.mlp.up_proj.weight"
    bad = rewrite_grads(fp32_capture, str(tmp_path / "bad"), lambda n, g: g * 1.05 if n == target else g)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = {w: score(oracle_bundle, [amp_capture, bad], band_paths=[band("amp-bf16"), band("fp32")], workers=w)
                for w in (1, 2, 3)}  # fmt: skip
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    text = {w: json.dumps(r, sort_keys=True, default=str) for w, r in runs.items()}
    assert text[1] == text[2] == text[3]
    worst = max(runs[3]["captures"][1]["params"], key=lambda p: p["excess"])
    assert worst["name"] == target and worst["rel_l2"] == pytest.approx(0.05, rel=1e-3)
    assert len(runs[3]["captures"][0]["params"]) == len(Bundle(oracle_bundle).names("grads"))


def test_the_report_is_the_same_whatever_torchs_thread_count(amp_capture, oracle_bundle, band):
    """torch's float64 sum of a 2^20-element chunk is grouped by its intra-op threads; the score runs its
    chunks on one thread each (pool.one_thread), so the caller's thread count does not reach the report."""
    before = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            r = score(oracle_bundle, [amp_capture], band_paths=[band("amp-bf16")], workers=1)
            runs.append(json.dumps(r, sort_keys=True, default=str))
    finally:
        torch.set_num_threads(before)
    assert runs[0] == runs[1]


def test_metrics_on_a_pool_are_the_serial_ones_bit_for_bit_and_the_formulas(monkeypatch):
    """Chunks of 1000 over 10^5 elements with NaN and Inf: on 3 threads the same floats as in one thread,
    and the formulas of metrics.py computed whole in float64 (an independent reference) within 1e-12."""
    monkeypatch.setattr(metrics, "CHUNK", 1000)
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(100_000, generator=gen, dtype=torch.float64)
    g = (t * (1 + 1e-2 * torch.randn(100_000, generator=gen, dtype=torch.float64))).float()
    g[17], g[50_001] = float("nan"), float("inf")
    serial = metrics.tensor_metrics(g, t)
    with ThreadPoolExecutor(3) as ex:
        pooled = metrics.tensor_metrics(g, t, ex)
    assert serial == {k: v for k, v in pooled.items()}  # every float bit for bit (no NaN among them)
    ok = torch.isfinite(g)
    gd, td = g.double()[ok], t[ok]
    d = gd - td
    assert serial["nonfinite"] == 2
    assert math.isclose(serial["rel_l2"], float(d.norm() / td.norm()), rel_tol=1e-12)
    assert math.isclose(serial["cosine"], float(gd @ td / (gd.norm() * td.norm())), rel_tol=1e-12)
    assert serial["max_abs"] == float(d.abs().max())
    assert serial["frac_rel_gt_1e-3"] == float((d.abs() > 1e-3 * td.abs()).double().mean())


def test_parameters_in_flight_stay_within_the_budget_and_come_back_in_order():
    """Needs 1..4 and one of 10 under a cap of 10 on 4 workers: the sum in flight never passes the cap,
    the large one runs alone, results in the items' order."""
    lock, live, seen = threading.Lock(), {}, []
    needs = {i: (10 if i == 7 else 1 + i % 4) for i in range(20)}

    def fn(i):
        with lock:
            live[i] = needs[i]
            seen.append(dict(live))
        time.sleep(0.002)
        with lock:
            del live[i]
        return i * i

    out = list(pool.ordered(fn, range(20), needs.get, cap=10, workers=4))
    assert out == [i * i for i in range(20)]
    assert max(sum(s.values()) for s in seen) <= 10
    assert all(s == {7: 10} for s in seen if 7 in s)  # the one as large as the cap, alone
    assert any(len(s) > 1 for s in seen)  # and the others together


def test_a_failing_parameter_raises_in_order_and_the_rest_stop():
    """Item 3 fails: the caller gets items 0-2, then item 3's error; the later items waiting for the budget
    give up instead of hanging the pool."""
    ran = []

    def fn(i):
        ran.append(i)
        if i == 3:
            raise ValueError("item 3")
        time.sleep(0.01)
        return i

    got = []
    with pytest.raises(ValueError, match="item 3"):
        for r in pool.ordered(fn, range(50), lambda i: 5, cap=5, workers=3):
            got.append(r)
    assert got == [0, 1, 2]
    assert len(ran) < 50


def test_the_estimate_counts_every_chunk_threads_temporaries(fp32_capture):
    """memory_need: the largest parameter's three tensors plus six float64 chunks per worker."""
    caps = [Bundle(fp32_capture)]
    assert memory_need(caps, workers=4) - memory_need(caps, workers=1) == 3 * 6 * 8 * metrics.CHUNK
