"""``python -m gdskit``: the ``gdskit`` command, for environments without the console script."""

from gdskit.cli.main import main

if __name__ == "__main__":
    main()
