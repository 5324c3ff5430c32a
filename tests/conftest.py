"""Shared fixtures: one tiny Qwen3-VL step captured in several ways, replayed once.

Everything session-scoped is built lazily and written under pytest's tmp_path_factory only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oracle import recipe as recipes
from oracle.capture.steps import capture_recipe_step
from oracle.replay.run import replay

MODEL = "tiny-qwen3-vl"


# torch's thread count in every test: the process's default (every core), the count `oracle replay` and `judge`
# take when no --threads is given (api/replay.py: the float64 sums' split follows it), so a test's in-process result
# and a child process's run of the same command agree bitwise. Not lowered under xdist's two workers for that reason.
THREADS = torch.get_num_threads()


@pytest.fixture(scope="session")
def source():
    r = recipes.for_model(MODEL)
    return r.load(MODEL)


@pytest.fixture(scope="session")
def sample(source):
    return source.recipe.default_sample()


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bundles")


@pytest.fixture(scope="session")
def make_capture(source, sample, root):
    """make_capture(name, precision, instrument=None) -> path; cached per name."""
    cache = {}

    def make(name: str, precision: str = "fp32", instrument=None):
        if name not in cache:
            cache[name] = capture_recipe_step(source, sample, str(root / name), precision=precision, instrument=instrument)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def fp32_capture(make_capture):
    return make_capture("fp32", "fp32")


@pytest.fixture(scope="session")
def amp_capture(make_capture):
    return make_capture("amp-bf16", "amp-bf16")


@pytest.fixture(scope="session")
def oracle_bundle(fp32_capture, root):
    return str(replay(fp32_capture, root / "oracle", dtype="fp64"))


@pytest.fixture(scope="session")
def band(fp32_capture, root):
    """band(precision) -> emulation bundle with 3 members, cached."""
    cache = {}

    def make(precision: str):
        if precision not in cache:
            cache[precision] = str(replay(fp32_capture, root / f"band-{precision}", dtype=precision, ensemble=3))
        return cache[precision]

    return make


@pytest.fixture(autouse=True)
def _deterministic():
    """Each test starts from seed 0 and the suite's thread count (THREADS), and leaves it so: a command run in
    process with --threads sets torch's for the process, as its own process would, and float32 sums follow the
    count (BLAS blocking, precision/mode.py), so a leak would make the next in-process result differ from a
    child process's run of the same command."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(THREADS)


FOLDER_MARKERS = {"unit": "unit", "integration": "integration", "distributed": "distributed", "peers": "peers", "swift": "peers", "mindspeed": "peers"}


def _named(config) -> set[Path]:
    """The files given on the command line by name (a file, or a test of it), not through a folder."""
    out = set()
    for a in config.args:
        p = Path(a.split("::", 1)[0]).resolve()
        if p.is_file():
            out.add(p)
    return out


def pytest_collection_modifyitems(config, items):
    """Every test carries the marker of its folder (tests/unit -> unit, tests/swift -> peers, ...), so -m selects a layer.

    Tests marked ``rare`` guard a rare path at many moments (a kill at each stage, fuzzers, concurrent writers,
    --nproc's launcher): README command 2 (``python -m pytest tests``) deselects them, pytest says how many, and
    ``.ci/run`` runs them right after it (``python -m pytest tests -m rare``); a -m naming ``rare`` or a file named
    on the command line selects them as any other test."""
    for item in items:
        parts = item.path.parts
        for folder, marker in FOLDER_MARKERS.items():
            if folder in parts:
                item.add_marker(getattr(pytest.mark, marker))
    if "rare" in (config.option.markexpr or ""):
        return
    named = _named(config)
    rare = [i for i in items if i.get_closest_marker("rare") and i.path.resolve() not in named]
    if rare:
        config.hook.pytest_deselected(items=rare)
        drop = {id(i) for i in rare}
        items[:] = [i for i in items if id(i) not in drop]
