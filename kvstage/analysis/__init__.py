"""Looking at finished runs: comparisons, the HTML report, run figures, the Chrome
trace export and the derived layout of a scenario."""
