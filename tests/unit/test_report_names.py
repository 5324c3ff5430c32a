"""Report tables print every parameter name whole: a name longer than the column (61 characters:
``model.language_model.layers.0.post_attention_layernorm.weight`` in the demo's tiny Qwen3-VL, longer
at 8B with MoE / deepstack names) widens the column instead of losing its first letters."""

from __future__ import annotations

from oracle.integrations.normlog import render_compare
from oracle.report.judge import render_judge
from oracle.report.text import render

LONG = "model.language_model.layers.0.post_attention_layernorm.weight"  # 61 characters
LONGER = "model.visual.deepstack_merger_list.0.linear_fc1.weight.extra.long.name.for.the.test"  # 82


def _row(name: str, excess: float) -> dict:
    return {"name": name, "rel_l2": 1e-3 * excess, "band": 1e-3, "excess": excess, "cosine": 0.99999,
            "norm_ratio": 1.0001, "class": "within_noise"}  # fmt: skip


def _score() -> dict:
    cap = {"name": "cpu-fp32", "precision": "fp32", "loss": 1.0, "band_kind": "emulated", "norms_only": False,
           "verdict": {}, "params": [_row(LONG, 1.2), _row(LONGER, 1.1), _row("lm_head.weight", 0.5)], "layers": []}  # fmt: skip
    return {"oracle": {"path": "truth", "precision": "fp64", "loss": 1.0}, "captures": [cap], "summary": "ok"}


def _table_rows(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith(header))
    return lines[i : i + 4]


def test_worst_parameters_table_keeps_long_names_whole_and_aligned():
    """The demo's worst-parameters table: the 61- and 82-character names appear whole, columns aligned."""
    rows = _table_rows(render(_score(), top=5), "parameter")
    assert rows[1].split()[0] == LONG and rows[2].split()[0] == LONGER, rows
    col = rows[0].index("rel_l2") + len("rel_l2")  # right-aligned numbers end under their header
    assert all(r[col - 1] != " " and r[col] == " " for r in rows[1:]), rows


def test_judge_logs_table_and_compare_logs_keep_long_names_whole(monkeypatch):
    """The judge report's grad-norm table and `oracle compare-logs` print the long names whole."""
    import oracle.report.judge as rj

    logs = {"labels": ["h20", "910b"], "where": "the whole parameters", "wins": {"h20": 1},
            "params": [{"name": n, "oracle": 1.0, "logs": {"h20": 1.0, "910b": 1.1}, "closer": "h20"} for n in (LONG, LONGER)]}  # fmt: skip
    monkeypatch.setattr(rj, "render_answers", lambda doc: "answers")  # the answers are not this test's table
    text = render_judge({"score": _score(), "logs": logs})
    names = [ln.split()[0] for ln in _table_rows(text, "parameter")[1:3]]
    assert names == [LONG, LONGER], text
    cmp = {"names": ["h20", "910b"], "logs": ["a.log", "b.log"], "layers": [], "kinds": [],
           "summary": "", "params": [{"name": n, "h20": 1.0, "910b": 1.1, "ratio": 1.1} for n in ("x." + LONGER, "y." + LONG)]}  # fmt: skip
    rows = _table_rows(render_compare(cmp), "parameter (backward order)")
    assert [r.split()[0] for r in rows[1:3]] == ["x." + LONGER, "y." + LONG], rows
