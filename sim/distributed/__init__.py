"""The real backend: the same per-rank programs on torch.distributed, and DDP communication hooks.

:mod:`sim.distributed.backend` (transport, launcher, worker loop), :mod:`sim.distributed.ddp_hooks` (Top-k,
gTop-k and the successors as torch DDP communication hooks). The top layer of :mod:`sim`: it imports the
engines (replay, runner) and the algorithms; nothing in :mod:`sim` imports it.
"""
