"""``python -m oracle.api.worker``: one rank of ``--nproc``. Reads one JSON request on stdin,
``{"command": "replay", "options": {...}}``, runs it through the library with the options the
launcher validated (oracle/parallel/launch.py), and exits with the command's code: the launcher
reads 2..10 as the rank's own word on a user mistake, 11 as a lost peer."""

from __future__ import annotations

import json
import sys

from .guard import guarded

COMMANDS = ("replay",)


def _run(request: dict) -> int:
    from ..errors import UsageError

    command = request.get("command")
    if command not in COMMANDS:
        raise UsageError(f"worker: unknown command {command!r} (expected one of {', '.join(COMMANDS)})")
    from ..replay.options import ReplayOptions
    from .replay import replay

    return replay(ReplayOptions.from_dict(request.get("options") or {}))


def main() -> int:
    return guarded(lambda: _run(json.loads(sys.stdin.buffer.read() or b"{}")))


if __name__ == "__main__":
    sys.exit(main())
