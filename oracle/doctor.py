"""``python -m oracle.doctor [DIR]``: is ``ORACLE_CAPTURE`` going to capture in this environment?
(oracle/integrations/megatron/doctor.py; runs without the CLI's packages.)"""

import sys

from .integrations.megatron.doctor import main

if __name__ == "__main__":
    sys.exit(main())
