"""The released sglang 0.5.23 as a CPU prefill-decode stack, for tests, the demo and the benchmark.

Development only (beside pdsim/ and sandbox/; not in the wheel). `realsglang/setup.sh` (`make
real-setup`) installs the pinned environment into a cache directory; `realsglang.stack` runs a real
prefill, a real decode (KV over mooncake TCP) and both real routers as units of a sandboxed systemd
in a private network namespace, with faults: the transfer path dropped (silent, or with mooncake's
default timeouts), a scheduler SIGSTOPped, one unit killed or restarted alone.
"""
