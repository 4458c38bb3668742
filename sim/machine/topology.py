"""Hierarchical clusters: nodes of several GPUs on an intra-node fabric, NICs into a switched network.

A :class:`ClusterSpec` is ``nodes`` x ``gpus_per_node`` ranks (P = their product). Ranks are placed
contiguously, as ``torchrun`` and ``mpirun --map-by node`` do: rank r lives on node ``r // G`` with local
index ``r % G`` (G = gpus_per_node). Every piece is a directed FIFO link with a latency and a bandwidth.

Link rule (pipelined, cut-through, as NCCL's chunked transfers and switches behave): a message's head
reaches a link at time h; the link serves it from ``start = max(h, link free)`` until
``end = max(start + n / bandwidth, tail)``, where ``tail`` is when its last byte arrives from the previous
link (the end there plus that link's latency); the head moves on at ``start + latency`` and the message has
arrived when its last byte has crossed the last link (``end + latency``). Alone on a path the message costs
the sum of the latencies plus n / (the smallest bandwidth). Messages queue at a link in order of head
arrival. So G ranks that send m bytes each through one shared NIC at once finish at alpha_e + G m beta_e,
and alone or on their own NICs at alpha_e + m beta_e (docs/costs.md's hand check). (The flat
:class:`sim.machine.network.NetworkSpec` keeps ASTRA-sim's store-and-forward rule, whose exact values it is tested on.)

- **Intra-node fabric** (``intra``): each GPU has one port into the node's fabric, an up link
  ``gpu -> fabric`` and a down link ``fabric -> gpu``, each with latency ``intra_alpha_s / 2`` and
  bandwidth ``intra_bandwidth_Bps``, so an uncontended GPU-to-GPU message costs exactly
  ``intra_alpha_s + n / intra_bandwidth_Bps``.

  - ``"nvswitch"``: a non-blocking switch (NVSwitch, or NVLink modelled as one). Inter-node traffic does
    not cross it: the NICs hang off their own PCIe switches (GPUDirect RDMA), as in DGX systems.
  - ``"pcie"``: PCIe through the host. The port is the GPU's PCIe link to the root complex; a GPU-to-GPU
    copy goes up one GPU's link and down the other's. Inter-node messages are staged through host memory,
    so they also cross the sender's and the receiver's PCIe links, which they share with intra-node traffic
    (FIFO, in both directions).

- **NICs**: ``nics_per_node`` per node (a divisor of G). Local GPU ``l`` uses NIC ``l // (G / nics)``:
  one NIC shared by all GPUs of the node (``nics_per_node = 1``), or one per GPU (``nics_per_node = G``,
  rail-optimised). Each NIC has an up and a down link, latency ``inter_alpha_s / 2`` and bandwidth
  ``inter_bandwidth_Bps``, into a non-blocking switch: NIC to NIC costs ``inter_alpha_s +
  n / inter_bandwidth_Bps`` uncontended. GPUs sharing a NIC queue on it, in both directions.
- **Leaf/spine fat tree** (optional, ``nodes_per_leaf > 0``): nodes are grouped into leaves of
  ``nodes_per_leaf`` consecutive nodes. Traffic between leaves crosses the leaf's up link to the spine and
  the destination leaf's down link, each an aggregate FIFO link of bandwidth ``nodes_per_leaf x
  nics_per_node x inter_bandwidth_Bps / oversubscription`` and latency ``spine_alpha_s / 2``. One
  aggregate link per leaf and direction serves one message at a time at the summed rate: a fluid
  approximation of ECMP over the leaf's uplinks (it finishes a batch of equal messages at the same time
  as parallel uplinks would; the first of them earlier). Oversubscription > 1 makes it the bottleneck.

Paths (link ids in level order, the order every path visits them): ``gpu_up (0)``, ``nic_up (1)``,
``leaf_up (2)``, ``leaf_down (3)``, ``nic_down (4)``, ``gpu_down (5)``. Same node: levels 0 and 5.
Other node: NIC levels 1 and 4, plus 0 and 5 with PCIe, plus 2 and 3 between leaves.

A flat cluster is ``gpus_per_node = 1`` with the ``nvswitch`` fabric: every path is NIC up, NIC down, and
an uncontended message costs alpha + n beta as on :class:`sim.machine.network.NetworkSpec`'s star.

Presets (:data:`CLUSTER_PRESETS`), each node shape with the source of its numbers; P comes from the run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from sim.base.errors import ConfigError, check_int, check_real

__all__ = ["INTRA_FABRICS", "ClusterSpec", "CLUSTER_PRESETS", "get_cluster_preset", "LEVELS"]

#: Upper limits of a cluster's link parameters: no interconnect is slower to answer than 10 s or faster than
#: 1 PB/s per link; larger values would only overflow the simulated clock into nonsense.
MAX_LATENCY_S = 10.0
MAX_BANDWIDTH_BPS = 1e15
#: Valid values of :attr:`ClusterSpec.intra`.
INTRA_FABRICS = ("nvswitch", "pcie")
#: Link levels, in the order every path visits them.
LEVELS = ("gpu_up", "nic_up", "leaf_up", "leaf_down", "nic_down", "gpu_down")

_real = functools.partial(check_real, err=ConfigError)
_int = functools.partial(check_int, err=ConfigError)


@dataclass(frozen=True)
class ClusterSpec:
    """A hierarchical cluster of ``nodes x gpus_per_node`` ranks (see the module docstring).

    Attributes:
        nodes: number of nodes N, integer >= 1.
        gpus_per_node: ranks per node G, integer >= 1.
        intra: ``"nvswitch"`` or ``"pcie"`` (intra-node fabric; see module docstring).
        intra_alpha_s: GPU-to-GPU latency inside a node (s), finite, >= 0.
        intra_bandwidth_Bps: GPU-to-GPU bandwidth inside a node (bytes/s, per direction), finite, > 0.
        inter_alpha_s: NIC-to-NIC latency through the switch (s), finite, >= 0.
        inter_bandwidth_Bps: bandwidth of one NIC (bytes/s, per direction), finite, > 0.
        nics_per_node: NICs per node, a divisor of G (1 = shared; G = rail-optimised).
        nodes_per_leaf: 0 for one non-blocking switch, else nodes per leaf switch of a two-level fat tree
            (integer >= 0).
        oversubscription: leaf down/up capacity ratio of the fat tree, finite, >= 1.
        spine_alpha_s: extra latency of a leaf-spine-leaf crossing (s), finite, >= 0.
        name: label (the preset's name, or "custom").

    Raises:
        ConfigError: a value out of range, naming it and the valid range.
    """

    nodes: int
    gpus_per_node: int = 1
    intra: str = "nvswitch"
    intra_alpha_s: float = 5e-6
    intra_bandwidth_Bps: float = 150e9
    inter_alpha_s: float = 0.436e-3
    inter_bandwidth_Bps: float = 1 / 9e-9
    nics_per_node: int = 1
    nodes_per_leaf: int = 0
    oversubscription: float = 1.0
    spine_alpha_s: float = 0.0
    name: str = "custom"

    def __post_init__(self):
        _int("nodes", self.nodes, 1)
        _int("gpus_per_node", self.gpus_per_node, 1)
        if self.intra not in INTRA_FABRICS:
            raise ConfigError(f"intra = {self.intra!r} is unknown: valid intra-node fabrics are {', '.join(INTRA_FABRICS)}")
        _real("intra_alpha_s", self.intra_alpha_s, 0)
        _real("intra_bandwidth_Bps", self.intra_bandwidth_Bps, 0, lo_open=True)
        _real("inter_alpha_s", self.inter_alpha_s, 0)
        _real("inter_bandwidth_Bps", self.inter_bandwidth_Bps, 0, lo_open=True)
        G = self.gpus_per_node
        _int("nics_per_node", self.nics_per_node, 1, G)
        if G % self.nics_per_node:
            raise ConfigError(f"nics_per_node = {self.nics_per_node} does not divide gpus_per_node = {G}: "
                              f"valid divisors of {G}: {', '.join(str(x) for x in range(1, G + 1) if G % x == 0)}")
        _int("nodes_per_leaf", self.nodes_per_leaf, 0)
        if self.nodes_per_leaf and self.nodes_per_leaf >= self.nodes:
            raise ConfigError(f"nodes_per_leaf = {self.nodes_per_leaf} leaves one leaf for nodes = {self.nodes}: valid "
                              f"0 (one non-blocking switch) or 1 <= nodes_per_leaf < nodes = {self.nodes}")
        _real("oversubscription", self.oversubscription, 1, 1000)
        _real("spine_alpha_s", self.spine_alpha_s, 0, MAX_LATENCY_S)
        if not self.nodes_per_leaf and (self.oversubscription != 1.0 or self.spine_alpha_s != 0.0):
            raise ConfigError(f"oversubscription = {self.oversubscription} and spine_alpha_s = {self.spine_alpha_s} "
                              "describe a fat tree, which nodes_per_leaf = 0 turns off: valid 1 <= nodes_per_leaf "
                              f"< nodes = {self.nodes} with them, or oversubscription = 1 and spine_alpha_s = 0")
        for name in ("intra_alpha_s", "inter_alpha_s"):
            _real(name, getattr(self, name), 0, MAX_LATENCY_S)
        for name in ("intra_bandwidth_Bps", "inter_bandwidth_Bps"):
            _real(name, getattr(self, name), 0, MAX_BANDWIDTH_BPS, lo_open=True)

    # -- shape ------------------------------------------------------------------------------
    @property
    def P(self) -> int:
        """Ranks: nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def leaves(self) -> int:
        """Leaf switches (0 without a fat tree)."""
        return 0 if self.nodes_per_leaf == 0 else -(-self.nodes // self.nodes_per_leaf)

    def with_P(self, P: int) -> "ClusterSpec":
        """The same node shape with P ranks: nodes = P / gpus_per_node.

        Raises ConfigError when gpus_per_node does not divide P (naming both and the valid P)."""
        P = _int("P", P, 1)
        G = self.gpus_per_node
        if P % G:
            raise ConfigError(f"P = {P} is not a multiple of gpus_per_node = {G}: valid P = {G}, {2 * G}, {3 * G}, ...")
        return replace(self, nodes=P // G)

    def intra_alpha_beta(self) -> tuple[float, float]:
        """(alpha s, beta s/byte) of an uncontended GPU-to-GPU message inside a node."""
        return self.intra_alpha_s, 1.0 / self.intra_bandwidth_Bps

    def inter_alpha_beta(self) -> tuple[float, float]:
        """(alpha s, beta s/byte) of an uncontended rank-to-rank message between nodes of one leaf (with
        ``pcie`` the two PCIe crossings are included: alpha_i + alpha_e, and the slower of the two bandwidths,
        beta = max(beta_i, beta_e), since the transfer is pipelined)."""
        a, b = self.inter_alpha_s, 1.0 / self.inter_bandwidth_Bps
        if self.intra == "pcie":
            a, b = a + self.intra_alpha_s, max(b, 1.0 / self.intra_bandwidth_Bps)
        return a, b

    # -- links ------------------------------------------------------------------------------
    def link_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(latency s, bandwidth bytes/s, level) of every directed link, float/float/int arrays (n_links,).

        Ids: gpu_up = r, gpu_down = P + r, nic_up = 2P + j, nic_down = 2P + M + j (j = node * nics + nic,
        M = nodes * nics), leaf_up = 2P + 2M + l, leaf_down = 2P + 2M + L + l."""
        P, M, L = self.P, self.nodes * self.nics_per_node, self.leaves
        n = 2 * P + 2 * M + 2 * L
        lat = np.empty(n)
        bw = np.empty(n)
        lev = np.empty(n, dtype=np.int64)
        lat[:2 * P] = self.intra_alpha_s / 2
        bw[:2 * P] = self.intra_bandwidth_Bps
        lev[:P], lev[P:2 * P] = 0, 5
        o = 2 * P
        lat[o:o + 2 * M] = self.inter_alpha_s / 2
        bw[o:o + 2 * M] = self.inter_bandwidth_Bps
        lev[o:o + M], lev[o + M:o + 2 * M] = 1, 4
        o += 2 * M
        if L:
            lat[o:] = self.spine_alpha_s / 2
            bw[o:] = self.nodes_per_leaf * self.nics_per_node * self.inter_bandwidth_Bps / self.oversubscription
            lev[o:o + L], lev[o + L:] = 2, 3
        return lat, bw, lev

    def shared_levels(self) -> tuple[int, ...]:
        """Levels whose links can carry messages of more than one sender (up levels) or more than one receiver
        (down levels), which therefore need FIFO state: the NICs when GPUs share them, the leaf links when
        there are several leaves, and with PCIe and G > 1 the GPU ports (the node's traffic to and from other
        nodes is staged through the host over them). Every other link serves one rank's sends or one rank's
        receives, one at a time (rendezvous), so it is never contended."""
        out = []
        if self.intra == "pcie" and self.gpus_per_node > 1:
            out += [0, 5]
        if self.nics_per_node < self.gpus_per_node:
            out += [1, 4]
        if self.leaves > 1:
            out += [2, 3]
        return tuple(sorted(out))

    def zero_latency_shared(self) -> bool:
        """True when a shared level has zero latency: heads then reach the next shared link in the same instant
        as others and the fast engine's tie order is not the message-level engine's (use engine = message)."""
        lat = {0: self.intra_alpha_s, 5: self.intra_alpha_s, 1: self.inter_alpha_s, 4: self.inter_alpha_s,
               2: self.spine_alpha_s, 3: self.spine_alpha_s}
        return any(lat[lev] == 0 for lev in self.shared_levels())

    def routes(self, src, dst) -> np.ndarray:
        """Link ids of the path of each message, int64 array (m, 6) by level, -1 where a level is not crossed.

        src, dst: int arrays (m,) of ranks in [0, P). A self-message (src == dst) crosses nothing."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        P, G, nics = self.P, self.gpus_per_node, self.nics_per_node
        M, L = self.nodes * nics, self.leaves
        ns, nd = src // G, dst // G
        out = np.full((src.shape[0], 6), -1, dtype=np.int64)
        same = ns == nd
        other = ~same
        intra_msg = same & (src != dst)
        gpu_path = intra_msg | (other if self.intra == "pcie" else np.zeros_like(other))
        out[gpu_path, 0] = src[gpu_path]
        out[gpu_path, 5] = P + dst[gpu_path]
        per = G // nics
        out[other, 1] = 2 * P + ns[other] * nics + (src[other] % G) // per
        out[other, 4] = 2 * P + M + nd[other] * nics + (dst[other] % G) // per
        if L:
            ls, ld = ns // self.nodes_per_leaf, nd // self.nodes_per_leaf
            cross = other & (ls != ld)
            out[cross, 2] = 2 * P + 2 * M + ls[cross]
            out[cross, 3] = 2 * P + 2 * M + L + ld[cross]
        return out

    def path_plan(self, src: int, dst: int) -> list[tuple]:
        """One message's path as segments, the form both engines evaluate (same float operations):
        ``("run", latency_sum, 1 / min bandwidth, links)`` for consecutive links of unshared levels (each used by
        one rank's sends or one rank's receives, one at a time: a pipelined run of them costs its summed latency
        plus n / its slowest bandwidth, so it is evaluated in one step), ``("link", id)`` for a link of a shared
        level (FIFO, :meth:`shared_levels`). Empty for src == dst."""
        return self.plan_of_route(self.routes(np.array([src]), np.array([dst]))[0].tolist())

    def plan_of_route(self, row: list[int]) -> list[tuple]:
        """:meth:`path_plan` of a route given as its row of :meth:`routes` (link id per level, -1 = absent)."""
        lat, bw, _ = self._table
        shared = self.shared_levels()
        out: list[tuple] = []
        for lev, L in enumerate(row):
            if L < 0:
                continue
            if lev in shared:
                out.append(("link", L))
            elif out and out[-1][0] == "run":
                _, Ls, inv, links = out[-1]
                out[-1] = ("run", Ls + float(lat[L]), max(inv, 1.0 / float(bw[L])), links + (L,))
            else:
                out.append(("run", float(lat[L]), 1.0 / float(bw[L]), (L,)))
        return out

    @functools.cached_property
    def _table(self):
        """:meth:`link_table`, built once per spec (path_plan is called per message pair)."""
        return self.link_table()

    def route(self, src: int, dst: int) -> list[int]:
        """Link ids of one message's path in order (empty for src == dst)."""
        row = self.routes(np.array([src]), np.array([dst]))[0]
        return [int(x) for x in row if x >= 0]


#: Node shapes with the sources of their numbers (never fitted to a result this project compares against).
#:
#: - ``"gtopk-icdcs"``: the gTop-k authors' cluster (ICDCS 2019 released launch script: ``nwpernode=4``).
#:   4 Nvidia P102-100 per node on PCIe through the host; the P102-100 exposes PCIe 1.1 x4, about 1 GB/s
#:   per direction (TechPowerUp GPU database: P102-100, bus interface PCIe 1.0 x4), so beta_i = 1 ns/byte;
#:   alpha_i = 10 us (assumption: a staged cudaMemcpy through host memory). One 1 Gb/s Ethernet NIC per
#:   node; the inter-node path (which with PCIe includes both PCIe crossings) keeps the end-to-end 1GbE fit
#:   of the released scripts, alpha = 0.436 ms and beta = 9 ns/byte (docs/costs.md), so the NIC's own latency is
#:   alpha_e = 0.426 ms and its bandwidth 1 / 9 ns/byte (the pipelined path is paced by the slower link).
#: - ``"v100-25GbE"``: the MSTopK paper's cloud setting (Shi et al., "Towards scalable distributed training of
#:   deep learning on public cloud clusters", MLSys 2021): nodes of 8 V100 with NVLink inside and one
#:   25 Gb/s Ethernet NIC per node. NVLink 2.0: 6 links x 25 GB/s per direction per V100 (NVIDIA Tesla V100
#:   whitepaper), modelled as a non-blocking switch at 150 GB/s, alpha_i = 5 us (assumption). NIC: 25 Gb/s
#:   at 90 % efficiency (2.8125 GB/s), alpha_e = 50 us (assumption, kernel TCP as the 10GbE preset).
#: - ``"dgx-h100"``: a DGX H100 class cluster (NVIDIA DGX H100 user guide / SuperPOD reference architecture):
#:   8 H100 on NVSwitch (NVLink 4: 900 GB/s bidirectional, 450 GB/s per direction per GPU), 8 ConnectX-7
#:   400 Gb/s NICs per node (50 GB/s each), rail-optimised (NIC l serves GPU l). alpha_i = 3 us and
#:   alpha_e = 5 us are assumptions (NCCL's small-message latencies on such systems are a few us).
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    "gtopk-icdcs": ClusterSpec(1, 4, "pcie", 10e-6, 1e9, 0.436e-3 - 10e-6, 1 / 9e-9, 1, name="gtopk-icdcs"),
    "v100-25GbE": ClusterSpec(1, 8, "nvswitch", 5e-6, 150e9, 50e-6, 0.9 * 25e9 / 8, 1, name="v100-25GbE"),
    "dgx-h100": ClusterSpec(1, 8, "nvswitch", 3e-6, 450e9, 5e-6, 400e9 / 8, 8, name="dgx-h100"),
}


def get_cluster_preset(name: str, P: int | None = None) -> ClusterSpec:
    """The :data:`CLUSTER_PRESETS` entry ``name``, with P ranks if given (see :meth:`ClusterSpec.with_P`).

    Raises ConfigError for an unknown name (listing the valid ones) or a P the node shape does not divide."""
    try:
        spec = CLUSTER_PRESETS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"cluster preset = {name!r} is unknown: valid presets are {', '.join(CLUSTER_PRESETS)}") from None
    return spec if P is None else spec.with_P(P)
