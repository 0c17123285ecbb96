"""A real systemd as PID 1 of a private namespace, for tests, the demo and the benchmark."""
