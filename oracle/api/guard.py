"""One mapping from what went wrong to what the user sees and the exit code, for the CLI and the
``--nproc`` ranks alike: an ``OracleError`` is its message and its code (oracle/errors.py); the file
system refusing (permission, disk full) is exit 9 or 3 with the path; Ctrl-C is exit 130 with one
line; anything else is a bug, exit 1, its last frames printed and never a tensor's value."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

from ..errors import OracleError, from_os_error

INTERRUPTED = ("interrupted (Ctrl-C), exit 130: rerun the same command to resume (judge reuses its finished stages, "
               "a streamed replay resumes from its journal)")  # fmt: skip


def guarded(fn: Callable[[], Any], say: Callable[[str], None] | None = None) -> int:
    """Run ``fn``; return its int result (0 for None), or the exit code of what it raised, said on ``say``."""
    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        rc = fn()
        return rc if isinstance(rc, int) else 0
    except OracleError as e:
        say(f"error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        say(INTERRUPTED)
        return 130
    except OSError as e:  # the file system refused (permission, disk full, ...): the user's to fix
        err = from_os_error(e)
        say(f"error: {err}")
        return err.exit_code
    except Exception as e:  # a bug: say so, show where, never dump tensors
        say(f"internal error: {type(e).__name__}: {e}")
        say("".join(traceback.format_exception(e, limit=-3)))
        return 1
