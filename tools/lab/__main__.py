"""`python -m rlfleet.tools.lab`: see cli.py."""

from rlfleet.tools.lab.cli import main

main()
