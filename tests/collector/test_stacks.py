"""Stacks name where a rank was in its own code, not the library frame it waits in."""

from __future__ import annotations

import json
import threading

import torch

from meshscope.collector.stacks import LIBRARY, frame_text, own_frame, write_stacks


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
