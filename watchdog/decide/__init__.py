"""Decide: the pure stall detector (no I/O, no clock, no logging)."""
