"""The KV cache's host tier on a worker: the memory of the blocks the core's host pool
numbers, and the copies between it and the device cache that a step carries
(SchedulerOutput.kv_to_host, then kv_to_device, before the step's forward pass)."""

from __future__ import annotations

import logging
import os
import tempfile

import torch

logger = logging.getLogger(__name__)


def file_backed_bytes(directory: str, num_bytes: int) -> torch.Tensor:
    """`num_bytes` of a new sparse file in `directory`, mapped shared: the OS pages the
    tier to disk, so it may outgrow memory. The file is unlinked once mapped: no file
    outlives the process, however it ends."""
    fd, path = tempfile.mkstemp(prefix="pyengine-kv-tier-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, num_bytes)
        return torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)


class HostKVTier:
    """num_blocks blocks laid out as the device pool's bytes are, [layer, K or V, block,
    the block's bytes], so that one gather moves a block of every layer at once. Each
    virtual engine (a pipeline's step in flight) numbers its own equal range, as it does
    its device blocks."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_bytes: int,  # of every layer's K and V
        device: torch.device,
        directory: str | None = None,
        halves: int = 2,  # K and V a layer (1: latent attention's one vector)
    ) -> None:
        num_bytes = num_blocks * block_bytes
        if directory is not None:
            memory = file_backed_bytes(directory, num_bytes)
        else:
            # Pinned on a GPU: copies run by DMA, at the bus's speed.
            memory = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.num_blocks = num_blocks
        self.blocks = memory.view(num_layers, halves, num_blocks, -1)
        where = f"a file in {directory}" if directory else "host memory"
        logger.info("KV host tier: %d blocks, %.1f MiB in %s", num_blocks, num_bytes / 2**20, where)

    def copy_out(
        self, device_blocks: torch.Tensor, pairs: list[tuple[int, int]], offsets: tuple[int, int]
    ) -> None:
        """(device block, host block) pairs; `offsets` (device, host) place the virtual
        engine's block numbers in the pools."""
        src, dst = _indices(pairs, offsets, device_blocks.device)
        self.blocks[:, :, dst] = device_blocks[:, :, src].to("cpu")

    def copy_in(
        self, device_blocks: torch.Tensor, pairs: list[tuple[int, int]], offsets: tuple[int, int]
    ) -> None:
        """(host block, device block) pairs, as copy_out's."""
        dst, src = _indices([(d, h) for h, d in pairs], offsets, device_blocks.device)
        device_blocks[:, :, dst] = self.blocks[:, :, src].to(
            device_blocks.device, non_blocking=True
        )


def _indices(
    pairs: list[tuple[int, int]], offsets: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(device indices on `device`, host indices on the CPU) of (device, host) pairs."""
    device_ids = torch.tensor([d for d, _ in pairs], dtype=torch.int64) + offsets[0]
    host_ids = torch.tensor([h for _, h in pairs], dtype=torch.int64) + offsets[1]
    return device_ids.to(device), host_ids
