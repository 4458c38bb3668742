"""A SimPy message-level network model: store-and-forward hops over FIFO, full-duplex links.

Units throughout: seconds (s), bytes (B), bytes per second (B/s). "Gb/s" means 1e9 bits/s;
"GB" in the ASTRA-sim reference values means 2**30 bytes.

Link rule (ASTRA-sim congestion-aware analytical backend, ``congestion_aware/Link.cpp``):
every directed link is a FIFO queue served one message at a time. A message that reaches the
head of a link's queue at time ``t0`` holds the link for its serialization time
``ser = nbytes / bandwidth`` and arrives at the next node at ``t0 + ser + latency``; the next
hop starts only after arrival (store-and-forward). With ``quantum_s > 0`` the hold time and the
hop delay are truncated to whole quanta exactly as ASTRA-sim casts ``size / bw`` and
``latency + size / bw`` to integer nanoseconds (see :class:`NetworkSpec`).

Topologies (:class:`Network`): ``"star"`` (a non-blocking switch; rank ``p`` has an uplink
``p -> switch`` and a downlink ``switch -> p``), ``"ring"`` (bidirectional ring, shortest
direction, ties clockwise) and ``"direct"`` (full mesh, one link per ordered pair).

Closed-form references: ``docs/costs.md`` (Thakur, Rabenseifner and Gropp 2005; nccl-tests
``PERFORMANCE.md`` for :func:`busbw`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import simpy

from sim.base.errors import ConfigError, SparsimError, check_int, check_real

__all__ = [
    "TOPOLOGIES",
    "NetworkSpec",
    "PRESETS",
    "get_preset",
    "Network",
    "BUSBW_FACTORS",
    "busbw",
]

#: Valid values of :attr:`NetworkSpec.topology`.
TOPOLOGIES = ("star", "ring", "direct")

#: Node name of the star topology's switch in link keys, e.g. ``(3, SWITCH)`` is rank 3's uplink.
SWITCH = "switch"


_check_real = functools.partial(check_real, err=ConfigError)  # link parameters are configuration
_check_int = check_int


def _floor_quanta(x: float) -> int:
    """``floor(x)`` for ``x >= 0``, but snapping values within float noise of an integer to it.

    ``x`` is a duration in quanta computed in floating point; e.g. ``3 * 1e-9 / 1e-9`` may come
    out as ``2.9999999999999996`` and must count as 3 whole quanta, as integer arithmetic would.
    """
    r = round(x)
    if abs(x - r) <= 1e-9 * max(1.0, abs(x)):
        return int(r)
    return int(math.floor(x))


def _ceil_quanta(x: float) -> int:
    """``ceil(x)`` with the same float-noise snapping as :func:`_floor_quanta` (start times)."""
    r = round(x)
    if abs(x - r) <= 1e-9 * max(1.0, abs(x)):
        return int(r)
    return int(math.ceil(x))


#: Largest time quantum (s) a flat network accepts: 1 us. ASTRA-sim's is 1 ns; coarser quanta truncate every
#: hop of a fast fabric (1-5 us of NVLink / InfiniBand latency) by up to its whole length. A hop that a
#: quantum still truncates to 0 while its exact time is not 0 raises SparsimError when it is simulated.
MAX_QUANTUM_S = 1e-6


@dataclass(frozen=True)
class NetworkSpec:
    """Homogeneous link parameters and topology of a simulated cluster network.

    Attributes:
        topology: ``"star"``, ``"ring"`` or ``"direct"`` (see :class:`Network`).
        link_latency_s: per-hop propagation/processing latency in seconds, finite, >= 0.
        link_bandwidth_Bps: per-direction link bandwidth in bytes/s, finite, > 0.
        quantum_s: time quantum in seconds, finite, 0 <= quantum_s <= 1e-6 (:data:`MAX_QUANTUM_S`). ``0``
            keeps exact float time. With
            ``quantum_s > 0`` each hop's link hold time ``nbytes / bw`` and its delay
            ``latency + nbytes / bw`` are *truncated* to whole quanta, as ASTRA-sim's
            congestion-aware backend does (``static_cast<EventTime>`` of nanoseconds when
            ``quantum_s = 1e-9``): a 1 MiB message on a 50 GiB/s, 500 ns link takes
            ``floor(500 + 19531.25) = 20031`` ns per hop. Event times are snapped to the
            ``quantum_s`` grid so they do not drift; a message handed to a link between grid
            points starts at the next grid point. (Truncation, not rounding up: rounding up
            would give 20032 ns, not ASTRA-sim's 20031 ns.) A hop whose delay the truncation makes 0 while
            ``latency + nbytes / bw`` is not raises SparsimError when it is simulated (the message would
            arrive in no time).

    Raises:
        ConfigError: an unknown topology, or a value out of its range (the message names it).
    """

    topology: str
    link_latency_s: float
    link_bandwidth_Bps: float
    quantum_s: float = 0.0

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ConfigError(
                f"topology = {self.topology!r} is unknown: valid topologies are {', '.join(TOPOLOGIES)}"
            )
        _check_real("link_latency_s", self.link_latency_s, 0)
        _check_real("link_bandwidth_Bps", self.link_bandwidth_Bps, 0, lo_open=True)
        _check_real("quantum_s", self.quantum_s, 0, MAX_QUANTUM_S)

    @classmethod
    def from_alpha_beta(
        cls, alpha_s: float, beta_s_per_byte: float, topology: str = "star", quantum_s: float = 0.0
    ) -> "NetworkSpec":
        """Build a spec whose uncontended end-to-end message time is ``alpha_s + n * beta_s_per_byte``.

        Args:
            alpha_s: per-message latency alpha in seconds, finite, >= 0.
            beta_s_per_byte: transfer time per byte beta in s/byte (1 / bandwidth), finite, > 0.
            topology: ``"direct"`` (one hop: latency alpha, bandwidth 1/beta), ``"star"`` (two
                store-and-forward hops src -> switch -> dst, each with latency alpha/2 and
                bandwidth 2/beta, so the path costs exactly alpha + n beta) or ``"ring"`` (per
                hop between neighbours: latency alpha, bandwidth 1/beta; ``h`` hops cost
                ``h (alpha + n beta)``).
            quantum_s: see :class:`NetworkSpec`; with ``quantum_s > 0`` the identity holds only
                up to the truncation to whole quanta.

        Raises:
            ConfigError: alpha < 0, beta <= 0, non-finite values or an unknown topology.
        """
        alpha = _check_real("alpha_s", alpha_s, 0)
        beta = _check_real("beta_s_per_byte", beta_s_per_byte, 0, lo_open=True)
        if topology == "star":
            return cls("star", alpha / 2.0, 2.0 / beta, quantum_s)
        if topology in ("direct", "ring"):
            return cls(topology, alpha, 1.0 / beta, quantum_s)
        raise ConfigError(f"topology = {topology!r} is unknown: valid topologies are {', '.join(TOPOLOGIES)}")

    def end_to_end_alpha_beta(self) -> tuple[float, float]:
        """Return ``(alpha_s, beta_s_per_byte)`` of one uncontended path, ignoring ``quantum_s``.

        ``"star"``: the two-hop path through the switch, ``(2 latency, 2 / bandwidth)``;
        ``"direct"`` and ``"ring"``: one link between (neighbouring) ranks,
        ``(latency, 1 / bandwidth)``. Inverse of :meth:`from_alpha_beta` up to rounding.
        """
        if self.topology == "star":
            return 2.0 * self.link_latency_s, 2.0 / self.link_bandwidth_Bps
        return self.link_latency_s, 1.0 / self.link_bandwidth_Bps


#: Named network presets (star topology through a non-blocking switch, built with
#: :meth:`NetworkSpec.from_alpha_beta`; Gb/s = 1e9 bits/s, 1 byte = 8 bits).
#:
#: - ``"1GbE"``: alpha = 0.436e-3 s, beta = 9e-9 s/byte (about 0.89 Gb/s effective), fitted from the
#:   gTop-k authors' released ICDCS 2019 scripts on their 1 Gb/s Ethernet cluster (docs/costs.md).
#: - ``"10GbE"``: alpha = 50e-6 s, beta = 8 / (0.9 * 10e9) s/byte (about 8.89e-10, i.e. 9 Gb/s
#:   effective). Assumption, not a measurement: 10 Gb/s line rate at 90% efficiency (close to the
#:   89% the 1GbE fit shows for TCP/MPI), and a 50 us small-message latency typical of kernel TCP
#:   over 10GbE (MPI ping-pong half round trips of tens of microseconds).
#: - ``"IB100"``: alpha = 2e-6 s, beta = 8e-11 s/byte (100 Gb/s InfiniBand EDR line rate, about
#:   12.5 GB/s with GB = 1e9 bytes). Assumption: a ~1-2 us MPI latency typical of EDR with RDMA.
PRESETS: dict[str, NetworkSpec] = {
    "1GbE": NetworkSpec.from_alpha_beta(0.436e-3, 9e-9),
    "10GbE": NetworkSpec.from_alpha_beta(50e-6, 8.0 / (0.9 * 10e9)),
    "IB100": NetworkSpec.from_alpha_beta(2e-6, 8.0 / 100e9),
}


def get_preset(name: str) -> NetworkSpec:
    """Return the :data:`PRESETS` entry ``name``.

    Raises:
        ConfigError: ``name`` is not a preset; the message lists the valid names.
    """
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"network preset = {name!r} is unknown: valid presets are {', '.join(PRESETS)}"
        ) from None


class Network:
    """Message-level SimPy model of ``P`` ranks joined by FIFO, full-duplex links.

    Each directed link is a FIFO server of capacity 1 (the two directions of a cable are
    separate links). Because a message's service time on a link is known when it joins the
    queue, the link keeps only the time it next falls free and a message arriving at ``t``
    starts at ``max(t, free time)``: the same start times as a ``simpy.Resource(capacity=1)``
    queue (Lindley's recursion; checked against one in ``tests/test_network.py``), at one
    SimPy event per hop instead of four. Topologies (``spec.topology``):

    - ``"star"``: rank ``p`` has uplink ``(p, "switch")`` and downlink ``("switch", p)``; the
      switch is non-blocking, so only the uplink and downlink can contend. 2 hops per message.
    - ``"ring"``: ranks ``0..P-1`` in a bidirectional ring with links ``(p, p+1 mod P)`` and
      ``(p, p-1 mod P)``. A message takes the shorter direction (ties: clockwise, i.e.
      increasing rank) and is stored and forwarded at every intermediate rank. With ``P = 2``
      there is one link per direction.
    - ``"direct"``: a separate link ``(s, d)`` for every ordered pair (full mesh). One hop.

    Hop rule: see the module docstring and :class:`NetworkSpec`.

    Args:
        env: the SimPy environment whose clock (seconds) the network advances.
        P: number of ranks, integer >= 1.
        spec: link parameters and topology.

    Attributes:
        bytes_sent: ``np.ndarray`` of int64, shape ``(P,)``: bytes put on the wire by each source
            rank (self-transfers are not counted: nothing goes on the wire).
        messages_sent: ``np.ndarray`` of int64, shape ``(P,)``: messages sent by each source rank
            (self-transfers not counted).
        link_busy_s: ``dict`` link key -> seconds the link spent serializing (holding time; with
            ``quantum_s > 0`` the truncated hold). Link keys are ``(from_node, to_node)`` with
            ranks as ints and the star switch as ``"switch"``. Star and ring links are listed
            from the start; direct-mesh links appear on first use (P**2 would be too many).

    Raises:
        SparsimError: ``P`` is not an integer >= 1, or ``spec`` is not a :class:`NetworkSpec`.
    """

    def __init__(self, env: simpy.Environment, P: int, spec):
        from sim.machine.topology import ClusterSpec

        self.P = _check_int("P", P, 1)
        if not isinstance(spec, (NetworkSpec, ClusterSpec)):
            raise SparsimError(f"spec = {spec!r} is invalid: valid values are NetworkSpec or ClusterSpec instances")
        if isinstance(spec, ClusterSpec) and spec.P != self.P:
            raise SparsimError(f"P = {self.P} but the cluster has {spec.nodes} x {spec.gpus_per_node} = {spec.P} ranks: "
                               "valid P = nodes x gpus_per_node")
        self.env = env
        self.spec = spec
        self.bytes_sent = np.zeros(self.P, dtype=np.int64)
        self.messages_sent = np.zeros(self.P, dtype=np.int64)
        self._free_at: dict[Hashable, float | int] = {}
        self.link_busy_s: dict[Hashable, float] = {}
        if isinstance(spec, ClusterSpec):  # hierarchical: integer link ids with their own latency and bandwidth
            lat, bw, lev = spec.link_table()
            self._links = (lat.tolist(), bw.tolist(), lev)  # Python floats: the hop loop runs per message
            self._waiting: dict[int, list] = {}
            self._in_flight = np.zeros((2, self.P), dtype=np.int64)  # messages leaving / reaching each rank
            self._routes: dict[tuple[int, int], list[int]] = {}
            self._q = 0.0
            for key in range(len(lat)):
                self._add_link(key)
            return
        self._links = None
        self._latency = spec.link_latency_s
        self._bw = spec.link_bandwidth_Bps
        self._q = spec.quantum_s
        if spec.topology == "star":
            for p in range(self.P):
                self._add_link((p, SWITCH))
            for p in range(self.P):
                self._add_link((SWITCH, p))
        elif spec.topology == "ring" and self.P >= 2:
            for p in range(self.P):
                self._add_link((p, (p + 1) % self.P))
            for p in range(self.P):
                self._add_link((p, (p - 1) % self.P))

    # -- construction helpers -------------------------------------------------------------
    def _add_link(self, key) -> None:
        if key not in self._free_at:
            self._free_at[key] = 0 if self._q > 0 else 0.0
            self.link_busy_s[key] = 0.0

    # -- public API -------------------------------------------------------------------------
    def route(self, src: int, dst: int) -> list[tuple]:
        """Return the list of link keys (hops, in order) a message from ``src`` to ``dst`` uses.

        Empty for ``src == dst``. Star: ``[(src, "switch"), ("switch", dst)]``; direct:
        ``[(src, dst)]``; ring: the shorter direction, clockwise (increasing rank) on ties. A
        :class:`~sim.machine.topology.ClusterSpec` gives its :meth:`~sim.machine.topology.ClusterSpec.path_plan` segments.

        Raises:
            SparsimError: ``src`` or ``dst`` not an integer in ``0 <= rank <= P-1``.
        """
        src = _check_int("src", src, 0, self.P - 1)
        dst = _check_int("dst", dst, 0, self.P - 1)
        return self._route(src, dst)

    def _route(self, src: int, dst: int) -> list:
        if src == dst:
            return []
        if self._links is not None:
            path = self._routes.get((src, dst))
            if path is None:
                path = self._routes[(src, dst)] = self.spec.path_plan(src, dst)
            return path
        topo = self.spec.topology
        if topo == "star":
            return [(src, SWITCH), (SWITCH, dst)]
        if topo == "direct":
            return [(src, dst)]
        P = self.P
        cw = (dst - src) % P
        step = 1 if cw <= P - cw else -1
        hops = cw if step == 1 else P - cw
        path = []
        node = src
        for _ in range(hops):
            nxt = (node + step) % P
            path.append((node, nxt))
            node = nxt
        return path

    def hop_times(self, nbytes: int) -> tuple[float, float]:
        """Return ``(hold_s, delay_s)`` of one uncontended hop for an ``nbytes``-byte message.

        ``hold_s`` = time the link is busy (``nbytes / bandwidth``), ``delay_s`` = time from the
        start of transmission to arrival at the next node (``latency + nbytes / bandwidth``);
        both truncated to whole quanta when ``quantum_s > 0`` (ASTRA-sim's rule).

        Raises:
            SparsimError: ``nbytes`` not an integer >= 0.
        """
        nbytes = _check_int("nbytes", nbytes, 0)
        if self._links is not None:
            raise SparsimError("hop_times: a hierarchical cluster's links differ; valid only for a NetworkSpec network")
        hold_q, delay_q = self._hop_quanta(nbytes)
        if self._q > 0:
            return hold_q * self._q, delay_q * self._q
        return hold_q, delay_q

    def _quantum_too_coarse(self, src: int, dst: int, nbytes: int):
        """Raise SparsimError: the time quantum truncates this message's hop (latency + transfer) to 0 quanta."""
        q = self._q
        exact = self._latency + nbytes / self._bw
        raise SparsimError(
            f"quantum_s = {q:g} s truncates a {nbytes}-byte message's hop (rank {src} -> {dst}, latency "
            f"{self._latency:.3g} s + {nbytes / self._bw:.3g} s of transfer = {exact:.3g} s) to 0: valid "
            f"quantum_s <= {exact:.3g} s (the shortest hop simulated), or quantum_s = 0 (exact time)")

    def _hop_quanta(self, nbytes: int):
        """Hold and delay in quanta (ints) when quantum_s > 0, else in seconds (floats)."""
        ser = nbytes / self._bw
        if self._q > 0:
            q = self._q
            return _floor_quanta(ser / q), _floor_quanta((self._latency + ser) / q)
        return ser, self._latency + ser

    def transfer(self, src: int, dst: int, nbytes: int) -> simpy.Process:
        """Start sending ``nbytes`` bytes from rank ``src`` to rank ``dst``; return its process.

        The process completes (value ``None``) when the whole message has arrived at ``dst``.
        ``src == dst`` is allowed and completes at once (0 s, not counted in the counters). A
        0-byte message still pays every hop's latency.

        Args:
            src, dst: ranks, integers in ``0 <= rank <= P-1``.
            nbytes: message size in bytes, integer >= 0 (Python or numpy int; not bool/float).

        Raises:
            SparsimError: ``src``/``dst`` out of range or ``nbytes`` not an integer >= 0.
        """
        P = self.P
        if not (type(src) is int and type(dst) is int and type(nbytes) is int
                and 0 <= src < P and 0 <= dst < P and nbytes >= 0):  # fast path for plain ints
            src = _check_int("src", src, 0, P - 1)
            dst = _check_int("dst", dst, 0, P - 1)
            nbytes = _check_int("nbytes", nbytes, 0)
        path = self._route(src, dst)
        if path:
            self.bytes_sent[src] += nbytes
            self.messages_sent[src] += 1
        if self._links is not None and path:
            # a hierarchical cluster's per-rank links are modelled as uncontended, which holds because a rank
            # has at most one message leaving and one arriving at a time (SimCluster's rendezvous)
            if self._in_flight[0, src] or self._in_flight[1, dst]:
                raise SparsimError(f"a hierarchical cluster carries one message at a time out of each rank and into "
                                   f"each rank (rendezvous, as SimCluster drives it): rank {src} -> {dst} overlaps "
                                   "another; valid: run programs on sim.engine.cluster.SimCluster")
            self._in_flight[0, src] += 1
            self._in_flight[1, dst] += 1
        return self.env.process(self._send(path, nbytes, src, dst))

    @property
    def rendezvous_uncontended(self) -> bool:
        """Whether a message's links are provably free of other messages while it is on them when the traffic
        is SimCluster's rendezvous (each rank has at most one message leaving it and one reaching it at a time):
        true on flat ``"star"`` networks (the only links are a rank's own uplink and downlink) and ``"direct"``
        meshes (a link per ordered pair), false on rings (a hop may carry other ranks' messages) and on
        hierarchical clusters (shared NICs). :class:`~sim.engine.cluster.SimCluster` then computes each message's
        arrival once, when it starts (:meth:`uncontended_arrival`), instead of running it hop by hop."""
        return self._links is None and self.spec.topology in ("star", "direct")

    def uncontended_arrival(self, src: int, dst: int, nbytes: int, now: float) -> float:
        """Start a message from ``src`` to ``dst`` at simulated time ``now`` and return when its last byte
        arrives at ``dst``, doing at once, with the same float operations, what :meth:`transfer` does hop by
        hop: the counters, each hop's start ``max(t, link free)``, the links' free times and busy seconds, and
        the arrival ``t + ((start - t) + delay)`` per hop (with ``quantum_s > 0``: the grid arithmetic of
        :meth:`_send`). Exact only while no other message reaches these links before this one has left them,
        which holds on a :attr:`rendezvous_uncontended` network under SimCluster's rendezvous; a hop that finds
        its link still held by an earlier message (which that traffic never does) raises SparsimError rather
        than give a time that could differ from :meth:`transfer`'s. Validates like :meth:`transfer`."""
        P = self.P
        if not (type(src) is int and type(dst) is int and type(nbytes) is int
                and 0 <= src < P and 0 <= dst < P and nbytes >= 0):
            src = _check_int("src", src, 0, P - 1)
            dst = _check_int("dst", dst, 0, P - 1)
            nbytes = _check_int("nbytes", nbytes, 0)
        if src == dst:
            return now
        self.bytes_sent[src] += nbytes
        self.messages_sent[src] += 1
        path = ((src, SWITCH), (SWITCH, dst)) if self.spec.topology == "star" else self._route(src, dst)
        free_at = self._free_at
        busy = self.link_busy_s
        hold, delay = self._hop_quanta(nbytes)
        t = now
        q = self._q
        if q > 0:
            if delay == 0 and (self._latency > 0 or nbytes > 0):
                self._quantum_too_coarse(src, dst, nbytes)
            hold_s = hold * q
            for key in path:
                k_now = _ceil_quanta(t / q)
                k_free = free_at.get(key)
                if k_free is None:
                    self._add_link(key)
                    k_free = 0
                if k_free > k_now:
                    self._contended(key, src, dst)
                free_at[key] = k_now + hold
                busy[key] += hold_s
                t_arrive = (k_now + delay) * q
                t = t + (t_arrive - t if t_arrive > t else 0.0)
            return t
        for key in path:
            t_free = free_at.get(key)
            if t_free is None:
                self._add_link(key)
                t_free = 0.0
            if t_free > t:
                self._contended(key, src, dst)
            free_at[key] = t + hold
            busy[key] += hold
            t = t + (0.0 + delay)  # start = t: (start - t) + delay
        return t

    def _contended(self, key, src, dst):
        raise SparsimError(f"message {src} -> {dst} finds link {key} still held by an earlier message: "
                           "Network.uncontended_arrival is exact only under SimCluster's rendezvous (one message "
                           "leaving and one reaching each rank at a time); valid: Network.transfer for other traffic")

    def _arbitrate(self, key, src):
        """Event that fires when message ``src``'s head may take shared link ``key``. All heads that reach the
        link at one instant are released in order of sender rank, after every other event of that instant
        (priority below SimPy's NORMAL), so a tie never depends on the order SimPy created events in; the
        fast engine (:mod:`sim.engine.fastsim`) breaks ties the same way."""
        ev = self.env.event()
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = []
            release = self.env.event()
            release._ok, release._value = True, None  # scheduled by hand below, at the lowest priority

            def _release(_):
                for _, e in sorted(self._waiting.pop(key), key=lambda w: w[0]):
                    e.succeed()

            release.callbacks.append(_release)
            self.env.schedule(release, priority=2)
        waiting.append((src, ev))
        return ev

    def _send(self, path, nbytes, src=0, dst=0):
        # FIFO service with known service times: a message reaching a link at time t starts at
        # max(t, the link's free time), the Lindley recursion a capacity-1 FIFO simpy.Resource
        # would realise with four events per hop; here each hop costs one timeout event.
        env = self.env
        free_at = self._free_at
        busy = self.link_busy_s
        if self._links is not None:  # hierarchical cluster: pipelined (cut-through) FIFO links, sim.machine.topology
            lat, bw, _ = self._links
            tail = -math.inf  # when the message's last byte has left the previous link (plus its latency)
            for seg in path:
                if seg[0] == "run":  # unshared links: free when the head arrives (ClusterSpec.path_plan)
                    _, L, inv, keys = seg
                    for key in keys:
                        busy[key] += nbytes / bw[key]
                    now = env.now
                    t = now + (L + nbytes * inv)
                    if tail + L > t:
                        t = tail + L
                    tail = t
                    yield env.timeout(L)
                    continue
                key = seg[1]
                yield self._arbitrate(key, src)  # heads arriving at the same instant: lower sender rank first
                now = env.now  # the message's head reaches this link
                t_free = free_at[key]
                start = now if now >= t_free else t_free
                end = start + nbytes / bw[key]
                if tail > end:
                    end = tail
                free_at[key] = end
                busy[key] += end - start
                tail = end + lat[key]
                yield env.timeout((start - now) + lat[key])
            if tail > env.now:
                yield env.timeout(tail - env.now)
            if path:
                self._in_flight[0, src] -= 1
                self._in_flight[1, dst] -= 1
            return
        hold, delay = self._hop_quanta(nbytes)
        q = self._q
        if q > 0:
            if delay == 0 and (self._latency > 0 or nbytes > 0):
                self._quantum_too_coarse(src, dst, nbytes)
            hold_s = hold * q
            for key in path:
                now = env.now
                k_now = _ceil_quanta(now / q)  # a send made off the grid starts at the next quantum
                k_free = free_at.get(key)
                if k_free is None:
                    self._add_link(key)
                    k_free = 0
                start = k_now if k_now >= k_free else k_free
                free_at[key] = start + hold
                busy[key] += hold_s
                t_arrive = (start + delay) * q
                yield env.timeout(t_arrive - now if t_arrive > now else 0.0)
        else:
            for key in path:
                now = env.now
                t_free = free_at.get(key)
                if t_free is None:
                    self._add_link(key)
                    t_free = 0.0
                start = now if now >= t_free else t_free
                free_at[key] = start + hold
                busy[key] += hold
                yield env.timeout((start - now) + delay)


#: busbw / algbw correction factors by collective (nccl-tests ``PERFORMANCE.md``), as functions of P.
BUSBW_FACTORS = {
    "allreduce": lambda P: 2.0 * (P - 1) / P,
    "allgather": lambda P: (P - 1) / P,
    "reduce_scatter": lambda P: (P - 1) / P,
    "broadcast": lambda P: 1.0,
}


def busbw(collective: str, nbytes: int, P: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s of a collective over ``nbytes`` bytes on ``P`` ranks taking ``seconds``.

    nccl-tests convention (``doc/PERFORMANCE.md``): ``algbw = nbytes / seconds`` and
    ``busbw = algbw * factor`` with factor ``2 (P-1) / P`` for ``"allreduce"``, ``(P-1) / P``
    for ``"allgather"`` and ``"reduce_scatter"`` (``nbytes`` = the total gathered/input size),
    and ``1`` for ``"broadcast"``. A bandwidth-optimal algorithm on links of bandwidth B has
    busbw = B, independent of P.

    Args:
        collective: a key of :data:`BUSBW_FACTORS`.
        nbytes: message size in bytes, real >= 0.
        P: number of ranks, integer >= 1.
        seconds: measured/simulated duration in seconds, finite, > 0.

    Raises:
        SparsimError: unknown collective (message lists the valid ones) or a value out of range.
    """
    if collective not in BUSBW_FACTORS:
        raise SparsimError(
            f"collective = {collective!r} is unknown: valid collectives are {', '.join(BUSBW_FACTORS)}"
        )
    nbytes = _check_real("nbytes", nbytes, 0, err=SparsimError)
    P = _check_int("P", P, 1)
    seconds = _check_real("seconds", seconds, 0, lo_open=True, err=SparsimError)
    return nbytes / seconds * BUSBW_FACTORS[collective](P)
