"""How long each ``oracle judge`` stage will take: measured on this machine, now, and revised as
stages finish.

A replay pass costs its FLOPs plus a fixed cost that its FLOPs do not show: building the recipe's
model, per-op dispatch and autograd bookkeeping, the emulation's rounding ops, reading and writing
bundles. At 8B the FLOPs dominate (hours); on a small model the fixed cost is all there is, and it
grows with the machine's load as much as the FLOPs do.

Before any stage (the first estimate)
    the probe is the replay planner itself, timed on this capture (``judge.py``: the plan of the
    first band's precision, after the float64 plan has paid the imports): it builds the recipe's
    model skeleton, reads the capture's manifest and inputs and runs a float64 GEMM probe -- the
    same kind of work as a pass's fixed cost (0.5-0.8 s on the tiny Qwen3-VL here), as wall time,
    so a busy machine lengthens it as it lengthens the replay. A stage's estimate is

        seconds = FLOPs / (GEMM probe rate x EFFICIENCY) + (units + per_call x calls) x probe seconds

    with ``units`` the pass's fixed cost in probes (``TRUTH_PROBES`` for the float64 pass with its
    certificate, ``member_probes(precision)`` per emulated band member) and ``calls`` the step's
    attention kernel calls (``plan``'s ``attention_calls``: one per packed sample or image and
    attention module): each is a handful of small ops whose dispatch, not FLOPs, is the time on a
    small model (a 96-sample packed tiny step: 96x the calls, 20x the truth's time, 1/40 of it in its
    FLOPs). Per call, in probes (``TRUTH_CALL_PROBES``, ``MEMBER_CALL_PROBES``): the truth's exact chunked
    kernel (a Python autograd function, chunk loops) 0.19, a member's fused sdpa 0.05 (amp-bf16) to
    0.12 (fp32, every op rounded). (A probe of small autograd ops was tried first: on 2
    oversubscribed cores its time per round ranged 30x a minute apart while the truth's ranged 3x;
    the planner's time follows the truth's, see ``TRUTH_PROBES``.)

After each stage (``Calibration``)
    its wall time over its plan, ``ratio``, is the machine's speed now. The ``compute`` stages left
    (truth, bands, local replays, explain, logs, and the report, which draws its figures) are
    rescaled by sqrt(ratio) of the LAST finished compute stage: the band members are calibrated
    on the truth, a pass of the same capture, and a load that changed since the first stage is
    followed rather than averaged in. The square root halves (in log) what one stage says: a
    slowdown that persists, up to 4x the plan, is then shown within 2x; one that passes (another
    job ending between two stages: here a truth 1.8x its plan, the next band 0.44x its plan)
    misleads the next estimate half as much. At 8B the plan's own error is its efficiencies' (streaming/plan.py:
    1.00x of the 16384-token cut, 0.68x of the 2048-token one), which the square root leaves within 1.2x. The ``io`` stages (merge, score, local score: reading and
    writing bundles) keep their plan: one says nothing of another (a score 4x faster than planned
    made the next stage's estimate 4x too short). Ratios are clipped to [1/16, 16]; a reused stage
    says nothing of the machine.
"""

from __future__ import annotations

# Fixed cost per pass in probes (planner runs), measured on the tiny Qwen3-VL of ``oracle demo``
# (``python benchmarks/judge_eta.py``: 1, 24 and 96 packed samples, judge's own stages timed).
# The truth (float64 + its certificate): 5-7 probes quiet (2026-12-03: 0.37-0.51 s, probes of 0.06-0.08 s),
# 7.2-8.6 with one more busy core in a CI rehearsal (2026-12-02), 15-25 under load 6-15 (the planner,
# mostly one thread, slows less than the replay). 10 is within 2x of the quiet end and of 15; beyond
# that the first stage is short of its real time, and the stages after it are calibrated on it
# (``Calibration``).
# An emulated member a share of the truth that depends on its precision: fp32 0.67-0.96 (every op
# rounded to fp32: 0.82 quiet), amp-bf16 0.35-0.61 (only autocast's ops emulated: 0.58 quiet).
# Per attention call (same runs, the slope from 7 to 672 calls, linear within 3 %): the truth 0.19,
# an amp-bf16 member 0.051, an fp32 member 0.118. The report (HTML, PNG, CSV) 0.6-0.9 s quiet in a
# judge process of its own (it imports matplotlib; 0.3 s once imported), 1.3-5.3 s loaded: 10 probes;
# the score 0.1-3.3 s, 2. With one of 2 cores kept busy the replays' two threads slow 3-9x and the
# planner (one thread) 1.5x: the truth then takes up to 3x its estimate; the stages after it are
# calibrated on it.
TRUTH_PROBES, TRUTH_CALL_PROBES = 10.0, 0.19
MEMBER_PROBES = {"fp32": 8.5, "amp-bf16": 5.5}
MEMBER_CALL_PROBES = {"fp32": 0.12, "amp-bf16": 0.05}
MEMBER_PROBES_OTHER, MEMBER_CALL_PROBES_OTHER = 7.0, 0.085  # the precisions not measured: between the two
REPORT_PROBES, SCORE_PROBES = 10.0, 2.0


def member_probes(precision: str) -> float:
    return MEMBER_PROBES.get(precision, MEMBER_PROBES_OTHER)


def truth_seconds(gemm_seconds: float, calls: int, probe: float) -> float:
    """The float64 pass: its GEMMs at the planner's rate, its fixed cost and its attention calls."""
    return gemm_seconds + (TRUTH_PROBES + TRUTH_CALL_PROBES * calls) * probe


def member_seconds(precision: str, gemm_seconds: float, calls: int, probe: float) -> float:
    """One emulated band member of ``precision``, as ``truth_seconds``."""
    per_call = MEMBER_CALL_PROBES.get(precision, MEMBER_CALL_PROBES_OTHER)
    return gemm_seconds + (member_probes(precision) + per_call * calls) * probe


RATIO_CLIP = (1 / 16, 16.0)
IO_STAGES = ("merge-", "score", "local-score-")


def kind(stage: str) -> str:
    """``io`` for the stages that mostly read and write bundles (merge, score, local score), else
    ``compute`` (the replays, explain, logs, and the report, which draws its figures)."""
    return "io" if stage.startswith(IO_STAGES) else "compute"


class Calibration:
    """sqrt(real over planned seconds) of the last finished compute stage; ``ratio(stage)`` is what
    the plan of a stage not run yet is multiplied by (1 for an io stage)."""

    def __init__(self) -> None:
        self.last: float | None = None  # the ratio of the last finished compute stage

    def add(self, stage: str, real: float, planned: float) -> None:
        if real <= 0 or planned <= 0 or kind(stage) != "compute":
            return
        r = min(RATIO_CLIP[1], max(RATIO_CLIP[0], real / planned))
        self.last = r**0.5

    def ratio(self, stage: str) -> float:
        return self.last if self.last is not None and kind(stage) == "compute" else 1.0
