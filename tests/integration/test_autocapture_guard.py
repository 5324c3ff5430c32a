"""ORACLE_CAPTURE never stops, hangs or changes a training run (issue 32, item 1): every failure of the
capture is said once on stderr with its fix, nothing of the user's is touched, and the training call's
gradients are bitwise those of a run without the variable.

The training calls run in real processes (tests/autocapture_step.py: megatron-core 0.12.1's own
schedule on a tiny GPTModel, the hook installed at start-up as oracle_capture.pth installs it): one
process without the variable, one that takes every case below in turn. As root (these tests' machine
runs them as root) mode 555 stops no write: there the read-only folders are made unwritable by refusing
``os.open``/``os.mkdir`` under them with EACCES, what the kernel answers a non-root user.
"""

from __future__ import annotations

import autocapture_step as step
import megatron.core  # noqa: F401  (the [test] extra installs it: a missing one is an error, not a skip)
import pytest


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    yield step.run_cases(tmp, tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("captured"))
    for p in (tmp / "ro", tmp / "ro-existing"):
        p.chmod(0o755)


@pytest.mark.parametrize("name", step.CASES)
def test_a_failing_capture_is_said_once_touches_nothing_and_the_step_trains_bitwise(runs, name):
    """The call ran, its gradients are bitwise those without the variable, the problem is said once
    with its fix, the user's files are untouched (autocapture_step.check)."""
    step.check(runs, name)


def test_the_users_folders_in_the_way_are_never_replaced(runs):
    """User folders keep their files, a full disk leaves no debris, bad selections still capture."""
    step.check_places(runs)


def test_a_catastrophic_selection_regex_is_refused_before_it_runs(monkeypatch):
    """^(\\w+\\.?)+!$ over module names would backtrack for hours; it is refused from its parse alone, without
    the regex package (the standard library's parser finds the nested quantifier): no pattern is compiled or run."""
    import re

    from oracle.capture.modules import check_pattern

    def ran(*a, **k):
        raise AssertionError("the pattern was compiled or run")

    said = {}
    with monkeypatch.context() as m:
        for f in ("compile", "search", "match", "fullmatch", "finditer", "findall"):
            m.setattr(re, f, ran)
        for pattern in (r"^(\w+\.?)+!$", r"(a|ab)*c", r"(?:x+)+y", r"(\d+\.)*mlp", r"(^|\.)decoder\.layers\.\d+$",
                        r"layers\.\d+\.mlp$", r".*mlp.*", r"(ab){2}"):  # fmt: skip
            try:
                check_pattern(pattern)
                said[pattern] = "accepted"
            except ValueError as e:
                said[pattern] = str(e)
    assert all("exponential time" in said[p] for p in list(said)[:4]), said
    assert all(said[p] == "accepted" for p in list(said)[4:]), said
