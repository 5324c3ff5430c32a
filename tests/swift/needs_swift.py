"""Imported first by the tests in this folder: skips the importing test module unless ms-swift 3.12
is installed (the pinned ``.venv-swift``, built by ``bash .ci/swift-env``)."""

import importlib.metadata

import pytest

try:
    SWIFT = importlib.metadata.version("ms-swift")
except importlib.metadata.PackageNotFoundError:
    SWIFT = None
if SWIFT is None or not SWIFT.startswith("3.12"):
    pytest.skip(f"ms-swift 3.12 is not installed here ({SWIFT}): the swift peer runs in .venv-swift "
                "(bash .ci/swift-env)", allow_module_level=True)  # fmt: skip
