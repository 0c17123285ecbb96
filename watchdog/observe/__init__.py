"""Observe: probes through the router, worker /health and /metrics scrapes, unit state."""
