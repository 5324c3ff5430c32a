"""ms-swift's own Megatron Qwen3-VL step (peer.py), each rank captured by the documented hook.

Test code only; runs inside the pinned environment (``.venv-swift``) with this checkout on
``PYTHONPATH``. It observes the step where peer.py records it: ms-swift's ``get_batch`` (the batch
as the model receives it, labels already rolled by -1) and ``loss_func`` (the token-loss sum and
count), then ``oracle.integrations.megatron.hook.capture_rank`` on every rank right before
``finalize_model_grads`` (``OUT/pre/rankNNNNN``) and right after (``OUT/post/rankNNNNN``).
Nothing is passed that the run does not record itself: no vocabulary, no config, no label
convention (the hook finds them in the model and the batch).

    from rank_capture import run
    run(out, tp=2, sp=True)     # OUT/pre, OUT/post
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VENV = os.path.join(ROOT, ".venv-swift", "bin", "python")


def available() -> bool:
    """.venv-swift is built and this checkout's oracle installed in it: .ci/install-oracle marks it last (CI builds
    it beside README command 2, whose tests must not pick it up half made)."""
    return os.path.exists(os.path.join(ROOT, ".venv-swift", ".oracle-ready"))


def run(out: str, tp: int = 1, sp: bool = False, dtype: str = "fp32", timeout: float = 600.0) -> str:
    """One step at TP ``tp`` (+SP), ``dtype`` (tiny.sample's image straddles the middle of the row:
    under SP at TP 2 both ranks hold deepstack tokens)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), ORACLE_RANK_CAPTURE=out)
    cmd = [VENV, os.path.abspath(__file__), out, str(tp), str(int(sp)), dtype]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"ms-swift peer failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
    return out


def env_capture(out: str, tp: int = 1, sp: bool = False, dtype: str = "fp32", timeout: float = 600.0,
                env: dict | None = None, packed: bool = False) -> str:  # fmt: skip
    """The same step captured as the user would: peer.py unchanged, only ``ORACLE_CAPTURE=OUT/capture``
    in its environment (the start-up hook, oracle/integrations/megatron/autocapture.py), plus ``env``
    (e.g. ``ORACLE_CAPTURE_MODULES``, or peer.py's ``SWIFT_PEER_FAULT``); ``packed``: the user's packed
    step (peer.run's ``packed``). -> OUT/capture."""
    cap = os.path.join(out, "capture")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), ORACLE_CAPTURE=cap, **(env or {}))
    cmd = [VENV, os.path.join(HERE, "peer.py"), out, "--tp", str(tp), *(["--sp"] if sp else []), "--dtype", dtype,
           *(["--packed"] if packed else [])]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"ms-swift peer under ORACLE_CAPTURE failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
    return cap


def packed_capture(out: str, dtype: str = "bf16", env: dict | None = None, capture: bool = True,
                   timeout: float = 600.0, plain_first: bool = False) -> str:  # fmt: skip
    """The H20 path of the user's PACKED step, captured as the user would (harness for other tests).

    ms-swift 3.12.1's own Megatron Qwen3-VL on megatron-core 0.12.1 in ``.venv-swift``, TP 2 + SP,
    ms-swift's packing collation of 3 samples (2 with images) plus 1 SP pad singleton
    (tests/swift/packed.py), THD attention through the TE stand-in (tests/swift/te_thd.py), full
    uniform recompute, ``dtype`` fp32 or bf16 (Float16Module, fp32 main_grad); peer.py unchanged, only
    ``ORACLE_CAPTURE=OUT/capture`` and ``ORACLE_CAPTURE_MODULES=layers`` in its environment, plus
    ``env`` (e.g. peer.py's ``SWIFT_PEER_FAULT``). ``capture=False``: the same run without them.
    Returns ``OUT/capture`` (rank folders under ``pre/`` and ``post/``); each rank's main_grads as
    the run saw them are in ``OUT/raw/rankN/grads_post.safetensors``. ``plain_first``: each rank runs the
    same call once before, uncaptured (``ORACLE_CAPTURE_STEP=1`` captures the second), its main_grads in
    ``OUT/raw/rankN/grads_post_plain.safetensors``: the capture's non-invasiveness without a second run.
    For example::

        cap = packed_capture(str(tmp_path / "h20"), "bf16")
        merged = merge_ranks([Path(cap) / "pre"], tmp_path / "h20.cap", recipe="qwen3-vl")
    """
    if capture:
        return env_capture(out, tp=2, sp=True, dtype=dtype, timeout=timeout, packed=True,
                           env={"ORACLE_CAPTURE_MODULES": "layers", **(env or {}),
                                **({"SWIFT_PEER_PLAIN_FIRST": "1", "ORACLE_CAPTURE_STEP": "1"} if plain_first else {})})  # fmt: skip
    e = {k: v for k, v in os.environ.items() if not k.startswith("ORACLE_")}
    e.update(PYTHONPATH=os.pathsep.join([ROOT, HERE]), **(env or {}))
    cmd = [VENV, os.path.join(HERE, "peer.py"), out, "--tp", "2", "--sp", "--dtype", dtype, "--packed"]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"ms-swift packed peer failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
    return os.path.join(out, "capture")


def _patch_peer() -> None:
    """Inside a rank: record ms-swift's batch and loss, and capture before and after finalize."""
    import peer
    import standins

    importer = standins.import_swift_megatron

    def import_then_patch():
        importer()
        _patch_trainer(peer)

    standins.import_swift_megatron = import_then_patch  # peer.worker imports swift.megatron first


def _patch_trainer(peer) -> None:
    from swift.megatron.trainers.trainer import MegatronTrainer

    from oracle.integrations.megatron.hook import capture_rank

    seen: dict = {}
    get_batch, loss_func, main_grads = MegatronTrainer.get_batch, MegatronTrainer.loss_func, peer._main_grads

    def recording_get_batch(self, *a, **k):
        batch = get_batch(self, *a, **k)
        seen["batch"] = batch
        return batch

    def recording_loss_func(self, output_tensor, **k):
        out = loss_func(self, output_tensor, **k)
        seen["loss"], seen["num_tokens"] = out[0].detach().clone(), int(out[1])
        return out

    def capturing_main_grads(model):
        seen["calls"] = seen.get("calls", 0) + 1  # peer.py reads main_grads once before finalize, once after
        stage, sub = ("pre-finalize", "pre") if seen["calls"] == 1 else ("post-finalize", "post")
        b = seen["batch"]
        capture_rank(model, os.path.join(os.environ["ORACLE_RANK_CAPTURE"], sub), stage=stage,
                     batch=b, loss=seen["loss"], num_tokens=seen["num_tokens"],
                     packed_seq_params=b.get("packed_seq_params"))  # fmt: skip
        return main_grads(model)

    MegatronTrainer.get_batch, MegatronTrainer.loss_func, peer._main_grads = (
        recording_get_batch, recording_loss_func, capturing_main_grads)  # fmt: skip


def _launch(out: str, tp: int, sp: bool, dtype: str) -> None:
    """One process per TP rank (peer.py's worker, patched), as peer.run starts them."""
    sys.path.insert(0, HERE)
    import peer
    import tiny

    model_dir = os.path.join(out, "hf")
    tiny.write_model_dir(model_dir)
    port = peer._free_port()
    procs = []
    for rank in range(tp):
        e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp),
                 LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", out, model_dir, str(tp), str(int(sp)), dtype]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if bad:
        sys.stderr.write(logs[bad[0][0]][-6000:])
        raise SystemExit(f"ranks failed: {bad}")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        sys.path.insert(0, HERE)
        _patch_peer()
        import peer

        _, _, out_, mdir, tp_, sp_, dt = sys.argv
        peer.worker(out_, mdir, int(tp_), bool(int(sp_)), dt)
    else:
        _launch(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])), sys.argv[4])
