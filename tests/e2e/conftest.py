"""Fixtures of the end-to-end tests: the systemd sandbox's (defined in tests/sandbox/fixtures.py)."""

from tests.sandbox.fixtures import host_tmp_sentinel, pd_sandbox, pd_serving, sandbox_available

__all__ = ["host_tmp_sentinel", "pd_sandbox", "pd_serving", "sandbox_available"]
