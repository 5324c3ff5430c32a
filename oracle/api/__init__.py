"""The library under the command line: one function per command, each taking a validated options
object (``oracle.replay.options.ReplayOptions`` ...) and returning an exit code; the CLI parses,
calls these, prints and exits, and ``--nproc`` ranks (``python -m oracle.api.worker``) call them
with the same options serialised as JSON."""

from ..replay.options import ReplayOptions
from .replay import replay

__all__ = ["ReplayOptions", "replay"]
