"""What ``oracle merge`` holds: merged parameter by parameter and streamed, against the whole model at once.

    python benchmarks/merge_memory.py [--vocab V] [--hidden H] [--layers L]

Writes one TP 1 rank capture (the hook's ``capture_rank``, no Megatron needed) of an embedding and an output
layer of V x H, a final norm and L decoder layers' ``linear_fc2`` (H x 4H), every parameter with a float32
gradient; then merges it in two fresh child processes: with the default shard size (``merge.STREAM_BYTES``)
and with one shard per group (all merged weights held, written, then all gradients: half of what merge held
before it streamed, when weights and gradients were held together).
Prints each peak resident set above the child's start, in units of the capture's tensor bytes, side by side.
Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
from oracle.integrations.megatron import merge
ranks, out, whole = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
hf = json.loads(sys.argv[4])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
if whole:
    merge.STREAM_BYTES = 1 << 62
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
merge.merge_ranks([ranks], out, recipe="qwen3", hf_config=hf)
print(json.dumps({"extra": status("VmHWM") - before}))
"""


def _rank(folder: Path, vocab: int, hidden: int, layers: int) -> int:
    import torch

    from oracle.integrations.megatron.hook import capture_rank

    torch.manual_seed(0)
    m = torch.nn.Module()
    shapes = {"embedding.word_embeddings": (vocab, hidden), "decoder.final_layernorm": (hidden,), "output_layer": (vocab, hidden),
              **{f"decoder.layers.{i}.mlp.linear_fc2": (hidden, 4 * hidden) for i in range(layers)}}  # fmt: skip
    for dotted, shape in shapes.items():
        parent = m
        for part in dotted.split("."):
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.weight = torch.nn.Parameter(torch.randn(shape))
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    coords = {"rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1}
    capture_rank(m, folder, stage="post-finalize", batch={"input_ids": torch.arange(8).view(1, 8)}, loss=1.0, num_tokens=8,
                 coords=coords)  # fmt: skip
    return 2 * sum(p.numel() * 4 for p in m.parameters())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    a = ap.parse_args()
    hf = {"model_type": "qwen3", "vocab_size": a.vocab, "hidden_size": a.hidden, "intermediate_size": 4 * a.hidden,
          "num_hidden_layers": a.layers, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": a.hidden // 8,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        total = _rank(Path(tmp) / "pre", a.vocab, a.hidden, a.layers)
        from oracle.integrations.megatron import merge

        need = merge.memory_need([Path(tmp) / "pre"])
        res = {}
        for name, whole in (("one shard", "1"), ("streamed", "0")):
            p = subprocess.run([sys.executable, "-c", CHILD, str(Path(tmp) / "pre"), str(Path(tmp) / name.replace(" ", "-")),
                                whole, json.dumps(hf)], capture_output=True, text=True)  # fmt: skip
            if p.returncode:
                sys.stderr.write(p.stderr[-3000:])
                return 1
            res[name] = json.loads(p.stdout)["extra"]
    print(f"merge of one rank: {a.layers} layers, vocabulary {a.vocab} x hidden {a.hidden}; weights and float32 "
          f"gradients {total / 2**20:.0f} MiB")
    for name, extra in res.items():
        print(f"  {name:<12} peak above the start {extra / 2**20:7.0f} MiB = {extra / total:4.2f}x the tensors")
    print(f"  judge's estimate of the streamed merge (merge.memory_need, from the manifests): "
          f"{need / 2**20:.0f} MiB = {need / max(res['streamed'], 1):.2f}x the streamed peak")
    print(f"  streamed / one shard per group: {res['streamed'] / res['one shard']:.2f}x (a shard file closes at the "
          "first tensor that takes it to 256 MiB, merge.STREAM_BYTES; before streaming merge held weights and "
          "gradients at once: 1x the tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
