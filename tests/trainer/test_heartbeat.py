import torch.distributed as dist

from tests.helpers.ports import free_port_range
from trainer.heartbeat import (Heartbeat, connect_store, exit_marks, hb_key,
                               previous_attempt_failures)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(store, rank, clock, dead):
    return Heartbeat(store, rank=rank, world_size=3, attempt=0,
                     interval_s=1.0, clock=clock,
                     on_dead=lambda r, age, step: dead.append((rank, r, age, step)))


def test_dead_peer_is_reported_once_within_two_intervals_by_the_lowest_live_rank():
    store = dist.HashStore()  # the logic under test, without a network in the way
    clock, dead = Clock(), []
    beats = [make(store, r, clock, dead) for r in range(3)]
    for b in beats:
        b._beat()
    for b in beats:
        b._watch()
    # rank 1 dies right after its beat at t=0; the others keep beating every interval
    for tick in range(1, 5):
        clock.t = tick * 0.5
        for r in (0, 2):
            beats[r].step = tick
            if tick % 2 == 0:
                beats[r]._beat()
        for r in (0, 2):
            beats[r]._watch()
        if dead:
            break
    assert dead == [(0, 1, dead[0][2], -1)]
    assert clock.t <= 2.0  # watched every half interval: found within two intervals


def test_exit_marks_tell_the_culprit_of_the_previous_attempt():
    port = free_port_range(1)
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    clock, dead = Clock(), []
    old = [Heartbeat(connect_store("127.0.0.1", port), rank=r, world_size=3, attempt=0,
                     clock=clock) for r in range(3)]
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
