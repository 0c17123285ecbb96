"""pdsim's free ports: never the same port twice from one process, within the range it is given."""

from __future__ import annotations

import itertools

import pytest

from pdsim import stack


def test_a_port_is_not_handed_out_twice_while_others_remain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every port of a narrow range comes out once before any comes out again."""
    monkeypatch.setattr(stack, "_given", {})
    monkeypatch.setenv(stack.PORT_RANGE_ENV, "24000-24128")
    ports = [p for _ in range(32) for p in stack.free_ports(2)]
    assert len(set(ports)) == len(ports) == 64
    assert all(24000 <= p < 24128 for p in ports)


def test_the_oldest_ports_are_forgotten_when_half_the_range_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long-lived process does not run out: only the newest half of the range is held back."""
    monkeypatch.setattr(stack, "_given", {})
    monkeypatch.setenv(stack.PORT_RANGE_ENV, "24000-24128")
    for _ in range(200):
        stack.free_ports(3)
    assert len(stack._given) <= 64


@pytest.mark.parametrize("spec", ["24000", "a-b", "24000-24010", "80-2000", "30000-20000"])
def test_a_bad_port_range_is_named(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """A malformed PDSIM_PORT_RANGE is an error that names the variable and its value."""
    monkeypatch.setenv(stack.PORT_RANGE_ENV, spec)
    with pytest.raises(ValueError, match=f"PDSIM_PORT_RANGE={spec!r}"):
        stack.port_range()


@pytest.mark.parametrize("count", [1, 2, 4, 7])
def test_parallel_processes_get_disjoint_blocks(count: int) -> None:
    """The blocks the test workers are given (tests/conftest.py) lie in the range and never meet."""
    blocks = [stack.port_block(index, count) for index in range(count)]
    low, high = stack.FREE_PORT_RANGE
    assert all(low <= start < end <= high for start, end in blocks)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(blocks))
