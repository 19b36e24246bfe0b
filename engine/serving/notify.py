"""Readiness for a service manager: systemd's sd_notify protocol, without libsystemd.

Under a unit of Type=notify, systemd passes NOTIFY_SOCKET (a datagram socket,
a path or an abstract name written with a leading '@'); `shmbatch serve` sends
READY=1 there once clients can attach, and STOPPING=1 when it drains, so a
unit ordered After= it starts only once the engine serves. Without
NOTIFY_SOCKET nothing is sent.
"""
import os
import socket


def sd_notify(state: str) -> bool:
    """Sends state (e.g. "READY=1") to NOTIFY_SOCKET; False when there is none."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(address)
        s.sendall(state.encode())
    return True
