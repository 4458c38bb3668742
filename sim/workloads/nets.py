"""Torch networks on 1 x 28 x 28 images as the objective of the simulator's numerics.

:data:`NET_ZOO` holds networks for Fashion-MNIST / MNIST (10 classes) with exact parameter counts
(:data:`NET_PARAMS`); :class:`NetObjective` turns any ``torch.nn.Module`` with its training and test images into an
:class:`sim.workloads.objectives.Objective`: the parameters are one flat vector v (``module.parameters()`` order, d = the
parameter count), a worker's stochastic gradient is the module's mean cross-entropy gradient on its mini-batch, and
the same ``sgd_step`` programs train it with every registered algorithm.

Gradients of P workers at the price of one global batch: in synchronous S-SGD every worker starts an iteration
from the same v, so :meth:`NetObjective.batch_grads` computes all P gradients in one call,
``torch.func.vmap(torch.func.grad(loss))`` over the workers' batches with the parameters shared: every layer's
forward and input-gradient runs once over the P x b images and only the per-worker weight gradients are P
separate reductions (batched matrix products). :meth:`NetObjective.batch_grad` is the per-worker reference (the
same function without vmap, one worker's batch). vmap turns a layer's ``mm`` into a ``bmm`` and a convolution's
weight gradient into a grouped one, which sum the batch in another order: the two paths agree to a relative
tolerance (:data:`BATCHED_RTOL`, on the norm of the difference over the norm of the gradient), not bit for bit.
A run that needs the reference's bits (the torch backend computes one worker per process) sets
``model.gradients = "loop"`` (the default for networks with convolutions, where the loop is the faster on CPU).

Threads. Every torch operator of a :class:`NetObjective` runs at one intra-op thread, whatever the caller's
``torch.set_num_threads`` (restored afterwards): torch splits reductions by its thread count, so the gradients'
last bits would otherwise depend on the machine's cores (and two OpenMP threads on two busy cores wait on each
other). The caller's thread count is used instead by the per-worker loop, which computes that many workers at once
in Python threads (torch releases the GIL in its operators), and by the evaluation's batches: each result still has
the bits it has alone, so the loop's rows are batch_grad's on any machine (benchmarks/bench_net_sim.py, table (d)).

BatchNorm. Each worker normalises over its own mini-batch (vmap keeps the batches apart: the gradient is computed on
a copy whose BatchNorm layers keep no running statistics, ``torch.func.replace_all_batch_norm_modules_``). The
running statistics, used only to evaluate (train and test accuracy in eval mode), are kept as DDP keeps them: DDP
broadcasts rank 0's buffers at every forward, so they are rank 0's -- after each iteration's gradients, one no-grad
train-mode forward of rank 0's batch at v updates them (momentum 0.1, PyTorch's rule).

Sources: LeNet-5 (LeCun et al., "Gradient-based learning applied to document recognition", Proc. IEEE 1998), the
CIFAR ResNet-20 (He et al., "Deep residual learning for image recognition", CVPR 2016, section 4.2, option-A
shortcuts), here with one input channel and a 7 x 7 global pool; Fashion-MNIST (Xiao et al. 2017).
"""
from __future__ import annotations

import copy
import functools

import numpy as np

from sim.base.optional import torch_module
from sim.base.errors import ConfigError, SparsimError
from sim.workloads.objectives import Objective, constant_record

__all__ = ["NET_ZOO", "NET_PARAMS", "BATCHED_RTOL", "GRADIENT_MODES", "build_net", "net_workload", "NetObjective",
           "torch_or_error"]

#: Networks for 1 x 28 x 28 images and 10 classes: name -> one-line description.
NET_ZOO = {
    "mlp-256": "784-256-10 MLP, ReLU",
    "mlp-1024": "784-1024-1024-10 MLP, ReLU",
    "mlp-3000": "784-3000-3000-10 MLP, ReLU",
    "lenet5": "LeNet-5 (LeCun et al. 1998): conv5x5 1-6 pad 2, pool, conv5x5 6-16, pool, fc 400-120-84-10, ReLU",
    "resnet20": "ResNet-20 (He et al. 2016, CIFAR variant) for 1 x 28 x 28: 16-32-64 channels, BatchNorm, option-A "
                "shortcuts, 7 x 7 global average pool",
}
#: Exact parameter counts (sum of p.numel(); checked by the tests against the built modules).
NET_PARAMS = {"mlp-256": 203_530, "mlp-1024": 1_863_690, "mlp-3000": 11_388_010, "lenet5": 61_706,
              "resnet20": 269_434}
#: Relative tolerance ||batched - reference|| / ||reference|| of a worker's gradient (:class:`NetObjective`), per
#: dtype: bmm / grouped convolutions sum in another order than the per-worker mm / convolution (measured <= 1e-6
#: in float32 and <= 1e-14 in float64 on the zoo; the bounds leave a factor of 10 or more).
BATCHED_RTOL = {"float32": 1e-5, "float64": 1e-12}


#: How :meth:`NetObjective.batch_grads` computes the P gradients: one vmap call, the per-worker loop, or auto: vmap
#: for networks without convolutions, the loop for those with. Measured (benchmarks/bench_net_sim.py, float32,
#: b = 32, one torch thread, this project's shared 2-core VM, CPU seconds of the P gradients, median of 3; the floor
#: is one plain backward of the P x b images): ResNet-20 vmap 0.63 / 2.50 / 11.6 s at P = 4 / 16 / 64, loop 0.45 /
#: 1.96 / 8.2 s, floor 0.33 / 1.65 / 7.6 s (vmap's grouped convolution weight gradients and batched BatchNorm: vmap
#: is 1.25x the loop even with the BatchNorm layers removed); mlp-1024 vmap 0.025 / 0.074 / 0.51 s, loop 0.030 /
#: 0.095 / 0.50 s; LeNet-5 a draw (vmap / loop 0.9 to 1.3 over two runs). With more than one thread the loop runs
#: its workers in parallel (module docstring) and vmap does not: at 2 threads on the idle VM the loop took 0.056 s
#: for mlp-1024 at P = 16 against vmap's 0.072 s. auto does not look at the thread count: the mode changes the
#: gradients' last bits, which must not depend on the machine.
GRADIENT_MODES = ("auto", "vmap", "loop")

#: Most Python threads the per-worker loop runs at once (:meth:`NetObjective.batch_grads`): at most torch's
#: intra-op thread count of the caller (by default the machine's cores), and at most this.
LOOP_MAX_THREADS = 16


def _one_torch_thread(method):
    """Run a :class:`NetObjective` method with torch's intra-op thread pool at one thread (restored afterwards); the
    caller's setting is kept in ``self._caller_threads`` for the method (the per-worker loop of
    :meth:`NetObjective.batch_grads` runs that many workers at once, each at one thread).

    torch splits a product's or a convolution's reductions by its thread count (MKL, oneDNN), which changes the last
    bits of every gradient (measured: mlp-1024, LeNet-5 and ResNet-20 gradients differ between 1 and 2 threads by
    2e-7 to 2e-6 relative in float32, 3e-16 to 8e-16 in float64), so a [model] run's numbers would depend on the
    machine's cores; ``sim.engine.runner.run_algorithm`` and the CLI limit only the BLAS pools (threadpoolctl), not torch's
    OpenMP pool. One thread is also the faster on a shared 2-core machine: with the cores oversubscribed, torch's
    two OpenMP threads wait on each other (ResNet-20, b = 32: 0.13 s forward + backward with 1 thread, 1.1 to 5 s
    with 2 at load 7). The torch backend's ranks run with one thread as well."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        torch = self._torch
        n = torch.get_num_threads()
        if n == 1:  # already pinned (a nested call keeps the outer call's _caller_threads), or the caller's choice
            if not self._pinned:
                self._caller_threads = 1
            return method(self, *args, **kwargs)
        torch.set_num_threads(1)
        self._pinned, self._caller_threads = True, n
        try:
            return method(self, *args, **kwargs)
        finally:
            self._pinned = False
            torch.set_num_threads(n)

    return run


def torch_or_error():
    """The torch module, or ConfigError (one line) naming the extra that installs it (sim.base.optional.torch_module)."""
    return torch_module("a [model] network")


def _modules():
    """The zoo's module classes (defined on first use: torch is imported only then)."""
    torch = torch_or_error()
    from torch import nn

    from sim.workloads.torch_defs import DownsampleA, ResNetBasicblock

    class MLP(nn.Sequential):
        """Flatten, then Linear layers with ReLU between them: sizes (784, h_1, ..., 10)."""

        def __init__(self, sizes):
            layers = [nn.Flatten()]
            for i in range(len(sizes) - 1):
                layers.append(nn.Linear(sizes[i], sizes[i + 1]))
                if i < len(sizes) - 2:
                    layers.append(nn.ReLU())
            super().__init__(*layers)

    class LeNet5(nn.Module):
        """LeNet-5 for 1 x 28 x 28 (the first convolution padded by 2, as for the 32 x 32 original), ReLU, max pool."""

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
            self.conv2 = nn.Conv2d(6, 16, 5)
            self.fc1 = nn.Linear(400, 120)
            self.fc2 = nn.Linear(120, 84)
            self.fc3 = nn.Linear(84, 10)

        def forward(self, x):
            f = torch.nn.functional
            x = f.max_pool2d(f.relu(self.conv1(x)), 2)
            x = f.max_pool2d(f.relu(self.conv2(x)), 2)
            x = torch.flatten(x, 1)
            return self.fc3(f.relu(self.fc2(f.relu(self.fc1(x)))))

    class ResNet20(nn.Module):
        """ResNet-20 for 1 x 28 x 28: the zoo's CIFAR blocks (sim.workloads.torch_defs), one input channel."""

        def __init__(self, num_classes: int = 10):
            super().__init__()
            self.conv_1_3x3 = nn.Conv2d(1, 16, kernel_size=3, stride=1, padding=1, bias=False)
            self.bn_1 = nn.BatchNorm2d(16)
            self.inplanes = 16
            self.stage_1 = self._make_layer(16, 3, 1)
            self.stage_2 = self._make_layer(32, 3, 2)
            self.stage_3 = self._make_layer(64, 3, 2)
            self.classifier = nn.Linear(64, num_classes)

        def _make_layer(self, planes, blocks, stride):
            down = DownsampleA(self.inplanes, planes, stride) if stride != 1 or self.inplanes != planes else None
            layers = [ResNetBasicblock(self.inplanes, planes, stride, down)]
            self.inplanes = planes
            layers += [ResNetBasicblock(planes, planes) for _ in range(1, blocks)]
            return nn.Sequential(*layers)

        def forward(self, x):
            x = torch.relu(self.bn_1(self.conv_1_3x3(x)))
            x = self.stage_3(self.stage_2(self.stage_1(x)))
            return self.classifier(x.mean(dim=(2, 3)))

    return {"mlp-256": lambda: MLP((784, 256, 10)), "mlp-1024": lambda: MLP((784, 1024, 1024, 10)),
            "mlp-3000": lambda: MLP((784, 3000, 3000, 10)), "lenet5": LeNet5, "resnet20": ResNet20}


def build_net(name: str, *, seed: int = 0, dtype: str = "float64"):
    """The zoo network ``name`` (:data:`NET_ZOO`) with PyTorch's default initialisation drawn from ``seed`` (under
    ``torch.random.fork_rng``: the global generator is left as it was), parameters in ``dtype`` ("float64" or
    "float32"), in train mode. Returns a torch.nn.Module taking (B, 1, 28, 28) float images to (B, 10) logits.

    Raises ConfigError for an unknown name (a timing-only model of the workload zoo, e.g. resnet50, is named as
    such: it has no trainable definition for 1 x 28 x 28 images) or dtype, and when torch is missing."""
    if name not in NET_ZOO:
        from sim.workloads.zoo import ZOO_MODELS

        why = (f"{name!r} is a timing-only model of the workload zoo (workload.model), with no trainable definition "
               "for 1 x 28 x 28 images" if name in ZOO_MODELS else f"{name!r} is unknown")
        raise ConfigError(f"model.name = {why}: valid {', '.join(NET_ZOO)}")
    if dtype not in ("float64", "float32"):
        raise ConfigError(f"dtype = {dtype!r} is unknown: valid float64, float32")
    torch = torch_or_error()
    make = _modules()[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        m = make()
    return m.to(getattr(torch, dtype))


def net_workload(module, input_shape: tuple[int, ...], name: str):
    """The timeline's :class:`sim.workloads.Workload` of a network: :func:`sim.workloads.extract.from_torch` on a
    float32 copy of ``module`` for one sample of ``input_shape`` (e.g. (1, 28, 28)), FLOPs per layer by
    torch.utils.flop_counter formulas, tensors in ``module.parameters()`` order. Raises ConfigError as from_torch."""
    from sim.workloads.extract import from_torch

    return from_torch(copy.deepcopy(module).float(), tuple(input_shape), name=name,
                      source=f"sim.workloads.nets {name}: FLOPs by torch.utils.flop_counter formulas")


def _pixel_stats(X) -> tuple[float, float] | None:
    """(mean, std) of uint8 images X scaled by 1/255 (float64, population std from the 256-bin histogram: exact
    and one pass); None for float images (already normalised)."""
    X = np.asarray(X)
    if X.dtype != np.uint8:
        return None
    counts = np.bincount(X.ravel(), minlength=256).astype(np.float64)
    v = np.arange(256) / 255.0
    n = counts.sum()
    mean = float(counts @ v / n)
    std = float(np.sqrt(counts @ (v - mean) ** 2 / n))
    return mean, std or 1.0


class NetObjective(Objective):
    """f(v) = mean cross-entropy of a torch module over its training images, v the flat parameter vector.

    module: a torch.nn.Module (copied; its parameters at construction are :meth:`x0`) mapping (B, 1, 28, 28) to
    (B, C) logits. X_train, X_test: uint8 (n, 28, 28) images -- scaled by 1/255 and standardised by the training
    set's mean and standard deviation (float64 statistics) -- or float (n, 1, 28, 28) already normalised; y_train,
    y_test: int labels (n,). dtype: "float64" or "float32" (the module is cast to it). eval_samples: training
    images of :meth:`loss` / :meth:`full_grad` / train accuracy (a fixed subset: the first ones of a permutation
    seeded by 0, rounded down to a multiple of ``chunk``; 0 = all); test_samples: the first test images of the
    test metrics (0 = all); chunk: samples per BatchNorm batch in :meth:`loss` (the workers' batch size b);
    gradients: :data:`GRADIENT_MODES`, how :meth:`batch_grads` computes the P gradients.

    Attributes: d (parameters), n (training images), n_classes, tensor_names. Raises ConfigError when the module's
    output on one image is not (1, C) with C > the largest label (naming both shapes), for eval_samples <
    chunk, and SparsimError as :class:`~sim.workloads.objectives.Objective` for a wrong x or idx.
    """

    name = "net"
    shares_point_work = False

    def __init__(self, module, X_train, y_train, X_test, y_test, *, dtype: str = "float64", eval_samples: int = 2048,
                 test_samples: int = 0, chunk: int = 32, gradients: str = "auto", name: str = "net"):
        torch = torch_or_error()
        from torch.func import replace_all_batch_norm_modules_

        self._torch = torch
        self.name = f"net:{name}"
        self.net_name = name
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            self.dtype = np.dtype(np.int8)  # refused below (np.dtype(None) == float64, so no None here)
        if self.dtype not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ConfigError(f"dtype = {dtype!r} is unknown: valid float64, float32")
        tdt = getattr(torch, str(self.dtype))
        self._tdt = tdt
        if gradients not in GRADIENT_MODES:
            raise ConfigError(f"model.gradients = {gradients!r} is unknown: valid {', '.join(GRADIENT_MODES)}")
        self.chunk = int(chunk)
        if self.chunk < 1:
            raise ConfigError(f"chunk = {chunk!r} is out of range: valid >= 1 (the workers' batch size)")
        self._stats = copy.deepcopy(module).to(tdt)  # keeps the running statistics; evaluation and rank 0's update
        self.n_classes = int(max(np.max(y_train), np.max(y_test))) + 1
        stats = _pixel_stats(X_train)
        self._X, self._Xt = self._images(X_train, stats), self._images(X_test, stats)
        self._y = torch.as_tensor(np.array(y_train, dtype=np.int64))
        self._yt = torch.as_tensor(np.array(y_test, dtype=np.int64))
        self.n = int(self._X.shape[0])
        self._check_output()  # before the parameters are read: it materialises a lazy module's (nn.LazyLinear)
        self._init_buffers = {k: b.clone() for k, b in self._stats.named_buffers()}
        self._grad_mod = replace_all_batch_norm_modules_(copy.deepcopy(self._stats))  # BatchNorm over each batch
        self._grad_mod.train()
        self._thread_mods = []  # copies of _grad_mod for the loop's threads (made on first use)
        self._pinned, self._caller_threads = False, 1
        self.tensor_names = [n for n, _ in self._stats.named_parameters()]
        self._shapes = [p.shape for _, p in self._stats.named_parameters()]
        self._numel = [p.numel() for _, p in self._stats.named_parameters()]
        self.d = int(sum(self._numel))
        self._x0 = np.concatenate([p.detach().cpu().numpy().ravel() for p in self._stats.parameters()]).astype(
            self.dtype)
        n_eval = self.n if not eval_samples else min(int(eval_samples), self.n)
        n_eval -= n_eval % self.chunk
        if n_eval < 1:
            raise ConfigError(f"model.eval_samples = {eval_samples} is out of range: valid 0 (all) or >= the batch "
                              f"size {self.chunk} (the loss is evaluated in batches of that size)")
        self._eval_idx = torch.as_tensor(np.sort(np.random.default_rng(0).permutation(self.n)[:n_eval]))
        nt = int(self._Xt.shape[0])
        self._n_test = nt if not test_samples else min(int(test_samples), nt)
        self.params = {"module": name, "eval_samples": n_eval, "test_samples": self._n_test, "chunk": self.chunk}
        self._has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self._stats.modules())
        has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in self._stats.modules())
        #: "vmap" (one batched call) or "loop" (the per-worker reference); auto: vmap without convolutions
        self.gradients = gradients if gradients != "auto" else ("loop" if has_conv else "vmap")
        self.params["gradients"] = self.gradients

    # -- set-up
    def _images(self, X, stats):
        torch = self._torch
        X = np.asarray(X)
        if X.dtype == np.uint8:
            if X.ndim != 3:
                raise ConfigError(f"images of shape {X.shape}: valid uint8 (n, 28, 28)")
            mean, std = stats
            lut = ((np.arange(256) / 255.0 - mean) / std).astype(self.dtype)  # each pixel value once, in float64
            X = lut[X][:, None]
        return torch.as_tensor(np.ascontiguousarray(X, dtype=self.dtype))

    def _check_output(self):
        torch = self._torch
        shape = tuple(self._X.shape[1:])
        try:
            with torch.no_grad():
                self._stats.eval()
                out = self._stats(self._X[:1])
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"the network {self.net_name!r} does not take the data's images of shape "
                              f"{' x '.join(map(str, shape))} ({msg}): valid a network for that input") from None
        finally:
            self._stats.train()
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"the network {self.net_name!r} returns a {type(out).__name__} for one image: valid one "
                              f"tensor of logits, shape (1, C) with C >= {self.n_classes} classes")
        params = list(self._stats.named_parameters())
        if not params:
            raise ConfigError(f"the network {self.net_name!r} has no parameters: valid a network with d >= 1 parameters")
        frozen = [n for n, p in params if not p.requires_grad]
        if frozen:
            raise ConfigError(f"the network {self.net_name!r} has frozen parameters ({', '.join(frozen[:3])}"
                              f"{', ...' if len(frozen) > 3 else ''}; requires_grad = False), which the flat vector would "
                              "train: valid every parameter trainable (leave frozen ones out of the module)")
        random = sorted({type(m).__name__ for m in self._stats.modules()
                         if isinstance(m, torch.nn.modules.dropout._DropoutNd)})
        if random:
            raise ConfigError(f"the network {self.net_name!r} holds {', '.join(random)}: its draws would make the workers' "
                              "gradients depend on torch's global generator (and vmap refuses them): valid a network "
                              "without random layers")
        if out.ndim != 2 or out.shape[0] != 1 or out.shape[1] < self.n_classes:
            raise ConfigError(f"the network {self.net_name!r} outputs shape {tuple(out.shape)} for one image of "
                              f"{' x '.join(map(str, shape))}: valid (1, C) with C >= {self.n_classes} classes")

    def _params(self, x):
        """The flat vector x (d,) as a {name: tensor view} dict (no copy)."""
        t = self._torch.from_numpy(x if x.flags.writeable else x.copy())
        out, off = {}, 0
        for name, shape, n in zip(self.tensor_names, self._shapes, self._numel):
            out[name] = t[off:off + n].view(shape)
            off += n
        return out

    def _loss_fn(self, mod=None):
        """(params, X, y) -> mean cross-entropy of ``mod`` (default the gradient module) with those parameters."""
        torch = self._torch
        from torch.func import functional_call

        mod = self._grad_mod if mod is None else mod

        def loss(params, X, y):
            return torch.nn.functional.cross_entropy(functional_call(mod, params, (X,)), y)

        return loss

    def _flat(self, grads: dict, lead: tuple = (), out: np.ndarray | None = None) -> np.ndarray:
        """Concatenate per-tensor gradients (each ``lead + shape``) into a numpy array ``lead + (d,)``: ``out`` (a
        C-contiguous array of that shape and the objective's dtype, filled and returned) or a new one."""
        torch = self._torch
        parts = [grads[n].reshape(*lead, -1) for n in self.tensor_names]
        if out is None:
            return torch.cat(parts, dim=-1).numpy()
        torch.cat(parts, dim=-1, out=torch.from_numpy(out))
        return out

    def _grad(self, x, idx, out: np.ndarray | None = None, mod=None) -> np.ndarray:
        """batch_grad's computation for a checked x and int64 idx, written into ``out`` (d,) when given; ``mod``: a
        copy of the gradient module (one per thread of the loop: functional_call swaps a module's parameters)."""
        from torch.func import grad

        idx = self._torch.from_numpy(idx)
        g = grad(self._loss_fn(mod))(self._params(x), self._X[idx], self._y[idx])
        return self._flat(g, out=out)

    def _n_threads(self, count: int) -> int:
        """Python threads for ``count`` independent gradients: the caller's torch thread count (``_caller_threads``,
        :func:`_one_torch_thread`), at most ``count`` and :data:`LOOP_MAX_THREADS`."""
        return max(1, min(int(self._caller_threads), int(count), LOOP_MAX_THREADS))

    def _in_threads(self, job, items, n: int) -> None:
        """Call ``job(item, mod)`` for every item, by n Python threads (item j by thread j mod n, each with its own
        copy ``mod`` of the gradient module: functional_call swaps a module's parameters while it runs), or in
        this thread when n = 1. torch releases the GIL inside its operators, so the threads' forward and backward
        passes overlap; every operator still runs at one intra-op thread, so each result has the bits it has
        when computed alone."""
        if n <= 1:
            for it in items:
                job(it, self._grad_mod)
            return
        from concurrent.futures import ThreadPoolExecutor

        while len(self._thread_mods) < n:
            self._thread_mods.append(copy.deepcopy(self._grad_mod))
        torch = self._torch

        def run(t):
            torch.set_num_threads(1)  # this thread's operators at one thread too
            for it in items[t::n]:
                job(it, self._thread_mods[t])

        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sim.workloads.nets") as pool:
            for f in [pool.submit(run, t) for t in range(n)]:
                f.result()

    def _loop(self, x, idxs, out):
        """The per-worker loop: row p of out = batch_grad(x, idxs[p]) (its bits), the workers spread over
        :meth:`_n_threads` threads (:meth:`_in_threads`)."""
        P = idxs.shape[0]
        self._in_threads(lambda p, mod: self._grad(x, np.array(idxs[p]), out=out[p], mod=mod), list(range(P)),
                         self._n_threads(P))

    # -- gradients
    @_one_torch_thread
    def batch_grad(self, x, idx):
        """Mean gradient over the samples idx (int (b,)) at x (d,), train mode (BatchNorm over this batch): the
        per-worker reference path. Returns an array (d,) of the objective's dtype; running statistics untouched."""
        return self._grad(self._check_x(x), np.array(self._check_idx(idx)))

    @_one_torch_thread
    def batch_grads(self, x, idxs, scratch=None):
        """The P workers' mean gradients at x: array (P, d), row p for batch idxs[p] (int (P, b)); batched with
        torch.func.vmap when :attr:`gradients` is "vmap" (within :data:`BATCHED_RTOL` of batch_grad), else the
        per-worker loop (row p has batch_grad's bits; each row is written in place, without a stacking copy).
        Then updates the running statistics from rank 0's batch idxs[0] (module docstring)."""
        from torch.func import grad, vmap

        x = self._check_x(x)
        idxs = self._check_idxs(idxs)
        if self.gradients == "vmap":
            it = self._torch.as_tensor(np.array(idxs))
            g = vmap(grad(self._loss_fn()), in_dims=(None, 0, 0))(self._params(x), self._X[it], self._y[it])
            out = self._flat(g, (idxs.shape[0],))
        else:
            out = np.empty((idxs.shape[0], self.d), dtype=self.dtype)
            self._loop(x, idxs, out)
        self._observe(x, idxs[0])
        return out

    @_one_torch_thread
    def worker_grad(self, x, idx, rank: int):
        """Worker ``rank``'s gradient (:meth:`batch_grad`); rank 0 also updates the running statistics from its
        batch (the per-worker path's equivalent of :meth:`batch_grads`)."""
        g = self.batch_grad(x, idx)
        if rank == 0:
            self._observe(self._check_x(x), idx)
        return g

    def _observe(self, x, idx):
        """Rank 0's train-mode forward of batch idx at x, no gradient: updates the BatchNorm running statistics."""
        if not self._has_bn:
            return
        torch = self._torch
        from torch.func import functional_call

        self._stats.train()
        with torch.no_grad():
            functional_call(self._stats, self._params(x), (self._X[torch.from_numpy(np.array(idx, dtype=np.int64))],))

    def reset_state(self) -> None:
        """Restore the running statistics of construction (each algorithm of a run starts from them)."""
        with self._torch.no_grad():
            for k, b in self._stats.named_buffers():
                b.copy_(self._init_buffers[k])

    # -- the objective f (evaluation subset, train mode in batches of ``chunk``)
    def _eval_batches(self):
        """The evaluation subset as C batches of ``chunk`` images: (X (C, chunk, 1, 28, 28), y (C, chunk))."""
        idx = self._eval_idx
        c = self.chunk
        return self._X[idx].reshape(-1, c, *self._X.shape[1:]), self._y[idx].reshape(-1, c)

    @_one_torch_thread
    def loss(self, x):
        """f(x): mean over the evaluation subset's batches of ``chunk`` images of their mean cross-entropy (float):
        the batches' losses summed in batch order, divided by their number (:meth:`loss_and_grad`'s bits)."""
        params = self._params(self._check_x(x))
        X, y = self._eval_batches()
        lf = self._loss_fn()
        with self._torch.no_grad():
            total = lf(params, X[0], y[0])
            for i in range(1, X.shape[0]):
                total = total + lf(params, X[i], y[i])
            return float(total / X.shape[0])

    @_one_torch_thread
    def loss_and_grad(self, x, scratch=None):
        """(f(x), grad f(x) as an array (d,)): batch by batch, each batch's loss and gradient in one forward and
        backward, so that only one batch's activations are held (the whole evaluation subset's at once took 1 GiB
        for ResNet-20 at eval_samples = 512); the batches' gradients are summed in batch order and divided by
        their number, their losses as :meth:`loss` (its bits). The batches are spread over threads as the
        per-worker loop's (:meth:`_in_threads`), a group of n at a time, and summed in batch order after each
        group: the same bits whatever the number of threads."""
        from torch.func import grad_and_value

        x = self._check_x(x)
        params = self._params(x)
        X, y = self._eval_batches()
        C = X.shape[0]
        n = self._n_threads(C)
        bufs = np.empty((n, self.d), dtype=self.dtype)
        vals: list = [None] * n
        acc = total = None

        def job(j, mod):
            i = start + j
            g, vals[j] = grad_and_value(self._loss_fn(mod))(params, X[i], y[i])
            self._flat(g, out=bufs[j])

        for start in range(0, C, n):
            m = min(n, C - start)
            self._in_threads(job, list(range(m)), min(n, m))
            for j in range(m):
                if acc is None:
                    acc, total = bufs[0].copy(), vals[0]
                else:
                    acc += bufs[j]
                    total = total + vals[j]
        acc /= self.dtype.type(C)
        return float(total.detach() / C), acc

    def full_grad(self, x):
        """grad f(x): array (d,) of the objective's dtype."""
        return self.loss_and_grad(x)[1]

    @_one_torch_thread
    def batch_loss(self, x, idx):
        """Mean cross-entropy over samples idx at x, train mode (float)."""
        x = self._check_x(x)
        idx = self._torch.from_numpy(np.array(self._check_idx(idx)))
        with self._torch.no_grad():
            return float(self._loss_fn()(self._params(x), self._X[idx], self._y[idx]))

    @_one_torch_thread
    def sample_grad_norms(self, x):
        """||grad f_i(x)|| for each image of the evaluation subset (float64 (n_eval,)): per-sample gradients with
        vmap; a BatchNorm network normalises a single image by its own statistics there (its per-sample gradient is
        not the one inside a batch), so for such networks this is a different quantity and is said so by
        :meth:`constants`."""
        from torch.func import grad, vmap

        x = self._check_x(x)
        lf = self._loss_fn()
        out = []
        # at most 256 samples' gradients at once, and at most 256 MiB of them (mlp-3000: 5 samples)
        per = max(1, min(256, 2**28 // (self.d * self.dtype.itemsize)))
        for part in self._eval_idx.split(per):
            g = vmap(grad(lambda p, X, y: lf(p, X[None], y[None])), in_dims=(None, 0, 0))(
                self._params(x), self._X[part], self._y[part])
            out.append(np.linalg.norm(self._flat(g, (len(part),)).astype(np.float64), axis=1))
        return np.concatenate(out)

    # -- evaluation (eval mode, running statistics)
    @_one_torch_thread
    def evaluate(self, x) -> dict:
        """Accuracy in eval mode (BatchNorm with the running statistics): ``train_accuracy`` on the evaluation
        subset, ``test_loss`` (mean cross-entropy) and ``test_accuracy`` on the first test_samples test images;
        floats, accuracies in [0, 1]."""
        torch = self._torch
        from torch.func import functional_call

        params = self._params(self._check_x(x))
        self._stats.eval()
        try:
            with torch.no_grad():
                def run(X, y):
                    loss, hits = 0.0, 0
                    for s in range(0, X.shape[0], 1000):
                        out = functional_call(self._stats, params, (X[s:s + 1000],))
                        loss += float(torch.nn.functional.cross_entropy(out, y[s:s + 1000], reduction="sum"))
                        hits += int((out.argmax(dim=1) == y[s:s + 1000]).sum())
                    return loss / X.shape[0], hits / X.shape[0]

                _, train_acc = run(self._X[self._eval_idx], self._y[self._eval_idx])
                test_loss, test_acc = run(self._Xt[:self._n_test], self._yt[:self._n_test])
        finally:
            self._stats.train()
        return {"train_accuracy": train_acc, "test_loss": test_loss, "test_accuracy": test_acc}

    # -- the rest of the Objective interface
    def x0(self, seed: int = 0):
        """The module's parameters at construction as the flat vector (d,) (the zoo draws them from its seed;
        ``seed`` here is unused)."""
        return self._x0.copy()

    def constants(self):
        """Bound constants: L, L_f and M unknown (a ReLU network's gradient is not Lipschitz and its per-sample
        gradients are unbounded on R^d); f* >= 0 (cross-entropy is non-negative)."""
        why = "a ReLU network's gradient is not Lipschitz on R^d and its per-sample gradients are unbounded"
        return {"L": constant_record(None, "unknown", why), "L_f": constant_record(None, "unknown", why),
                "M": constant_record(None, "unknown", why + ("; with BatchNorm a per-sample gradient depends on the batch"
                                                    if self._has_bn else "")),
                "f_star_lower": constant_record(0.0, "analytic", "cross-entropy >= 0")}

    def astype(self, dtype):
        """This objective computing in ``dtype`` ("float64" / "float32"): self for its own dtype, else a rebuilt
        copy with the module cast. Raises ConfigError for another dtype."""
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ConfigError(f"dtype = {dtype!r} is unknown: valid float64, float32")
        if dt == self.dtype:
            return self
        new = copy.copy(self)
        torch = self._torch
        tdt = getattr(torch, str(dt))
        new.dtype, new._tdt = dt, tdt
        new._stats = copy.deepcopy(self._stats).to(tdt)
        new._grad_mod = copy.deepcopy(self._grad_mod).to(tdt)
        new._thread_mods = []
        new._init_buffers = {k: b.to(tdt) if b.is_floating_point() else b.clone() for k, b in self._init_buffers.items()}
        new._X, new._Xt = self._X.to(tdt), self._Xt.to(tdt)
        new._x0 = self._x0.astype(dt)
        return new

    def workload(self):
        """The network as a :class:`sim.workloads.Workload` (FLOPs per layer from
        :func:`sim.workloads.extract.from_torch` on a 1 x 28 x 28 input), tensors in the flat vector's order."""
        wl = net_workload(self._stats, tuple(self._X.shape[1:]), self.net_name)
        if [t.name for t in wl.tensors] != self.tensor_names:
            raise SparsimError(f"the timeline's tensors of {self.net_name!r} are not the flat vector's order")
        return wl

    def tensor_sizes(self) -> list[tuple[str, int]]:
        """(name, numel) of each parameter tensor in flat-vector order."""
        return list(zip(self.tensor_names, self._numel))
