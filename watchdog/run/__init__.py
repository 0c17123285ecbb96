"""Run: the daemon lifecycle, its own metrics, sd_notify and observation recording."""
