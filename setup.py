"""Everything is in pyproject.toml; this only ships ``oracle_capture.pth`` (the ORACLE_CAPTURE
start-up hook, one line that does nothing unless the variable is set) at the root of the wheel,
so that it lands in site-packages (oracle/integrations/megatron/autocapture.py)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "oracle_capture.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
