"""The one decision (oracle/pipeline/decide.py) on synthetic score documents whose rows are built as the
scorer builds them (members, band = the larger member, excess, class against the calibrated threshold of
oracle/score/calibrate.py): honest runs with the usual spread are not called, a fault a few times the
noise in one parameter of an honest layer is, a framework scale is the framework's, and the first line,
answer 1 and answer 3 never disagree."""

import math
import random

from oracle.pipeline import answers, decide
from oracle.score import calibrate

LAYERS = [f"model.layers.{i}" for i in (3, 2, 1, 0)]  # loss end first
PARAMS = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm", "self_attn.o_proj",
          "self_attn.v_proj", "self_attn.q_proj", "self_attn.k_proj", "input_layernorm"]  # fmt: skip
SPREAD = 0.15  # log-normal spread of one honest draw's error around its unit's level


def _capture(name="B", seed=0, plant=None, scale=None, margin=None, apart=1.0):
    """A score capture: every parameter's honest level 1e-2, two members and the run drawn around it;
    ``plant`` = (param, factor) multiplies that parameter's error; ``scale`` = c scales every gradient;
    ``apart``: member 0 (round to nearest) and the run sit that factor above the jittered member 1 at
    every unit (a deterministic rounding repeated over micro-batches adds up coherently)."""
    rng = random.Random(seed)
    draw = lambda: 1e-2 * math.exp(rng.gauss(0, SPREAD))  # noqa: E731
    params = []
    for lay in LAYERS:
        for p in PARAMS:
            members, e = [draw() * apart, draw()], draw() * apart
            full = f"{lay}.{p}.weight"
            if plant and plant[0] == full:
                e *= plant[1]
            row = {"name": full, "layer": lay, "members": members, "band": max(members), "ref_norm": 1.0}
            if scale:  # g = t / c with its rounding: ||c g - t|| = e, direction off by e
                row.update(norm=1 / scale, cosine=1 - e * e / 2, norm_ratio=1 / scale, rel_l2=abs(1 / scale - 1))
            else:
                row.update(norm=1.0, cosine=1 - e * e / 2, norm_ratio=1.0, rel_l2=e)
            params.append(row)
    layers = []
    for lay in LAYERS:
        rows = [p for p in params if p["layer"] == lay]
        members = [math.sqrt(sum(r["members"][k] ** 2 for r in rows) / len(rows)) for k in (0, 1)]
        err = math.sqrt(sum(r["rel_l2"] ** 2 for r in rows) / len(rows))
        layers.append({"name": lay, "members": members, "band": max(members), "rel_l2": err, "worst_param": rows[0]["name"]})
    thr = calibrate.threshold([(u["members"], 1e-6) for u in params + layers], margin=margin)
    for u in params + layers:
        u["excess"] = u["rel_l2"] / u["band"]
        u["class"] = "beyond_noise" if u["excess"] > thr["value"] else "within_noise"
        u["nonfinite"] = 0
    gs = {"c": scale, "rel_l2": abs(1 / scale - 1), "residual_after_scaling": 1e-2, "explains": True} if scale else None
    return {"name": name, "precision": "bf16", "band_kind": "emulated bf16 x2", "params": params, "layers": layers,
            "threshold": thr, "num_tokens": 2435,
            "verdict": {"class": "beyond_noise" if any(u["class"] != "within_noise" for u in params + layers) else "within_noise",
                        "global_scale": gs, "text": "the scorer's own line"},
            "loss_check": {"beyond": False, "rel": 1e-6, "band": 1e-2, "text": "the loss agrees"}}  # fmt: skip


def _judge(caps, local=None, runs=None):
    score = {"captures": caps, "margin": None}
    runs = runs or [{"name": c["name"], "num_tokens": c.get("num_tokens")} for c in caps]
    d = decide.decide(score, local or {}, runs)
    a1 = answers.noise(score, d)
    a3 = answers.born(score, local or {}, decision=d)
    a4 = answers.op_class(score, {}, a3["per_run"], None, decision=d, runs=runs, local=local or {})
    return d, a1, a3, a4, answers.headline(a1, a3, a4, answers.framework(score), d)


def test_the_threshold_is_the_bonferroni_quantile_of_the_members_spread():
    """T = exp(max(sigma z(1 - a/N), max |l|)) from the leave-one-out log ratios, floored at the fidelity;
    without members the fixed margin, with --margin the margin."""
    units = [([1.0, math.exp(0.3)], 1e-9), ([1.0, math.exp(-0.1)], 1e-9)]
    t = calibrate.threshold(units)
    sigma = math.sqrt((0.3**2 * 2 + 0.1**2 * 2) / 4)
    assert math.isclose(t["sigma"], sigma) and t["n"] == 2 and t["rule"] == "calibrated"
    assert math.isclose(t["stat"], math.exp(max(sigma * t["z"], 0.3)))
    assert t["value"] == max(t["stat"], calibrate.FIDELITY)
    assert calibrate.threshold([([1e-3], 1e-9)])["rule"] == "fixed"
    assert calibrate.threshold(units, margin=5.0)["value"] == 5.0


def test_members_a_constant_factor_apart_are_an_offset_not_spread():
    """Member 0 and the run 5.7x above member 1 at every unit (sqrt(32): the same 3 samples over 96
    micro-batches, coherent vs jittered rounding): the offset is taken out, T stays near the fidelity and
    says so, the honest run is honest and a 4.5x fault in one parameter is called. Members apart at random
    (no offset to take out) keep a wide T: the centering narrows only what is systematic."""
    apart = math.sqrt(32)
    honest = _capture(seed=5, apart=apart)
    t = honest["threshold"]
    assert t["value"] < 3.0 and math.isclose(t["members_apart"], apart, rel_tol=0.15), t
    assert "apart at every unit" in t["text"]
    raw = [x for u in honest["params"] + honest["layers"] for _, x in calibrate.loo_logs(u["members"], 1e-6)]
    assert math.exp(max(abs(x) for x in raw)) > 4.5  # the raw spread would have hidden the fault
    assert decide.decide({"captures": [honest]})["per_run"][0]["honest"]
    target = "model.layers.0.self_attn.o_proj.weight"
    d = decide.decide({"captures": [_capture(seed=6, apart=apart, plant=(target, 4.5))]})["per_run"][0]
    assert not d["honest"] and target in [x["name"] for x in d["calls"]], d["calls"]
    rng = random.Random(7)
    wild = [([1e-2 * math.exp(rng.gauss(0, 1.0)), 1e-2 * math.exp(rng.gauss(0, 1.0))], 1e-6) for _ in range(72)]
    w = calibrate.threshold(wild)
    assert w["value"] > 10 and w["members_apart"] < 1.5, w


def test_honest_runs_with_the_usual_spread_are_not_called():
    """200 synthetic honest runs (72 units each, members and run drawn alike): at most 1 % false alarms
    would be expected from the rule; more than 4 of 200 fails."""
    alarms = sum(not decide.decide({"captures": [_capture(seed=s)]})["per_run"][0]["honest"] for s in range(200))
    assert alarms <= 4, alarms


def test_a_fault_a_few_times_the_noise_in_one_parameter_of_an_honest_layer_is_called():
    """gate_proj of layer 0 at 4x its level (the layer aggregate stays within): faulty, the parameter named in
    the first line, answer 1 and answer 3, born in that layer's MLP; the same run unplanted is honest."""
    target = "model.layers.0.mlp.gate_proj.weight"
    d, a1, a3, _, head = _judge([_capture("A", seed=1), _capture("B", seed=2, plant=(target, 4.0))])
    b = d["per_run"][1]
    layer0 = next(r for r in b["layers"] if r["name"] == "model.layers.0")
    assert layer0["class"] == "within_noise" and [x["name"] for x in b["calls"]] == [target]
    assert d["faulty"] == ["B"] and head.startswith("answer: B is faulty (beyond its own noise band); born in model.layers.0.mlp")
    assert "B: NOT honest noise" in a1["text"] and target in a1["text"]
    assert a3["per_run"][1]["module"] == "model.layers.0.mlp" and a3["per_run"][0]["module"] is None


def test_an_honest_answer_says_down_to_what_it_is_honest():
    """Per layer, the smallest error it would have called: T x the layer's band, in the JSON and the words."""
    d, a1, *_ = _judge([_capture("A", seed=3)])
    r = d["per_run"][0]
    t = r["threshold"]["value"]
    assert [x["limit"] for x in r["limits"]] == [t * lay["band"] for lay in r["layers"]]
    assert a1["per_run"][0]["limits"] == r["limits"] and "honest down to" in a1["text"]


def test_a_uniform_scale_is_the_frameworks_in_the_first_line_and_the_device_is_judged_on_what_remains():
    """Every gradient scaled by c = 0.5068 (a loss normalised by the local token count: 1234 of 2435 tokens):
    the first line names the factor and the token-count ratio as a framework finding, never "B is faulty"."""
    runs = [{"name": "A", "num_tokens": 2435}, {"name": "B", "num_tokens": 2435, "rank_num_tokens": [1234, 1201]}]
    d, a1, a3, _, head = _judge([_capture("A", seed=4), _capture("B", seed=5, scale=1234 / 2435)], runs=runs)
    assert d["faulty"] == [] and "is faulty" not in head
    assert head.startswith("answer: both runs are honest noise of their own precision on what the framework findings leave")
    assert "framework finding in B (not the device): every gradient of B is off by one factor: c = 0.506776" in head
    assert "token-count ratio 1234/2435 (DP rank 0's loss tokens over" in head, head
    assert "framework finding, not the device" in a1["text"] and a3["per_run"][1]["module"] is None
    # the same scale with a planted fault on top: the fault is still called
    planted = _capture("B", seed=5, scale=1234 / 2435, plant=("model.layers.2.mlp.up_proj.weight", 6.0))
    d = decide.decide({"captures": [_capture("A", seed=4), planted]}, runs=runs)
    d = {"faulty": d["faulty"], "per_run": d["per_run"][1:]}
    assert d["faulty"] == ["B"] and d["per_run"][0]["calls"][0]["name"] == "model.layers.2.mlp.up_proj.weight"


def test_a_uniform_scale_no_convention_makes_is_the_runs_own_at_the_loss_end_its_direction_from_the_loss():
    """Every gradient x1.1 (c = 1/1.1): no token-count ratio, small fraction or power of two makes it, so it is
    not a framework finding but B's own, placed at the loss end: backward when the loss agrees with the truth
    (the loss's gradient or the head's backward scaled), forward when the loss is beyond its band (the logits)."""
    runs = [{"name": "A", "num_tokens": 2435}, {"name": "B", "num_tokens": 2435, "rank_num_tokens": [1234, 1201]}]
    d, a1, a3, a4, head = _judge([_capture("A", seed=4), _capture("B", seed=5, scale=1 / 1.1)], runs=runs)
    assert d["faulty"] == ["B"] and not d["per_run"][1]["framework"] and d["per_run"][1]["scale"]["c"] == 1 / 1.1
    assert head.startswith("answer: B is faulty") and "framework finding" not in head, head
    born = a3["per_run"][1]
    assert born["module"].startswith("model.layers.3.") and born["direction"] == "backward", born
    assert "no loss-token count, rank or micro-batch count or loss scale makes it" in born["evidence"]
    assert a4["per_run"][0]["class"] == "scaling", a4
    moved = _capture("B", seed=5, scale=1 / 1.1)  # the loss 8.4x its band: not a finding (22.5x), a direction (6.9x)
    moved["loss_check"] = {"beyond": False, "moved": True, "rel": 4.1e-4, "band": 1.1e-3, "excess": 8.4,
                           "direction_threshold": 6.9, "text": "the loss agrees"}  # fmt: skip
    _, _, a3, _, _ = _judge([_capture("A", seed=4), moved], runs=runs)
    assert a3["per_run"][1]["direction"] == "forward" and "the logits are wrong" in a3["per_run"][1]["evidence"]
    # x1.05: the scorer's overall test does not explain it, every unit scaled back by c is within noise
    small = _capture("B", seed=5, scale=1 / 1.05)
    small["verdict"]["global_scale"]["explains"] = False
    d, _, a3, _, _ = _judge([_capture("A", seed=4), small], runs=runs)
    assert d["faulty"] == ["B"] and d["per_run"][1]["scale"] and a3["per_run"][1]["direction"] == "backward"
    # a power of two (a loss scale) and a small fraction stay the framework's
    for c in (2.0**-12, 2 / 3):
        d, *_ = _judge([_capture("A", seed=4), _capture("B", seed=5, scale=c)], runs=runs)
        assert d["faulty"] == [] and d["per_run"][1]["framework"][0]["kind"] == "scale", c


def test_gradients_left_out_of_the_verdict_are_named_in_the_first_line():
    cap = _capture("B", seed=6)
    why = "left unreduced across TP ranks by the framework and not the sum of its copies; no per-rank truth"
    cap["left_out"] = [{"name": "model.visual.blocks.0.attn.qkv.weight", "reason": why}]  # the scorer's list
    *_, head = _judge([cap])
    assert f"1 gradient(s) of B left out of the verdict (model.visual.blocks.0.attn.qkv.weight): {why}" in head


def test_a_local_culprit_alone_makes_the_run_faulty_and_forward_attention_gets_its_class_and_forward_advice():
    """End to end within, the local replay's attention forward beyond its own threshold: faulty, born there
    (forward), op class attention (forward); a backward culprit with its sub-modules already replayed gets
    no advice to capture them again."""
    mod = "model.layers.1.self_attn"
    local = {"B": {"culprits": [mod], "threshold": {"value": 2.0},
                   "modules": [{"module": mod, "ratio": 5.4, "direction": "forward", "class": "beyond_noise"}],
                   "verdict": {"culprit": mod, "direction": "forward", "text": "culprit"}}}  # fmt: skip
    d, a1, a3, a4, head = _judge([_capture("B", seed=7)], local=local)
    assert d["faulty"] == ["B"] and a3["per_run"][0]["module"] == mod and a4["per_run"][0]["class"] == "attention (forward)"
    assert head.startswith("answer: B is faulty") and "op class: attention (forward)" in head
    mlp = "model.layers.1.mlp"
    local = {"B": {"culprits": [mlp], "modules": [{"module": mlp, "ratio": 4.0, "direction": "backward"},
                                                  {"module": f"{mlp}.act_fn", "ratio": 1.0, "direction": None}],
                   "verdict": {"culprit": mlp, "direction": "backward", "text": "culprit"}}}  # fmt: skip
    _, _, _, a4, _ = _judge([_capture("B", seed=7)], local=local)
    r = a4["per_run"][0]
    assert r["class"] is None and r["settled"] and "ORACLE_CAPTURE_MODULES" not in r["settle"], r
    local["B"]["modules"].pop()
    _, _, _, a4, _ = _judge([_capture("B", seed=7)], local=local)
    assert "ORACLE_CAPTURE_MODULES='decoder\\.layers\\.1\\..*'" not in a4["per_run"][0]["settle"]  # not a layer: its own name
    assert "whose backward is wrong" in a4["per_run"][0]["settle"]


def test_the_first_line_answer_1_and_answer_3_never_disagree():
    """Across honest, planted, scaled, partial-sum and local-only cases: faulty in the decision <=> "is faulty"
    in the first line <=> "NOT honest" in answer 1 <=> a module (or "not localised") in answer 3."""
    norms = ["model.norm.weight", "model.layers.0.self_attn.q_norm.weight"]
    partial = _capture("B", seed=9)
    for n in norms:
        partial["params"].append({"name": n, "layer": "model.layers.0", "members": [1e-2, 1e-2], "band": 1e-2, "rel_l2": 0.5,
                                  "excess": 50.0, "class": "beyond_noise", "nonfinite": 0, "norm": 0.5, "ref_norm": 1.0,
                                  "cosine": 1.0, "norm_ratio": 0.5})  # fmt: skip
    local = {"B": {"culprits": ["model.layers.2.mlp"], "modules": [{"module": "model.layers.2.mlp", "ratio": 3.0,
                                                                    "direction": "backward"}],
                   "verdict": {"culprit": "model.layers.2.mlp", "direction": "backward", "text": ""}}}  # fmt: skip
    cases = [([_capture("A", seed=s), _capture("B", seed=s + 50)], None) for s in range(10)]
    cases += [([_capture("A", seed=s), _capture("B", seed=s + 50, plant=(f"{LAYERS[s % 4]}.{PARAMS[s % 9]}.weight", 5.0))], None)
              for s in range(10)]  # fmt: skip
    cases += [([_capture("B", seed=8, scale=0.5)], None), ([partial], None), ([_capture("B", seed=10)], local)]
    seen = set()
    for caps, loc in cases:
        d, a1, a3, _, head = _judge(caps, local=loc)
        for r, row1, row3 in zip(d["per_run"], a1["per_run"], a3["per_run"]):
            faulty = not r["honest"]
            seen.add(faulty)
            assert (f"{r['run']} is faulty" in head) == faulty, head
            assert (f"{r['run']}: NOT honest noise" in a1["text"]) == faulty == (not row1["honest"]), a1["text"]
            assert bool(row3["module"]) == faulty, row3
    assert seen == {True, False}
    d = decide.decide({"captures": [partial]})["per_run"][0]
    assert d["honest"] and d["framework"][0]["kind"] == "partial_sums"


def test_non_finite_gradients_make_the_run_faulty_and_are_placed():
    cap = _capture("B", seed=11)
    row = next(p for p in cap["params"] if p["name"] == "model.layers.1.self_attn.o_proj.weight")
    row.update(nonfinite=3, excess=math.inf, **{"class": "non_finite"})
    cap["verdict"]["nonfinite_params"] = [row["name"]]
    d, a1, a3, _, head = _judge([cap])
    assert d["per_run"][0]["class"] == "non_finite" and "B: NOT honest noise: non-finite gradients" in a1["text"]
    assert a3["per_run"][0]["module"] == "model.layers.1.self_attn" and head.startswith("answer: B is faulty")


def test_a_fault_diluted_in_a_replayed_layers_pooled_gradients_is_not_called_a_hand_off_and_gets_the_capture_below():
    """End to end, one weight gradient of layer 1 beyond T while the local replay of layer 1 stays below its
    own T (its parameter gradients are one pooled unit): answer 3 says the layer was replayed (no "hand-off"),
    and answer 4 neither claims "no module boundaries captured" nor repeats ORACLE_CAPTURE_MODULES=layers:
    it advises layer 1's sub-modules."""
    lay = "model.layers.1"
    local = {"B": {"culprits": [], "threshold": {"value": 2.5},
                   "modules": [{"module": f"model.layers.{i}", "ratio": 1.66 if i == 1 else 0.8, "direction": None,
                                "class": "within_noise"} for i in range(4)],
                   "verdict": {"culprit": None, "direction": None, "text": f"no module beyond; largest {lay} at 1.66x"}}}  # fmt: skip
    runs = [{"name": "B", "num_tokens": 2435, "modules": True}]
    d, _, a3, a4, head = _judge([_capture("B", seed=5, plant=(f"{lay}.mlp.gate_proj.weight", 5.0))], local=local, runs=runs)
    assert d["faulty"] == ["B"] and a3["per_run"][0]["module"] == f"{lay}.mlp", a3
    ev = a3["per_run"][0]["evidence"]
    assert f"{lay} was replayed alone" in ev and "hand-off" not in ev and "1.66x, T 2.50x" in ev, ev
    r = a4["per_run"][0]
    assert r["class"] is None and "no module boundaries" not in r["short"] and r["short"].startswith(lay), r
    assert "ORACLE_CAPTURE_MODULES='decoder\\.layers\\.1\\..*'" in r["settle"] and "=layers" not in r["settle"], r
    assert "no module boundaries captured" not in head and f"{lay} replayed, below its local threshold" in head, head
    # without a local replay holding it, the old reading stays: a hand-off between recorded modules
    local["B"]["modules"] = [m for m in local["B"]["modules"] if m["module"] != lay]
    _, _, a3, a4, _ = _judge([_capture("B", seed=5, plant=(f"{lay}.mlp.gate_proj.weight", 5.0))], local=local, runs=runs)
    assert "hand-off" in a3["per_run"][0]["evidence"] and a4["per_run"][0]["short"].startswith("module boundaries recorded")


def test_a_called_module_reads_as_forward_when_its_forward_output_alone_is_out_of_the_honest_range():
    """The direction of a module already beyond T is a choice between two (a backward fault leaves the
    forward output honest): its forward output beyond one unit's honest quantile (at least the fidelity
    2.0x) reads as forward, even below the family-wise T; an honest-looking forward output reads as backward."""
    from oracle.score import calibrate
    from oracle.score.local import _score_row

    thr = calibrate.threshold([([1.0, 1.2], 1e-9), ([0.9, 1.0], 1e-9)] * 50, fidelity=calibrate.LOCAL_FIDELITY)
    t_dir = calibrate.direction_threshold(thr)
    assert thr["value"] == calibrate.LOCAL_FIDELITY and t_dir == calibrate.FIDELITY < thr["value"]
    row = {"module": "m", "order": 0, "param": 9e-3, "expected_param": 1e-3, "bwd": 1e-3, "expected_bwd": 1e-3,
           "expected_fwd": 1e-3}  # fmt: skip
    # the layer-3 MLP scaled by 1.1 in the forward: its forward output 2.49x against T 2.50x
    assert _score_row({**row, "fwd": 2.49e-3}, 1e-9, thr["value"], t_dir)["direction"] == "forward"
    assert _score_row({**row, "fwd": 2.49e-3}, 1e-9, thr["value"])["direction"] == "backward"  # the old rule: T
    assert _score_row({**row, "fwd": 1.5e-3}, 1e-9, thr["value"], t_dir)["direction"] == "backward"
    assert _score_row({**row, "param": 1e-3, "fwd": 2.49e-3}, 1e-9, thr["value"], t_dir)["direction"] is None  # not called
    wide = calibrate.threshold([([1.0, 3.0], 1e-9), ([3.0, 1.0], 1e-9)] * 50, fidelity=calibrate.LOCAL_FIDELITY)
    assert calibrate.FIDELITY < calibrate.direction_threshold(wide) < wide["value"]  # a wide null: its own quantile
    assert calibrate.direction_threshold(calibrate.threshold([], margin=4.0)) == 4.0  # --margin: no null, T itself


def test_an_onset_before_the_recorded_modules_is_forward_when_what_enters_them_is_wrong():
    """End to end the onset is in a module no local replay holds (a vision merger before the recorded decoder
    layers); the hidden states entering the first recorded module, against the float64 replay's, tell the
    direction: beyond their band, forward (the loss agreeing says nothing there); within, backward as before."""
    lay = "model.layers.0"

    def local(ratio):
        return {"B": {"culprits": [], "threshold": {"value": 2.5},
                      "modules": [{"module": f"model.layers.{i}", "ratio": 0.8, "direction": None, "class": "within_noise"}
                                  for i in (1, 2, 3)],
                      "verdict": {"culprit": None, "direction": None, "text": "no module beyond",
                                  "entry": {"module": "model.layers.1", "ratio": ratio, "beyond": ratio > 2.5}}}}  # fmt: skip

    runs = [{"name": "B", "num_tokens": 2435, "modules": True}]
    cap = _capture("B", seed=5, plant=(f"{lay}.mlp.gate_proj.weight", 8.0))
    d, _, a3, _, head = _judge([cap], local=local(18.4), runs=runs)
    row = a3["per_run"][0]
    assert d["faulty"] == ["B"] and row["module"] == f"{lay}.mlp" and row["direction"] == "forward", row
    assert "entering model.layers.1" in row["evidence"] and "hand-off" not in row["evidence"], row["evidence"]
    assert "(forward" in head, head
    _, _, a3, _, _ = _judge([cap], local=local(1.1), runs=runs)
    assert a3["per_run"][0]["direction"] == "backward", a3["per_run"][0]


def test_an_onset_outside_the_recorded_layers_of_a_megatron_run_never_gets_the_capture_already_made():
    """A merged Megatron run recorded with ORACLE_CAPTURE_MODULES=layers, its onset in the vision merger (no
    recorded module holds it, the merge maps decoder layers only): answer 4 is undetermined and says the
    capture cannot place it further, never "capture with ORACLE_CAPTURE_MODULES=layers" again; a transformers
    capture gets the selection that holds the module."""
    cap = _capture("B", seed=5, plant=("model.layers.0.mlp.gate_proj.weight", 8.0))
    ren = lambda n: n.replace("model.layers.0", "model.visual.merger")  # noqa: E731
    for r in cap["params"]:
        r["name"], r["layer"] = ren(r["name"]), ren(r["layer"])
    for r in cap["layers"]:
        r["name"], r["worst_param"] = ren(r["name"]), ren(r["worst_param"])
    local = {"B": {"culprits": [], "threshold": {"value": 2.5},
                   "modules": [{"module": f"model.layers.{i}", "ratio": 0.8, "direction": None, "class": "within_noise"}
                               for i in (1, 2, 3)],
                   "verdict": {"culprit": None, "direction": None, "text": "no module beyond",
                               "entry": {"module": "model.layers.1", "ratio": 9.0, "beyond": True}}}}  # fmt: skip
    for megatron, says in ((True, "the Megatron merge maps decoder layers"), (False, "ORACLE_CAPTURE_MODULES='visual\\.merger\\.mlp$'")):
        runs = [{"name": "B", "num_tokens": 2435, "modules": True, "megatron": megatron}]
        _, _, a3, a4, _ = _judge([cap], local=local, runs=runs)
        assert a3["per_run"][0]["module"].startswith("model.visual.merger") and a3["per_run"][0]["direction"] == "forward"
        r = a4["per_run"][0]
        assert r["class"] is None and says in r["settle"] and "=layers" not in r["settle"], r["settle"]
    # the onset in a vision block the Megatron run did not record: the preset that records it
    for r in cap["params"]:
        r["name"], r["layer"] = r["name"].replace("model.visual.merger", "model.visual.blocks.0"), "visual.blocks.0"
    for r in cap["layers"]:
        r["name"], r["worst_param"] = r["name"].replace("model.visual.merger", "visual.blocks.0"), r["worst_param"].replace(
            "model.visual.merger", "model.visual.blocks.0")
    runs = [{"name": "B", "num_tokens": 2435, "modules": True, "megatron": True}]
    _, _, a3, a4, _ = _judge([cap], local=local, runs=runs)
    assert a3["per_run"][0]["module"].startswith("model.visual.blocks.0"), a3["per_run"][0]
    assert "ORACLE_CAPTURE_MODULES=layers,vit" in a4["per_run"][0]["settle"], a4["per_run"][0]["settle"]


def _entry_local(ratio, sources=None):
    """A local replay whose recorded modules (vision blocks, decoder layers) are all within, and whose entry row
    into decoder layer 0 (what the token embedding and the merger wrote) is at ``ratio`` its band."""
    within = [{"module": m, "ratio": 0.8, "direction": None, "class": "within_noise", "beyond": False}
              for m in ("model.layers.3", "model.layers.2", "model.layers.1", "model.layers.0")]  # fmt: skip
    entry = {"module": "model.layers.0:hidden_states", "input_of": "model.layers.0", "entry": True, "ratio": ratio,
             "beyond": ratio > 2.5, "direction": "forward" if ratio > 2.5 else None, "order": 3}  # fmt: skip
    if sources:
        entry["sources"] = sources
    return {"B": {"culprits": [], "threshold": {"value": 2.5}, "modules": [*within, entry],
                  "verdict": {"culprit": None, "direction": None, "text": "no module beyond",
                              "entry": {"module": "model.layers.0", "ratio": ratio, "beyond": ratio > 2.5}}}}  # fmt: skip


def test_an_entry_beyond_its_band_alone_makes_the_run_faulty_placed_in_the_module_that_wrote_its_rows():
    """Every gradient and every recorded module within (a 3 % forward scale of the vision merger: its gradients
    0.7-1.0x their band), the hidden states entering decoder layer 0 5.5x theirs: faulty, forward, born in the
    module whose rows carry the error (the image rows, the merger's: 6.1x, the text rows 0.9x). Within its band,
    the same run is honest."""
    cap = _capture("B", seed=3)
    src = {"model.visual.merger": {"ratio": 6.1}, "model.embed_tokens": {"ratio": 0.9}}
    d, a1, a3, _, head = _judge([cap], local=_entry_local(5.5, src))
    row = a3["per_run"][0]
    assert d["faulty"] == ["B"] and row["module"] == "model.visual.merger" and row["direction"] == "forward", row
    assert row["source"] == "local replay (entry)" and "model.visual.merger 6.1x" in row["evidence"], row
    assert head.startswith("answer: B is faulty") and "born in model.visual.merger (forward)" in head, head
    assert any(x["kind"] == "entry" for x in d["per_run"][0]["calls"])
    d, _, _, _, head = _judge([cap], local=_entry_local(1.1, src))
    assert d["faulty"] == [] and "honest" in head, head


def test_an_entry_beyond_without_row_writers_is_placed_in_the_unrecorded_layers_before_it():
    """No split of the entry's rows (a recipe with one writer): the layers after the entry's along the backward up
    to the next layer holding a recorded module; the module of their largest-excess parameter."""
    cap = _capture("B", seed=3, plant=("model.layers.0.mlp.gate_proj.weight", 1.0))
    cap["layers"].append({"name": "model.embed_tokens", "band": 1e-2, "excess": 0.5, "class": "within_noise",
                          "members": [1e-2, 1e-2], "rel_l2": 5e-3, "worst_param": "model.embed_tokens.weight"})  # fmt: skip
    cap["params"].append({"name": "model.embed_tokens.weight", "layer": "model.embed_tokens", "band": 1e-2, "excess": 0.9,
                          "class": "within_noise", "members": [1e-2, 1e-2], "rel_l2": 9e-3, "ref_norm": 1.0, "norm": 1.0,
                          "cosine": 1.0, "norm_ratio": 1.0, "nonfinite": 0})  # fmt: skip
    _, _, a3, _, _ = _judge([cap], local=_entry_local(5.5))
    row = a3["per_run"][0]
    assert row["module"] == "model.embed_tokens" and row["direction"] == "forward", row
    assert "(model.embed_tokens)" in row["evidence"], row["evidence"]


def _branch_local(coef_mlp):
    """Layer 1 replayed alone, within its band as a whole (its gradients one pooled unit), its forward error split
    along its branches (replay/local.py ``_branch_coefs``): the MLP's coefficient ``coef_mlp``, the members' near 0."""
    from oracle.score.local import _score_branches

    row = {"module": "model.layers.1", "ratio": 1.2, "beyond": False, "direction": None, "class": "within_noise",
           "branches": {"model.layers.1.mlp": {"coef": coef_mlp, "members": [1.2e-3, -4e-4]},
                        "model.layers.1.self_attn": {"coef": 2e-4, "members": [-5e-4, 3e-4]}}}  # fmt: skip
    _score_branches(row)
    return {"B": {"culprits": [], "threshold": {"value": 2.5}, "modules": [row],
                  "verdict": {"culprit": None, "direction": None, "text": "no module beyond"}}}  # fmt: skip


def test_a_branch_whose_output_is_off_reads_the_called_layer_as_forward_and_names_the_branch():
    """A 3 % scale of layer 1's MLP output, forward or backward, scales its gradients alike (1.03x, onset in the MLP's
    weights, the loss agreeing): the layer's own forward output stays in band. Its forward error along the MLP's
    output (+0.030, 25x the members') says forward, born in the MLP; a coefficient like the members' leaves it
    backward."""
    cap = _capture("B", seed=11, plant=("model.layers.1.mlp.gate_proj.weight", 6.0))
    runs = [{"name": "B", "num_tokens": 2435, "modules": True}]
    local = _branch_local(0.0302)
    row = local["B"]["modules"][0]
    assert row["forward_branch"] == "model.layers.1.mlp" and row["branches"]["model.layers.1.mlp"]["ratio"] > 20
    assert row["branches"]["model.layers.1.mlp"]["threshold"] > 10  # K = 2: a scalar's heavy tail, read at 5 %
    d, _, a3, _, head = _judge([cap], local=local, runs=runs)
    born = a3["per_run"][0]
    assert d["faulty"] == ["B"] and born["module"] == "model.layers.1.mlp" and born["direction"] == "forward", born
    assert "+0.0302 x model.layers.1.mlp's own output" in born["evidence"] and "(forward" in head, born["evidence"]
    _, _, a3, _, _ = _judge([cap], local=_branch_local(9e-4), runs=runs)
    assert a3["per_run"][0]["direction"] == "backward" and a3["per_run"][0]["module"] == "model.layers.1.mlp"


def test_a_forward_output_that_is_one_factor_of_the_truth_is_a_scaling():
    """A local culprit whose forward output is 1.1x the truth's with nothing left after scaling (a vision block's
    output scaled inside its forward): op class scaling, where explain ranks no rounding; an output not a scale
    (after scaling still 10x its band) stays undetermined."""
    mod = "model.visual.blocks.0"

    def local(after):
        return {"B": {"culprits": [mod], "threshold": {"value": 2.5},
                      "modules": [{"module": mod, "ratio": 35.0, "direction": "forward", "class": "beyond_noise",
                                   "fwd": 0.1, "expected_fwd": 2.9e-3, "fwd_scale": 1.1, "fwd_after_scaling": after}],
                      "verdict": {"culprit": mod, "direction": "forward", "text": "culprit"}}}  # fmt: skip

    explained = {"B": {"classes": [{"share_only": 0.0}], "top": "elementwise", "text": "explain ranked none"}}
    for after, want in ((3e-3, "scaling"), (3e-2, None)):
        score = {"captures": [_capture("B", seed=7)], "margin": None}
        d = decide.decide(score, local(after))
        a3 = answers.born(score, local(after), decision=d)
        a4 = answers.op_class(score, explained, a3["per_run"], None, decision=d, local=local(after))
        assert a3["per_run"][0]["module"] == mod and a4["per_run"][0]["class"] == want, a4["per_run"][0]


def test_a_loss_end_scale_is_forward_when_the_loss_moved_as_scaled_logits_would_move_it():
    """Every gradient x1.03 at the loss end (c = 1/1.03), the loss below the 6.9x direction level either way: logits
    1.03x too large move the loss by 0.03 x dL/df (scorer._logit_slope: <W, dL/dW> = 3.3e-3 of a loss of 1, a
    prediction of +9.9e-5 against a band of 4.9e-5). A loss that moved +1.3e-4 is nearer that: forward (the logits);
    one that moved +2.1e-5 is nearer 0: backward; a prediction inside the band leaves the moved rule (backward)."""
    runs = [{"name": "A", "num_tokens": 2435}, {"name": "B", "num_tokens": 2435}]

    def run(moved_by, slope=3.3e-3):
        cap = _capture("B", seed=5, scale=1 / 1.03)
        cap["loss_check"] = {"beyond": False, "moved": False, "rel": abs(moved_by), "band": 1.1e-3, "loss_band": 4.9e-5,
                             "excess": abs(moved_by) / 4.9e-5, "direction_threshold": 6.9, "captured": 1.0 + moved_by,
                             "replayed": 1.0, "logit_slope": slope, "text": "the loss agrees"}  # fmt: skip
        _, _, a3, _, _ = _judge([_capture("A", seed=4), cap], runs=runs)
        return a3["per_run"][1]

    fwd = run(1.34e-4)
    assert fwd["direction"] == "forward" and "would move the loss by +9.90e-05" in fwd["evidence"], fwd["evidence"]
    assert run(2.1e-5)["direction"] == "backward"
    assert run(1.34e-4, slope=1e-3)["direction"] == "backward"  # +3.0e-5 predicted: within the band, nothing told
