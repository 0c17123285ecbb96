"""A simulated SGLang prefill-decode (PD) stack behind the real sglang-router, for tests and demos.

`worker` is the process entry point (`python -m tests.pdsim.worker --role prefill|decode ...`),
`stack` starts and stops a whole stack, `fixtures` offers it to pytest, and `python -m tests.pdsim`
brings one up and down by hand. See README.md in this directory for the fault catalogue.
"""
