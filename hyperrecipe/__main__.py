"""``python -m hyperrecipe`` is the ``hyperrecipe`` command."""

from hyperrecipe.cli import main

raise SystemExit(main())
