"""``python -m oracle ...`` runs the command line: what torchrun launches
(``torchrun --nproc-per-node N -m oracle replay ...``) and what ``--nproc`` spawns."""

import sys

from cli import main

if __name__ == "__main__":
    sys.exit(main())
