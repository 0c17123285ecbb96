"""`make demo`: a transfer stall on a simulated PD stack, found and healed by the watchdog."""
