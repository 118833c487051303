"""Pyro glue: reading model structure off traces, with no user-facing objects."""
