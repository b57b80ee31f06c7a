"""What a rank started by the fork server sees: test-only (tests/test_forkserver.py).

`python forked_probe.py OUT MODE`: writes to OUT (JSON) its argv, working directory,
environment, session, parent, whether stdin is /dev/null and whether torch was already
imported (and, if numpy was, whether a matrix product works); prints a line to stdout and one to stderr; then, by MODE: `exit:N` exits N,
`raise` raises, `kill` kills itself with SIGKILL, `pause` waits for a signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _blas() -> bool | None:
    """A matrix product on numpy's BLAS (its threads), where numpy was imported already."""
    if "numpy" not in sys.modules:
        return None
    import numpy as np

    a = np.ones((256, 256))
    return bool(((a @ a) == 256.0).all())


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    seen = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "session_leader": os.getsid(0) == os.getpid(),
        "ppid": os.getppid(),
        "stdin": os.path.realpath("/proc/self/fd/0"),
        "torch_preloaded": "torch" in sys.modules,
        "blas_works": _blas(),
        "name": __name__,
    }
    with open(out + ".tmp", "w") as fh:
        json.dump(seen, fh)
    os.replace(out + ".tmp", out)
    print("to stdout")
    print("to stderr", file=sys.stderr)
    if mode.startswith("exit:"):
        sys.exit(int(mode[5:]))
    if mode == "raise":
        raise RuntimeError("the probe raised")
    if mode == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "pause":
        signal.pause()
