"""``python -m asyncddp``: the same as the ``asyncddp`` command."""

from ._cli import main

raise SystemExit(main())
