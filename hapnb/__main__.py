"""``python -m hapnb ...`` is the same program as the ``hapnb`` console script."""

from .cli import run

run()
