"""Fuzzed attacks on what lies beside an output and on a capture's stated fields (issue 30, item 4):
folders named like this tool's temporaries are removed or moved only when this user's oracle signed
them and no live writer holds them; a capture leaving any of recipe/precision/loss unsaid is
INCOMPLETE naming exactly those, whatever else it holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oracle.bundle import atomic
from oracle.bundle.store import Bundle, BundleWriter
from oracle.score.scorer import score

pytestmark = pytest.mark.rare  # a fuzzer: .ci/run's `pytest tests -m rare` (tests/conftest.py)

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
_DEAD: list[int] = []


def dead_pid() -> int:
    if not _DEAD:
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        _DEAD.append(p.pid)
    return _DEAD[0]


def bundle(path: Path, v: float) -> Path:
    with BundleWriter(path, "capture") as w:
        w.manifest.update(recipe={"name": None, "config": {}}, precision="fp32", loss=None)
        w.add("weights", {"a": torch.full((2,), v)})
        w.add("grads", {"a": torch.full((2,), -v)})
    return path


hexes = st.text("0123456789abcdef", min_size=0, max_size=18)


@FUZZ
@given(what=st.sampled_from(["tmp", "old", "claim", "partial", "tmp2"]), host=st.sampled_from(["mine", "elsewhere", "a-b"]),
       pid=st.sampled_from(["dead", "1", "0", "99999999"]), token=hexes, mac=st.one_of(st.none(), hexes, st.just("signed")),
       final_exists=st.booleans())  # fmt: skip
def test_fuzzed_look_alike_folders_are_touched_only_when_ours_and_dead(tmp_path_factory, what, host, pid, token, mac, final_exists):
    """A folder named .b.WHAT-HOST-PID-TOKEN[-MAC] with a file in it: after a write into the folder and a read of
    b, it is gone (or moved back under b) only if its MAC verifies for this user, its host is this one and no
    live writer holds it; every other one is exactly as it was."""
    root = tmp_path_factory.mktemp("look")
    final = root / "b"
    if final_exists:
        bundle(final, 1.0)
    h = atomic._host() if host == "mine" else host
    p_ = str(dead_pid()) if pid == "dead" else pid
    sig = atomic._sign("b", what, h, p_, token) if mac == "signed" else mac
    name = f".b.{what}-{h}-{p_}-{token}" + (f"-{sig}" if sig is not None else "")
    d = root / name
    if what == "old" or not final_exists:
        src = bundle(root / "src", 2.0)
        os.rename(src, d)
    else:
        d.mkdir()
        (d / "theirs.txt").write_text("keep")
    before = sorted(x.name for x in d.iterdir())
    ours = atomic.parse(d) is not None and atomic.parse(d)["signed"] == "yes" and host == "mine" and not atomic.in_use(d)
    bundle(root / "other", 3.0)  # a write into the folder sweeps it
    try:
        Bundle(final)  # a read of b recovers a displaced old bundle
    except Exception:
        pass
    if not ours:
        assert d.is_dir() and sorted(x.name for x in d.iterdir()) == before, name
    else:
        assert not d.exists(), name
        if what == "old" and not final_exists:
            assert float(Bundle(final).load("weights", "a")[0]) == 2.0  # moved back, not deleted
    shutil.rmtree(root)


@FUZZ
@given(drop=st.sets(st.sampled_from(["recipe", "precision", "loss"])), null_precision=st.booleans(), null_loss=st.booleans())
def test_fuzzed_unsaid_fields_make_the_verdict_incomplete_naming_exactly_them(fp32_capture, oracle_bundle, tmp_path_factory,
                                                                              drop, null_precision, null_loss):  # fmt: skip
    cap = tmp_path_factory.mktemp("fields") / "cap"
    shutil.copytree(fp32_capture, cap)
    m = json.loads((cap / "manifest.json").read_text())
    if null_precision:
        m["precision"] = None
    if null_loss:
        m["loss"] = None
    for f in drop:
        m.pop(f, None)
    (cap / "manifest.json").write_text(json.dumps(m))
    v = score(oracle_bundle, [cap])["captures"][0]["verdict"]
    said = {f for f in ("recipe", "precision", "loss") if f"'{f}' is missing" in v["text"]}
    assert said == drop
    unsaid_precision = "precision" in drop or null_precision
    assert ("'precision' is not given" in v["text"]) == (null_precision and "precision" not in drop)
    assert (v["class"] == "incomplete") == bool(drop or unsaid_precision), v["text"]
    assert v["checked_class"] == "within_noise"
