"""One run of either mode as a library: simulate or launch it, write and read its run
directory (trace, scenario.toml, summary.json), summarise it and judge it against the
scenario's [expect]."""
