"""``python -m mimo ...`` runs the ``mimo`` command line."""

from mimo.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
