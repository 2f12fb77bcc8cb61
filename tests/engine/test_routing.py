"""The routing decision and the PCIe distance classes, as pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from gdskit.machine.storage import Storage, distance
from gdskit.machine.topology import PciPlace, PeerDevice
from gdskit.engine.gpu_routing import RouteWhy, decide
from gdskit.machine.distance import Distance, PeerLink
from gdskit.vocabulary import Routing

D = Distance
NEAR, FAR = D.SAME_SWITCH, D.CROSS_SOCKET


def peers_all(a: int, b: int) -> PeerLink:
    return PeerLink(True, True)


def peers_none(a: int, b: int) -> PeerLink:
    return PeerLink(False, False)


# --------------------------------------------------------------------------- decide
def test_auto_routes_through_the_strictly_nearer_gpu_with_peer_access():
    r = decide(0, {0: FAR, 1: NEAR}, peers_all, Routing.AUTO)
    assert (r.via, r.why, r.routed) == (1, RouteWhy.NEARER_GPU, True)
    assert r.nearest == (1,) and r.nearest_distance is NEAR and r.target_distance is FAR
    assert r.peer == PeerLink(True, True)


def test_auto_takes_the_nearest_of_several_nearer_gpus_and_skips_those_without_access():
    dist = {0: D.CROSS_SOCKET, 1: D.SAME_ROOT_COMPLEX, 2: D.SAME_SWITCH, 3: D.SAME_SWITCH}
    assert decide(0, dist, peers_all, Routing.AUTO).via == 2
    no_2 = lambda a, b: PeerLink({a, b} != {0, 2})  # noqa: E731
    assert decide(0, dist, no_2, Routing.AUTO).via == 3
    only_1 = lambda a, b: PeerLink({a, b} == {0, 1})  # noqa: E731
    assert decide(0, dist, only_1, Routing.AUTO).via == 1


def test_auto_does_not_route_the_nearest_or_a_tie():
    assert decide(1, {0: FAR, 1: NEAR}, peers_all, Routing.AUTO).why is RouteWhy.TARGET_NEAREST
    tie = decide(0, {0: NEAR, 1: NEAR}, peers_all, Routing.AUTO)
    assert not tie.routed and tie.why is RouteWhy.TARGET_NEAREST and tie.nearest == (0, 1)


def test_auto_without_peer_access_or_distance_or_direct_path_does_not_route():
    assert decide(0, {0: FAR, 1: NEAR}, peers_none, Routing.AUTO).why is RouteWhy.NO_PEER_ACCESS
    unknown_peer = decide(0, {0: FAR, 1: NEAR}, lambda a, b: PeerLink(None), Routing.AUTO)
    assert unknown_peer.why is RouteWhy.NO_PEER_ACCESS  # not known is not access
    assert decide(0, {0: D.UNKNOWN, 1: NEAR}, peers_all, Routing.AUTO).why is RouteWhy.DISTANCE_UNKNOWN
    assert decide(0, {0: FAR, 1: D.UNKNOWN}, peers_all, Routing.AUTO).why is RouteWhy.TARGET_NEAREST
    assert decide(0, {0: FAR, 1: NEAR}, peers_all, Routing.AUTO, direct=False).why is RouteWhy.NO_DIRECT_PATH
    assert decide(0, {0: FAR, 1: NEAR}, peers_all, Routing.AUTO,
                  storage_known=False).why is RouteWhy.STORAGE_UNKNOWN


def test_off_never_routes_and_one_gpu_is_a_no_op_under_every_policy():
    assert decide(0, {0: FAR, 1: NEAR}, peers_all, Routing.OFF).why is RouteWhy.OFF
    for policy in Routing:
        r = decide(0, {0: FAR}, peers_all, policy)
        assert not r.routed and r.why in (RouteWhy.ONE_GPU, RouteWhy.OFF)


def test_force_routes_through_the_nearest_other_gpu_on_ties_and_unknowns():
    tie = decide(0, {0: NEAR, 1: NEAR}, peers_all, Routing.FORCE)
    assert (tie.via, tie.why) == (1, RouteWhy.FORCED)
    assert decide(1, {0: D.UNKNOWN, 1: D.UNKNOWN}, peers_all, Routing.FORCE).via == 0
    # Even the nearest GPU goes through the next one; peer-capable GPUs come first.
    assert decide(0, {0: NEAR, 1: FAR, 2: D.SAME_ROOT_PORT}, peers_all, Routing.FORCE).via == 2
    only_1 = lambda a, b: PeerLink({a, b} == {0, 1})  # noqa: E731
    assert decide(0, {0: NEAR, 1: FAR, 2: D.SAME_ROOT_PORT}, only_1, Routing.FORCE).via == 1
    # Without a direct path or known storage it still routes (it is for testing the path).
    assert decide(0, {}, peers_none, Routing.FORCE, 2, direct=False, storage_known=False).via == 1


_dist = st.sampled_from(list(Distance))


@hsettings(max_examples=300, deadline=None)
@given(st.lists(_dist, min_size=1, max_size=6), st.data())
def test_decisions_keep_their_rules(dists, data):
    n = len(dists)
    target = data.draw(st.integers(0, n - 1))
    access = data.draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))))

    def peers(a, b):
        return PeerLink((a, b) in access or (b, a) in access)

    table = dict(enumerate(dists))
    auto = decide(target, table, peers, Routing.AUTO)
    if auto.routed:
        assert auto.via != target and peers(target, auto.via).access
        assert table[auto.via].rank is not None and table[target].rank is not None
        assert table[auto.via].rank < table[target].rank
        # No nearer GPU with access was passed over.
        better = [g for g, d in table.items() if d.rank is not None and d.rank < table[auto.via].rank
                  and peers(target, g).access]
        assert not better
    assert not decide(target, table, peers, Routing.OFF).routed
    forced = decide(target, table, peers, Routing.FORCE)
    assert forced.routed is (n >= 2) and forced.via != target


# --------------------------------------------------------------------------- distance classes
def place(host: str, *chain: str) -> PciPlace:
    return PciPlace(host, tuple(chain))


GPU = place("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0")


@pytest.mark.parametrize("other, numa, expected", [
    # Another downstream port of the GPU's switch.
    (place("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"), 0, D.SAME_SWITCH),
    # Behind a second switch under the same root port.
    (place("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:02.0", "0000:05:00.0", "0000:06:00.0",
           "0000:07:00.0"), 0, D.SAME_ROOT_PORT),
    # Another root port of the same host bridge.
    (place("pci0000:00", "0000:00:03.0", "0000:08:00.0"), 0, D.SAME_ROOT_COMPLEX),
    # Another host bridge on the same NUMA node, or with the node unknown.
    (place("pci0000:16", "0000:16:01.0", "0000:17:00.0"), 0, D.CROSS_ROOT_COMPLEX),
    (place("pci0000:16", "0000:16:01.0", "0000:17:00.0"), None, D.CROSS_ROOT_COMPLEX),
    # Another socket.
    (place("pci0000:80", "0000:80:01.0", "0000:81:00.0"), 1, D.CROSS_SOCKET),
    (None, 0, D.UNKNOWN),
    (place(None), 0, D.UNKNOWN),
])
def test_distance_classes(other, numa, expected):
    assert distance(GPU, 0, other, numa) is expected
    assert distance(other, numa, GPU, 0) is expected


def test_striped_storage_is_as_far_as_its_farthest_drive_and_nics_as_near_as_the_nearest():
    near = PeerDevice("nvme", "nvme0", "0000:04:00.0",
                      place("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"), 0)
    far = PeerDevice("nvme", "nvme1", "0000:81:00.0", place("pci0000:80", "0000:80:01.0", "0000:81:00.0"), 1)
    assert Storage((near, far), spread=True).distance_to(GPU, 0) is D.CROSS_SOCKET
    assert Storage((near, far), spread=False).distance_to(GPU, 0) is D.SAME_SWITCH
    lost = PeerDevice("nvme", "nvme2", None, None, None)
    assert Storage((near, lost), spread=True).distance_to(GPU, 0) is D.UNKNOWN
    assert Storage((near, lost), spread=False).distance_to(GPU, 0) is D.SAME_SWITCH
    assert Storage().distance_to(GPU, 0) is D.UNKNOWN
