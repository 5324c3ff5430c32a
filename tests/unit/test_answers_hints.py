"""The judge's "not concluded" list tells each run how to record module boundaries in the way that
run was captured: ORACLE_CAPTURE_MODULES=layers for Megatron rank folders (ms-swift, MindSpeed),
``oracle capture --modules`` for capture bundles."""

from __future__ import annotations

from oracle.pipeline.answers import not_concluded


def test_the_module_hint_follows_how_each_run_was_captured():
    """A rank folder or a merged Megatron capture is told ORACLE_CAPTURE_MODULES=layers (ORACLE_CAPTURE has no
    --modules), a capture bundle of `oracle capture` --modules."""
    score = {"captures": [], "oracle": {}, "margin": 3.0}
    runs = [{"name": "H20", "modules": False, "input_kind": "megatron rank folder"},
            {"name": "cpu", "modules": False, "input_kind": "capture bundle"},
            {"name": "910B", "modules": False, "input_kind": "capture bundle", "megatron": True}]  # fmt: skip
    said = not_concluded(score, {}, runs, None)
    cpu = next(s for s in said if s.startswith("cpu:"))
    for name in ("H20", "910B"):  # a rank folder, and the cluster path's merged capture given as a bundle
        line = next(s for s in said if s.startswith(f"{name}:"))
        assert line.endswith("capture both runs again with ORACLE_CAPTURE_MODULES=layers set beside ORACLE_CAPTURE"), line
        assert "--modules" not in line
    assert cpu.endswith("capture both with `oracle capture --modules` (e.g. --modules all)"), cpu


def test_without_logs_it_says_which_options_check_them():
    """No logs given: the line names --log-a and --log-b."""
    said = not_concluded({"captures": [], "oracle": {}, "margin": 3.0}, {}, [], None)
    assert any(s.startswith("no grad-norm logs given") and s.endswith("(give each run's log as --log-a and --log-b)") for s in said), said


def test_explain_tells_a_merged_megatron_capture_how_its_run_records_modules(tmp_path):
    """oracle explain on a capture without module boundaries: a merged Megatron capture is told
    ORACLE_CAPTURE_MODULES=layers (its run has no --modules), an `oracle capture` bundle --modules."""
    import pytest
    import torch

    from oracle.bundle.store import BundleWriter
    from oracle.errors import BundleError
    from oracle.score.explain import explain

    for name, extra, want in (("merged", {"megatron": {"tp_size": 1}}, "with ORACLE_CAPTURE_MODULES=layers beside ORACLE_CAPTURE"),
                              ("bundle", {}, "capture with --modules naming 'model.layers.0.mlp'")):  # fmt: skip
        with BundleWriter(tmp_path / name, "capture") as w:
            w.manifest.update(**extra)
            w.add("weights", {"a": torch.zeros(2)})
            w.add("grads", {"a": torch.zeros(2)})
        with pytest.raises(BundleError, match="has no module boundaries") as e:
            explain(tmp_path / name, "model.layers.0.mlp")
        assert want in str(e.value) and ("--modules" in str(e.value)) == (name == "bundle"), str(e.value)
