"""The judge's detection curve: faults planted at graded strength on the packed step of both paths, and honest pairs.

    bash .ci/swift-env && bash .ci/mindspeed-env       # the two pinned training environments (once)
    python benchmarks/detection_power.py OUT --quick    # the 910B path, 4 families, 2 strengths, 3 honest pairs
    python benchmarks/detection_power.py OUT            # both paths, every family, 24 honest pairs (hours here)
    python benchmarks/detection_power.py OUT --families swiglu attention --paths H20

The step is tests/peers/two_paths.py's (ms-swift's own Qwen3-VL, TP 2 + SP, 3 packed samples, 2 images,
full recompute, bf16 with fp32 main_grad, ``ORACLE_CAPTURE`` and ``ORACLE_CAPTURE_MODULES=layers,vit``, the
decoder layers' and the vision blocks' boundaries; ``--modules layers`` for the decoder's alone): the
H20 path (megatron-core) in ``.venv-swift``, the 910B path (MindSpeed on the torch_npu stand-in) in
``.venv-mindspeed``. Faults are this benchmark's own (benchmarks/detection_plants.py: module hooks and
monkeypatches inside the ranks, as a user's harness would plant them; none of oracle's or the tests'
fault switches). Each judged pair is ``oracle judge`` as a user runs it; its answer is read through
``verdict()`` alone (the JSON's ``answers.noise.faulty``, ``answers.born.per_run``, ``headline``).

Cost: the truth and the band depend only on run A's capture, so every plant is judged with the honest
run of the other path as A, in one judge work folder per planted path: the stages keyed by A (merge-A,
truth, band) are reused and each plant costs one capture plus merge-B, score, B's local replay and the
report.

Printed, side by side: the false-alarm rate on the honest pairs (a pair alarms when the first line calls
any run faulty), and per family and strength the share of plants called right: the planted run alone
faulty, born in the planted layer (decoder layer K, ViT block K, the merger, the head) and in the planted
direction. Each plant's strength is also measured: its effect = the largest over parameters of
||g_planted - g_honest|| / ||g_truth|| / band (the parameter's band: the largest emulated honest member's
rel L2), the honest run being the same path's unplanted capture; the target (issue 40) is >= 90 % called
right among plants of effect >= 2 and no false alarm on >= 20 honest pairs. ``OUT/detection_power.json``
holds every number, ``OUT/detection_power.png`` the curve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWIFT = ROOT / "tests" / "swift"
VENVS = {"H20": ROOT / ".venv-swift" / "bin" / "python", "910B": ROOT / ".venv-mindspeed" / "bin" / "python"}
OTHER = {"H20": "910B", "910B": "H20"}
SEED = 1234  # tests/swift/tiny.py's

# (family, target, direction, layer key, strengths); layer keys: ("decoder", K), ("vit", K), ("merger",), ("head",)
FULL = [
    *[("scale", t, d, key, (0.003, 0.01, 0.03, 0.1)) for t, key in (
        ("language_model.decoder.layers.0.mlp", ("decoder", 0)),
        ("language_model.decoder.layers.1.self_attention", ("decoder", 1)),
        ("language_model.decoder.layers.3.mlp", ("decoder", 3)),
        ("visual.visual.blocks.0", ("vit", 0)), ("visual.visual.merger", ("merger",)),
        ("language_model.output_layer", ("head",))) for d in ("forward", "backward")],
    *[("swiglu", k, "backward", ("decoder", k), (0.1, 0.3, 1.0)) for k in (0, 1, 3)],
    *[("attention", k, d, ("decoder", k), (0.1, 0.3, 1.0)) for k in (0, 1, 3) for d in ("forward", "backward")],
    ("rotary", None, "forward", ("decoder", 0), (0.1, 0.3, 1.0)),
    *[("bf16acc", k, "backward", ("decoder", k), (7, 5, 3)) for k in (0, 3)],
]  # fmt: skip
QUICK = [
    ("scale", "language_model.decoder.layers.0.mlp", "backward", ("decoder", 0), (0.01, 0.05)),
    ("swiglu", 0, "backward", ("decoder", 0), (0.3, 1.0)),
    ("attention", 1, "backward", ("decoder", 1), (0.3, 1.0)),
    ("rotary", None, "forward", ("decoder", 0), (0.3, 1.0)),
]
# honest pairs: (weights seed, micro-batches, H20 dtype, 910B dtype)
FULL_HONEST = [(s, m, da, db) for s in (SEED, 1, 2, 3) for m in (1, 2)
               for da, db in (("bf16", "bf16"), ("fp32", "bf16"), ("bf16", "fp32"))]  # fmt: skip
QUICK_HONEST = [(SEED, 1, "bf16", "bf16"), (1, 1, "bf16", "bf16"), (SEED, 1, "fp32", "bf16")]


# -- the judge's answer: the one place that reads its JSON --------------------------------------------
def verdict(doc: dict) -> dict:
    """{"faulty": [runs called faulty], "born": {run: (module, direction)}, "headline": first line,
    "left_out": {run: [gradients left out of the verdict]}}: the decision's own ``left_out`` (gradients the
    framework never reduced that no stage judged); the unreduced ViT gradients the judge's rank-view stage
    judges are in the verdict, so a plant's effect counts them. A judge of before the decision JSON: the
    framework's unreduced list."""
    ans = doc.get("answers") or {}
    born = {r["run"]: (r.get("module"), r.get("direction")) for r in (ans.get("born") or {}).get("per_run") or []}
    per = (doc.get("decision") or {}).get("per_run")
    if per is not None:
        left = {r["run"]: sorted(x["name"] for x in r.get("left_out") or []) for r in per}
    else:
        fw = ans.get("framework") or {}
        left = {run: sorted({*(fw.get("shared") or []), *only}) for run, only in (fw.get("only") or {}).items()}
    faulty = list((ans.get("noise") or {}).get("faulty") or [])
    return {"faulty": faulty, "born": born, "headline": doc.get("headline", ""), "left_out": left}


def layer_key(module: str | None) -> tuple | None:
    """Where a module name lives, in either naming (the judge's merged names or megatron's)."""
    if not module:
        return None
    for pat, kind in ((r"(?:decoder\.)?layers\.(\d+)", "decoder"), (r"visual\.blocks\.(\d+)", "vit")):
        m = re.search(pat, module)
        if m and (kind == "vit" or "visual" not in module):
            return (kind, int(m.group(1)))
    if re.search(r"visual\.(deepstack_)?merger", module):
        return ("merger",)
    if re.search(r"lm_head|output_layer|language_model\.norm$|final_layernorm", module):
        return ("head",)
    return (module,)


def called_right(v: dict, run: str, key: tuple, direction: str) -> bool:
    module, d = v["born"].get(run, (None, None))
    return v["faulty"] == [run] and layer_key(module) == tuple(key) and d == direction


# -- captures -------------------------------------------------------------------------------------
def _shim(out: Path) -> Path:
    """A folder with a sitecustomize that imports the planting module in every process of the step."""
    d = out / "plant-shim"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                                        "import detection_plants\ndetection_plants.install()\n")  # fmt: skip
    return d


def capture(path: str, out: Path, shim: Path, dtype: str = "bf16", seed: int = SEED, microbatches: int = 1,
            plant: dict | None = None, reuse: bool = False, modules: str = "layers") -> Path:  # fmt: skip
    """One packed step of ``path`` captured by ``ORACLE_CAPTURE`` -> its rank folder (``.../capture/pre``);
    ``reuse``: a capture this benchmark already finished in ``out`` (its step log written last) is taken as it is."""
    cap = out / "capture"
    if reuse and (cap / "pre").is_dir() and (out / "step.log").is_file():
        return cap / "pre"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN", "DETECTION_"))}
    env.update(ORACLE_CAPTURE=str(cap), ORACLE_CAPTURE_MODULES=modules, DETECTION_SEED=str(seed),
               SWIFT_STEP_MICROBATCHES=str(microbatches), OMP_NUM_THREADS="1")  # fmt: skip
    if plant:
        env["DETECTION_PLANT"] = json.dumps(plant)
    if path == "H20":
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SWIFT), str(shim)])
        cmd = [str(VENVS[path]), str(SWIFT / "peer.py"), str(out), "--tp", "2", "--sp", "--dtype", dtype, "--packed"]
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(shim)])
        hf = out / "hf"
        subprocess.run([str(VENVS[path]), "-c", "import sys; sys.path.insert(0, sys.argv[1]); import tiny; "
                        "tiny.write_model_dir(sys.argv[2])", str(SWIFT), str(hf)], env=env, check=True,
                       capture_output=True, timeout=600)  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        sys.path.insert(0, str(ROOT / "tests" / "mindspeed"))
        import run as ms_run  # stdlib only: launches the ranks in the pinned interpreter

        keep = ("PYTHONPATH", "SWIFT_STEP_MICROBATCHES")
        try:
            res = ms_run.ranks("swift_npu_step.py", str(out), str(hf), "2", dtype, "packed", world=2, tag="SWIFT",
                               env={k: v for k, v in env.items() if k.startswith(("ORACLE_", "DETECTION_")) or k in keep},
                               python=str(VENVS[path]))  # fmt: skip
        except AssertionError as e:
            (out / "step.log").write_text(str(e))
            raise RuntimeError(f"{path} step failed; see {out / 'step.log'}:\n{str(e)[-3000:]}") from None
        (out / "step.log").write_text("\n".join(err for _, err in res))
        return cap / "pre"
    out.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    (out / "step.log").write_text(p.stdout + p.stderr)
    if p.returncode or not (cap / "pre").is_dir():
        raise RuntimeError(f"{path} step failed (exit {p.returncode}); see {out / 'step.log'}:\n{(p.stdout + p.stderr)[-3000:]}")
    return cap / "pre"


def judge(a: Path, b: Path, names: list[str], work: Path) -> dict:
    """``oracle judge A B`` as a user runs it; its JSON answer."""
    cmd = [sys.executable, "-m", "oracle", "judge", str(a), str(b), "--recipe", "qwen3-vl", "--name", names[0],
           "--name", names[1], "--out", str(work)]  # fmt: skip
    report = work / "report" / "judge.json"
    report.unlink(missing_ok=True)  # a plant's judge reuses the folder: never read the previous answer
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if not report.is_file():
        raise RuntimeError(f"oracle judge failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(report.read_text())


def effect(doc: dict, run: str, planted: Path, honest: Path, left_out=()) -> dict:
    """The plant's largest gradient effect relative to the honest spread, and its parameter:
    max over parameters of ||g_planted - g_honest|| / ||g_truth|| / band; over the gradients the verdict
    judges (``effect``) and over all of them (``effect_all``: ``left_out`` too)."""
    from oracle.bundle.store import Bundle

    rows = {p["name"]: p for c in doc["score"]["captures"] if c["name"] == run for p in c["params"]}
    hb, judged, every = Bundle(honest), (0.0, ""), (0.0, "")
    for name, g in Bundle(planted).iter_group("grads"):
        r = rows.get(name)
        if not r or not r.get("band") or not r.get("ref_norm"):
            continue
        e = float((g.double() - hb.load("grads", name).double()).norm()) / r["ref_norm"] / r["band"]
        every = max(every, (e, name))
        if name not in left_out:
            judged = max(judged, (e, name))
    return {"effect": judged[0], "effect_param": judged[1], "effect_all": every[0], "effect_all_param": every[1]}


# -- the run --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="work folder (new or empty)")
    ap.add_argument("--quick", action="store_true", help="the 910B path, 4 families at 2 strengths, 3 honest pairs")
    ap.add_argument("--paths", nargs="+", choices=["H20", "910B"], help="the planted paths (quick: 910B; full: both)")
    ap.add_argument("--families", nargs="+", help="only these families (scale swiglu attention rotary bf16acc)")
    ap.add_argument("--strengths", nargs="+", type=float, help="only these strengths (of the families that have them)")
    ap.add_argument("--targets", nargs="+", help="only plants whose target or layer contains one of these (e.g. output_layer, 0)")
    ap.add_argument("--honest", type=int, help="only the first N honest pairs")
    ap.add_argument("--modules", default="layers,vit",
                    help="ORACLE_CAPTURE_MODULES of every capture (default: the decoder layers and the vision blocks)")
    ap.add_argument("--reuse", action="store_true",
                    help="captures already finished in OUT are judged again as they are (the verdict changed, not the step)")
    ap.add_argument("--combine", nargs="+", type=Path, help="no run: these runs' detection_power.json as one, written to OUT")
    o = ap.parse_args(argv)
    if o.combine:
        return combine(o.combine, o.out)
    missing = [
        f"{p}: build it with bash .ci/{'swift' if p == 'H20' else 'mindspeed'}-env" for p, v in VENVS.items() if not v.exists()
    ]
    if missing:
        print("detection_power: the pinned environments are not built: " + "; ".join(missing), file=sys.stderr)
        return 2
    plants = [p for p in (QUICK if o.quick else FULL) if not o.families or p[0] in o.families]
    plants = [p for p in plants if not o.targets or any(t in str(p[1]) for t in o.targets)]
    honest = (QUICK_HONEST if o.quick else FULL_HONEST)[: o.honest]
    paths = o.paths or (["910B"] if o.quick else ["H20", "910B"])
    o.out.mkdir(parents=True, exist_ok=True)
    shim, t_start = _shim(o.out), time.time()
    doc = {"mode": "quick" if o.quick else "full", "machine": machine(), "modules": o.modules, "honest": [], "plants": [],
           "failed": []}  # fmt: skip
    caps: dict = {}

    def cap(path, dtype, seed, mb):
        k = (path, dtype, seed, mb)
        if k not in caps:
            caps[k] = capture(path, o.out / "caps" / f"{path}-{dtype}-s{seed}-mb{mb}", shim, dtype, seed, mb, reuse=o.reuse,
                              modules=o.modules)  # fmt: skip
        return caps[k]

    print(f"honest pairs: {len(honest)}", flush=True)
    for seed, mb, da, db in honest:
        t0 = time.time()
        tag = f"s{seed}-mb{mb}-{da}-{db}"
        work = o.out / "judge" / tag
        v = verdict(judge(cap("H20", da, seed, mb), cap("910B", db, seed, mb), ["H20", "910B"], work))
        row = {"pair": tag, "seed": seed, "microbatches": mb, "dtypes": [da, db], "alarm": bool(v["faulty"]),
               "headline": v["headline"], "seconds": round(time.time() - t0, 1)}  # fmt: skip
        doc["honest"].append(row)
        print(
            f"  {tag:28} {'FALSE ALARM' if row['alarm'] else 'honest':12} {row['seconds']:6.0f} s  {v['headline'][:150]}",
            flush=True,
        )
    t_honest = time.time()

    ref = o.out / "ref"
    for path in paths:
        other = OTHER[path]
        default = o.out / "judge" / f"s{SEED}-mb1-bf16-bf16"  # the honest pair A = H20, B = 910B: reused as it is
        work = default if path == "910B" and default.is_dir() else o.out / "plants" / path
        base_a, base_b = cap(other, "bf16", SEED, 1), cap(path, "bf16", SEED, 1)
        doc0 = judge(base_a, base_b, [other, path], work)  # the A stages, once; B's honest merge kept as the reference
        shutil.copytree(work / f"merge-{path}", ref / path, dirs_exist_ok=True)
        print(f"plants in the {path} run (A = {other}'s honest run; unplanted: {verdict(doc0)['headline'][:120]})", flush=True)
        for fam, target, direction, key, strengths in plants:
            for s in strengths:
                if o.strengths and s not in o.strengths:
                    continue
                t0 = time.time()
                spec = {"family": fam, "direction": direction, "strength": s}
                spec.update({"target": target} if fam == "scale" else {"layer": target} if target is not None else {})
                pdir = o.out / "caps" / f"plant-{path}-{fam}-{target}-{direction}-{s}"
                row = {"path": path, "family": fam, "target": target, "layer": list(key), "direction": direction,
                       "strength": s}  # fmt: skip
                try:
                    planted = capture(path, pdir, shim, plant=spec, reuse=o.reuse, modules=o.modules)
                    t1 = time.time()
                    d = judge(base_a, planted, [other, path], work)
                except RuntimeError as e:  # a plant that does not run is said and skipped, not counted
                    print(f"  {fam:9} {str(target):45} {direction:8} s={s:<6g} FAILED: {str(e)[:300]}", flush=True)
                    doc["failed"].append({**row, "error": str(e)[-2000:]})
                    continue
                v = verdict(d)
                row.update(effect(d, path, work / f"merge-{path}", ref / path, set(v["left_out"].get(path, ()))))
                eff = row["effect"]
                row.update(right=called_right(v, path, key, direction), alarm=path in v["faulty"],
                           born=v["born"].get(path), headline=v["headline"], capture_s=round(t1 - t0, 1),
                           judge_s=round(time.time() - t1, 1))  # fmt: skip
                doc["plants"].append(row)
                shutil.rmtree(pdir / "raw", ignore_errors=True)
                print(f"  {fam:9} {str(target):45} {direction:8} s={s:<6g} effect {eff:7.2f}x (all {row['effect_all']:.2f}x)  "
                      f"{'RIGHT' if row['right'] else 'wrong':5} {row['capture_s']:4.0f}+{row['judge_s']:3.0f} s  "
                      f"{v['headline'][:110]}", flush=True)  # fmt: skip
    doc["seconds"] = {"honest": round(t_honest - t_start, 1), "plants": round(time.time() - t_honest, 1),
                      "total": round(time.time() - t_start, 1)}  # fmt: skip
    doc["summary"] = summary(doc)
    print_summary(doc)
    (o.out / "detection_power.json").write_text(json.dumps(doc, indent=1))
    plot(doc, o.out / "detection_power.png")
    print(f"wrote {o.out / 'detection_power.json'} and {o.out / 'detection_power.png'}")
    return 0


def combine(files: list[Path], out: Path) -> int:
    """Several runs' numbers (e.g. one per planted path) as one table, JSON and plot."""
    docs = [json.loads(Path(f).read_text()) for f in files]
    doc = {"mode": "+".join(d["mode"] for d in docs), "machine": [d["machine"] for d in docs],
           **{k: [r for d in docs for r in d.get(k, [])] for k in ("honest", "plants", "failed")},
           "seconds": {k: sum(d["seconds"][k] for d in docs) for k in ("honest", "plants", "total")}}  # fmt: skip
    for r in doc["plants"]:  # a run of before the judged/all split measured all gradients
        r.setdefault("effect_all", r["effect"])
    doc["summary"] = summary(doc)
    print_summary(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "detection_power.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / "detection_power.png")
    return 0


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_at_start": [round(x, 2) for x in load] if load else None}  # fmt: skip


def summary(doc: dict) -> dict:
    h = doc["honest"]
    per = {}
    for r in doc["plants"]:
        k = f"{r['family']} s={r['strength']:g}"
        per.setdefault(k, []).append(r)
    strong = [r for r in doc["plants"] if r["effect"] >= 2]
    return {
        "honest_pairs": len(h), "false_alarms": sum(r["alarm"] for r in h),
        "false_alarm_rate": sum(r["alarm"] for r in h) / len(h) if h else None,
        "per_family_strength": {k: {"plants": len(v), "right": sum(r["right"] for r in v),
                                    "effect_min": min(r["effect"] for r in v), "effect_max": max(r["effect"] for r in v)}
                                for k, v in per.items()},
        "effect_ge_2": {"plants": len(strong), "right": sum(r["right"] for r in strong),
                        "share": sum(r["right"] for r in strong) / len(strong) if strong else None},
    }  # fmt: skip


def print_summary(doc: dict) -> None:
    s = doc["summary"]
    print(f"\nfalse alarms: {s['false_alarms']}/{s['honest_pairs']} honest pairs "
          f"(target: 0 on >= 20)   |   called right (run, layer, direction) per family and strength:")  # fmt: skip
    print(f"  {'family, strength':22} {'plants':>6} {'right':>6} {'share':>6}   effect (x honest spread)")
    for k, v in s["per_family_strength"].items():
        print(
            f"  {k:22} {v['plants']:>6} {v['right']:>6} {v['right'] / v['plants']:>6.0%}   {v['effect_min']:.2f}-{v['effect_max']:.2f}"
        )
    e = s["effect_ge_2"]
    share = "n/a" if e["share"] is None else f"{e['share']:.0%}"
    print(f"  plants of effect >= 2x: {e['right']}/{e['plants']} called right = {share} (target >= 90 %)")
    t = doc["seconds"]
    print(f"time: honest pairs {t['honest']:.0f} s, plants {t['plants']:.0f} s, total {t['total']:.0f} s")


def plot(doc: dict, png: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    fams = sorted({r["family"] for r in doc["plants"]})
    for i, fam in enumerate(fams):
        rows = [r for r in doc["plants"] if r["family"] == fam]
        ax.scatter([max(r["effect"], 1e-2) for r in rows], [int(r["right"]) + 0.04 * (i - len(fams) / 2) for r in rows],
                   label=fam, alpha=0.8)  # fmt: skip
    edges = [0, 1, 2, 4, 8, 16, 1e9]
    xs, ys = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        rows = [r for r in doc["plants"] if lo <= r["effect"] < hi]
        if rows:
            xs.append(max(min(r["effect"] for r in rows), 1e-2) * 0.5 + max(r["effect"] for r in rows) * 0.5)
            ys.append(sum(r["right"] for r in rows) / len(rows))
    ax.plot(xs, ys, "k-", label="share called right (binned)")
    ax.axvline(2, color="grey", ls=":")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylim(-0.15, 1.15)
    ax.set_xlabel("plant's largest gradient effect / honest spread (band)")
    ax.set_ylabel("called right (run, layer, direction)")
    s = doc["summary"]
    ax.set_title(f"oracle judge, {doc['mode']} mode: false alarms {s['false_alarms']}/{s['honest_pairs']} honest pairs",
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
