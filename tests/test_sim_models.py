"""Closed-form checks of the simulator's physical models (sim/links.py, sim/gpu.py):
bandwidth sharing, posting threads and the NIC message rate."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Generator
from typing import Any

import pytest
import simpy

from kvstage.shared.scenario import LinkNumbers
from kvstage.sim.gpu import GpuParams, SerialStream, copy_time
from kvstage.sim.links import Fabric, Nic

GB = 1e9
# Round numbers so the hand computations below stay readable.
RDMA = LinkNumbers(bandwidth_bytes_s=math.inf, latency_s=5e-6, per_request_s=1e-6)
BARE = LinkNumbers(bandwidth_bytes_s=math.inf, latency_s=0.0, per_request_s=0.0)


def approx(x: float) -> Any:
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def start_at(env: simpy.Environment, t: float, fab: Fabric, src: Nic, dst: Nic, nbytes: int,
             params: LinkNumbers, requests: int = 1) -> simpy.Process:  # fmt: skip
    """A transfer issued at simulated time ``t``; its value is the finish time."""

    def proc() -> Generator[simpy.Event, Any, float]:
        yield env.timeout(t)
        return (yield fab.transfer(src, dst, nbytes, params, requests))

    return env.process(proc())


def fabric(*bandwidths: float) -> tuple[simpy.Environment, Fabric, list[Nic]]:
    env = simpy.Environment()
    fab = Fabric(env)
    return env, fab, [fab.add_nic(f"n{i}", bw) for i, bw in enumerate(bandwidths)]


# -- links ------------------------------------------------------------------


def test_single_transfer_closed_form() -> None:
    env, fab, (a, b) = fabric(50 * GB, 50 * GB)
    nbytes = 64 << 20
    ev = fab.transfer(a, b, nbytes, RDMA)
    env.run()
    expected = RDMA.latency_s + RDMA.per_request_s + nbytes / (50 * GB)
    assert ev.value == approx(expected)
    assert env.now == approx(expected)
    assert fab.bytes_moved == nbytes and fab.transfers_done == 1 and fab.active_flows == 0
    assert a.bytes_sent == nbytes and b.bytes_received == nbytes


def test_two_equal_transfers_share_the_sender() -> None:
    env, fab, (a, b, c) = fabric(10 * GB, 10 * GB, 10 * GB)
    nbytes = 10**9
    e1 = fab.transfer(a, b, nbytes, RDMA)
    e2 = fab.transfer(a, c, nbytes, RDMA)
    env.run()
    alone = nbytes / (10 * GB)
    fixed = RDMA.latency_s + RDMA.per_request_s
    assert e1.value == approx(fixed + 2 * alone)
    assert e2.value == approx(fixed + 2 * alone)


def test_short_transfer_during_long_one_is_processor_shared() -> None:
    env, fab, (a, b, c) = fabric(10 * GB, 10 * GB, 10 * GB)
    C = 10 * GB
    long_b, short_b, t1 = 10 * 10**9, 2 * 10**9, 0.3
    long = start_at(env, 0.0, fab, a, b, long_b, BARE)
    short = start_at(env, t1, fab, a, c, short_b, BARE)
    env.run()
    # Long alone on [0, t1); both at C/2 until the short drains; the sender never
    # idles, so the long ends when the sum of both has gone through at rate C.
    assert short.value == approx(t1 + 2 * short_b / C)
    assert long.value == approx((long_b + short_b) / C)


def test_receive_side_sharing() -> None:
    env, fab, (a, b, c) = fabric(10 * GB, 10 * GB, 10 * GB)
    e1 = fab.transfer(a, c, 10**9, BARE)
    e2 = fab.transfer(b, c, 3 * 10**9, BARE)
    env.run()
    # Both at 5 GB/s while two; the first drains at 0.2 s, then the second alone at 10.
    assert e1.value == approx(0.2)
    assert e2.value == approx(0.2 + 2 * 10**9 / (10 * GB))


def test_full_duplex_sides_are_independent() -> None:
    env, fab, (a, b) = fabric(10 * GB, 10 * GB)
    e1 = fab.transfer(a, b, 10**9, BARE)
    e2 = fab.transfer(b, a, 10**9, BARE)
    env.run()
    assert e1.value == approx(0.1) and e2.value == approx(0.1)


def test_max_min_unequal_bottlenecks() -> None:
    # A: n1->n2 and B: n1->n3 share n1 (100); n3 is slower (30): B gets 30, A the other 70.
    env, fab, (n1, n2, n3) = fabric(100.0, 100.0, 30.0)
    a = fab.transfer(n1, n2, 1400, BARE)
    b = fab.transfer(n1, n3, 300, BARE)
    env.run(until=1.0)
    assert sorted(r for _, _, r in fab.rates()) == [approx(30.0), approx(70.0)]
    fab.check_invariants()
    env.run()
    assert b.value == approx(10.0)  # 300 B at 30 B/s
    assert a.value == approx(10.0 + (1400 - 700) / 100.0)  # then alone at 100


def test_max_min_chain_of_bottlenecks() -> None:
    # f1: a->x, f2: a->y, f3: b->y with y=4 the tightest: f2, f3 get 2; f1 takes a's other 8.
    env, fab, (a, b, x, y) = fabric(10.0, 100.0, 100.0, 4.0)
    f1 = fab.transfer(a, x, 80, BARE)
    f2 = fab.transfer(a, y, 20, BARE)
    f3 = fab.transfer(b, y, 40, BARE)
    env.run(until=1.0)
    assert [r for _, _, r in fab.rates()] == [approx(8.0), approx(2.0), approx(2.0)]
    fab.check_invariants()
    env.run()
    # t=10: f1 (80 at 8) and f2 (20 at 2) drain together; f3 has 20 left, alone at 4.
    assert f1.value == approx(10.0) and f2.value == approx(10.0)
    assert f3.value == approx(15.0)


def test_same_path_flows_share_one_clock() -> None:
    # Three flows on one path: processor sharing among members of one path class.
    env, fab, (a, b) = fabric(100.0, 100.0)
    evs = [fab.transfer(a, b, nbytes, BARE) for nbytes in (100, 200, 300)]
    late_long = start_at(env, 10.0, fab, a, b, 300, BARE)
    late_short = start_at(env, 11.0, fab, a, b, 100, BARE)
    env.run()
    # 3 at 33.3 until the 100 B one drains (t=3), 2 at 50 for the next 100 B (t=5), 1 at 100.
    assert [e.value for e in evs] == [approx(3.0), approx(5.0), approx(6.0)]
    # Joining mid-way: the 300 B one had 100 B alone, then both at 50 B/s.
    assert late_short.value == approx(13.0)
    assert late_long.value == approx(14.0)


def test_far_from_time_zero() -> None:
    # Float time near 1e6 s: completions must still fire once, at the right instant.
    env, fab, (a, b, c) = fabric(3.0, 7.0, 7.0)
    t = 1e6 + 0.1
    e1 = start_at(env, t, fab, a, b, 1, BARE)
    e2 = start_at(env, t, fab, a, c, 2, BARE)
    env.run()
    assert e1.value == pytest.approx(t + 2 / 3.0, rel=1e-13)
    assert e2.value == pytest.approx(t + 1.0, rel=1e-13)
    assert fab.active_flows == 0 and fab.bytes_moved == 3


def test_path_cap_below_nic_bandwidth() -> None:
    env, fab, (a, b, c) = fabric(100.0, 100.0, 100.0)
    capped = LinkNumbers(bandwidth_bytes_s=25.0, latency_s=0.0, per_request_s=0.0)
    e1 = fab.transfer(a, b, 250, capped)
    e2 = fab.transfer(a, c, 750, BARE)  # uncapped neighbour takes what the cap leaves
    env.run(until=1.0)
    assert [r for _, _, r in fab.rates()] == [approx(25.0), approx(75.0)]
    env.run()
    assert e1.value == approx(10.0) and e2.value == approx(10.0)


def test_requests_add_posting_cost() -> None:
    env, fab, (a, b) = fabric(10 * GB, 10 * GB)
    one = fab.transfer(a, b, 10**6, RDMA, requests=1)
    env.run()
    env2, fab2, (a2, b2) = fabric(10 * GB, 10 * GB)
    many = fab2.transfer(a2, b2, 10**6, RDMA, requests=1000)
    env2.run()
    assert many.value - one.value == approx(999 * RDMA.per_request_s)


def test_zero_bytes() -> None:
    env, fab, (a, b) = fabric(10 * GB, 10 * GB)
    ev = fab.transfer(a, b, 0, RDMA, requests=3)
    env.run()
    assert ev.value == approx(RDMA.latency_s + 3 * RDMA.per_request_s)
    assert fab.bytes_moved == 0 and fab.transfers_done == 1 and fab.active_flows == 0
    env2, fab2, (a2, b2) = fabric(10 * GB, 10 * GB)
    ev2 = fab2.transfer(a2, b2, 0, BARE, requests=0)
    env2.run()
    assert ev2.value == 0.0


def test_message_is_a_plain_delay() -> None:
    env, fab, _ = fabric(1.0)
    ev = fab.message(7e-6)
    env.run()
    assert env.now == approx(7e-6) and ev.processed and fab.messages_sent == 1


def test_bad_inputs_rejected() -> None:
    env, fab, (a, b) = fabric(1.0, 1.0)
    with pytest.raises(ValueError):
        fab.add_nic("n0", 1.0)
    with pytest.raises(ValueError):
        fab.add_nic("z", 0.0)
    with pytest.raises(ValueError):
        LinkNumbers(bandwidth_bytes_s=0.0, latency_s=0.0, per_request_s=0.0)
    with pytest.raises(ValueError):
        fab.transfer(a, b, -1, BARE)


# -- posting threads and the NIC message rate ------------------------------------
# Round numbers: a 10 GB/s NIC that processes 1e6 work requests/s, so one request
# occupies a NIC side for at least 1 us, i.e. W = 10 GB/s / 1e6/s = 10,000 bytes.
MSG = LinkNumbers(bandwidth_bytes_s=math.inf, latency_s=2e-6, per_request_s=1e-7, per_batch_s=5e-6,
                 message_rate=1e6)  # fmt: skip
MSG_ONLY = LinkNumbers(
    bandwidth_bytes_s=math.inf, latency_s=0.0, per_request_s=0.0, message_rate=1e6
)


def test_one_small_batch_alone_costs_batch_plus_requests_over_message_rate() -> None:
    env, fab, (a, b) = fabric(10 * GB, 10 * GB)
    ev = fab.transfer(a, b, 100_000, MSG, requests=1000)  # 1,000 writes of 100 B
    env.run()
    # latency + per batch + R * per request + R / message rate (100 KB alone would take 10 us)
    assert ev.value == approx(2e-6 + 5e-6 + 1000 * 1e-7 + 1000 / 1e6)
    assert fab.bytes_moved == 100_000 and a.bytes_sent == 100_000 and b.bytes_received == 100_000


def test_two_batches_share_one_nics_message_rate() -> None:
    env, fab, (a, b, c) = fabric(10 * GB, 10 * GB, 10 * GB)
    e1 = fab.transfer(a, b, 50_000, MSG_ONLY, requests=500)  # same sending NIC
    e2 = fab.transfer(a, c, 100_000, MSG_ONLY, requests=1000)
    env.run(until=1e-4)
    fab.check_invariants()
    env.run()
    # processor sharing of a's message rate: 500 requests each by 1 ms, then the rest alone
    assert e1.value == approx(2 * 500 / 1e6) and e2.value == approx((500 + 1000) / 1e6)
    # the receiving side's message rate is shared the same way (fan-in)
    env2, fab2, (p, q, d) = fabric(10 * GB, 10 * GB, 10 * GB)
    f1 = fab2.transfer(p, d, 1000, MSG_ONLY, requests=1000)
    f2 = fab2.transfer(q, d, 1000, MSG_ONLY, requests=1000)
    env2.run()
    assert f1.value == approx(2e-3) and f2.value == approx(2e-3)


def test_large_write_unaffected_by_message_rate() -> None:
    nbytes = 64 << 20  # one request of 64 MiB: 6.7 ms of bytes, 1 us of message rate
    env, fab, (a, b) = fabric(10 * GB, 10 * GB)
    ev = fab.transfer(a, b, nbytes, MSG, requests=1)
    env.run()
    assert ev.value == approx(2e-6 + 5e-6 + 1e-7 + nbytes / (10 * GB))
    # a slice write whose requests are larger than W = 10,000 bytes is byte-bound too
    env2, fab2, (a2, b2) = fabric(10 * GB, 10 * GB)
    ev2 = fab2.transfer(a2, b2, 1000 * 20_000, MSG_ONLY, requests=1000)
    env2.run()
    assert ev2.value == approx(1000 * 20_000 / (10 * GB))


def test_message_bound_and_byte_bound_flows_share_nic_time() -> None:
    env, fab, (a, b) = fabric(10 * GB, 10 * GB)
    small = fab.transfer(a, b, 1000, MSG_ONLY, requests=1000)  # 1 ms of NIC time alone
    big = fab.transfer(a, b, 10**7, MSG_ONLY, requests=1)  # 1 ms of bytes alone
    env.run()
    assert small.value == approx(2e-3) and big.value == approx(2e-3)


def test_posting_threads_queue_a_ranks_batches() -> None:
    def finishes(threads: int, posters: tuple[Any, Any]) -> list[float]:
        p = LinkNumbers(bandwidth_bytes_s=math.inf, latency_s=0.0, per_request_s=1e-6, per_batch_s=1e-5,
                       post_threads=threads)  # fmt: skip
        env, fab, (a, b, c) = fabric(10 * GB, 10 * GB, 10 * GB)
        evs = [
            fab.transfer(a, dst, 0, p, requests=90, poster=who)
            for dst, who in zip((b, c), posters, strict=True)
        ]
        env.run()
        return [ev.value for ev in evs]

    post = 1e-5 + 90 * 1e-6  # 100 us of posting per batch
    assert finishes(1, (0, 0)) == [approx(post), approx(2 * post)]  # one thread: serialised
    assert finishes(2, (0, 0)) == [approx(post), approx(post)]  # two threads: overlap
    assert finishes(1, (0, 1)) == [
        approx(post),
        approx(post),
    ]  # two ranks never wait for each other
    assert finishes(0, (0, 0)) == [approx(post), approx(post)]  # 0: unlimited (parallel)


def test_link_numbers_refuse_impossible_values() -> None:
    """The fabric takes the scenario's own LinkNumbers; built by hand, they still
    refuse what no link can be."""
    for bad in (
        dict(bandwidth_bytes_s=0.0, latency_s=0.0, per_request_s=0.0),
        dict(bandwidth_bytes_s=1.0, latency_s=-1.0, per_request_s=0.0),
        dict(bandwidth_bytes_s=1.0, latency_s=0.0, per_request_s=math.inf),
        dict(bandwidth_bytes_s=1.0, latency_s=0.0, per_request_s=0.0, message_rate=0.0),
        dict(bandwidth_bytes_s=1.0, latency_s=0.0, per_request_s=0.0, post_threads=-1),
    ):
        with pytest.raises(ValueError):
            LinkNumbers(**bad)


def run_random(seed: int, n: int, fan_in: bool = False, check_every: int = 0
               ) -> tuple[Fabric, list[tuple[int, float]], list[tuple[int, float, float]]]:  # fmt: skip
    """``n`` transfers with Poisson arrivals at ~60% load; returns (fabric, finishes, specs).

    Random: 32 NICs, any sender to any receiver (one big component, hundreds of
    distinct paths: the worst case for re-rating). Fan-in: 16 prefill NICs write
    into 4 decode NICs, as a disaggregated deployment does (few distinct paths).
    """
    rng = random.Random(seed)
    env = simpy.Environment()
    fab = Fabric(env)
    if fan_in:
        senders = [fab.add_nic(f"p{i}", 25 * GB) for i in range(16)]
        receivers = [fab.add_nic(f"d{i}", 50 * GB) for i in range(4)]
        capacity = 4 * 50 * GB
    else:
        senders = receivers = [
            fab.add_nic(f"n{i}", rng.choice([25 * GB, 50 * GB])) for i in range(32)
        ]
        capacity = sum(nic.bandwidth_bytes_s for nic in senders)
    paths = [
        LinkNumbers(bandwidth_bytes_s=math.inf, latency_s=5e-6, per_request_s=1e-6),
        LinkNumbers(bandwidth_bytes_s=20 * GB, latency_s=2e-6, per_request_s=2e-7),
        # posting threads (one per sending NIC here) and a NIC message rate
        LinkNumbers(
            bandwidth_bytes_s=math.inf,
            latency_s=3e-6,
            per_request_s=1e-7,
            per_batch_s=2e-6,
            message_rate=5e6,
            post_threads=1,
        ),  # fmt: skip
    ]
    mean_size = 4 << 20
    rate = 0.6 * capacity / mean_size
    done: list[tuple[int, float]] = []
    specs: list[tuple[int, float, float]] = []  # (bytes, issue time, lower bound duration)

    def one(i: int, src: Nic, dst: Nic, nbytes: int, p: LinkNumbers, reqs: int
            ) -> Generator[simpy.Event, Any, None]:  # fmt: skip
        t = yield fab.transfer(src, dst, nbytes, p, reqs, poster=src.name)
        done.append((i, t))

    def source() -> Generator[simpy.Event, Any, None]:
        for i in range(n):
            yield env.timeout(rng.expovariate(rate))
            src = rng.choice(senders)
            dst = rng.choice([r for r in receivers if r is not src])
            nbytes = 0 if rng.random() < 0.01 else int(rng.expovariate(1 / mean_size))
            p = rng.choice(paths)
            reqs = rng.randint(1, 8)
            bw = min(src.bandwidth_bytes_s, dst.bandwidth_bytes_s, p.bandwidth_bytes_s)
            post = p.per_batch_s + reqs * p.per_request_s
            specs.append((nbytes, env.now, p.latency_s + post + nbytes / bw))
            env.process(one(i, src, dst, nbytes, p, reqs))
            if check_every and i % check_every == 0:
                fab.check_invariants()

    env.process(source())
    env.run()
    return fab, done, specs


def test_deterministic_event_order() -> None:
    _, done1, _ = run_random(seed=7, n=1000)
    _, done2, _ = run_random(seed=7, n=1000)
    assert done1 == done2
    _, done3, _ = run_random(seed=8, n=1000)
    assert done1 != done3


@pytest.mark.parametrize(
    "fan_in",
    [pytest.param(False, id="random", marks=pytest.mark.slow), pytest.param(True, id="fan_in")],
)
def test_stress_20k_flows_conserve_bytes(fan_in: bool) -> None:
    n = 20_000
    t0 = time.perf_counter()
    fab, done, specs = run_random(seed=1, n=n, fan_in=fan_in, check_every=500)
    wall = time.perf_counter() - t0
    print(f"\nstress {'fan-in' if fan_in else 'random'}: {n} transfers in {wall:.2f} s wall"
          f" = {n / wall:,.0f} transfers/s; {fab.env.now * 1e3:.1f} ms simulated")  # fmt: skip
    assert len(done) == n == fab.transfers_done
    assert fab.active_flows == 0
    total = sum(b for b, _, _ in specs)
    assert fab.bytes_moved == total
    assert sum(nic.bytes_sent for nic in fab.nics.values()) == total
    assert sum(nic.bytes_received for nic in fab.nics.values()) == total
    # Rates integrate to the sizes: at completion no flow had bytes left over.
    assert fab.max_residual_bytes < 1.0
    # Sharing can only slow a transfer down relative to having the path alone.
    finish = dict(done)
    for i, (_, issued, lower) in enumerate(specs):
        assert finish[i] - issued >= lower * (1 - 1e-9)


# -- gpu --------------------------------------------------------------------

H100 = GpuParams(mem_bandwidth_Bps=3.0e12, launch_s=5e-6)


def test_copy_time_formula() -> None:
    assert copy_time(H100, 3 * 10**9) == approx(5e-6 + 2 * 3e9 / 3.0e12)
    assert copy_time(H100, 0, launches=4) == approx(4 * 5e-6)


def test_serial_stream_books_in_order() -> None:
    s = SerialStream()
    assert s.reserve(0.0, 2.0) == 2.0
    assert s.free_at(1.0) == 2.0
    assert s.reserve(1.0, 3.0) == 5.0  # waits behind the first job
    assert s.reserve(9.0, 1.0) == 10.0  # stream was idle: starts at once
    assert s.busy_s == 6.0 and s.jobs == 3
