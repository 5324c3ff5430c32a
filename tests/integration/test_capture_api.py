"""oracle.Capture around a user's own loop: any nn.Module, any loss."""

import pytest
import torch

import oracle
from oracle.bundle.store import Bundle
from oracle.errors import RecipeError, UsageError
from oracle.score.scorer import score


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x, scale=1.0):
        return self.b(torch.tanh(self.a(x))) * scale


def test_capture_records_inputs_weights_grads_and_loss(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    with oracle.Capture(model, tmp_path / "c", precision="fp32", seed=0) as cap:
        out = model(x, scale=2.0)
        model(x * 0)  # a second forward is not recorded: one step of one sample
        loss = torch.nn.functional.mse_loss(out, y)
        cap.add_inputs(target=y)
        cap.set_loss(loss, reduction="mean")
        loss.backward()
    b = Bundle(tmp_path / "c")
    assert torch.equal(b.load("inputs", "arg0"), x) and torch.equal(b.load("inputs", "target"), y)
    assert b.get("static_inputs") == {"scale": 2.0}
    assert b.get("loss")["value"] == pytest.approx(float(loss.detach()))
    for n, p in model.named_parameters():
        assert torch.equal(b.load("weights", n), p.detach()) and torch.equal(b.load("grads", n), p.grad)
    assert all(not m._forward_pre_hooks for m in model.modules())  # the hook removed itself


def test_nothing_is_written_when_the_step_raises(tmp_path):
    model = Tiny()
    with pytest.raises(ValueError):
        with oracle.Capture(model, tmp_path / "c"):
            model(torch.randn(2, 3))
            raise ValueError("step failed")
    assert not (tmp_path / "c").exists() and all(not m._forward_pre_hooks for m in model.modules())


def test_a_capture_without_recipe_can_be_scored_but_not_replayed(tmp_path):
    """A plain module's capture scores against a float64 truth written by hand; replay needs a recipe."""
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(4, 3)
    with oracle.Capture(model, tmp_path / "c"):
        model(x).sum().backward()
    truth = Tiny().double()
    truth.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    truth(x.double()).sum().backward()
    with oracle.BundleWriter(tmp_path / "o", "oracle") as w:
        w.manifest.update(recipe={"name": None, "config": {}}, precision="fp64", loss={"value": 0.0})
        w.add("inputs", {"arg0": x})
        w.add("weights", {n: p.detach() for n, p in model.named_parameters()})
        w.add("grads", {n: p.grad for n, p in truth.named_parameters()})
    res = score(tmp_path / "o", [tmp_path / "c"])
    cap = res["captures"][0]
    assert {r["name"] for r in cap["params"]} == {n for n, _ in model.named_parameters()}
    assert [lr["name"] for lr in cap["layers"]] == ["b", "a"]  # no recipe: reverse registration order
    assert cap["verdict"]["class"] == "within_noise" and 0 < cap["verdict"]["worst_rel_l2"] < 1e-6
    from oracle.replay.run import replay

    with pytest.raises(RecipeError, match="names no recipe"):
        replay(tmp_path / "c", tmp_path / "o2")
    with pytest.raises(UsageError, match="unknown precision"):
        oracle.Capture(model, tmp_path / "d", precision="fp8")


def test_uncertified_oracle_is_flagged(fp32_capture, tmp_path):
    from oracle.replay.run import replay

    o = replay(fp32_capture, tmp_path / "o", verify="off")
    r = score(o, [fp32_capture])
    assert r["oracle"]["certificate"] is None and "uncertified" in r["summary"]
