"""systemd's sd_notify(3) protocol, without libsystemd.

With `Type=notify` systemd passes $NOTIFY_SOCKET (a filesystem path, or an
abstract name written with a leading '@'); one datagram of "KEY=value" lines
reports state. Outside systemd the variable is unset and `notify` does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*lines: str) -> bool:
    """Send `lines` (e.g. "READY=1") to the service manager; True if sent."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        log.warning("ignoring NOTIFY_SOCKET=%r: not a path or abstract name", addr)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
    except OSError as exc:
        log.warning("could not notify the service manager: %s", exc.strerror or exc)
        return False
    return True
