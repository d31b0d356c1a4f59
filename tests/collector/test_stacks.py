"""Stacks name where a rank was in its own code, not the library frame it waits in."""

from __future__ import annotations

import json
import threading
import time

import torch

from meshscope.collector import stacks
from meshscope.collector.stacks import (
    LIBRARY,
    StackResponder,
    frame_text,
    own_frame,
    request_stacks,
    write_stacks,
)


def test_library_frames_are_marked_and_the_own_frame_is_the_innermost_of_ours(tmp_path):
    assert frame_text(torch.__file__, 1, "x").startswith(LIBRARY + "torch/__init__.py:1")
    assert frame_text(threading.__file__, 2, "wait").startswith(LIBRARY + "threading.py:2")
    assert frame_text("/work/job/trainer/loop.py", 90, "train_step") == "trainer/loop.py:90 train_step"
    # asked from another thread while the main thread waits inside threading's join()
    asker = threading.Thread(target=write_stacks, args=(tmp_path / "rank0-1.flight",))
    asker.start()
    asker.join()
    main = json.loads((tmp_path / "rank0-1.stacks.json").read_text())["stacks"]["MainThread"]
    assert main[-1].startswith(LIBRARY + "threading.py"), main[-3:]
    assert own_frame(main).startswith("collector/test_stacks.py:"), main[-4:]


def test_stores_from_before_the_marker_still_name_the_own_frame():
    old = [
        "collector/control.py:70 all_reduce",
        "distributed/c10d_logger.py:83 wrapper",
        "distributed/distributed_c10d.py:3252 all_reduce",
    ]
    assert own_frame(old) == "collector/control.py:70 all_reduce"
    assert (
        own_frame(["trainer/loop.py:90 train_step", "torch/_tensor.py:623 backward"])
        == "trainer/loop.py:90 train_step"
    )


def test_the_responder_sleeps_until_asked_and_answers_every_request(tmp_path, monkeypatch):
    # The safety look pushed out of reach: an answer within the test's time comes from the
    # kernel's notification, and a quiet responder does not wake at all.
    monkeypatch.setattr(stacks, "RECHECK_S", 60.0)
    asked, looks = [], []
    real_stat = type(tmp_path).stat

    def counted_stat(path, **kw):
        looks.extend([path] if path.parent == tmp_path else [])
        return real_stat(path, **kw)

    monkeypatch.setattr(type(tmp_path), "stat", counted_stat)
    responder = StackResponder(tmp_path, asked.append).start()
    deadline = time.monotonic() + 10
    while not looks and time.monotonic() < deadline:  # its first look, however busy the machine
        time.sleep(0.01)
    time.sleep(1.0)
    assert len(looks) == 1  # once on start, then asleep (polling looked 5 times a second)
    for request in ("a1", "a2"):
        request_stacks(tmp_path, request)
        deadline = time.monotonic() + 5
        while request not in asked and time.monotonic() < deadline:
            time.sleep(0.01)
    assert asked == ["a1", "a2"]
    responder.stop(wait=False)
    request_stacks(tmp_path, "wake")  # a notification wakes it: it ends without answering
    responder._thread.join(5)
    assert not responder.running and asked == ["a1", "a2"]
