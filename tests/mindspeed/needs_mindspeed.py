"""Imported first by the tests in this folder: skips the importing test module unless MindSpeed and
ms-swift 3.12 are installed (the pinned ``.venv-mindspeed``, built by ``bash .ci/mindspeed-env``)."""

import importlib.metadata
import importlib.util

import pytest

try:
    SWIFT = importlib.metadata.version("ms-swift")
except importlib.metadata.PackageNotFoundError:
    SWIFT = None
if importlib.util.find_spec("mindspeed") is None or SWIFT is None or not SWIFT.startswith("3.12"):
    pytest.skip(f"MindSpeed with ms-swift 3.12 is not installed here (ms-swift {SWIFT}): these tests run in "
                ".venv-mindspeed (bash .ci/mindspeed-env)", allow_module_level=True)  # fmt: skip
