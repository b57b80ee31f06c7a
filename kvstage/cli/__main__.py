"""`python -m kvstage.cli`: the `kvstage` command."""

from kvstage.cli.main import main

main()
