"""One training call of a tiny megatron-core 0.12.1 GPTModel through the schedule a training loop
takes (``get_forward_backward_func()``), in a process of its own, as a rank runs it: with
``ORACLE_CAPTURE`` set the capture hook is installed as the start-up line installs it.

``python tests/autocapture_step.py OUT CASES_JSON``: for each case ``{"name", "env", "fault"}`` in turn
(the process's environment set to the case's, the hook's per-process state reset as in a fresh
process), one training call of a freshly built model (the same seed each time); writes
``OUT/NAME.safetensors`` (every parameter's gradient after the loop's finalize) and ``OUT/NAME.err``
(what the call printed on stderr). Test-only faults (``fault``): ``eacces`` (every
``os.open`` / ``os.mkdir`` under ORACLE_CAPTURE refused, as a read-only folder does for a non-root
user: this test machine runs as root, where mode 555 stops nothing), ``enospc`` (the bundle writer
runs out of disk after its first file), ``hook`` (copying the batch to the CPU fails mid-step).
"""

from __future__ import annotations

import errno
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if os.environ.get("ORACLE_CAPTURE"):  # what oracle_capture.pth does at start-up
    from oracle.integrations.megatron import autocapture

    autocapture.install()

import contextlib  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

# -- the cases (tests/integration/test_autocapture_guard.py, tests/swift/test_autocapture.py) ----------------
AS_ROOT = os.geteuid() == 0
LONG = "x" * 300  # one path component longer than NAME_MAX (255)


def read_only(path):
    """A folder this process cannot write: mode 555, or (as root) EACCES planted under it."""
    os.makedirs(path, exist_ok=True)
    if not AS_ROOT:
        os.chmod(path, 0o555)
    return "eacces" if AS_ROOT else ""


def cases(tmp):
    """name -> (env, fault, what the one stderr line must say, user files that must stay as they are)."""
    user = {}
    os.makedirs(tmp / "pre-is-file")
    (tmp / "pre-is-file" / "pre").write_text("my notes\n")
    user["pre-is-file"] = [tmp / "pre-is-file" / "pre"]
    (tmp / "a-file").write_text("my data\n")
    user["a-file"] = [tmp / "a-file"]
    os.makedirs(tmp / "user-rank" / "pre" / "rank00000")
    (tmp / "user-rank" / "pre" / "rank00000" / "results.csv").write_text("1,2,3\n")
    user["user-rank"] = [tmp / "user-rank" / "pre" / "rank00000" / "results.csv"]
    ro_new = read_only(tmp / "ro")
    os.makedirs(tmp / "ro-existing")
    (tmp / "ro-existing" / "keep.txt").write_text("mine\n")
    user["read-only-existing"] = [tmp / "ro-existing" / "keep.txt"]
    ro_old = read_only(tmp / "ro-existing")
    c = {
        "read-only-new": ({"ORACLE_CAPTURE": str(tmp / "ro" / "cap")}, ro_new, "folder this process can write"),
        "read-only-existing": ({"ORACLE_CAPTURE": str(tmp / "ro-existing")}, ro_old, "folder this process can write"),
        "proc": ({"ORACLE_CAPTURE": "/proc/oracle-capture"}, "", "cannot write /proc/oracle-capture"),
        "a-file": ({"ORACLE_CAPTURE": str(tmp / "a-file")}, "", "a file is in the way"),
        "pre-is-file": ({"ORACLE_CAPTURE": str(tmp / "pre-is-file")}, "", "a file is in the way"),
        "user-rank": ({"ORACLE_CAPTURE": str(tmp / "user-rank")}, "", "move it away or point ORACLE_CAPTURE at another"),
        "too-long": ({"ORACLE_CAPTURE": str(tmp / LONG / "cap")}, "", "shorter path"),
        "disk-full": ({"ORACLE_CAPTURE": str(tmp / "full")}, "enospc", "disk with room"),
        "hook-fails": ({"ORACLE_CAPTURE": str(tmp / "hook")}, "hook", "out of host memory"),
        "budget-1e400": ({"ORACLE_CAPTURE": str(tmp / "b1"), "ORACLE_CAPTURE_MODULES": "layers",
                          "ORACLE_CAPTURE_MODULES_BUDGET_MB": "1e400"}, "", "ORACLE_CAPTURE_MODULES_BUDGET_MB='1e400'"),
        "budget-words": ({"ORACLE_CAPTURE": str(tmp / "b2"), "ORACLE_CAPTURE_MODULES": "layers",
                          "ORACLE_CAPTURE_MODULES_BUDGET_MB": "lots"}, "", "ORACLE_CAPTURE_MODULES_BUDGET_MB='lots'"),
        "step-word": ({"ORACLE_CAPTURE": str(tmp / "s1"), "ORACLE_CAPTURE_STEP": "first"}, "", "ORACLE_CAPTURE_STEP"),
        "step-negative": ({"ORACLE_CAPTURE": str(tmp / "s2"), "ORACLE_CAPTURE_STEP": "-1"}, "", "integer >= 0"),
        "step-float": ({"ORACLE_CAPTURE": str(tmp / "s3"), "ORACLE_CAPTURE_STEP": "0.5"}, "", "integer >= 0"),
        "catastrophic-regex": ({"ORACLE_CAPTURE": str(tmp / "rx"), "ORACLE_CAPTURE_MODULES": r"^(\w+\.?)+!$"}, "",
                               "exponential time"),
        "ok-with-layers": ({"ORACLE_CAPTURE": str(tmp / "ok"), "ORACLE_CAPTURE_MODULES": "layers"}, "",
                           "captured training call 0"),
    }  # fmt: skip
    return c, user


def run_cases(tmp, plain_out, out) -> dict:
    """The plain run (no variable) and every case in one process with the variable set at start-up,
    both with this interpreter; what the checks need."""
    import subprocess
    import time

    from safetensors.torch import load_file

    c, user = cases(tmp)
    before = {k: [(f.read_bytes(), f.stat().st_mtime_ns) for f in fs] for k, fs in user.items()}

    def run(where, spec, env_start):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORACLE_CAPTURE")}
        env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), **env_start)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), str(where), json.dumps(spec)], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        return time.monotonic() - t0

    run(plain_out, [{"name": "plain"}], {})
    spec = [{"name": n, "env": env, "fault": fault} for n, (env, fault, _) in c.items()]
    seconds = run(out, spec, {"ORACLE_CAPTURE": str(tmp / "first")})  # set at start-up, as a job sets it
    return {"tmp": tmp, "cases": c, "user": user, "before": before, "out": out, "seconds": seconds,
            "plain": load_file(os.path.join(plain_out, "plain.safetensors"))}  # fmt: skip


def check(runs: dict, name: str) -> None:
    """The call ran (the process went on to the next case), its gradients after the loop's finalize
    are bitwise the run's without the variable, stderr holds the problem once, with its fix, and
    the user's files in the way are as they were."""
    import torch
    from safetensors.torch import load_file

    env, fault, says = runs["cases"][name]
    grads = load_file(os.path.join(runs["out"], f"{name}.safetensors"))
    assert set(grads) == set(runs["plain"]) and all(torch.equal(grads[n], runs["plain"][n]) for n in grads), name
    with open(os.path.join(runs["out"], f"{name}.err")) as f:
        err = f.read()
    lines = [x for x in err.splitlines() if x.startswith("oracle:")]
    assert sum(says in x for x in lines) == 1, err
    assert "Traceback" not in err, err
    if name != "ok-with-layers" and not name.startswith(("budget", "catastrophic")):
        assert len(lines) == 1, err  # once: nothing else said for it
    with open(os.path.join(runs["out"], f"{name}.json")) as f:
        assert json.load(f) == {"hooks": 0, "finalize_restored": True}, name  # nothing of the capture stays on the model
    for f, (data, mtime) in zip(runs["user"].get(name, []), runs["before"].get(name, [])):
        assert f.read_bytes() == data and f.stat().st_mtime_ns == mtime, f


def check_places(runs: dict) -> None:
    """A user folder where the rank bundle goes keeps its file and gets no bundle; a full disk leaves
    no half-written bundle; a bad module selection still captures the step (without boundaries)."""
    from oracle.bundle.store import Bundle

    tmp = runs["tmp"]
    assert os.listdir(tmp / "user-rank" / "pre" / "rank00000") == ["results.csv"]
    assert os.listdir(tmp / "full" / "pre") == []  # no bundle, no debris, no probe
    assert sorted(os.listdir(tmp / "ro-existing")) == ["keep.txt"]
    for name in ("b1", "b2", "rx"):
        assert (tmp / name / "pre" / "rank00000" / "manifest.json").exists(), name
        assert (tmp / name / "post" / "rank00000" / "manifest.json").exists(), name
    assert any(g.startswith("mod.") for g in Bundle(tmp / "ok" / "pre" / "rank00000").groups())
    assert not any(g.startswith("mod.") for g in Bundle(tmp / "rx" / "pre" / "rank00000").groups())


CASES = ["read-only-new", "read-only-existing", "proc", "a-file", "pre-is-file", "user-rank", "too-long", "disk-full",
         "hook-fails", "budget-1e400", "budget-words", "step-word", "step-negative", "step-float", "catastrophic-regex",
         "ok-with-layers"]  # fmt: skip



# -- the training process ---------------------------------------------------------------------


class CudaToCpu(TorchFunctionMode):
    """The schedule counts tokens in a ``device="cuda"`` tensor: on this CPU machine, the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def faults(kind: str, under: str):
    saved = (os.open, os.mkdir, torch.Tensor.to)
    import oracle.bundle.store as store

    saved_save = store.save_file
    try:
        _plant(kind, under)
        yield
    finally:
        os.open, os.mkdir, torch.Tensor.to = saved
        store.save_file = saved_save


def _plant(kind: str, under: str) -> None:
    if kind == "eacces":
        real_open, real_mkdir = os.open, os.mkdir

        def refuse(real):
            def f(path, *a, **k):
                if os.path.abspath(os.fsdecode(path)).startswith(os.path.abspath(under)):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
                return real(path, *a, **k)

            return f

        os.open, os.mkdir = refuse(real_open), refuse(real_mkdir)
    elif kind == "enospc":
        import oracle.bundle.store as store

        real_save, calls = store.save_file, []

        def save_file(tensors, path, *a, **k):
            calls.append(path)
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            return real_save(tensors, path, *a, **k)

        store.save_file = save_file
    elif kind == "hook":
        real_to = torch.Tensor.to

        def to(self, *a, **k):
            if a and a[0] == "cpu" and k.get("copy"):
                raise MemoryError("no host memory left for the copy")
            return real_to(self, *a, **k)

        torch.Tensor.to = to


def main(out: str, cases: list[dict]) -> None:
    import io

    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/pg", rank=0, world_size=1)
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from safetensors.torch import save_file

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    parallel_state.initialize_model_parallel(1, 1)
    base_env = dict(os.environ)
    for case in cases:
        os.environ.clear()
        os.environ.update({**base_env, **case.get("env", {})})
        for k in [k for k in os.environ if k.startswith("ORACLE_CAPTURE") and k not in case.get("env", {})]:
            del os.environ[k]
        if "autocapture" in globals():
            autocapture._state.update(calls=0, written=[], why=None, bad_step=False)
        err, real_err = io.StringIO(), sys.stderr
        sys.stderr = err
        try:
            with faults(case.get("fault", ""), os.environ.get("ORACLE_CAPTURE", "/nonexistent")):
                grads, left = one_step()
        finally:
            sys.stderr = real_err
        save_file(grads, os.path.join(out, case["name"] + ".safetensors"))
        with open(os.path.join(out, case["name"] + ".err"), "w") as f:
            f.write(err.getvalue())
        with open(os.path.join(out, case["name"] + ".json"), "w") as f:
            json.dump(left, f)
    torch.distributed.destroy_process_group()


def one_step() -> dict[str, torch.Tensor]:
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=64,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=1e-6, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, params_dtype=torch.float32, init_method_std=0.02,
    )  # fmt: skip
    s, vocab = 12, 64
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), vocab_size=vocab,
                     max_sequence_length=s, position_embedding_type="rope")  # fmt: skip
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (1, s), generator=g)
    b = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": torch.arange(s)[None],
         "loss_mask": torch.ones(1, s)}  # fmt: skip
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)

    def loss_func(output):
        total = (output.float() * b["loss_mask"]).sum()
        return total, torch.tensor(s, dtype=torch.int), {}

    def step(data_iterator, m):
        d = next(data_iterator)
        return m(d["tokens"], d["position_ids"], mask, labels=d["labels"]), loss_func

    def finalize(models, num_tokens=None):  # what a loop's finalize does to the grads (here: halve them)
        for p in models[0].parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)

    config.finalize_model_grads_func = finalize
    with CudaToCpu():
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([b]), model=[model], num_microbatches=1,
                                    seq_length=s, micro_batch_size=1, forward_only=False)  # fmt: skip
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    left = {"hooks": hooks, "finalize_restored": config.finalize_model_grads_func is finalize}
    return {n: p.grad.contiguous() for n, p in model.named_parameters()}, left


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
