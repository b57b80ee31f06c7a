"""Measured runs: what users' benchmark clients and servers wrote, read into run
directories that `compare`, `report` and `calibrate` understand (docs/workflow.md)."""
