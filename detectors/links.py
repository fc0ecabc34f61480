"""Fabric links that trained below the rate they should run at.

An InfiniBand or RoCE link negotiates its width (lanes) and lane speed when it comes up;
a dirty connector, a damaged cable or a failing transceiver makes it train down (4X to
1X, NDR to HDR) and stay up, carrying a fraction of its traffic with no error counter
moving.  The kernel shows only the result (``rate``: "100 Gb/sec (2X NDR)"), not what the
port supports, so a port is compared with, in this order:

1. **its rated speed**, where the operator configured one (``rated``): below it is down-trained;
2. **its peers on the node**: the other up ports of the same adapter model and link layer
   (the eight compute HCAs of a GPU node are alike); below the fastest of them is down-trained;
3. **itself**: below the highest rate the same port has run at before.

Peers are not compared across nodes: fleets mix adapter generations, and a node of an
older generation is not a degraded one.  A port that is down, or whose rate is unknown,
is never flagged (a down port is the link rules' business).

Pure: numpy only, vectorised over nodes and ports.
"""

from __future__ import annotations

import numpy as np

#: Basis codes of :func:`links_below`.
NONE, RATED, NODE_PEERS, OWN_HISTORY = 0, 1, 2, 3
BASIS = {RATED: "rated", NODE_PEERS: "node_peers", OWN_HISTORY: "own_history"}
#: Rates within this fraction count as equal (rates are printed rounded: "2.5", "56").
TOLERANCE = 0.01


def links_below(rate: np.ndarray, group: np.ndarray, up: np.ndarray, best: np.ndarray,
                rated: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ports running below what they should, and what that is.

    Parameters (all ``(m, p)``: m nodes, p ports each)
    ----------
    rate: the rate each port trained to, Gb/s; NaN where unknown.
    group: ports of one node with the same code run alike (adapter model and link
        layer); a negative code is in no group.
    up: the port is up.
    best: the highest rate the port ran at before; NaN or 0 where none.
    rated: the configured rate; NaN where none (then peers and history decide).

    Returns
    -------
    ``(flag, expected, basis)``: bool, the expected rate (NaN where not flagged), and
    the basis code (:data:`RATED`, :data:`NODE_PEERS`, :data:`OWN_HISTORY`; 0 where not
    flagged).
    """
    rate = np.asarray(rate, dtype=np.float64)
    known = np.asarray(up, dtype=bool) & np.isfinite(rate) & (rate > 0)
    r = np.where(known, rate, -np.inf)
    g = np.asarray(group)
    same = (g[:, :, None] == g[:, None, :]) & (g[:, :, None] >= 0)
    peer = np.where(same, r[:, None, :], -np.inf).max(axis=2)           # fastest alike port (itself included)
    rated = np.asarray(rated, dtype=np.float64)
    best = np.nan_to_num(np.asarray(best, dtype=np.float64), nan=0.0)
    has_rated = np.isfinite(rated) & (rated > 0)
    slow = 1.0 - TOLERANCE
    by_rated = known & has_rated & (rate < rated * slow)
    by_peers = known & ~has_rated & (rate < peer * slow)
    by_history = known & ~has_rated & ~by_peers & (rate < best * slow)
    basis = np.zeros(rate.shape, dtype=np.int8)
    basis[by_rated], basis[by_peers], basis[by_history] = RATED, NODE_PEERS, OWN_HISTORY
    expected = np.full(rate.shape, np.nan)
    expected[by_rated] = rated[by_rated]
    expected[by_peers] = peer[by_peers]
    expected[by_history] = best[by_history]
    return basis > 0, expected, basis
