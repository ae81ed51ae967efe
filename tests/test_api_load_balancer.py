"""The load balancer (AMoE §3.1) against fake ranks: most-free placement, reservations, FIFO waiting, 503."""

import asyncio

import pytest

from amoe.errors import RequestError
from coordinator.requests.backend import RankKV
from coordinator.requests.errors import Overloaded
from coordinator.requests.load_balancer import LoadBalancer

BLOCK = 16


def make_balancer(*totals: int, max_waiting: int = 4) -> LoadBalancer:
    ranks = [RankKV(free_blocks=t, total_blocks=t) for t in totals]
    return LoadBalancer(lambda: ranks, block_size=BLOCK, max_waiting=max_waiting)


def test_new_requests_go_to_the_rank_with_most_free_blocks():
    lb = make_balancer(10, 10, 10)
    assert lb.try_admit("a", 8 * BLOCK) == 0
    assert lb.try_admit("b", 4 * BLOCK) == 1
    assert lb.try_admit("c", 1) == 2  # rank 2 has 10 free, rank 1 has 6, rank 0 has 2
    assert lb.free_blocks() == [2, 6, 9]
    assert lb.rank_of("a") == 0 and lb.rank_of("c") == 2


def test_reservation_is_prompt_plus_max_tokens_rounded_up_to_blocks():
    lb = make_balancer(4)
    assert lb.blocks_needed(BLOCK + 1) == 2
    assert lb.try_admit("a", 4 * BLOCK + 1) is None  # 5 blocks
    assert lb.try_admit("a", 2 * BLOCK + 1) == 0  # 3 blocks
    assert lb.free_blocks() == [1]


def test_release_returns_blocks_and_is_idempotent():
    lb = make_balancer(4)
    lb.try_admit("a", 4 * BLOCK)
    lb.release("a")
    lb.release("a")
    lb.release("never-admitted")
    assert lb.free_blocks() == [4]
    assert lb.num_running == 0


def test_never_over_commits_under_random_admissions_and_releases():
    import random

    rng = random.Random(0)
    lb = make_balancer(7, 5, 9)
    live = []
    for i in range(500):
        if live and rng.random() < 0.4:
            lb.release(live.pop(rng.randrange(len(live))))
        elif lb.try_admit(str(i), rng.randint(1, 5 * BLOCK)) is not None:
            live.append(str(i))
        assert all(free >= 0 for free in lb.free_blocks())


@pytest.mark.timeout(10)
def test_waiters_are_admitted_in_fifo_order_when_blocks_free_up():
    async def scenario():
        lb = make_balancer(4, 4)
        assert await lb.admit("big0", 4 * BLOCK) == 0
        assert await lb.admit("big1", 4 * BLOCK) == 1
        first = asyncio.create_task(lb.admit("w1", 3 * BLOCK))
        second = asyncio.create_task(lb.admit("w2", 1 * BLOCK))
        await asyncio.sleep(0)
        assert lb.num_waiting == 2 and not first.done()
        lb.release("big1")
        # w1 takes 3 of rank 1's blocks, then w2 fits in the 1 left there.
        assert await first == 1
        assert await second == 1
        assert lb.num_waiting == 0 and lb.free_blocks() == [0, 0]

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_a_newcomer_does_not_overtake_a_waiting_request():
    async def scenario():
        lb = make_balancer(4)
        await lb.admit("a", 3 * BLOCK)
        big = asyncio.create_task(lb.admit("big", 4 * BLOCK))
        await asyncio.sleep(0)
        small = asyncio.create_task(lb.admit("small", 1))  # would fit now, but "big" came first
        await asyncio.sleep(0)
        assert not small.done()
        lb.release("a")
        assert await big == 0
        assert not small.done()
        lb.release("big")
        assert await small == 0

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_full_queue_is_overloaded_and_a_cancelled_waiter_leaves_it():
    async def scenario():
        lb = make_balancer(1, max_waiting=1)
        await lb.admit("a", BLOCK)
        waiter = asyncio.create_task(lb.admit("w", BLOCK))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="max_waiting"):
            await lb.admit("x", BLOCK)
        waiter.cancel()  # the client went away while waiting
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert lb.num_waiting == 0
        lb.release("a")
        assert lb.free_blocks() == [1]  # nothing was reserved for the cancelled waiter

    asyncio.run(scenario())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("granted", [False, True], ids=["still waiting", "granted meanwhile"])
def test_withdrawing_a_waiting_request_leaves_nothing_reserved(granted):
    """Ending a waiting request (its client left) takes it out of the queue, or gives back what it was granted in
    the same loop turn; the next waiter is admitted in its place."""

    async def scenario():
        lb = make_balancer(1)
        await lb.admit("a", BLOCK)
        waiter = asyncio.create_task(lb.admit("w", BLOCK))
        after = asyncio.create_task(lb.admit("next", BLOCK))
        await asyncio.sleep(0)
        if granted:
            lb.release("a")  # "w" is bound to rank 0 before it runs again
        lb.withdraw("w")
        lb.withdraw("w")
        if granted:  # its admission still returns the rank, no longer reserved for it
            assert await waiter == 0
        else:
            with pytest.raises(asyncio.CancelledError):
                await waiter
        if not granted:
            assert lb.num_waiting == 1 and lb.rank_of("w") is None
            lb.release("a")
        assert await after == 0 and lb.rank_of("w") is None and lb.num_waiting == 0

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_a_request_larger_than_any_rank_is_rejected_not_queued():
    async def scenario():
        lb = make_balancer(2, 3)
        with pytest.raises(RequestError, match="largest rank holds 3 blocks"):
            await lb.admit("huge", 4 * BLOCK)
        assert lb.num_waiting == 0

    asyncio.run(scenario())


def test_a_rank_takes_no_more_than_max_num_seqs_requests():
    """--cache-max-num-seqs bounds the requests a rank decodes at once even when its KV has room: the next one
    goes to another rank, and when every rank is full it waits until a request ends."""
    ranks = [RankKV(free_blocks=100, total_blocks=100, max_requests=2) for _ in range(2)]
    lb = LoadBalancer(lambda: ranks, block_size=BLOCK, max_waiting=4)
    assert [lb.try_admit(r, BLOCK) for r in "abcd"] == [0, 1, 0, 1]
    assert lb.try_admit("e", BLOCK) is None

    async def scenario():
        waiting = asyncio.ensure_future(lb.admit("e", BLOCK))
        await asyncio.sleep(0)
        assert not waiting.done() and lb.num_waiting == 1
        lb.release("b")
        return await asyncio.wait_for(waiting, 1)

    assert asyncio.run(scenario()) == 1
    assert lb.num_running == 4
