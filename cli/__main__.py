"""`python -m kvgraft.cli`: the same entry point as the console script."""

from kvgraft.cli.main import main

main()
