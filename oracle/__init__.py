"""oracle: float64 ground truth for cross-hardware training precision.

Capture one training step on a device, replay it in float64 on CPU, score every device's
gradients against that truth with a measured noise band.
"""

__version__ = "0.1.0"

from .bundle import Bundle, BundleWriter  # noqa: E402
from .capture import Capture  # noqa: E402

__all__ = ["Bundle", "BundleWriter", "Capture", "__version__"]
