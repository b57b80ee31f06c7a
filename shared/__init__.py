"""kvstage shared."""
