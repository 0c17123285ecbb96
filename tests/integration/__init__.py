"""Loopback tests of probes and scrapes against the simulated PD stack behind the real router."""
