"""The order in which autograd makes a torch module's parameter gradients ready (what DDP's buckets follow)."""
from __future__ import annotations

from sim.base.errors import ConfigError

__all__ = ["observe_ready_order"]


def observe_ready_order(module, example_input) -> list[int]:
    """Run one forward and backward of ``module`` on ``example_input`` and return the indices of
    ``module.parameters()`` in the order their gradients were accumulated (``Tensor.register_post_accumulate_
    grad_hook``, the same event DDP's reducer marks a gradient ready on). Parameters without a gradient
    (unused in this forward) are appended in reverse definition order. The module's ``.grad`` fields are
    restored afterwards. Raises ConfigError when the module rejects the input (the message names its shape).
    """
    import torch

    params = list(module.parameters())
    order: list[int] = []
    saved = [p.grad for p in params]
    handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i)) for i, p in enumerate(params)]
    try:
        for p in params:
            p.grad = None
        try:
            out = module(example_input)
        except Exception as err:  # the module rejects the input: a user error, one line
            shape = tuple(example_input.shape) if hasattr(example_input, "shape") else example_input
            raise ConfigError(f"input shape {shape} is rejected by the module ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}): give the shape the module takes") from None
        out = out[0] if isinstance(out, (tuple, list)) else out
        if hasattr(out, "last_hidden_state"):
            out = out.last_hidden_state
        out.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved):
            p.grad = g
    seen = set(order)
    return order + [i for i in range(len(params) - 1, -1, -1) if i not in seen]
