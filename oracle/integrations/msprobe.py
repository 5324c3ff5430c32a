"""Import mindstudio-probe (msprobe) dumps as captures.

A dump directory ``DUMP/step{S}/rank{R}/`` (``proc{PID}/`` without torch.distributed) holds
``dump.json`` and, for the tensor task, ``dump_tensor_data/*.pt``. Parameter gradients are the
entries ``Module.<module path>.<Class>.parameters_grad.<n>`` = {leaf: [tensor description]}; the
parameter's name is ``<module path>.<leaf>``. Forward entries ``Module.<path>.<Class>.forward.<n>``
carry the parameters the forward used (``parameters``: {leaf: description}).

With tensors (task ``tensor``) the import is a capture: gradients, and the weights from the
forward entries (so ``oracle score`` can check it is the oracle's step; the inputs are not
comparable and are reported as unverified). With statistics only it is a norm-only capture from
each gradient's ``Norm``. ``.pt`` files are read with ``torch.load(weights_only=True)`` only, and
only from the dump's own ``dump_tensor_data`` folder.

For a Megatron model (``megatron_tp``), each rank's dump becomes a Megatron rank bundle (the TP
layout read from the module classes: ColumnParallelLinear and VocabParallelEmbedding split dim 0,
RowParallelLinear dim 1; partial sums per megatron/layout.partial_sum), which ``oracle merge``
merges like the hook's captures. A dump is named by its global rank only; its TP/DP/PP
coordinates follow from the sizes given (``megatron_dp``, ``megatron_pp``) and Megatron's default
rank order tp-cp-ep-dp-pp (TP fastest, PP slowest, CP = 1):

    rank = tp_rank + TP * (dp_rank + DP * pp_rank)

A pipeline stage's layer offset is not in the dump: it is taken as pp_rank x (the decoder layers
this dump holds), i.e. an even split, and recorded as assumed. Such a rank bundle holds no inputs
and no config: its merge needs ``--hf-config`` and can be scored, not replayed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..bundle.store import BundleWriter, check_not_input
from ..errors import BundleError, InputNotFound
from .megatron.layout import partial_sum

_GRAD = re.compile(r"^Module\.(?P<path>.+)\.(?P<cls>[A-Za-z_][A-Za-z0-9_]*)\.parameters_grad\.(?P<n>\d+)$")
_FWD = re.compile(r"^Module\.(?P<path>.+)\.(?P<cls>[A-Za-z_][A-Za-z0-9_]*)\.forward\.(?P<n>\d+)$")
_SPLIT = {"ColumnParallelLinear": 0, "VocabParallelEmbedding": 0, "RowParallelLinear": 1}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def megatron_coords(rank: int, *, tp: int, dp: int = 1, pp: int = 1) -> dict[str, int]:
    """Coordinates of global rank ``rank`` in Megatron's default order tp-cp-ep-dp-pp (CP = 1)."""
    if not 0 <= rank < tp * dp * pp:
        raise BundleError(f"dump rank {rank} is outside TP {tp} x DP {dp} x PP {pp} = {tp * dp * pp} ranks; "
                          "give the run's sizes with --megatron-tp / --megatron-dp / --megatron-pp")  # fmt: skip
    return {"rank": rank, "tp_rank": rank % tp, "tp_size": tp, "dp_rank": (rank // tp) % dp, "dp_size": dp,
            "pp_rank": rank // (tp * dp), "pp_size": pp, "cp_size": 1}  # fmt: skip


def dump_dirs(path: str | Path, *, step: int | None = None, rank: int | None = None) -> list[Path]:
    p = Path(path)
    if not p.exists():
        raise InputNotFound(f"msprobe dump {p} does not exist")
    found = sorted(d.parent for d in p.rglob("dump.json"))
    if step is not None:
        found = [d for d in found if any(part == f"step{step}" for part in d.parts)]
    if rank is not None:
        found = [d for d in found if d.name == f"rank{rank}"]
    if not found:
        raise BundleError(
            f"{p}: no dump.json"
            + (f" for step {step}" if step is not None else "")
            + (f" rank {rank}" if rank is not None else "")
        )
    return found


def _load_pt(folder: Path, data_name: str, expect: dict[str, Any]) -> torch.Tensor:
    if Path(data_name).name != data_name:
        raise BundleError(f"{folder}: data_name {data_name!r} points outside dump_tensor_data; refusing it")
    f = folder / "dump_tensor_data" / data_name
    if not f.is_file():
        raise BundleError(f"{folder}: {data_name} named in dump.json is missing from dump_tensor_data")
    t = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor):
        raise BundleError(f"{f} does not hold a tensor")
    if list(t.shape) != list(expect.get("shape", t.shape)):
        raise BundleError(f"{f}: shape {list(t.shape)} but dump.json says {expect.get('shape')}")
    return t


def read_dump(folder: Path) -> dict[str, Any]:
    try:
        d = json.loads((folder / "dump.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BundleError(f"{folder / 'dump.json'} cannot be read as JSON ({e})") from e
    if not isinstance(d, dict) or not isinstance(d.get("data"), dict):
        raise BundleError(f"{folder / 'dump.json'} has no 'data' object; is this an msprobe dump?")
    grads, norms, weights, classes = {}, {}, {}, {}
    for key, entry in d["data"].items():
        if m := _GRAD.match(key):
            for leaf, descs in entry.items():
                desc = descs[0] if isinstance(descs, list) else descs
                name = f"{m['path']}.{leaf}"
                classes[name] = m["cls"]
                if desc.get("Norm") is not None:
                    norms[name] = float(desc["Norm"])
                if desc.get("data_name"):
                    grads[name] = _load_pt(folder, desc["data_name"], desc)
        elif (m := _FWD.match(key)) and m["n"] == "0":
            for leaf, desc in (entry.get("parameters") or {}).items():
                if isinstance(desc, dict) and desc.get("data_name"):
                    weights[f"{m['path']}.{leaf}"] = _load_pt(folder, desc["data_name"], desc)
    if not norms and not grads:
        raise BundleError(f"{folder / 'dump.json'} holds no parameters_grad entries; dump with level L0 or mix")
    return {
        "task": d.get("task"),
        "level": d.get("level"),
        "grads": grads,
        "norms": norms,
        "weights": weights,
        "classes": classes,
    }


def import_dump(path: str | Path, out: str | Path, *, step: int | None = None, rank: int | None = None,
                precision: str = "unknown", megatron_tp: int | None = None, megatron_rank: int | None = None,
                megatron_dp: int = 1, megatron_pp: int = 1, sequence_parallel: bool = False, stage: str = "pre-finalize",
                overwrite: bool = False) -> Path:  # fmt: skip
    check_not_input(out, [path])  # a bundle written into the dump it reads (issue 41)
    dirs = dump_dirs(path, step=step, rank=rank)
    if len(dirs) > 1:
        raise BundleError(
            f"{path} holds {len(dirs)} dumps ({', '.join(str(d) for d in dirs[:4])}); choose one with --step / --rank"
        )
    folder = dirs[0]
    d = read_dump(folder)
    source = {"msprobe": str(folder), "task": d["task"], "level": d["level"]}
    if not d["grads"]:
        with BundleWriter(out, "norms", overwrite=overwrite) as w:
            w.manifest.update(precision=precision, norms=d["norms"], source=source)
        return Path(out)
    with BundleWriter(out, "capture", overwrite=overwrite) as w:
        w.manifest.update(recipe={"name": None, "config": {}}, precision=precision, source=source, loss=None)
        if megatron_tp is not None:
            r = megatron_rank if megatron_rank is not None else int(re.sub(r"\D", "", folder.name) or 0)
            coords = megatron_coords(r, tp=megatron_tp, dp=megatron_dp, pp=megatron_pp)
            layout = {n: {"tensor_model_parallel": d["classes"].get(n) in _SPLIT, "partition_dim": _SPLIT.get(d["classes"].get(n), -1),
                          "partition_stride": 1, "sequence_parallel": partial_sum(n, tp=megatron_tp, sp=sequence_parallel) == "tokens"}
                      for n in d["grads"]}  # fmt: skip
            per_stage = len({m[1] for n in d["grads"] if (m := _LAYER.search(n))})
            w.manifest["megatron"] = {"stage": stage, "coords": coords, "calculate_per_token_loss": True, "num_tokens": None,
                                      "layout": layout, "config": {"sequence_parallel": sequence_parallel},
                                      "layer_offset": coords["pp_rank"] * per_stage,
                                      "layer_offset_assumed": "even split" if megatron_pp > 1 else None,
                                      "from_msprobe": True}  # fmt: skip
        w.add("grads", d["grads"])
        if d["weights"]:
            w.add("weights", d["weights"])
    return Path(out)
