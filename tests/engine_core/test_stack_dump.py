"""``kill -USR2`` makes a tidal process print every thread's stack and keep running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

CHILD = """
import sys, threading, time
from tidal.engine_core import stack_dump
stack_dump.install()
def parked_in_a_helper_thread():
    time.sleep(60)
threading.Thread(target=parked_in_a_helper_thread, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_sigusr2_dumps_all_threads_and_the_process_lives_on():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        assert proc.poll() is None, "the dump signal must not end the process"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    assert "parked_in_a_helper_thread" in err  # the other thread's stack, not only the main one
    assert "Current thread" in err
