"""The Monitor's host steps in C (`collector/csrc/`) against its Python path: the same
records, expert load and flight log, from the same DDP MoE loop on two gloo ranks (with
accumulation under no_sync() and evaluations between steps)."""

import math
import re
from pathlib import Path

import pytest
import torch

from fixtures.dist import run_ranks
from meshscope.collector import Monitor, MonitorConfig
from meshscope.collector.env import DistEnv
from meshscope.collector.expert_counts import EXPERT_LOAD_SITE as SUMS
from meshscope.collector.flightread import latest_logs, read_flight
from meshscope.collector.native import fast
from meshscope.collector.store import load_expert_load, load_steps

STEPS = 23  # two timed steps (0, 10, 20), expert windows of 5, and a window left open


def test_the_extension_is_built_where_the_tests_run():
    """`make test` installs with a C compiler: were the build to fail silently (it is optional
    for users), every test below would measure the Python path twice."""
    assert fast is not None, "meshscope.collector._fast did not build: see `pip install -e .` output"


def _loop(rank: int, world_size: int, run_dir: str, native: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector import comm, flightlog, monitor
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.data import SyntheticTokens
    from meshscope.trainer.model import MoELM

    if not native:  # the C path taken away in this rank's process: every step runs in Python
        for module in (comm, flightlog, monitor):
            module._fast = None
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    mon = Monitor(MonitorConfig(run_dir=run_dir, metrics_port=None, expert_every=5), env=env)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, seq_len=8, layers=2, d_model=16, heads=2, experts=4, top_k=2)
    model = MoELM(cfg)
    ddp = mon.watch(DDP(model))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    data = SyntheticTokens(vocab_size=64, seq_len=8, batch_size=4, seed=0, rank=rank, world_size=world_size)
    in_c = 0
    for i in range(STEPS):
        with mon.step(tokens=32) as s:
            in_c += fast is not None and type(s) is fast.Steps
            with s.phase("data"):
                x, y = data.batch(i)
            if i % 2:  # accumulation: a micro-batch under no_sync() first (nothing to reduce)
                with ddp.no_sync():
                    model.loss(ddp(x), y)[0].backward()
            with s.phase("forward"):
                loss, lm = model.loss(ddp(x), y)
            with s.phase("backward"):
                loss.backward()
            with s.phase("optimizer"):
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            s.log(loss=lm, grad_norm=norm)
        if i % 7 == 3:  # an evaluation between steps: no graph, nothing to reduce
            with torch.no_grad():
                ddp(x)
    mon.close()
    return {"in_c": in_c}


@pytest.fixture(scope="module")
def both_paths(tmp_path_factory) -> dict:
    """One run each way (two ranks each)."""
    runs = {}
    for native in (True, False):
        run_dir = tmp_path_factory.mktemp("native" if native else "python")
        runs[native] = (run_dir, run_ranks(_loop, 2, run_dir=str(run_dir), native=native))
    return runs


def test_host_steps_run_in_c(both_paths):
    """Every host step runs in C, timed (`detail_every`) or not, but the first: it describes
    the run, in Python."""
    (_, native), (_, python) = both_paths[True], both_paths[False]
    assert [r["in_c"] for r in native] == [STEPS - 1] * 2
    assert [r["in_c"] for r in python] == [0, 0]


def _same_or_both_nan(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def test_c_writes_the_records_the_python_path_writes(both_paths):
    """Every step's record, whichever path took it: the same tokens, bytes, loss and grad norm,
    phases NaN on the same steps, memory on every step."""
    native, python = (load_steps(Path(both_paths[k][0])) for k in (True, False))
    cols = ["rank", "step", "tokens", "bytes_raw", "bytes_wire", "bytes_inter", "nonfinite"]
    native, python = (t.sort_values(["rank", "step"]).reset_index(drop=True) for t in (native, python))
    assert len(native) == 2 * STEPS
    assert native[cols].equals(python[cols])
    assert (native["bytes_raw"] > 0).all()  # DDP reduced on every step, timed or not
    for col in ("loss", "grad_norm"):
        assert all(map(_same_or_both_nan, native[col], python[col])), col
    for col in ("forward_s", "comm_exposed_s"):  # times differ; NaN on the same steps
        assert native[col].isna().equals(python[col].isna()), col
    for table in (native, python):  # DDP's own figure: set by the drain, on sampled steps only
        sampled = table["step"] % 10 == 0
        assert table.loc[~sampled, "comm_total_s"].isna().all()
        # the latest figure when the drain reads: step 0's only if DDP had one by then
        measured = table[sampled & table["comm_total_s"].notna()].groupby("rank")["step"].apply(set)
        assert all({10, 20} <= steps for steps in measured) and len(measured) == 2
    assert native["forward_s"].isna().sum() == 2 * (STEPS - len(range(0, STEPS, 10)))
    assert (native["mem_rss"] > 0).all()  # read by the drain where due, carried between


def test_c_sums_the_same_expert_load(both_paths):
    native, python = (load_expert_load(Path(both_paths[k][0])) for k in (True, False))
    assert len(native) > 0
    assert (
        native.sort_values(list(native.columns))
        .reset_index(drop=True)
        .equals(python.sort_values(list(python.columns)).reset_index(drop=True))
    )


def _summed_counts(records) -> int:
    """Counts the expert sums carried, less each sum's proposal (`collector.expert_counts`)."""
    return sum(math.prod(int(d) for d in re.findall(r"\d+", r.shapes)) - 1 for r in records)


def test_c_opens_and_completes_the_same_flight_records(both_paths):
    """DDP's reduction: one record a step, in the same sequence, every one completed; the
    expert sums complete alike and carry the same windows (how many windows one sum carries
    follows the service thread's timing: `collector.expert_counts`)."""
    logs = {
        k: {
            rank: read_flight(head.path)
            for rank, head in latest_logs(Path(both_paths[k][0]) / "live").items()
        }
        for k in (True, False)
    }
    for rank in (0, 1):
        # by group and sequence: the service thread's expert sums land in the ring when it runs
        native, python = (
            sorted((r.group, r.seq, r.step, r.op, r.state) for r in logs[k][rank].records if r.site != SUMS)
            for k in logs
        )
        assert native == python
        sums = {k: [r for r in logs[k][rank].records if r.site == SUMS] for k in logs}
        assert all(r.state == "completed" for k in logs for r in sums[k])
        assert _summed_counts(sums[True]) == _summed_counts(sums[False]) > 0
        # C leaves the record to the drain: the ring's order may differ, its issue time is the forward's
        records = sorted(logs[True][rank].records, key=lambda r: r.t_issue)
        reductions = [r for r in records if r.op == "all_reduce" and "DDP" in r.site]
        assert [r.step for r in reductions] == list(range(STEPS))
        assert {r.state for r in reductions} == {"completed"}


def test_a_step_that_raises_in_c_is_no_step_and_the_next_goes_on(tmp_path):
    mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", metrics_port=None), env=DistEnv())
    mon.watch(torch.nn.Linear(2, 2))
    with mon.step():  # step 0: timed, describes the run
        pass
    with pytest.raises(ValueError), mon.step() as s:  # step 1: untimed, in C
        assert type(s) is fast.Steps
        s.log(loss=1.0)
        raise ValueError("the user's")
    with mon.step(tokens=8.0) as s:  # a count given as a float is kept as a whole count
        s.log(loss=2.0)
    with pytest.raises(TypeError, match="keyword"):
        s.log(3.0)
    mon.close()
    steps = load_steps(tmp_path / "run")
    assert steps["step"].tolist() == [0, 2]
    assert steps["loss"].tolist()[1] == 2.0 and steps["tokens"].tolist()[1] == 8


def test_a_loss_logged_in_c_is_kept_without_its_graph(tmp_path):
    mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", metrics_port=None), env=DistEnv())
    layer = mon.watch(torch.nn.Linear(2, 1))
    for _ in range(2):
        with mon.step() as s:
            loss = layer(torch.ones(1, 2)).sum()
            s.log(loss=loss)
            kept = s.scalars["loss"]
    assert type(s) is fast.Steps  # the second step ran in C
    assert not kept.requires_grad and kept.grad_fn is None and loss.grad_fn is not None
    mon.close()


def test_steps_do_not_nest(tmp_path):
    mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", metrics_port=None), env=DistEnv())
    mon.watch(torch.nn.Linear(2, 2))
    with mon.step():
        pass
    with mon.step(), pytest.raises(RuntimeError, match="nest"), mon.step():
        pass
    mon.close()


def test_the_fixed_record_c_writes_is_the_one_python_writes(tmp_path, monkeypatch):
    """`FlightLog.append_fixed` in C and in Python: the same bytes but the issue time."""
    from meshscope.collector import flightlog
    from meshscope.collector.flightfixed import fixed_tail
    from meshscope.collector.flightread import HEADER_SIZE, RECORD, read_flight

    tail = fixed_tail(b"0", 2, b"all_reduce", b"float32", b"100", b"site")
    raw = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(flightlog, "_fast", None)
        log = flightlog.FlightLog(tmp_path / str(native), rank=0, world_size=2, capacity=4)
        log._host_groups.add("0")
        log.step_begin(7)
        slots = [log.append_fixed("0", tail), log.append_fixed("0", tail, 3)]
        slots += [log.append_fixed("1", tail) for _ in range(3)]
        assert slots == [0, 1, 2, 3, 0] and log._host_slots == {0, 1}
        raw[native] = bytes(log._map)
        tail_read = read_flight(log.path)
        log.close()
        assert [(r.seq, r.step) for r in tail_read.records] == [(1, 3), (0, 7), (1, 7), (2, 7)]
    for slot in range(4):  # all but t_issue (bytes 16-24 of a record)
        at = HEADER_SIZE + slot * RECORD.size
        assert raw[True][at : at + 16] == raw[False][at : at + 16]
        assert raw[True][at + 24 : at + RECORD.size] == raw[False][at + 24 : at + RECORD.size]


def test_the_flight_logs_lock_is_cs_and_excludes_like_threading_lock(tmp_path):
    """The flight log's lock (`collector/csrc/lock.c`): C takes it without a call, Python with
    `with`; it excludes across threads, waits without the GIL, and refuses a release unheld."""
    import threading

    from meshscope.collector.flightlog import FlightLog

    log = FlightLog(tmp_path, rank=0, world_size=1)
    lock = log._lock
    assert type(lock) is fast.Lock
    counted = [0]

    def count() -> None:
        for _ in range(5000):
            with lock:
                seen = counted[0]
                counted[0] = seen + 1

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counted[0] == 20000
    lock.acquire()
    waiter = threading.Thread(target=lambda: (lock.acquire(), lock.release()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and lock.locked()  # it waits, and this thread runs meanwhile
    lock.release()
    waiter.join(5)
    assert not waiter.is_alive() and not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()
    log.close()


class _CountsOnly(torch.nn.Module):
    """An MoE layer as the protocol's minimum has it (`collector/moe.py`): its per-expert token
    counts, no `expert_work` (nn.Module's `__getattr__` raises for it, in Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.expert_token_counts = torch.zeros(3, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.expert_token_counts = torch.tensor([x.shape[0], 1, 0])  # new counts each forward
        return self.proj(x)


def _counts_only(rank: int, world_size: int, run_dir: str) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    mon = Monitor(MonitorConfig(run_dir=run_dir, metrics_port=None, expert_every=5), env=env)
    torch.manual_seed(0)
    layer = _CountsOnly()
    ddp = mon.watch(DDP(layer))
    for _ in range(10):
        with mon.step(tokens=6) as s:
            ddp(torch.randn(6, 4)).sum().backward()
            s.log(loss=1.0)
    idle = list(mon.experts._idle_work)
    mon.close()
    return idle


def test_a_layer_without_expert_work_is_looked_up_once_and_its_counts_still_noted(tmp_path):
    (idle,) = run_ranks(_counts_only, 1, run_dir=str(tmp_path))
    assert idle == [False]  # C asked once, and remembers there is none
    load = load_expert_load(tmp_path)
    assert sorted(load["step"].unique()) == [4, 9]  # both windows, every step's counts in them
    per_window = load.groupby(["step", "expert"])["tokens"].sum()
    assert per_window.loc[(4, 0)] == 5 * 6 and per_window.loc[(9, 1)] == 5
