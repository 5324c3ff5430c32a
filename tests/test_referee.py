"""The referee neither cries wolf nor looks away: capture is non-invasive, non-finite values are
located along the backward, bands of another precision are refused (issue 11)."""

import pytest
import torch

from oracle.bundle import Bundle
from oracle.modules import group_name
from oracle.steps import capture_recipe_step


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_recording_module_boundaries_leaves_every_gradient_bitwise_unchanged(source, sample, tmp_path, precision):
    plain = Bundle(capture_recipe_step(source, sample, str(tmp_path / "plain"), precision=precision))
    rec = Bundle(capture_recipe_step(source, sample, str(tmp_path / "rec"), precision=precision, modules="all"))
    names = plain.names("grads")
    assert names == rec.names("grads")
    changed = [n for n in names if not torch.equal(plain.load("grads", n), rec.load("grads", n))]
    assert changed == []
    # and the boundaries were recorded, grad_inputs of kwargs-called modules included
    attn = "model.language_model.layers.1.self_attn"
    meta = rec.manifest["modules"][attn]
    assert meta["grad_in"] and all(rec.has(group_name(attn), f"gin.{i}") for i in meta["grad_in"])
    assert len(rec.manifest["modules"]) > 20
