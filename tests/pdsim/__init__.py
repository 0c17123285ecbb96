"""Tests of the simulator in pdsim/ (the simulated SGLang PD stack behind the real router)."""
