"""The fast engine's ring kernel (sim.engine._fast_numba.ring_run: costs per distinct chunk size, tiles of ranks over
blocks of rounds) gives, bit for bit, the clocks and busy seconds of its one-pass-per-round form (_ring_rounds, the
form the engine's round-by-round tests hold against FastCluster.exchange / compute, tests/test_fastsim_runs.py), on
every layout of tiles: one tile, many, the wrap-around corner, blocks cut short, and the fallbacks."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

K = pytest.importorskip("sim.engine._fast_numba")


def _table(kind: str, P: int, n: int, rng) -> np.ndarray:
    """A ring's chunk table (elements per chunk, int64 (P,)) of one kind."""
    if kind == "split":  # np.array_split of n over P chunks: q + 1, then q (the engine's rings)
        return np.array([len(x) for x in np.array_split(np.arange(n), P)], dtype=np.int64)
    if kind == "const":
        return np.full(P, n // P, dtype=np.int64)
    if kind == "runs":  # MAX_RUNS runs: still by segments
        return np.repeat(np.arange(K.MAX_RUNS), -(-P // K.MAX_RUNS))[:P].astype(np.int64) * 3
    return rng.integers(0, 5, P)  # "random": more runs than MAX_RUNS -> _ring_rounds


def _both(P, c, tile, kind, n, ring_offsets, seed):
    rng = np.random.default_rng(seed)
    ch = _table(kind, P, n, rng)
    sizes = (np.concatenate([ch, ch]) * 4).astype(np.float64)
    works = np.concatenate([ch, ch]).astype(np.float64)
    rounds = 2 * (P - 1)
    if ring_offsets:  # ring_schedule's: chunk (pos - s) % P, reduced in the first P - 1 rounds
        offs = np.array([(P - i) % P for i in range(P - 1)] * 2, dtype=np.int64)
        wo = np.array([(P - i) % P for i in range(P - 1)] + [-1] * (P - 1), dtype=np.int64)
    else:
        offs = rng.integers(0, P + 1, rounds).astype(np.int64)
        wo = np.where(rng.random(rounds) < 0.5, rng.integers(0, P + 1, rounds), -1).astype(np.int64)
    lat = rng.random(P) * 1e-5
    inv = rng.random(P) * 1e-9
    r0 = rng.random(P) * 1e-3
    b0 = rng.random(P) * 1e-6
    out = []
    for tiled in (False, True):
        ready, busy = r0.copy(), b0.copy()
        args = (ready, c, lat, inv, sizes, offs, 1.7e-12, works, wo, busy)
        if tiled:
            took = K._ring_tiled(*args, tile)
            if not took:  # it changed nothing; ring_run then runs the one-pass form
                assert np.array_equal(ready, r0) and np.array_equal(busy, b0)
                K.ring_run(*args, tile)
        else:
            K._ring_rounds(*args)
        out.append((ready, busy))
    return out, took


def _tiles_it(P, c, tile, kind) -> bool:
    """Whether ring_run's docstring says the tiled form evaluates this ring."""
    blocks = (P // max(1, P // tile)) // (2 * c)
    return kind in ("split", "const", "runs") and blocks >= K.MIN_BLOCK


# (P, c, tile): one tile (P < 2 tile), many (8 to 30; tiles that do not divide P; blocks of exactly MIN_BLOCK rounds),
# and c too large for the tile (the one-pass fallback)
CASES = [(64, 1, 1024), (512, 1, 64), (600, 2, 70), (1000, 3, 100), (3001, 2, 100), (2048, 8, 256), (4096, 1, 1024),
         (64, 40, 8), (64, 63, 1024), (1024, 128, 1024)]


@pytest.mark.parametrize("P,c,tile", CASES)
@pytest.mark.parametrize("kind", ["split", "const", "runs", "random"])
@pytest.mark.parametrize("ring_offsets", [True, False])
def test_tiled_ring_gives_the_one_pass_bits(P, c, tile, kind, ring_offsets):
    """Tables of one size, of the split's two, of MAX_RUNS sizes and of random sizes (the fallback), on
    ring_schedule's offsets and on random ones: the tiled form runs exactly where ring_run's docstring says, and
    the clocks and the busy row are equal (==) to the one-pass form's."""
    ((want_r, want_b), (got_r, got_b)), took = _both(P, c, tile, kind, 7 * P + 3, ring_offsets, seed=P * 131 + c)
    assert took == _tiles_it(P, c, tile, kind)
    assert np.array_equal(got_r, want_r)
    assert np.array_equal(got_b, want_b)
    assert not np.array_equal(want_r, np.zeros(P))


@settings(max_examples=60, deadline=None)
@given(P=st.integers(32, 700), c=st.integers(1, 4), tile=st.integers(32, 256), n=st.integers(0, 5000),
       ring_offsets=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_tiled_ring_bits_property(P, c, tile, n, ring_offsets, seed):
    """Any P, c < P, tile and chunk-table size (split layout): the same bits as the one-pass form."""
    c = min(c, P - 1)
    ((want_r, want_b), (got_r, got_b)), took = _both(P, c, tile, "split", n, ring_offsets, seed)
    assert took == _tiles_it(P, c, tile, "split")
    assert np.array_equal(got_r, want_r)
    assert np.array_equal(got_b, want_b)


def test_a_table_too_short_is_left_to_the_one_pass_form():
    """Tables shorter than 2P (here: no work table, no round reducing) are refused before they are read (helper-28
    found the tiled form reading past the end of an empty work table), and ring_run gives the one-pass bits."""
    P = 256
    ch = np.array([len(x) for x in np.array_split(np.arange(1000), P)], dtype=np.float64)
    sizes = np.concatenate([ch, ch]) * 4
    offs = np.array([(P - i) % P for i in range(P - 1)] * 2, dtype=np.int64)
    wo = np.full(offs.shape[0], -1, dtype=np.int64)
    lat, inv = np.full(P, 2e-6), np.full(P, 1e-9)
    out = []
    for f in (K._ring_rounds, K.ring_run):
        ready, busy = np.zeros(P), np.zeros(P)
        f(ready, 1, lat, inv, sizes, offs, 0.0, np.empty(0), wo, busy)
        out.append(ready)
    assert not K._ring_tiled(np.zeros(P), 1, lat, inv, sizes, offs, 0.0, np.empty(0), wo, np.zeros(P), 64)
    assert np.array_equal(out[0], out[1]) and out[0].max() > 0


def test_runs_of_a_table():
    """_runs: run starts read cyclically (a run that wraps around position 0 starts where it starts), the value of
    each position, and the count past MAX_RUNS."""
    t = np.array([2.0, 2.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0] * 2)
    starts, which, values, n = K._runs(t, 8)
    assert list(starts) == [2, 5] and n == 2
    assert [values[w] for w in which] == list(t[:8])
    starts, which, values, n = K._runs(np.full(10, 4.0), 5)
    assert n == 0 and list(values) == [4.0] and list(which) == [0] * 5
    assert K._runs(np.arange(40, dtype=np.float64), 20)[3] == K.MAX_RUNS + 1
