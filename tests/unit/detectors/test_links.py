"""links_below: rated speed, alike peers on the node, the port's own past."""

from __future__ import annotations

import numpy as np

from detectors.links import NODE_PEERS, OWN_HISTORY, RATED, links_below

NAN = np.nan


def test_each_basis_over_several_nodes_at_once() -> None:
    rate = np.array([[400.0, 400.0, 200.0, 100.0],    # port 2 below its alike peers; port 3 another adapter
                     [400.0, 200.0, 400.0, 400.0],    # port 1 below the rated 400 (rated wins over peers)
                     [200.0, 200.0, 200.0, 200.0]])   # all alike and equal, port 0 ran at 400 before
    group = np.array([[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    up = np.ones((3, 4), dtype=bool)
    best = np.array([[0.0] * 4, [0.0] * 4, [400.0, 200.0, 0.0, 0.0]])
    rated = np.full((3, 4), NAN)
    rated[1] = 400.0
    flag, expected, basis = links_below(rate, group, up, best, rated)
    assert flag.tolist() == [[False, False, True, False], [False, True, False, False], [True, False, False, False]]
    assert (basis[0, 2], basis[1, 1], basis[2, 0]) == (NODE_PEERS, RATED, OWN_HISTORY)
    assert (expected[0, 2], expected[1, 1], expected[2, 0]) == (400.0, 400.0, 400.0)
    assert np.isnan(expected[~flag]).all() and (basis[~flag] == 0).all()


def test_down_unknown_and_ungrouped_ports_are_never_flagged_nor_peers() -> None:
    rate = np.array([[400.0, 100.0, NAN, 100.0, 100.0]])
    group = np.array([[0, 0, 0, -1, -1]])
    up = np.array([[False, True, True, True, True]])   # the 400 port is down: not a peer
    flag, _, _ = links_below(rate, group, up, np.zeros((1, 5)), np.full((1, 5), NAN))
    assert not flag.any()


def test_rates_within_rounding_are_equal() -> None:
    rate = np.array([[2.5, 2.49]])
    flag, _, _ = links_below(rate, np.zeros((1, 2), int), np.ones((1, 2), bool), np.zeros((1, 2)),
                             np.full((1, 2), NAN))
    assert not flag.any()
