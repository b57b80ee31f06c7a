"""`kvstage serve`: a simulated PD cluster behind an OpenAI-compatible server, on the
wall clock (kvstage/serve/server.py)."""
