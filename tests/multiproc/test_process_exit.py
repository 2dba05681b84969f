"""`wait_exited` sees a process exit even when a grandchild holds the process's sentinel open, as torch_shm_manager
does for any process that first used torch's file_system shared memory; `join(timeout)` would wait out its
timeout."""

import multiprocessing
import multiprocessing.connection
import subprocess
import sys

from miles_sync.engine.reference.ranks import wait_exited

HOLD_S = 15  # how long the grandchild outlives the process


def leave_a_grandchild_holding_inherited_fds() -> None:
    # close_fds=False: the grandchild inherits the spawn child's end of the sentinel pipe, as an exec'd
    # torch_shm_manager does.
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({HOLD_S})"], close_fds=False)


def test_a_process_whose_sentinel_a_grandchild_holds_is_seen_exited():
    process = multiprocessing.get_context("spawn").Process(target=leave_a_grandchild_holding_inherited_fds)
    process.start()
    assert wait_exited(process, 30.0)
    assert process.exitcode == 0
    # What join() waits on is still open: the grandchild holds it.
    assert not multiprocessing.connection.wait([process.sentinel], timeout=1.0)
