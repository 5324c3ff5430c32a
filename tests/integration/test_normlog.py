"""The original report's two real logs (shared/logs) and synthetic ones."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle
from oracle.errors import LogParseError
from oracle.integrations import normlog
from oracle.score.scorer import score

LOGS = Path(__file__).resolve().parents[1] / "data"  # copies of the original report's two rank-0 logs
H20, NPU = LOGS / "h20_rank0_grad_norms.log", LOGS / "910b_rank0_grad_norms.log"


def test_the_reports_logs_match_by_name_despite_their_order():
    a, b = normlog.parse(H20), normlog.parse(NPU)
    assert len(a.norms) == len(b.norms) == 20
    assert a.order != b.order and set(a.order) == set(b.order)  # same names, different order
    r = normlog.compare(a, b, ("H20", "910B"))
    assert len(r["params"]) == 20 and not any(r["only_in"].values())
    emb = next(p for p in r["params"] if p["name"].endswith("word_embeddings.weight"))
    assert emb["H20"] == 369.5640563964844 and emb["910B"] == 547.50244140625
    assert emb["ratio"] == pytest.approx(547.50244140625 / 369.5640563964844)
    ln = next(p for p in r["params"] if p["name"].endswith("layers.0.self_attention.linear_qkv.layer_norm_weight"))
    assert ln["ratio"] == pytest.approx(2109.36181640625 / 1350.11767578125) and ln["partial_sum"]
    assert [lr["layer"] for lr in r["layers"]] == ["layers.2", "layers.1", "layers.0", "embedding"]  # backward order
    assert "grows from" in r["summary"] and "cannot tell" in r["summary"]


def test_score_reads_the_two_logs_from_the_cli():
    res = CliRunner().invoke(app, ["compare-logs", str(H20), str(NPU), "--name", "H20", "--name", "910B"])
    assert res.exit_code == 0, res.output
    assert "word_embeddings.weight" in res.output and "1.4815" in res.output and "summary:" in res.output


def test_duplicates_need_a_selector_and_custom_patterns_work(tmp_path):
    log = tmp_path / "multi.log"
    log.write_text("".join(f"step={s} rank={r} grad {n} = {v}\n" for s in (1, 2) for r in (0, 1)
                           for n, v in (("w1", 1.0 + s + r), ("w2", 10.0 * s + r))))  # fmt: skip
    pat = r"step=(?P<step>\d+) rank=(?P<rank>\d+) grad (?P<name>\S+) = (?P<value>\S+)"
    with pytest.raises(LogParseError, match="printed more than once"):
        normlog.parse(log, pattern=pat)
    sel = normlog.parse(log, pattern=pat, step="2", rank="1")
    assert sel.norms == {"w1": 4.0, "w2": 21.0}
    assert normlog.parse(log, pattern=pat, occurrence=3).norms == {"w1": 4.0, "w2": 21.0}
    with pytest.raises(LogParseError, match="no line matches"):
        normlog.parse(log)
    with pytest.raises(LogParseError, match="named groups"):
        normlog.parse(log, pattern=r"grad (\S+)")


def test_names_only_in_one_log_are_listed(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    line = "[DEBUG_GRAD_NORM][X] {} norm={}\n"
    a.write_text(line.format("x.layers.0.w", 1) + line.format("x.layers.1.w", 2))
    b.write_text(line.format("x.layers.1.w", 3) + line.format("x.layers.5.w", 4))
    r = normlog.compare(normlog.parse(a), normlog.parse(b))
    assert r["only_in"] == {"A": ["x.layers.0.w"], "B": ["x.layers.5.w"]}
    assert [p["name"] for p in r["params"]] == ["x.layers.1.w"]


def test_an_imported_log_is_a_norm_only_capture_scored_against_the_oracle(oracle_bundle, tmp_path):
    o = Bundle(oracle_bundle)
    names = o.names("grads")
    log = tmp_path / "hf.log"
    log.write_text("".join(f"[DEBUG_GRAD_NORM][POST] {n} norm={float(o.load('grads', n).norm()) * (1.3 if i == 5 else 1.0)}\n"
                           for i, n in enumerate(names)))  # fmt: skip
    res = CliRunner().invoke(app, ["import-log", str(log), "--out", str(tmp_path / "nb"), "--precision", "bf16"])
    assert res.exit_code == 0, res.output
    c = score(oracle_bundle, [tmp_path / "nb"])["captures"][0]
    worst = max(c["params"], key=lambda p: p["excess"])
    assert c["norms_only"] and worst["name"] == names[5] and worst["class"] == "beyond_noise"
