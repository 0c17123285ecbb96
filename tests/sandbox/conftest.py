"""Fixtures of the systemd-sandbox tests (defined in tests/sandbox/fixtures.py for reuse)."""

from tests.sandbox.fixtures import host_tmp_sentinel, pd_sandbox, pd_serving, sandbox_available

__all__ = ["host_tmp_sentinel", "pd_sandbox", "pd_serving", "sandbox_available"]
