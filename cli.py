"""The ``oracle`` command line, as the repository's layout has it: the typer app lives in
``oracle/cli/app.py`` (installed under the ``oracle`` package; this file is not installed)."""

import sys

from oracle.cli.app import EPILOG, app, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
