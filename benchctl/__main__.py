"""`python -m benchctl ...` (and `torchrun -m benchctl train ...`)."""

from benchctl.cli import main

main()
