"""Everything is in pyproject.toml; this only ships ``oracle_capture.pth`` (the ORACLE_CAPTURE
start-up hook, one line that does nothing unless the variable is set) at the root of the wheel,
so that it lands in site-packages (oracle/integrations/megatron/autocapture.py) -- from a wheel
(``pip wheel .``, ``pip install .``) and from an editable install (``pip install -e .``) alike.
``oracle doctor`` says whether it fires in an environment.

It also names what is installed: the engine as ``oracle`` (``oracle.cli.app`` is the console
script) and the repository's ``replays/`` as ``oracle_replays``, so nothing top-level called
``cli`` or ``replays`` lands in site-packages (pyproject.toml cannot rename a found package)."""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "oracle_capture.pth"
PTH_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH_PATH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithPth}

try:  # PEP 660 editable wheels (setuptools >= 64): the hook goes into the editable wheel as well
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - an old setuptools: `oracle doctor` says the hook is absent
    editable_wheel = None


class _StrategyWithPth:
    """setuptools' editable strategy (the path .pth or the import finder), plus the hook's .pth;
    ``oracle_capture.pth`` sorts after ``__editable__*.pth``, so oracle is importable when it runs."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        with open(PTH_PATH, "rb") as f:
            wheel.writestr(PTH, f.read())


if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithPth

RECIPES = "replays"  # the folder in the repository; installed as oracle_replays
packages = find_packages(include=["oracle", "oracle.*"])
packages += ["oracle_replays"] + [f"oracle_replays.{p}" for p in find_packages(where=RECIPES)]

setup(cmdclass=cmdclass, packages=packages, package_dir={"oracle_replays": RECIPES})
