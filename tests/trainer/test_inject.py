import pytest

from meshscope.trainer.inject import InjectionError, Injector, parse_injection


def test_parse_full_spec():
    inj = parse_injection("slow@step=20,rank=1,steps=10,factor=3")
    assert (inj.kind, inj.step, inj.rank, inj.steps, inj.param("factor")) == ("slow", 20, 1, 10, 3)
    assert parse_injection("comm_delay@step=1,rank=0").param("ms") == 50  # default


@pytest.mark.parametrize(
    "spec, message",
    [
        ("explode@step=1,rank=0", "KIND"),
        ("slow@rank=0", "step= is required"),
        ("slow@step=1,rank=0,speed=2", "unknown parameter"),
        ("nan@step=x,rank=0", "not key=number"),
        ("kill@step=1,rank=0,steps=0", "steps >= 1"),
        ("kill@step=1,rank=0,during=later", "during= takes one of step, move"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(InjectionError, match=message):
        parse_injection(spec)


def test_fires_once_and_only_on_its_rank_and_steps():
    reported = []
    specs = [parse_injection("nan@step=2,rank=1,steps=2"), parse_injection("nan@step=0,rank=0")]
    inj = Injector(specs, rank=1, report=lambda i, s: reported.append((i.key, s)))
    import torch

    model = torch.nn.Linear(1, 1)
    poisoned = []
    for step in range(5):
        inj.before_step(step, model)
        poisoned.append(bool(torch.isnan(inj.poison_loss(torch.tensor(1.0), step))))
    assert poisoned == [False, False, True, True, False]
    assert reported == [("nan@2/1", 2)]


def test_already_fired_injections_do_not_fire_again():
    reported = []
    inj = Injector(
        [parse_injection("kill@step=3,rank=0")],
        rank=0,
        report=lambda i, s: reported.append(i),
        already_fired={"kill@3/0"},
    )
    import torch

    inj.before_step(3, torch.nn.Linear(1, 1))  # would SIGKILL this test if it fired
    assert reported == []


def test_a_kill_during_a_move_waits_for_the_re_placement(monkeypatch):
    """`during=move`: not at the step's start, but inside the first re-placement from that step
    on (the hook the expert mesh calls between the transfer and the agreement), once."""
    import signal
    import types

    import torch

    from meshscope.trainer import inject

    killed, reported = [], []
    monkeypatch.setattr(inject.os, "kill", lambda pid, sig: killed.append(sig))
    injector = Injector(
        [parse_injection("kill@step=3,rank=0,during=move")], rank=0, report=lambda i, s: reported.append(s)
    )
    mesh = types.SimpleNamespace(dropless=False, mid_move=None)
    layer = types.SimpleNamespace(expert_mesh=mesh)
    model = types.SimpleNamespace(moe_layers=lambda: [layer])
    injector.arm(model)
    for step in range(5):
        injector.before_step(step, torch.nn.Linear(1, 1))
        if step == 1:
            mesh.mid_move()  # a move before step 3: not yet
    assert killed == []
    mesh.mid_move()
    mesh.mid_move()
    assert killed == [signal.SIGKILL] and reported == [4]


def test_comm_delay_lands_after_backward_even_when_the_collective_is_already_done():
    """A fast collective completes before its hook returns; the delay must still be spent on
    the comm side (a completed future's callback runs inline, inside backward)."""
    import torch

    from meshscope.trainer.wirefaults import delayed_hook

    inj = Injector([parse_injection("comm_delay@step=0,rank=0,ms=200")], rank=0, report=lambda i, s: None)
    inj.before_step(0, torch.nn.Linear(1, 1))

    def finished(state, bucket):
        done = torch.futures.Future()
        done.set_result(torch.ones(2))
        return done

    late = delayed_hook(finished, inj)(None, None)
    assert not late.done()  # the hook returned without spending the delay
    assert torch.equal(late.wait(), torch.ones(2))
