"""A capture folder holding a rank an earlier run left (issue 30): named with the fix, exit 5, before any merge."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import tiny_rank_module
from typer.testing import CliRunner

from cli import app
from oracle.integrations.megatron.hook import capture_rank

HF = {"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 0,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": False}  # fmt: skip


def rank(folder: Path, r: int, dp: int, seed: int) -> Path:
    """A TP1 rank capture of embedding, final norm and output layer (no Megatron needed)."""
    m = tiny_rank_module(seed)
    coords = {"rank": r, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": r, "dp_size": dp}
    return capture_rank(m, folder, stage="post-finalize", batch={"input_ids": torch.arange(8).view(1, 8)}, loss=1.0,
                        num_tokens=8, coords=coords, overwrite=True)  # fmt: skip


def test_a_stale_rank_of_an_earlier_run_is_named_and_nothing_merged(tmp_path):
    """DP 2 wrote rank00000 and rank00001; a DP 1 rerun replaced rank00000: merging names rank00001 (exit 5)."""
    pre = tmp_path / "pre"
    for r in (0, 1):
        rank(pre, r, 2, 0)
    rank(pre, 0, 1, 1)
    (tmp_path / "hf.json").write_text(json.dumps(HF))
    r = CliRunner().invoke(app, ["merge", str(pre), "--out", str(tmp_path / "m"), "--recipe", "qwen3",
                                 "--hf-config", str(tmp_path / "hf.json")])  # fmt: skip
    assert r.exit_code == 5, r.output
    assert "1 rank capture(s) are not of the newest run in this folder (TP 1 x PP 1 x DP 1 x CP 1" in r.output
    assert f"{pre / 'rank00001'}: TP 1 x PP 1 x DP 2 x CP 1, rank 1" in r.output and "Move them out of the folder" in r.output
    assert not (tmp_path / "m").exists()
    (pre / "rank00001").rename(tmp_path / "old-rank00001")  # the fix the message gives
    r = CliRunner().invoke(app, ["merge", str(pre), "--out", str(tmp_path / "m"), "--recipe", "qwen3",
                                 "--hf-config", str(tmp_path / "hf.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
