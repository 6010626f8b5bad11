"""``python -m fedsim`` is the ``fedsim`` command."""

from fedsim.cli import main

main()
