"""``kill -USR2 <pid>`` prints every thread's Python stack of a tidal process to its stderr.

Every process tidal starts (the CLI, API servers, the EngineCore, workers) installs it, so a
wedged deployment can say where it waits without a debugger or py-spy on the host. SIGUSR1 is
taken: the API server supervisor uses it to ask its servers to drain.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR2


def install() -> None:
    """Dump all threads' stacks to stderr on ``DUMP_SIGNAL`` (the process keeps running)."""
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError):
        # No usable stderr (a closed or replaced stream) or no such signal here: not worth
        # failing a start-up over a debugging aid.
        pass
