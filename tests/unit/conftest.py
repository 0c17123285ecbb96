"""Fixtures shared by several unit-test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A private key file (mode 600) and a known_hosts file, for multi-host configs (neither is
    parsed by the config; no test here opens an SSH connection with them)."""
    key = tmp_path / "id_ed25519"
    key.write_text("not a key\n")
    key.chmod(0o600)
    known = tmp_path / "known_hosts"
    known.write_text("[10.0.0.12]:22 ssh-ed25519 AAAA\n")
    known.chmod(0o644)  # whatever the umask: config validation refuses group/other-writable
    return key, known
