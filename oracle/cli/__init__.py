"""The ``oracle`` command line (``app.py``: the typer app). The repository's top-level ``cli.py`` is
a thin alias of it; the installed console script is ``oracle.cli.app:main``."""
