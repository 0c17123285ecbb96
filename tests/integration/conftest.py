"""Makes the pdsim fixtures (a simulated PD stack behind the real sglang-router) available here."""

from tests.pdsim.fixtures import pd_stack, pd_stack_factory, pd_worker_factory, pdsim_config

__all__ = ["pd_stack", "pd_stack_factory", "pd_worker_factory", "pdsim_config"]
