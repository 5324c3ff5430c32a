"""``python -m oracle ...`` runs the command line: what torchrun launches
(``torchrun --nproc-per-node N -m oracle replay ...``) (``--nproc`` ranks run ``python -m oracle.api.worker``).
``python -m oracle doctor`` runs without the CLI's packages (the training environment has no typer)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["doctor"]:
        from oracle.integrations.megatron.doctor import main as doctor

        sys.exit(doctor(sys.argv[2:]))
    from oracle.cli.app import main

    sys.exit(main())
