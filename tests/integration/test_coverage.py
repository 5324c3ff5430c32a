"""Coverage is part of the verdict: a score never says "within noise" about gradients it did not
see (issue 21): missing gradients make a capture ``incomplete``, extra ones are stated, nothing in
common is ``incomplete``, a non-finite oracle is ``oracle_non_finite``; text and JSON alike."""

from __future__ import annotations

import json

import torch
from helpers import rewrite_grads
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle, BundleWriter
from oracle.score.scorer import score


def subset(src: str, dst: str, keep, extra: dict[str, torch.Tensor] | None = None) -> str:
    """Copy capture ``src`` to ``dst`` keeping the gradients whose name passes ``keep`` (plus ``extra``)."""
    return rewrite_grads(src, dst, lambda n, g: g if keep(n) else None, extra)


def test_a_capture_missing_half_its_gradients_is_incomplete_naming_them(fp32_capture, oracle_bundle, tmp_path):
    """Half the gradients dropped: class incomplete (not within_noise), count and first names given."""
    names = Bundle(oracle_bundle).names("grads")
    dropped = names[::2]
    half = subset(fp32_capture, str(tmp_path / "half"), lambda n: n not in dropped)
    c = score(oracle_bundle, [half])["captures"][0]
    assert c["verdict"]["class"] == "incomplete"
    assert c["verdict"]["checked_class"] == "within_noise"
    assert c["coverage"]["covered"] == len(names) - len(dropped) and c["coverage"]["oracle"] == len(names)
    assert sorted(c["coverage"]["missing"]) == sorted(dropped)
    text = c["verdict"]["text"]
    assert "INCOMPLETE" in text and f"missing {len(dropped)}" in text and dropped[0] in text


def test_a_capture_with_one_gradient_is_incomplete(fp32_capture, oracle_bundle, tmp_path):
    """1 of M gradients: incomplete, and the text says covers 1 of M."""
    names = Bundle(oracle_bundle).names("grads")
    one = subset(fp32_capture, str(tmp_path / "one"), lambda n: n == names[-1])
    c = score(oracle_bundle, [one])["captures"][0]
    assert c["verdict"]["class"] == "incomplete"
    assert f"covers 1 of the oracle's {len(names)} gradients" in c["verdict"]["text"]


def test_nothing_in_common_is_incomplete_and_extra_gradients_are_stated(fp32_capture, oracle_bundle, tmp_path):
    """No oracle parameter in the capture: incomplete, nothing checked; its own names listed as extra."""
    foreign = subset(fp32_capture, str(tmp_path / "foreign"), lambda n: False, {"not.a.param": torch.ones(3)})
    c = score(oracle_bundle, [foreign])["captures"][0]
    assert c["verdict"]["class"] == "incomplete"
    assert c["coverage"]["extra"] == ["not.a.param"] and "nothing was checked" in c["verdict"]["text"]
    assert "1 not in the oracle (not scored): not.a.param" in c["verdict"]["text"]


def test_a_complete_capture_with_an_extra_gradient_keeps_its_class_and_states_the_extra(fp32_capture, oracle_bundle, tmp_path):
    """Every gradient plus one the oracle lacks: still within noise, and the extra one is named."""
    more = subset(fp32_capture, str(tmp_path / "more"), lambda n: True, {"bonus.weight": torch.ones(2)})
    c = score(oracle_bundle, [more])["captures"][0]
    assert c["verdict"]["class"] == "within_noise" and c["coverage"]["missing"] == []
    assert "bonus.weight" in c["verdict"]["text"]


def test_a_non_finite_oracle_cannot_judge(fp32_capture, oracle_bundle, tmp_path):
    """An oracle with a NaN gradient: every verdict is oracle_non_finite, never within_noise."""
    first = Bundle(oracle_bundle).names("grads")[0]
    nan = rewrite_grads(oracle_bundle, str(tmp_path / "nan-oracle"),
                        lambda n, g: torch.full_like(g, float("nan")) if n == first else g)  # fmt: skip
    c = score(nan, [fp32_capture])["captures"][0]
    assert c["verdict"]["class"] == "oracle_non_finite"
    assert "CANNOT JUDGE" in c["verdict"]["text"] and first in c["verdict"]["text"]


def test_coverage_is_in_the_cli_text_and_json(fp32_capture, oracle_bundle, tmp_path):
    """`oracle score` prints the coverage line and writes it and the class into --json; exit 0."""
    names = Bundle(oracle_bundle).names("grads")
    half = subset(fp32_capture, str(tmp_path / "half"), lambda n: n in names[:3])
    res = CliRunner().invoke(app, ["score", oracle_bundle, half, "--json", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    assert f"coverage: covers 3 of the oracle's {len(names)} gradients" in res.output
    assert "INCOMPLETE" in res.output and "within noise;" not in res.output.split("verdict:")[-1].split("INCOMPLETE")[0]
    got = json.loads((tmp_path / "s.json").read_text())["captures"][0]
    assert got["verdict"]["class"] == "incomplete" and len(got["coverage"]["missing"]) == len(names) - 3


def _norm_log(path, norms: dict[str, float]) -> str:
    with BundleWriter(path, "norms") as w:
        w.manifest.update(precision="fp32", norms=norms, order=list(norms))
    return str(path)


def test_a_norm_log_states_what_it_covers_and_is_incomplete_only_when_it_covers_nothing(oracle_bundle, tmp_path):
    """A norm log of 2 parameters is judged on them and says 'covers 2 of M'; one of none is incomplete."""
    o = Bundle(oracle_bundle)
    names = o.names("grads")
    two = {n: float(o.load("grads", n).double().norm()) for n in names[:2]}
    c = score(oracle_bundle, [_norm_log(tmp_path / "two", two)])["captures"][0]
    assert c["verdict"]["class"] == "within_noise" and c["coverage"]["covered"] == 2
    assert f"covers 2 of the oracle's {len(names)} gradient norms" in c["verdict"]["text"]
    c = score(oracle_bundle, [_norm_log(tmp_path / "none", {"x.weight": 1.0})])["captures"][0]
    assert c["verdict"]["class"] == "incomplete" and c["coverage"]["extra"] == ["x.weight"]
