"""kvstage kvstage."""
