"""`oracle judge`'s time estimates against the stages' real wall time, in a real subprocess on the
tiny Qwen3-VL, on this machine as it is and with one more core kept busy: every stage's estimate
(as printed when it starts) is within 2x of its real time; stages of under 5 s both estimated and
real (score, report: reading and writing, 0.5-4.8 s for the same work on 2 shared cores), within 3 s."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DONE = re.compile(r"\[judge \d+/\d+\] (\S+): done in ([\d.]+) s \(estimated ([^)]+)\)")


def _seconds(said: str) -> float:
    if said == "< 1 s":
        return 0.5
    value, unit = said.split()
    return float(value) * {"s": 1, "min": 60, "h": 3600}[unit]


def _judge_rows(fp32_capture, amp_capture, out, load: int) -> tuple[list[tuple[str, float, float]], str]:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        r = subprocess.run([sys.executable, "-m", "oracle", "judge", str(fp32_capture), str(amp_capture), "--ensemble", "2",
                            "--out", str(out)], capture_output=True, text=True, env=env, cwd=out.parent)  # fmt: skip
    finally:
        for b in busy:
            b.kill()
            b.wait()
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [(m[1], float(m[2]), _seconds(m[3])) for m in DONE.finditer(r.stderr)]
    assert [n for n, _, _ in rows] == ["truth", "band-fp32", "band-amp-bf16", "score", "report"], r.stderr
    return rows, r.stderr


def _off(rows):
    """Replay stages (truth, bands) beyond 2x; score and report (seconds of reading, writing and drawing,
    2-3x slower under load than the replays slow down) beyond 3x, or 3 s when both are under 5 s."""

    def far(n, real, est):
        k = 2 if n == "truth" or n.startswith("band-") else 3
        return not (max(real, est) < 5 and abs(real - est) <= 3) and not (est / k <= real <= k * est)

    return [(n, real, est) for n, real, est in rows if far(n, real, est)]


@pytest.fixture(scope="module")
def many_samples(tmp_path_factory):
    """The tiny Qwen3-VL's sample packed PACKED times into one step, captured in fp32 and in amp-bf16: a
    replay of many attention calls (one per sample or image and attention module), whose time is their
    dispatch, not their FLOPs (a 96-sample step: the truth 20x the time of one sample)."""
    from oracle import recipe as recipes
    from oracle.capture.steps import capture_recipe_step

    r, root = recipes.get("qwen3-vl"), tmp_path_factory.mktemp("many")
    src, s = r.load("tiny-qwen3-vl"), r.default_sample()
    return tuple(capture_recipe_step(src, [s] * PACKED, str(root / p), precision=p) for p in ("fp32", "amp-bf16"))


PACKED = 48


@pytest.mark.parametrize(
    "load, step", [(0, "one"), (1, "one"), (0, "packed")], ids=["as-is", "one-core-busy", f"{PACKED}-samples-packed"]
)
def test_each_stage_estimate_is_within_2x_of_its_real_time(fp32_capture, amp_capture, request, tmp_path, load, step):
    """Every replay stage's printed estimate within 2x of its wall time, score and report within 3x (3 s
    for stages under 5 s), loaded or not, for one sample and for PACKED samples packed (its truth and
    bands 3-10 s here: before the planner counted attention calls they were estimated at 1/4-1/8 of it).
    A second judge (fresh work folder) is run only when the first has a stage off: on the shared 2-core
    machine other jobs start and end between two stages (a truth 2.1x, a band 0.44x of a plan made a
    minute before), which no estimate made before the stage can know; both runs' rows are printed."""
    if step == "packed":
        fp32_capture, amp_capture = request.getfixturevalue("many_samples")
    tried = []
    for attempt in range(2):
        rows, err = _judge_rows(fp32_capture, amp_capture, tmp_path / f"judge-{attempt}", load)
        print("\n".join(f"ETA-ROW load={load} run {attempt}: {n}: {real:.1f} s, estimated {est:.1f} s" for n, real, est in rows))
        tried.append((_off(rows), err))
        if not tried[-1][0]:
            return
    raise AssertionError(f"stages beyond 2x of their estimate in both runs: {[o for o, _ in tried]}\n{tried[-1][1]}")
