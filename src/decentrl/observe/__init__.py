"""Observing a run: the live dashboard and the report written at its end."""
