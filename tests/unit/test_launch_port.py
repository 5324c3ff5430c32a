"""The --nproc launcher's rendezvous port (oracle/parallel/launch.py::free_port)."""

from __future__ import annotations

import socket

from oracle.parallel import launch


def test_the_rendezvous_port_is_below_the_ephemeral_range_and_free():
    """A port in the kernel's ephemeral range can be taken by any connection between the check and rank 0's
    listen (EADDRINUSE when two --nproc runs started together); free_port draws below it, and the port binds."""
    low = launch._ephemeral_low()
    ports = {launch.free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # drawn at random, not one fixed port that two launchers would share
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_range_without_room_below_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: 1024)
    assert 0 < launch.free_port() < 65536
