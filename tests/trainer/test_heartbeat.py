import time

import torch.distributed as dist

from fixtures.ports import free_port_range
from meshscope.trainer.heartbeat import (
    Heartbeat,
    JobWatch,
    NodeWatch,
    connect_store,
    exit_marks,
    hb_key,
    previous_attempt_failures,
)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_dead_rank_is_reported_once_by_its_node_within_two_intervals():
    store = dist.HashStore()  # the logic under test, without a network in the way
    clock, dead, ages = Clock(), [], {}
    beats = [Heartbeat(store, rank=r, world_size=3, attempt=0) for r in range(3)]
    for b in beats:
        b.step = 3  # training
        b._beat()
    watch = NodeWatch(
        store,
        attempt=0,
        node=0,
        ranks=[0, 1, 2],
        interval_s=1.0,
        clock=clock,
        on_dead=lambda r, age, step: dead.append((r, step)),
        on_age=lambda r, age: ages.__setitem__(r, age),
    )
    watch.look()
    # rank 1 dies right after its beat at t=0; the others keep beating every interval
    for tick in range(1, 6):
        clock.t = tick * 0.5
        for r in (0, 2):
            beats[r].step = tick
            if tick % 2 == 0:
                beats[r]._beat()
        watch.look()
        if dead:
            break
    assert dead == [(1, 3)]
    assert clock.t <= 2.0  # looked every half interval: found within two intervals
    assert ages[1] is None and ages[0] is not None  # the departed rank's series goes
    for _ in range(10):
        clock.t += 0.5
        beats[0]._beat()
        beats[2]._beat()
        watch.look()
    assert dead == [(1, 3)]  # once
    assert store.check(["meshscope/node/0/0"])


def test_a_rank_not_yet_stepping_may_stall_its_beat_longer_before_it_is_gone():
    """Before its first step a rank imports and compiles, which on a busy host can hold its
    beat thread for seconds: 10 intervals of silence then, not 1.5, on its node and across
    nodes (a whole node starving at start-up, its watcher with it)."""
    store = dist.HashStore()
    clock, dead = Clock(), []
    nodes = {0: [0, 1], 1: [2, 3]}
    watchers = [NodeWatch(store, attempt=0, node=n, ranks=r, clock=clock) for n, r in nodes.items()]
    watchers[0].on_dead = lambda r, age, step: dead.append(r)
    for rank in range(4):
        Heartbeat(store, rank=rank, world_size=4, attempt=0)._beat()  # step -1: starting
    job = JobWatch(store, attempt=0, nodes=nodes, clock=clock, on_dead=lambda r, age, step: dead.append(r))
    watchers[1].look()  # node 1's last summary before it starves
    for tick in range(0, 40):
        clock.t = tick * 0.5
        store.set(hb_key(0, 0), f"{tick} -1")  # rank 0 beats; ranks 1, 2, 3 are silent
        watchers[0].look()
        job.look()
        if clock.t < 9.0:
            assert dead == [], (clock.t, dead)  # 1.5 intervals would have named all three
    assert sorted(dead) == [1, 2, 3]  # silent for good: gone, within 10 intervals and a look


def test_a_rank_that_left_on_purpose_is_not_dead():
    store = dist.HashStore()
    clock, dead = Clock(), []
    beats = [Heartbeat(store, rank=r, world_size=2, attempt=0) for r in range(2)]
    for b in beats:
        b._beat()
    watch = NodeWatch(
        store, attempt=0, node=0, ranks=[0, 1], clock=clock, on_dead=lambda r, age, step: dead.append(r)
    )
    watch.look()
    beats[1].mark_exit("done")
    for tick in range(1, 8):
        clock.t = tick * 0.5
        beats[0]._beat()
        watch.look()
    assert dead == []


def test_a_node_whose_watcher_died_has_its_ranks_reported_by_the_job_watcher():
    store = dist.HashStore()
    clock, dead = Clock(), []
    nodes = {0: [0, 1], 1: [2, 3]}
    watchers = [NodeWatch(store, attempt=0, node=n, ranks=r, clock=clock) for n, r in nodes.items()]
    for rank in range(4):
        beat = Heartbeat(store, rank=rank, world_size=4, attempt=0)
        beat.step = 1  # training
        beat._beat()
    job = JobWatch(store, attempt=0, nodes=nodes, clock=clock, on_dead=lambda r, age, step: dead.append(r))
    for tick in range(0, 8):
        clock.t = tick * 0.5
        store.set(hb_key(0, 0), str(tick) + " 1")
        store.set(hb_key(0, 1), str(tick) + " 1")
        watchers[0].look()  # node 1 (ranks 2, 3) went away with its watcher at t=0
        if tick == 0:
            watchers[1].look()
        job.look()
    assert dead == [2, 3]


def test_a_node_whose_first_rank_finished_first_is_not_dead_while_its_others_beat():
    # the end of a clean run: node 1's local rank 0 marks its exit and stops its watcher while
    # rank 3 is still finishing (a checkpoint in flight); rank 3 dies later, without a mark
    store = dist.HashStore()
    clock, dead = Clock(), []
    nodes = {0: [0, 1], 1: [2, 3]}
    watchers = [NodeWatch(store, attempt=0, node=n, ranks=r, clock=clock) for n, r in nodes.items()]
    beats = [Heartbeat(store, rank=rank, world_size=4, attempt=0) for rank in range(4)]
    for b in beats:
        b._beat()
    job = JobWatch(store, attempt=0, nodes=nodes, clock=clock, on_dead=lambda r, age, step: dead.append(r))
    watchers[1].look()  # node 1's last summary
    beats[2].mark_exit("finished")
    alive = [0, 1, 3]
    for tick in range(0, 16):
        clock.t = tick * 0.5
        if tick == 8:
            alive.remove(3)  # rank 3 dies at t=4
        for rank in alive:
            store.set(hb_key(0, rank), f"{time.time() + clock.t} {tick}")  # node-clock times
        watchers[0].look()
        job.look()
        if tick < 8:
            assert dead == [], (tick, dead)
    assert dead == [3]


def test_exit_marks_tell_the_culprit_of_the_previous_attempt():
    port = free_port_range(1)
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    old = [Heartbeat(connect_store("127.0.0.1", port), rank=r, world_size=3, attempt=0) for r in range(3)]
    for b in old:
        b.step = 7
        b._beat()
    master.set("meshscope/world/0", "3")
    old[0].mark_exit("sigterm")
    old[2].mark_exit("error:RuntimeError")
    failures = previous_attempt_failures(master, attempt=1)
    assert [(f.rank, f.last_step) for f in failures] == [(1, 7)]
    assert set(exit_marks(master, 0, 3)) == {0, 2}
    assert master.check([hb_key(0, 1)])
