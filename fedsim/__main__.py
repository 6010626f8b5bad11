"""``python -m fedsim`` is the ``fedsim`` command."""

from fedsim.errors import interrupt_from_now_on

interrupt_from_now_on(
    importing=True
)  # before the imports of the command: a signal while they run is a clean exit

from fedsim.cli import main  # noqa: E402

main()
