"""``python -m asyncddp``: the same as the ``asyncddp`` command."""

from ._cli import main

if __name__ == "__main__":  # importing the module (a doc tool walking the package) runs nothing
    raise SystemExit(main())
