"""kvstage sim."""
