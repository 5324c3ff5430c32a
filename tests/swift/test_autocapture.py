"""ORACLE_CAPTURE on ms-swift 3.12.1's own Megatron Qwen3-VL step: no file edited, nothing changed
(module boundaries selected through ORACLE_CAPTURE_MODULES included).

The ranks get only the environment variable; oracle-fp64 is installed in the pinned environment
as a user installs it (``.ci/swift-env``: not editable, so ``oracle_capture.pth`` is in
site-packages). Runs in that environment only; elsewhere it skips.
"""

from __future__ import annotations

import os
import sys
import sysconfig

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needs_swift  # noqa: E402, F401  (skips this module outside .venv-swift)
import peer  # noqa: E402
import tiny  # noqa: E402
import torch  # noqa: E402
import truth  # noqa: E402

from oracle.bundle.store import Bundle  # noqa: E402
from oracle.integrations.megatron.autocapture import PTH_LINE, PTH_NAME  # noqa: E402

CONFIGS = {"tp2sp-fp32": (2, True, "fp32", 1), "tp1-bf16": (1, False, "bf16", 1), "pp2-fp32": (1, False, "fp32", 2)}
MODULES = {"tp2sp-fp32": "layers", "tp1-bf16": "layers"}  # ORACLE_CAPTURE_MODULES: decoder layers' boundaries too
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny.write_model_dir(str(tmp_path_factory.mktemp("tiny-qwen3-vl")))


def _run(tmp_path_factory, hf_dir, name, env=None):
    tp, sp, dtype, pp = CONFIGS.get(name, (1, False, "fp32", 1))
    out = str(tmp_path_factory.mktemp(name + ("-captured" if env else "-plain")))
    env = {k: v.replace("{out}", out) for k, v in (env or {}).items()}
    peer.run(out, tp=tp, sp=sp, dtype=dtype, model_dir=hf_dir, env=env, pp=pp)
    return out


def test_the_start_up_hook_is_installed_with_the_package():
    """The wheel puts the one-line hook in site-packages; the repo's copy is the module's line."""
    installed = os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
    assert open(installed).read().strip() == PTH_LINE
    assert open(os.path.join(REPO, PTH_NAME)).read().strip() == PTH_LINE


@pytest.mark.parametrize("name", list(CONFIGS))
def test_oracle_capture_records_every_rank_as_the_step_ran_and_changes_nothing(tmp_path_factory, hf_dir, name):
    """With only ORACLE_CAPTURE=DIR set, every rank writes DIR/pre and DIR/post whose gradients,
    weights and inputs are bitwise the harness's raw truth, with the loss function's loss sum and
    token count; the step's gradients are bitwise those of the same step without the variable.
    Under PP (1F1B schedule) each stage captures its own part; only the last has a loss. With
    ORACLE_CAPTURE_MODULES=layers (TP 2 + SP fp32, TP 1 bf16) both bundles of every rank also hold
    each decoder layer's boundaries (its s/TP rows under SP), and the step is still bitwise the same."""
    env = {"ORACLE_CAPTURE": "{out}/capture", **({"ORACLE_CAPTURE_MODULES": MODULES[name]} if name in MODULES else {})}
    cap = _run(tmp_path_factory, hf_dir, name, env=env)
    plain = _run(tmp_path_factory, hf_dir, name)
    raw, ref = truth.load_ranks(cap), truth.load_ranks(plain)
    for r, (got, want) in enumerate(zip(raw, ref)):
        for kind in ("grads_pre", "grads_post", "weights"):
            assert all(torch.equal(got[kind][n], want[kind][n]) for n in want[kind]), (r, kind)
        m = got["meta"]
        for sub, kind, stage in (("pre", "grads_pre", "pre-finalize"), ("post", "grads_post", "post-finalize")):
            b = Bundle(os.path.join(cap, "capture", sub, f"rank{r:05d}"))
            assert b.get("megatron")["stage"] == stage
            g, w, x = b.load_group("grads"), b.load_group("weights"), b.load_group("inputs")
            assert set(g) == set(got[kind]) and all(torch.equal(g[n], got[kind][n]) for n in g), (r, sub)
            assert all(torch.equal(w[n], got["weights"][n]) for n in got["weights"]), (r, sub)
            assert set(x) == set(got["batch"]) and all(torch.equal(x[k], got["batch"][k]) for k in x), (r, sub)
            assert b.get("megatron")["num_tokens"] == m["num_tokens"]
            if m["loss_sum"] is None:  # a pipeline stage before the last
                assert b.get("megatron")["loss_as_given"] is None
            else:
                assert b.get("megatron")["loss_as_given"] == pytest.approx(m["loss_sum"], rel=1e-7)
            if name in MODULES:
                layers = [f"module.module.language_model.decoder.layers.{i}" for i in range(4)]
                assert sorted(b.get("modules")) == layers, (r, sub)
                tp, seq = CONFIGS[name][0], m["seq_len"]
                for n in layers:
                    mod = b.load_group(f"mod.{n}")
                    assert {"in.0", "out.0", "gout.0", "gin.0"} <= set(mod), (r, sub, n)
                    assert mod["in.0"].shape[0] == seq // tp and mod["gin.0"].shape == mod["in.0"].shape  # [s/TP, b, h]
                    assert b.get("modules")[n]["calls"] == 1
            else:
                assert not b.get("modules")
        log = open(os.path.join(cap, f"rank{r}.log")).read()
        assert "oracle: captured training call 0 into" in log
        assert ("with 4 module boundaries" in log) == (name in MODULES)


def test_nothing_captured_is_reported(tmp_path_factory, hf_dir):
    """A step number the run never reaches writes nothing and says so on every rank's stderr."""
    out = _run(tmp_path_factory, hf_dir, "tp1-fp32", env={"ORACLE_CAPTURE": "{out}/capture", "ORACLE_CAPTURE_STEP": "3"})
    assert not os.path.exists(os.path.join(out, "capture"))
    log = open(os.path.join(out, "rank0.log")).read()
    assert ("is set but nothing was captured: the training loop ran 1 forward-backward call(s), "
            "ORACLE_CAPTURE_STEP=3 was never reached") in log  # fmt: skip


# -- a failing capture never stops, hangs or changes the step (issue 32, item 1) ---------------------------------
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autocapture_step  # noqa: E402


@pytest.fixture(scope="module")
def plain_tp1(tmp_path_factory, hf_dir):
    return truth.load_ranks(_run(tmp_path_factory, hf_dir, "tp1-fp32"))


@pytest.mark.parametrize("case", ["user-folder-in-the-way", "catastrophic-regex"])
def test_a_failing_capture_leaves_ms_swifts_step_bitwise_and_says_so_once(tmp_path_factory, hf_dir, plain_tp1, case):
    """ms-swift's own step with ORACLE_CAPTURE at a folder whose pre/rank00000 is the user's (with a bad
    budget and a catastrophic regex as well), or with ORACLE_CAPTURE_MODULES='^(\\w+\\.?)+!$': the
    run ends (no hang, exit 0), its gradients are bitwise those without the variable, the problem is
    said once, the user's folder keeps its file; the regex case still captures, without boundaries."""
    mine = tmp_path_factory.mktemp("mine")
    (mine / "pre" / "rank00000").mkdir(parents=True)
    (mine / "pre" / "rank00000" / "results.csv").write_text("1,2,3\n")
    env = {"user-folder-in-the-way": {"ORACLE_CAPTURE": str(mine), "ORACLE_CAPTURE_MODULES": r"^(\w+\.?)+!$",
                                      "ORACLE_CAPTURE_MODULES_BUDGET_MB": "1e400"},
           "catastrophic-regex": {"ORACLE_CAPTURE": "{out}/capture", "ORACLE_CAPTURE_MODULES": r"^(\w+\.?)+!$"}}[case]  # fmt: skip
    out = _run(tmp_path_factory, hf_dir, "tp1-fp32", env=env)
    got = truth.load_ranks(out)[0]
    for kind in ("grads_pre", "grads_post", "weights"):
        assert all(torch.equal(got[kind][n], plain_tp1[0][kind][n]) for n in plain_tp1[0][kind]), kind
    said = [x for x in open(os.path.join(out, "rank0.log")).read().splitlines() if x.startswith("oracle:")]
    if case == "user-folder-in-the-way":
        assert len(said) == 1 and "move it away or point ORACLE_CAPTURE at another folder" in said[0], said
        assert os.listdir(mine / "pre" / "rank00000") == ["results.csv"] and not (mine / "post").exists()
    else:
        assert len(said) == 2 and "exponential time" in said[0] and "captured training call 0" in said[1], said
        assert not Bundle(os.path.join(out, "capture", "pre", "rank00000")).get("modules")


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    yield autocapture_step.run_cases(tmp, tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("captured"))
    for p in (tmp / "ro", tmp / "ro-existing"):
        p.chmod(0o755)


@pytest.mark.parametrize("name", autocapture_step.CASES)
def test_every_capture_failure_in_the_pinned_env(worker_runs, name):
    """The main env's cases (tests/integration/test_autocapture_guard.py) with this env's torch and megatron-core."""
    autocapture_step.check(worker_runs, name)
