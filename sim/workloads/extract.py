"""Workloads from torch modules: FLOPs per layer (:func:`from_torch`) and measured seconds (:func:`measure_torch`).

Layers
------
A layer is a module that runs in the forward pass: each leaf module, and a non-leaf module for the work
its own ``forward`` does outside its children (e.g. the attention matrix products of a transformer's
self-attention module, whose projections are child ``Linear`` modules). The root module's own layer is
called ``(root)``. A parameter tensor belongs to the layer of the module that holds it, or of its nearest
ancestor that runs (e.g. a ``Linear`` whose weight the parent uses through ``F.linear``). Layers are in
the order their work starts in the forward pass: a leaf module when it is called, a non-leaf module's own
layer at its first counted FLOP (so the attention core sits after the Q/K/V projections). A module
called several times is one layer, at its first call, with the costs of all calls summed.

FLOPs (:func:`from_torch`)
--------------------------
Counted with the formulas of ``torch.utils.flop_counter`` (the ones ``FlopCounterMode`` uses: matrix
multiplies, convolutions and their backward, attention kernels; a multiply-add is 2 FLOPs; elementwise
operations, normalisation, pooling, embedding look-ups and optimizers are not counted) on a forward and a
backward of a batch of 2 samples, divided by 2. Forward FLOPs go to the innermost module running when
the operation is dispatched. Backward FLOPs go to the module whose forward created the autograd node
that runs (``torch._C._current_autograd_node()``, matched by its sequence number to the module calls of
the forward), so the attribution is exact, not a rule such as backward = 2 x forward: a layer whose input
needs no gradient (the first convolution) has backward = 1 x forward. Layers with no parameters and no
counted FLOPs (ReLU, pooling, dropout) are left out. The run is done on the ``meta`` device (shapes only,
no memory, no change to the module) when the module allows it, else on the module's device with its
``.grad`` fields, buffers and train/eval flags restored.
The order in which the backward accumulates the parameter gradients is recorded as the workload's
``ready_order``.

Measured seconds (:func:`measure_torch`)
----------------------------------------
Forward: ``register_forward_pre_hook``/``register_forward_hook`` on every module; the time between two
consecutive hook events goes to the innermost running module (its own time). Backward: pre- and
post-hooks on every autograd node of the step (``Node.register_prehook``/``register_hook``), each node's
time going to the module whose forward created it (sequence number, as above) and the gradient
accumulation of a parameter to the parameter's layer. Module-level backward hooks
(``register_full_backward_pre_hook``/``register_full_backward_hook``) are not used because they miss the
backward of modules whose inputs need no gradient (the first layer, embeddings) and of the root when its
input is token ids. On CUDA each hook synchronises the device. Here the parameterless layers that do
work (ReLU, pooling, residual adds) are kept: they take time.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections import defaultdict

from sim.base.optional import torch_module
from sim.base.errors import ConfigError, check_int
from sim.workloads.model import LayerCost, ParamTensor, Workload

__all__ = ["from_torch", "measure_torch", "ROOT_LAYER"]

ROOT_LAYER = "(root)"
"""Name of the layer for the work and parameters of the root module itself."""

FLOPS_NOTE = ("FLOPs per sample by torch.utils.flop_counter formulas (multiply-add = 2 FLOPs; matmul, conv, "
               "attention; elementwise/norm/pool not counted), backward attributed per autograd node")


def _torch():
    return torch_module("from_torch / measure_torch (stored zoo tables load without it)")


def _check_shape(input_shape) -> tuple[int, ...]:
    """input_shape as a tuple of ints >= 1, or ConfigError naming it."""
    try:
        shape = tuple(input_shape)
        ok = len(shape) > 0 and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"input_shape = {input_shape!r} is out of range: valid a non-empty tuple of integers >= 1 "
                          "(one sample, batch excluded)")
    return tuple(int(s) for s in shape)


def _input_desc(shape, integer: bool) -> str:
    return "x".join(map(str, shape)) + (" tokens" if integer else "")


def _vocab(torch, module) -> int:
    """Smallest num_embeddings of the module's Embedding layers (the token ids drawn stay below it), or 1."""
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, torch.nn.Embedding)]
    return min(sizes) if sizes else 1


def _make_input(torch, module, shape, batch, dtype, device):
    if dtype.is_floating_point or dtype.is_complex:
        if device.type == "meta":
            return torch.empty((batch,) + shape, dtype=dtype, device=device)
        return torch.randn((batch,) + shape, dtype=dtype, device=device)
    if device.type == "meta":
        return torch.zeros((batch,) + shape, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, _vocab(torch, module), (batch,) + shape, generator=g, dtype=dtype).to(device)


def _loss(torch, out):
    """Sum of every floating output that requires grad (a scalar), or None."""
    from torch.utils._pytree import tree_leaves

    if isinstance(out, dict):
        out = list(out.values())
    ts = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not ts:
        return None
    loss = ts[0].sum()
    for t in ts[1:]:
        loss = loss + t.sum()
    return loss


def _rejected(module, shape, batch, err) -> ConfigError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ConfigError(f"input shape {shape} (batch {batch} added in front) is rejected by {type(module).__name__} "
                       f"({type(err).__name__}: {first}): valid the shape of one sample the module takes")


class _Tracer:
    """Module calls (pre/post hooks, autograd sequence-number intervals) and per-module FLOPs."""

    def __init__(self, torch, root):
        self.torch = torch
        self.names = {m: n for n, m in root.named_modules()}
        self.stack: list[tuple[str, int]] = []
        self.intervals: list[tuple[int, int, str]] = []
        self.tick = 0
        self.first_pre: dict[str, int] = {}
        self.first_op: dict[str, int] = {}
        self.first_flop: dict[str, int] = {}
        self.fwd: dict[str, int] = defaultdict(int)
        self.bwd: dict[str, int] = defaultdict(int)
        self.probing = False
        self.ready: list[int] = []  # parameter indices in the order their gradients were accumulated
        self.handles = []
        self._index = None
        self._cache: dict[int, str | None] = {}

    def seq(self) -> int:
        """The autograd sequence number a node created now gets (a probe node)."""
        torch = self.torch
        self.probing = True
        try:
            with torch.enable_grad():
                return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr()
        finally:
            self.probing = False

    def attach(self):
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))

    def watch(self, leaves):
        """Record the order in which the gradients of ``leaves`` (the parameters, in order) are accumulated."""
        for i, p in enumerate(leaves):
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self.ready.append(i)))

    def ready_order(self, n: int) -> tuple[int, ...]:
        """Parameter indices in gradient-ready order; ones without a gradient last, in reverse definition order."""
        seen = list(dict.fromkeys(self.ready))
        got = set(seen)
        return tuple(seen + [i for i in reversed(range(n)) if i not in got])

    def detach(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, mod, args):
        name = self.names[mod]
        s0 = self.seq()
        self.tick += 1
        self.first_pre.setdefault(name, self.tick)
        self.stack.append((name, s0))

    def _post(self, mod, args, out):
        name, s0 = self.stack.pop()
        self.intervals.append((s0, self.seq(), name))
        self._index = None

    def module_of_seq(self, s: int) -> str | None:
        """The innermost module call whose forward created the node with sequence number s, or None."""
        if s in self._cache:
            return self._cache[s]
        if self._index is None:
            iv = sorted(self.intervals)
            parent, open_ = [], []
            for i, (a, b, _n) in enumerate(iv):
                while open_ and iv[open_[-1]][1] < a:
                    open_.pop()
                parent.append(open_[-1] if open_ else -1)
                open_.append(i)
            self._index = (iv, [a for a, _, _ in iv], parent)
            self._cache = {}
        iv, starts, parent = self._index
        i = bisect.bisect_right(starts, s) - 1
        while i >= 0 and not (iv[i][0] < s < iv[i][1]):
            i = parent[i]
        name = iv[i][2] if i >= 0 else None
        self._cache[s] = name
        return name

    def record(self, flops: int):
        torch = self.torch
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            name = self.module_of_seq(node._sequence_nr()) if node is not None else None
            if name is not None and flops:
                self.bwd[name] += flops
            return
        if not self.stack:
            return
        name = self.stack[-1][0]
        self.tick += 1
        self.first_op.setdefault(name, self.tick)
        if flops:
            self.first_flop.setdefault(name, self.tick)
            self.fwd[name] += flops


def _flop_mode(torch, tracer):
    """A TorchDispatchMode counting FLOPs like FlopCounterMode (same registry, same decompositions)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    skip = {getattr(torch.ops.aten, n).default for n in (
        "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense", "size", "sym_size", "stride",
        "sym_stride", "storage_offset", "sym_storage_offset", "numel", "sym_numel", "dim")
        if hasattr(torch.ops.aten, n)}
    skip |= {torch.ops.aten.is_contiguous.memory_format, torch.ops.prim.layout.default}
    if hasattr(torch.ops.aten, "sym_is_contiguous"):
        skip.add(torch.ops.aten.sym_is_contiguous.default)

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs if kwargs else {}
            if func in skip:
                return NotImplemented
            if func not in flop_registry and func is not torch.ops.prim.device.default:
                with self:
                    r = func.decompose(*args, **kwargs)
                    if r is not NotImplemented:
                        return r
            out = func(*args, **kwargs)
            if not tracer.probing:
                packet = func._overloadpacket
                flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
                tracer.record(int(flops))
            return out

    return _Mode()


class _Saved:
    """The .grad fields, buffers and train/eval flags of a module, restored on exit."""

    def __init__(self, torch, module):
        self.torch, self.module = torch, module

    def __enter__(self):
        m = self.module
        self.params = list(m.parameters())
        self.grads = [p.grad for p in self.params]
        self.bufs = [(b, b.detach().clone()) for b in m.buffers() if b.device.type != "meta"]
        self.modes = [(x, x.training) for x in m.modules()]
        for p in self.params:
            p.grad = None
        return self

    def __exit__(self, *exc):
        with self.torch.no_grad():
            for b, v in self.bufs:
                b.copy_(v)
        for p, g in zip(self.params, self.grads):
            p.grad = g
        for x, t in self.modes:
            x.training = t
        return False


def _trace(torch, module, shape, dtype, batch: int = 2):
    """Run forward+backward of ``batch`` samples under the tracer: on meta when possible, else for real.
    Returns the tracer. Raises ConfigError when the module rejects the input shape."""
    params = list(module.parameters())
    on_meta = bool(params) and all(p.device.type == "meta" for p in params)
    errors = []
    attempts = ["meta"] if on_meta else ["functional-meta", "real"]
    for how in attempts:
        tracer = _Tracer(torch, module)
        tracer.attach()
        try:
            if how == "real":
                with _Saved(torch, module):
                    module.train()
                    dev = params[0].device if params else torch.device("cpu")
                    x = _make_input(torch, module, shape, batch, dtype, dev)
                    tracer.watch(params)
                    _run(torch, module, x, tracer, call=lambda: module(x))
            else:
                x = _make_input(torch, module, shape, batch, dtype, torch.device("meta"))
                if how == "meta":
                    with _Saved(torch, module):
                        module.train()
                        tracer.watch(params)
                        _run(torch, module, x, tracer, call=lambda: module(x))
                else:
                    from torch.func import functional_call

                    state = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                             for n, p in module.named_parameters()}
                    state.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()})
                    modes = [(m, m.training) for m in module.modules()]
                    module.train()
                    tracer.watch([state[n] for n, _ in module.named_parameters()])
                    try:
                        _run(torch, module, x, tracer, call=lambda: functional_call(module, state, (x,)))
                    finally:
                        for m, t in modes:
                            m.training = t
            return tracer
        except ConfigError:
            raise
        except Exception as err:  # the module rejects the input (or the meta device): try the next way
            errors.append(err)
        finally:
            tracer.detach()
    raise _rejected(module, shape, batch, errors[-1])


def _run(torch, module, x, tracer, call):
    with torch.enable_grad(), _flop_mode(torch, tracer):
        out = call()
        loss = _loss(torch, out)
        if loss is None:
            raise ConfigError(f"the output of {type(module).__name__} does not depend on any parameter: valid a "
                              "module with trainable parameters that its output uses")
        loss.backward()


def _structure(torch, module, tracer, *, keep_workers: bool):
    """Layers (names in forward order), tensors (ParamTensor list), from a trace.

    keep_workers: also keep parameterless layers that ran operations but counted no FLOPs (for timing).
    """
    mods = dict(module.named_modules())
    ran = tracer.first_pre
    leaf = {n: next(iter(m.children()), None) is None for n, m in mods.items()}

    def runs_for(pname: str) -> str:
        parts = pname.split(".")[:-1]
        while parts and ".".join(parts) not in ran:
            parts.pop()
        return ".".join(parts)

    tensors = [(n, p.numel(), runs_for(n)) for n, p in module.named_parameters()]
    owners = {t[2] for t in tensors}
    keep = [n for n in ran if n in owners or tracer.fwd.get(n) or tracer.bwd.get(n)
            or (keep_workers and n in tracer.first_op)]

    def key(n):
        if leaf[n]:
            return ran[n]
        return tracer.first_flop.get(n, tracer.first_op.get(n, ran[n]))

    keep.sort(key=key)
    return keep, tensors


def _lname(n: str) -> str:
    return n if n else ROOT_LAYER


def from_torch(module, input_shape, *, name: str | None = None, dtype=None, source: str | None = None) -> Workload:
    """The Workload of a torch module: parameter tensors and per-layer forward/backward FLOPs per sample.

    module: any ``torch.nn.Module`` (not modified: the count runs on the meta device when possible).
    input_shape: the shape of ONE sample, batch excluded, e.g. ``(3, 224, 224)`` or ``(128,)``; the
    module is called on a tensor of shape ``(2, *input_shape)`` and the counts are halved.
    dtype: the input's dtype (default ``torch.float32``; random normal values); an integer dtype such as
    ``torch.long`` gives token ids below the smallest ``nn.Embedding`` vocabulary of the module.
    name: the workload's name (default the module's class name). source: its source text.

    Returns a Workload with FLOPs per sample (layers and attribution as in the module docstring), tensors
    in ``module.parameters()`` order, ``ready_order`` the order in which the traced backward accumulated
    the parameters' gradients (``register_post_accumulate_grad_hook``, the event DDP marks a gradient
    ready on; parameters without a gradient last, in reverse definition order), ``input`` e.g.
    ``"3x224x224"`` or ``"128 tokens"``.
    Raises ConfigError (one line) for a bad input_shape, an input shape the module rejects (naming the
    shape), or a module whose output uses no parameter.
    """
    torch = _torch()
    shape = _check_shape(input_shape)
    dtype = torch.float32 if dtype is None else dtype
    batch = 2
    tracer = _trace(torch, module, shape, dtype, batch)
    layers, tensors = _structure(torch, module, tracer, keep_workers=False)
    costs = tuple(LayerCost(_lname(n), tracer.fwd.get(n, 0) / batch, tracer.bwd.get(n, 0) / batch) for n in layers)
    integer = not (dtype.is_floating_point or dtype.is_complex)
    return Workload(
        name=name or type(module).__name__, layers=costs,
        tensors=tuple(ParamTensor(n, int(k), _lname(l)) for n, k, l in tensors),
        ready_order=tracer.ready_order(len(tensors)), input=_input_desc(shape, integer),
        source=source if source is not None else f"from_torch({type(module).__name__}): {FLOPS_NOTE}")


def measure_torch(module, input_shape, *, batch_size: int, repeats: int = 5, warmup: int = 2, dtype=None,
                  device=None, name: str | None = None) -> Workload:
    """Measure per-layer forward and backward seconds of a training step of ``module`` on this machine.

    module: a ``torch.nn.Module`` with real (not meta) parameters; it is moved to ``device`` (in place)
    and put in train mode for the measurement; its ``.grad`` fields, buffers (e.g. BatchNorm running
    statistics) and train/eval flags are restored afterwards. input_shape: one sample, batch excluded.
    batch_size: samples per step (>= 1). repeats (>= 1) timed steps after warmup (>= 0) untimed ones; each
    layer's time is the median over the repeats. dtype: the input's dtype (default float32; an integer
    dtype gives token ids, as in :func:`from_torch`). device: default ``cuda`` when available, else ``cpu``.

    Returns a Workload with ``forward_s``/``backward_s`` (seconds for ``batch_size`` samples, >= 0) and
    ``measured_batch = batch_size``; its layers also carry the FLOPs per sample of :func:`from_torch`. The
    layers are those of :func:`from_torch` plus the parameterless modules that run operations (ReLU,
    pooling, dropout, residual adds in a non-leaf forward), in forward order (see the module docstring
    for the hooks used). Raises ConfigError for bad arguments, a meta module, or an input shape the
    module rejects.
    """
    torch = _torch()
    shape = _check_shape(input_shape)
    check_int("batch_size", batch_size, 1, err=ConfigError)
    check_int("repeats", repeats, 1, err=ConfigError)
    check_int("warmup", warmup, 0, err=ConfigError)
    dtype = torch.float32 if dtype is None else dtype
    params = list(module.parameters())
    if any(p.device.type == "meta" for p in params):
        raise ConfigError(f"{type(module).__name__} has parameters on the meta device: valid a module built on a "
                          "real device (e.g. sim.workloads.zoo.build_module(name, device='cpu'))")
    try:
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device = {device!r} is out of range: valid a torch device such as cpu, cuda "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    tracer = _trace(torch, module, shape, dtype, 2)
    layer_names, tensors = _structure(torch, module, tracer, keep_workers=True)
    module.to(dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    x = _make_input(torch, module, shape, batch_size, dtype, dev)
    names = {m: n for n, m in module.named_modules()}
    layer_set = set(layer_names)
    pname = {id(p): n for n, p in module.named_parameters()}
    tlayer = {n: l for n, _, l in tensors}
    fwd_runs, bwd_runs = [], []

    with _Saved(torch, module):
        module.train()
        for it in range(warmup + repeats):
            for p in params:
                p.grad = None
            st = {"stack": [], "last": 0.0, "iv": [], "fwd": defaultdict(float), "bwd": defaultdict(float)}
            probe = _Tracer(torch, module)

            def pre(mod, args, st=st, probe=probe):
                sync()
                t = time.perf_counter()
                if st["stack"]:
                    st["fwd"][st["stack"][-1][0]] += t - st["last"]
                st["stack"].append((names[mod], probe.seq()))
                st["last"] = time.perf_counter()

            def post(mod, args, out, st=st, probe=probe):
                sync()
                t = time.perf_counter()
                n, s0 = st["stack"].pop()
                st["fwd"][n] += t - st["last"]
                probe.intervals.append((s0, probe.seq(), n))
                probe._index = None
                st["last"] = time.perf_counter()

            hs = []
            for m in names:
                hs.append(m.register_forward_pre_hook(pre))
                hs.append(m.register_forward_hook(post))
            try:
                try:
                    out = module(x)
                except Exception as err:
                    raise _rejected(module, shape, batch_size, err) from None
            finally:
                for h in hs:
                    h.remove()
            loss = _loss(torch, out)
            nodes, seen, todo = [], set(), [loss.grad_fn]
            while todo:
                nd = todo.pop()
                if nd is None or nd in seen:
                    continue
                seen.add(nd)
                nodes.append(nd)
                todo.extend(f for f, _ in nd.next_functions)
            bt = {"t0": 0.0}

            def layer_of(nd):
                var = getattr(nd, "variable", None)
                if var is not None:
                    pn = pname.get(id(var))
                    return tlayer.get(pn) if pn is not None else None
                return probe.module_of_seq(nd._sequence_nr())

            nh = []
            for nd in nodes:
                lay = layer_of(nd)
                if lay is None:
                    continue

                def npre(grad_out, bt=bt):
                    sync()
                    bt["t0"] = time.perf_counter()

                def npost(grad_in, grad_out, lay=lay, bt=bt, st=st):
                    sync()
                    st["bwd"][lay] += time.perf_counter() - bt["t0"]

                nh.append(nd.register_prehook(npre))
                nh.append(nd.register_hook(npost))
            loss.backward()
            sync()
            for h in nh:
                h.remove()
            del out, loss, nodes
            if it >= warmup:
                fwd_runs.append(st["fwd"])
                bwd_runs.append(st["bwd"])

    def med(runs, n):
        return float(statistics.median(r.get(n, 0.0) for r in runs))

    batch = 2
    costs = tuple(LayerCost(_lname(n), tracer.fwd.get(n, 0) / batch, tracer.bwd.get(n, 0) / batch,
                            forward_s=max(0.0, med(fwd_runs, n)), backward_s=max(0.0, med(bwd_runs, n)))
                  for n in layer_names)
    integer = not (dtype.is_floating_point or dtype.is_complex)
    return Workload(
        name=name or type(module).__name__, layers=costs,
        tensors=tuple(ParamTensor(n, int(k), _lname(l)) for n, k, l in tensors),
        measured_batch=batch_size, ready_order=tracer.ready_order(len(tensors)), input=_input_desc(shape, integer),
        source=f"measure_torch({type(module).__name__}) on {dev}, batch {batch_size}, median of {repeats}: forward "
               f"by module hooks, backward by autograd-node hooks; {FLOPS_NOTE}")
