"""Helpers for multi-process tests: spawn N gloo ranks on loopback and collect their results."""
