"""Pytest fixtures for the simulated PD stack: load with `pytest_plugins` or import in a conftest.

`pd_stack` is one stack per test module (prefill, decode, real router), configured by the
module-scoped `pdsim_config` fixture, which a module overrides to change timings, versions,
router flags or start-up faults. `pd_stack_factory` starts extra stacks inside one test and
`pd_worker_factory` starts standalone workers; both stop everything they started at teardown,
also when the test fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdsim.stack import (
    REAL_SGLANG,
    ROUTER_REAL_HEALTH_ARGS,
    PDStack,
    StackConfig,
    WorkerProcess,
    start_stack,
    start_worker,
)


def real_config(**fields: Any) -> StackConfig:
    """A stack with real SGLang behaviour (no compat opt-ins; a router that waits out a 1 s
    /health). The library's own default keeps the old behaviours for the watchdog's tests."""
    fields.setdefault("compat", REAL_SGLANG)
    fields.setdefault("router_args", ROUTER_REAL_HEALTH_ARGS)
    return StackConfig(**fields)


@pytest.fixture(scope="module")
def pdsim_config() -> StackConfig:
    """Default stack configuration (real SGLang behaviour); override it in a module to change it."""
    return real_config()


@pytest.fixture(scope="module")
def pd_stack(
    pdsim_config: StackConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDStack]:
    """A running stack shared by the tests of one module; stopped by PID at module end."""
    log_dir = pdsim_config.log_dir or tmp_path_factory.mktemp("pdsim")
    stack = start_stack(dataclasses.replace(pdsim_config, log_dir=log_dir))
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def pd_stack_factory(tmp_path: Path) -> Iterator[Callable[..., PDStack]]:
    """Start stacks with `factory(**StackConfig fields)`; all are stopped after the test."""
    stacks: list[PDStack] = []

    def factory(**fields: Any) -> PDStack:
        log_dir = fields.pop("log_dir", None) or tmp_path / f"stack{len(stacks)}"
        stack = start_stack(StackConfig(log_dir=log_dir, **fields))
        stacks.append(stack)
        return stack

    try:
        yield factory
    finally:
        for stack in stacks:
            stack.stop()


@pytest.fixture
def pd_worker_factory(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start standalone workers with `factory(role, **start_worker_kwargs)` (real SGLang behaviour
    unless `compat` is given); stopped at teardown."""
    workers: list[WorkerProcess] = []

    def factory(role: str, **kwargs: Any) -> WorkerProcess:
        kwargs.setdefault("log_dir", tmp_path)
        kwargs.setdefault("compat", REAL_SGLANG)
        worker = start_worker(role, **kwargs)
        workers.append(worker)
        return worker

    try:
        yield factory
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
async def client(pd_stack: PDStack) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for one test on the module's stack; afterwards the stack's faults are
    cleared and stuck transfers released, whatever the test did, so the next test starts clean."""
    async with httpx.AsyncClient(timeout=30.0) as c:
        yield c
    for role in ("prefill", "decode"):
        pd_stack.clear_faults(role)
        pd_stack.release_stuck(role)
