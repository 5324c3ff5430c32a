"""The judge's answers from score results (oracle/pipeline/answers.py), on hand-made rows: the op class
read from where a decoder layer's backward leaves its band, the reason and the settling capture when
no class is determined, and framework findings split into one run's and both runs'."""

from oracle.pipeline import answers

L1 = "model.language_model.layers.1"
PARAMS = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm", "self_attn.o_proj", "self_attn.v_proj",
          "self_attn.q_norm", "self_attn.k_norm", "self_attn.q_proj", "self_attn.k_proj", "input_layernorm"]  # fmt: skip


def _capture(beyond: set[str], module: str = L1, framework: list[str] = ()) -> dict:
    rows = [{"name": f"{module}.{p}.weight", "class": "beyond_noise" if p in beyond else "within_noise",
             "excess": 9.0 if p in beyond else 0.5} for p in PARAMS]  # fmt: skip
    fw = {"params": [{"name": n} for n in framework], "text": "framework finding"} if framework else None
    return {"name": "B", "params": rows, "framework": fw}


def _explained(share: float = 0.01) -> dict:
    return {"B": {"top": "elementwise", "classes": [{"share_only": share}], "text": "explain's own text", "format": "bf16"}}


def _born(module: str = L1, direction: str = "backward") -> list[dict]:
    return [{"run": "B", "module": module, "direction": direction}]


def test_the_first_stage_beyond_noise_along_the_layers_backward_names_the_op_class():
    """V within noise and the q/k norms beyond: rotary; V beyond (o_proj within): attention; down_proj: matmul."""
    cases = {"rotary": {"self_attn.q_norm", "self_attn.k_norm", "self_attn.q_proj", "self_attn.k_proj", "input_layernorm"},
             "attention": {"self_attn.v_proj", "self_attn.q_norm", "self_attn.q_proj", "input_layernorm"},
             "matmul": set(PARAMS), "normalisation": {"self_attn.q_proj", "self_attn.k_proj", "input_layernorm"}}  # fmt: skip
    for want, beyond in cases.items():
        r = answers.op_class({"captures": [_capture(beyond)]}, _explained(), _born(), 3.0)["per_run"][0]
        assert r["class"] == want and r["source"] == "explain, then the gradient path", (want, r)
    # a class explain finds (>= 50 % of the error) is kept; a forward fault is not read along the backward
    r = answers.op_class({"captures": [_capture({"self_attn.v_proj"})]}, _explained(0.8), _born(), 3.0)["per_run"][0]
    assert r["class"] == "elementwise" and r["source"] == "explain"
    r = answers.op_class({"captures": [_capture({"self_attn.v_proj"})]}, _explained(), _born(direction="forward"), 3.0)
    assert r["per_run"][0]["class"] is None


def test_an_undetermined_op_class_says_why_and_which_capture_settles_it():
    """A culprit outside a decoder layer with no class explaining it: why (a wrong result, not a precision)
    and the sub-module capture that settles it, in the row, in the report's section 4 and the first line."""
    mod = "model.visual.blocks.1"
    r = answers.op_class({"captures": [_capture(set(), module=mod)]}, _explained(), _born(mod), 3.0)["per_run"][0]
    assert r["class"] is None
    assert r["why"] == ("no op class's rounding reproduces half of the error in model.visual.blocks.1 (best: elementwise, "
                        "1% in bf16): not one op class computed in too low a precision but a wrong result (a mask, a "
                        "sign, an index, a missing term), which rounding cannot reproduce")  # fmt: skip
    assert r["settle"].startswith(
        "capture model.visual.blocks.1's sub-modules too (ORACLE_CAPTURE_MODULES='visual\\.blocks\\.1\\..*')")
    head = answers.headline({"faulty": ["B"]}, {"per_run": [{"run": "B", "module": mod, "direction": "backward"}]},
                            {"per_run": [r]})  # fmt: skip
    assert head == ("answer: B is faulty (beyond its own noise band); born in model.visual.blocks.1 (backward); "
                    "op class: undetermined (no op class's rounding reproduces the error: a wrong result, not a "
                    "precision; see 4.)")  # fmt: skip
    from oracle.report.judge import _per_run_lines

    lines = _per_run_lines("op_class", {"per_run": [r]})
    assert lines[0].startswith("   B: undetermined (explain): no op class's rounding") and lines[1].startswith(
        "   B: to settle it, capture model.visual.blocks.1's sub-modules too")  # fmt: skip
    # without module boundaries: the capture that settles it is one with them
    r = answers.op_class({"captures": [{"name": "B", "params": []}]}, {}, _born(), 3.0)["per_run"][0]
    assert r["class"] is None and r["why"] == "no module boundaries were captured (explain needs them)"
    assert r["settle"].startswith("capture both runs again with module boundaries (ORACLE_CAPTURE_MODULES=layers")


def test_framework_findings_are_split_into_one_runs_and_both_runs():
    """A gradient left unreduced in one run only is named for that run; those in both are the framework's alike."""
    a = dict(_capture(set(), framework=["model.visual.blocks.0.attn.qkv.weight"]), name="A")
    b = _capture(set(), framework=["model.visual.blocks.0.attn.qkv.weight", "model.language_model.norm.weight"])
    fw = answers.framework({"captures": [a, b]})
    assert fw["shared"] == ["model.visual.blocks.0.attn.qkv.weight"]
    assert fw["only"] == {"A": [], "B": ["model.language_model.norm.weight"]}
    assert fw["text"] == ("framework finding in B only: 1 gradient(s) never reduced across TP ranks "
                          "(model.language_model.norm.weight); in A and B alike: 1 gradient(s) never reduced "
                          "across TP ranks")  # fmt: skip
    assert answers.framework({"captures": [dict(a, framework=None), dict(b, framework=None)]})["text"] == ""


def _scored(layers: dict[str, str], loss_beyond: bool = False) -> dict:
    """A capture whose per-layer classes are ``layers`` (loss end first), the onset the first one beyond."""
    rows = [{"name": n, "class": c, "excess": 4.0 if c == "beyond_noise" else 0.5, "worst_param": f"{n}.weight"}
            for n, c in layers.items()]  # fmt: skip
    on = next(r for r in rows if r["class"] == "beyond_noise")
    return {"name": "B", "layers": rows, "params": [{"name": r["worst_param"], "layer": r["name"], "excess": r["excess"], "class": r["class"],
                                                     "band": 1e-3, "cosine": 0.9999, "norm_ratio": 1.0} for r in rows],
            "verdict": {"class": "beyond_noise", "text": "", "onset": {"layer": on["name"], "excess": 4.0, "stays_out": 0,
                                                                        "after": len(rows) - 1}},
            "loss_check": {"beyond": loss_beyond, "rel": 2e-5, "band": 0.1, "text": "the loss differs"}}  # fmt: skip


def test_an_error_that_stays_in_the_loss_ends_weight_gradient_is_born_in_the_backward():
    """Onset at lm_head, the loss within its band and the norm below it within noise: the error did not reach
    the gradients below, so it is made where lm_head's weight gradient is computed (backward, confined); with
    the norm beyond too (propagated) or the loss beyond, not. A step of several micro-batches names the
    accumulation beside the GEMM in its op-class reason."""
    W, B = "within_noise", "beyond_noise"
    row = answers.born({"captures": [_scored({"lm_head": B, "norm": W, "layers.3": B})]}, {}, 3.0)["per_run"][0]
    assert row["module"] == "lm_head" and row["direction"] == "backward" and row["confined"] == "lm_head", row
    assert "the next layer along the backward, norm, is within noise" in row["evidence"]
    for layers, loss in (({"lm_head": B, "norm": B}, False), ({"lm_head": B, "norm": W}, True)):
        r = answers.born({"captures": [_scored(layers, loss)]}, {}, 3.0)["per_run"][0]
        assert r["confined"] is None and r["direction"] == ("forward" if loss else None), r
    cap = _scored({"lm_head": B, "norm": W})
    o = answers.op_class({"captures": [cap]}, {}, [row], 3.0, {"B": 8})["per_run"][0]
    assert o["class"] is None and o["why"].startswith("a step of 8 micro-batches: their module boundaries are not mapped")
    assert o["why"].endswith("the error stays in lm_head's weight gradient (born, 3.): its weight-gradient GEMM or "
                             "main_grad's accumulation") and o["settle"].startswith("capture a call of ONE micro-batch")  # fmt: skip


def test_section_3_names_each_runs_framework_finding_once():
    """The summary line of "where is the error born" points at the framework findings; each run's own
    line below spells its finding out, once (it was in the summary and again on the run's line)."""
    from oracle.report.judge import _per_run_lines

    def cap(name, text):
        return {"name": name, "verdict": {"class": "within_noise", "onset": None, "text": ""}, "params": [],
                "layers": [], "framework": {"params": [{"name": "w"}], "text": text}}  # fmt: skip

    a = answers.born({"captures": [cap("H20", "H20's finding"), cap("910B", "910B's finding")]}, {}, 3.0)
    assert a["text"] == "framework finding in H20 and 910B (below)", a["text"]
    lines = [a["text"], *_per_run_lines("born", a)]
    for name in ("H20", "910B"):
        assert sum(f"{name}'s finding" in x for x in lines) == 1, lines
        assert f"   {name} framework: {name}'s finding" in lines


def test_parameters_beyond_the_threshold_inside_layers_within_theirs_make_the_run_faulty():
    """The decision is per unit: a fault confined to a few parameters can leave them beyond the threshold while
    their layer stays within it (a new user's planted 5 % MLP-gradient scale in bf16: three weights 3.2-3.4x,
    the layer 1.00x, and the answer said only "honest noise"); answer 1, answer 3 and the first line now call
    the run faulty, where the parameters are."""

    def cap(name, beyond):
        params = [{"name": f"{L1}.{p}.weight", "layer": "layers.1", "band": 1e-3,
                   "class": "beyond_noise" if p in beyond else "within_noise",
                   "excess": {"mlp.down_proj": 3.4, "mlp.up_proj": 3.35}.get(p, 0.6) if p in beyond else 0.6} for p in PARAMS]  # fmt: skip
        return {"name": name, "precision": "bf16", "band_kind": "emulated bf16 x2", "params": params,
                "layers": [{"name": "layers.1", "band": 1e-3, "excess": 1.0, "class": "within_noise", "worst_param": params[0]["name"]}],
                "threshold": {"value": 2.5, "rule": "calibrated", "text": "2.50x"},
                "verdict": {"class": "within_noise", "excess": 1.0, "text": ""}}  # fmt: skip

    score = {"captures": [cap("H20", set()), cap("910B", {"mlp.up_proj", "mlp.down_proj"})], "margin": None}
    a = answers.noise(score)
    h20, npu = a["text"].split("; 910B")
    assert "honest noise" in h20 and "NOT" not in h20 and "would have called a rel L2 error from 2.50e-03" in h20, h20
    assert "NOT honest noise" in npu and f"{L1}.mlp.down_proj.weight 3.40x, {L1}.mlp.up_proj.weight 3.35x" in npu, npu
    assert a["faulty"] == ["910B"]
    b = answers.born(score, {})
    assert b["per_run"][0]["module"] is None and b["per_run"][1]["module"] == f"{L1}.mlp", b
    head = answers.headline(a, b, {"per_run": []}, decision=answers.decide_mod.decide(score))
    assert head.startswith(f"answer: 910B is faulty (beyond its own noise band); born in {L1}.mlp"), head


def test_one_capture_judged_against_itself_is_said_first():
    """Two runs of one manifest (a copy of a folder): the headline's first words say so and what to give; two
    captures of different manifests, or a run without a fingerprint (logs), say nothing."""
    runs = [{"name": "A", "fingerprint": "f0"}, {"name": "copy", "fingerprint": "f0"}]
    assert answers.one_capture(runs) == (
        "A and copy are one capture (byte-identical manifests, so the same gradients): one run judged against itself, "
        "not two devices; give the other device's capture as run B; "
    )
    assert answers.one_capture([runs[0], {"name": "B", "fingerprint": "f1"}]) == ""
    assert answers.one_capture([{"name": "A"}, {"name": "B"}]) == ""
