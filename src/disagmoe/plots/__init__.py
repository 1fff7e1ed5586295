"""Figures drawn from what runs write (trace.json)."""
