"""A simulated SGLang prefill-decode (PD) stack behind the real sglang-router.

For tests, the demo and the benchmark. `worker` is the process entry point
(`python -m pdsim.worker --role prefill|decode ...`), `stack` starts and stops a whole stack,
`tests/pdsim/fixtures.py` offers it to pytest, and `python -m pdsim` brings one up and down by
hand. See README.md in this directory for the fault catalogue.
"""
