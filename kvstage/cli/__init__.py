"""The `kvstage` command line: parse, call the library, print, exit.

`kvstage.cli.main` builds the typer app and is the entry point; every subcommand
lives in a module of `kvstage.cli.commands` that registers it; `kvstage.cli.errors`
is how each of them says that something went wrong.
"""
