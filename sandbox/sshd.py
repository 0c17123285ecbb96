"""A real OpenSSH server as a unit of a sandbox: a "remote host" for the multi-host tests.

The sandbox shares the host's network namespace, so sshd listens on a 127.0.0.1 port reachable
from outside; inside, /run is the sandbox's, so the forwarded /run/dbus/system_bus_socket is the
sandboxed systemd's bus, `journalctl` reads its journal and /proc is its PID namespace. Keys are
generated fresh (asyncssh) into a directory the namespace can see (the sandbox's share dir).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from sandbox.namespace import UnitSpec

SSHD = Path("/usr/sbin/sshd")
UNIT = "sandbox-sshd.service"


def sshd_skip_reason() -> str | None:
    """Why the sshd unit cannot run here, or None."""
    if not SSHD.exists() or shutil.which("ssh-keygen") is None:
        return "the multi-host sandbox tests need openssh-server (apt-get install openssh-server)"
    return None


@dataclass(frozen=True)
class SshdFiles:
    """The server's and the test client's keys, and the client's pinned known_hosts."""

    directory: Path
    port: int
    user: str = "root"

    @property
    def client_key(self) -> Path:
        """The client's private key (mode 600)."""
        return self.directory / "client_key"

    @property
    def known_hosts(self) -> Path:
        """known_hosts pinning the server's host key for [127.0.0.1]:port."""
        return self.directory / "known_hosts"

    @property
    def config(self) -> Path:
        """sshd_config."""
        return self.directory / "sshd_config"

    @property
    def url(self) -> str:
        """The watchdog's `host` value for this server."""
        return f"ssh://{self.user}@127.0.0.1:{self.port}"

    def unit(self) -> UnitSpec:
        """sshd in the foreground, logging to stderr (the sandbox's unit log)."""
        return UnitSpec(
            UNIT,
            [str(SSHD), "-D", "-e", "-f", str(self.config)],
            description="sandbox sshd",
            extra_service=["RuntimeDirectory=sshd", "RuntimeDirectoryMode=0755"],
        )

    def write_wrong_known_hosts(self, path: Path) -> Path:
        """A known_hosts pinning some other key for the same host and port."""
        other = asyncssh.generate_private_key("ssh-ed25519")
        public = other.export_public_key("openssh").decode().strip()
        path.write_text(f"[127.0.0.1]:{self.port} {public}\n")
        path.chmod(0o644)  # the watchdog refuses a known_hosts others may write
        return path


def make_sshd_files(directory: Path, port: int) -> SshdFiles:
    """Host key, client key, authorized_keys, known_hosts and sshd_config under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    files = SshdFiles(directory, port)
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    host_key.write_private_key(directory / "host_key")
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key.write_private_key(files.client_key)
    for private in (directory / "host_key", files.client_key):
        private.chmod(0o600)
    (directory / "authorized_keys").write_text(client_key.export_public_key("openssh").decode())
    host_public = host_key.export_public_key("openssh").decode().strip()
    files.known_hosts.write_text(f"[127.0.0.1]:{port} {host_public}\n")
    files.known_hosts.chmod(0o644)  # the watchdog refuses a known_hosts others may write
    files.config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {directory / 'host_key'}",
                f"AuthorizedKeysFile {directory / 'authorized_keys'}",
                "PidFile /run/sandbox-sshd.pid",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "AllowStreamLocalForwarding local",
                # sshd admits unix-socket forwards only where TCP forwarding is allowed too
                # (channels.c permits "all opens" from AllowTcpForwarding): `no` denies the bus.
                "AllowTcpForwarding local",
                "X11Forwarding no",
                "PrintMotd no",
                "",
            ]
        )
    )
    return files
