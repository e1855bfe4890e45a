"""The local process-group launcher: ports that do not collide when jobs run side by side."""
from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from megatron_iiet import distributed


def _world_size() -> int:
    return dist.get_world_size()


@pytest.mark.skipif(distributed._ephemeral_range()[0] - 20000 < 1000,
                    reason="this kernel's ephemeral range starts below 21000, leaving no room "
                    "under it: free_port then asks the kernel")
def test_free_port_is_below_the_kernels_ephemeral_range():
    # Outgoing connections (gloo opens many) take ephemeral ports; a port from that range could be
    # taken between free_port and the rendezvous binding it (seen as EADDRINUSE in CI).
    low, _ = distributed._ephemeral_range()
    ports = {distributed.free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports), ports
    assert len(ports) > 1  # random, so two workers asking at once rarely get the same one


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_port_taken_before_the_rendezvous_binds_it_is_retried_on_another(monkeypatch,
                                                                            world_size):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        real = distributed.free_port
        handed = []

        def first_the_taken_port():
            port = taken.getsockname()[1] if not handed else real()
            handed.append(port)
            return port

        monkeypatch.setattr(distributed, "free_port", first_the_taken_port)
        # with 2 ranks, rank 1 would wait on the taken port (here: a silent listener) until its
        # timeout; it is stopped when rank 0 reports the port taken
        assert distributed.spawn_local(_world_size, world_size=world_size,
                                       timeout_s=60) == [world_size] * world_size
    assert len(handed) == 2 and handed[0] != handed[1]
