"""tensor_metrics measures a tensor by chunks (oracle/metrics.py): the same metrics as one pass, and a
temporary memory of a few chunks whatever the tensor's size."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oracle import metrics

ROOT = Path(__file__).resolve().parents[2]


def _pair(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=gen, dtype=torch.float64)
    g = (t + 1e-3 * torch.randn(n, generator=gen, dtype=torch.float64)).float()
    t[5:9] = 0.0  # zero truths: every element of those is "off by more than 0.1 %"
    g[17], g[40], g[41], g[n - 1] = float("nan"), float("inf"), float("-inf"), float("nan")  # across chunks
    return g, t


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_by_chunks_equals_one_pass(monkeypatch, chunk):
    """Chunks of 1, 7 and 64 elements against one pass over 1000 with non-finite values in several chunks:
    counts and max_abs exactly, the sums and ratios within 1e-13 relative."""
    g, t = _pair(1000)
    whole = metrics.tensor_metrics(g, t)
    monkeypatch.setattr(metrics, "CHUNK", chunk)
    parts = metrics.tensor_metrics(g, t)
    assert parts["nonfinite"] == whole["nonfinite"] == 4
    assert parts["max_abs"] == whole["max_abs"] and parts["frac_rel_gt_1e-3"] == whole["frac_rel_gt_1e-3"]
    for k in ("rel_l2", "cosine", "norm_ratio", "err_sq", "ref_sq", "self_sq", "dot"):
        assert math.isclose(parts[k], whole[k], rel_tol=1e-13), (k, parts[k], whole[k])


def test_one_chunk_is_bitwise_the_one_pass_formulas():
    """A tensor within one chunk: the metrics are the formulas of the module docstring over the whole tensor."""
    g, t = _pair(300, seed=1)
    m = metrics.tensor_metrics(g, t)
    keep = torch.isfinite(g)
    gd, td = g.double()[keep], t[keep]
    d = gd - td
    assert m["err_sq"] == float((d * d).sum()) and m["dot"] == float((gd * td).sum())
    assert m["rel_l2"] == math.sqrt(float((d * d).sum())) / math.sqrt(float((td * td).sum()))
    assert m["frac_rel_gt_1e-3"] == float((d.abs() > 1e-3 * td.abs()).sum()) / d.numel()
    empty = metrics.tensor_metrics(torch.empty(0), torch.empty(0))
    assert empty["rel_l2"] == 0.0 and empty["cosine"] == 1.0 and empty["max_abs"] == 0.0


def test_temporaries_stay_a_few_chunks_for_a_large_tensor():
    """2^25 elements (the truth 256 MiB in float64): the peak above the inputs stays under its float64 size
    (one pass needed 5.1x: benchmarks/score_memory.py); the chunks' temporaries are about 0.2 GiB."""
    n = 1 << 25
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import score_memory
    finally:
        sys.path.pop(0)
    p = subprocess.run([sys.executable, "-c", score_memory.CHILD, str(n), "0"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    extra = json.loads(p.stdout)["extra"]
    assert extra < 8 * n, f"{extra / 2**20:.0f} MiB above the inputs for a {8 * n / 2**20:.0f} MiB truth"


def test_sums_are_the_same_at_any_thread_count():
    """tensor_metrics (no pool), rel_l2, sum_sq, dot and norm over 2^20 + 8197 elements (two chunks, a ragged last
    row): bitwise the same at 1, 2, 3 and 4 torch threads, and within 1e-13 of the plain float64 formulas. torch's own
    sum of the same squares is grouped by its threads (the inputs discriminate: it differs between the counts)."""
    n = (1 << 20) + 8197
    g, t = _pair(n, seed=2)
    g[17] = g[40] = g[41] = g[n - 1] = 0.5  # finite: rel_l2 and the plain sums see every element
    before = torch.get_num_threads()
    got, plain = {}, set()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            m = metrics.tensor_metrics(g, t)
            got[threads] = (m["err_sq"], m["ref_sq"], m["self_sq"], m["dot"], metrics.rel_l2([g, g[:100]], [t, t[:100]]),
                            metrics.sum_sq(g, t), metrics.dot(g, t), metrics.norm(t))  # fmt: skip
            plain.add(float(((g.double() - t) ** 2).sum()))
    finally:
        torch.set_num_threads(before)
    assert len(set(got.values())) == 1, got
    assert len(plain) > 1, "torch's whole-tensor sum gave one value at 1-4 threads: this test no longer discriminates"
    d = g.double() - t
    err, dt, ref = float((d * d).sum()), float((g.double() * t).sum()), float((t * t).sum())
    one = got[1]
    assert math.isclose(one[0], err, rel_tol=1e-13) and math.isclose(one[5], err, rel_tol=1e-13)
    assert math.isclose(one[3], dt, rel_tol=1e-13) and math.isclose(one[6], dt, rel_tol=1e-13)
    assert math.isclose(one[7], math.sqrt(ref), rel_tol=1e-13) and math.isclose(one[1], ref, rel_tol=1e-13)
    both = err + float((d[:100] * d[:100]).sum())
    assert math.isclose(one[4], math.sqrt(both / (ref + float((t[:100] ** 2).sum()))), rel_tol=1e-13)


def test_rel_l2_keeps_its_edges():
    """rel_l2: 0 when both are zero, inf when only the truth is, NaN when the device holds a NaN."""
    z = torch.zeros(10)
    assert metrics.rel_l2(z, z) == 0.0 and metrics.rel_l2(torch.ones(10), z) == math.inf
    assert math.isnan(metrics.rel_l2(torch.tensor([1.0, float("nan")]), torch.ones(2)))
    with pytest.raises(ValueError):
        metrics.rel_l2([z], [z, z])
