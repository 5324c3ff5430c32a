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

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402


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
                grads = one_step()
        finally:
            sys.stderr = real_err
        save_file(grads, os.path.join(out, case["name"] + ".safetensors"))
        with open(os.path.join(out, case["name"] + ".err"), "w") as f:
            f.write(err.getvalue())
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
    return {n: p.grad.contiguous() for n, p in model.named_parameters()}


if __name__ == "__main__":
    import json

    main(sys.argv[1], json.loads(sys.argv[2]))
