"""Makes the pdsim fixtures available to the tests in this directory."""

from tests.pdsim.fixtures import client, pd_stack, pd_stack_factory, pd_worker_factory, pdsim_config

__all__ = ["client", "pd_stack", "pd_stack_factory", "pd_worker_factory", "pdsim_config"]
