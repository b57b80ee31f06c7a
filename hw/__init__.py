"""kvstage hw."""
