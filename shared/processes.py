"""Running Flower's executables in the foreground from our commands, and the ``key=value``
config strings they take."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable


def run_foreground(cmd: list[str], env: dict[str, str] | None = None,
                   on_line: Callable[[str], None] | None = None) -> int:
    """Run ``cmd`` (found first beside this Python, then on PATH) until it exits, passing
    SIGINT/SIGTERM on to it; returns its exit code.
    ``on_line``: also see each line it prints (its output then goes to our stderr).
    FileNotFoundError (one line) when the executable is not installed."""
    # the executables installed beside this interpreter come first (a virtualenv that is not
    # activated); Flower's processes start their children through PATH too
    env = dict(os.environ if env is None else env)
    env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), env.get("PATH")]))
    found = shutil.which(cmd[0], path=env["PATH"])
    if found is None:
        raise FileNotFoundError(f"{cmd[0]} is not installed (it comes with flwr: pip install 'omnidraft-fleet')")
    cmd = [found, *cmd[1:]]
    piped = on_line is not None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if piped else None,
                            stderr=subprocess.STDOUT if piped else None, text=piped, bufsize=1 if piped else -1)
    handlers = {sig: signal.signal(sig, lambda s, _f: proc.send_signal(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    def relay() -> None:
        for line in proc.stdout:
            sys.stderr.write(line)
            on_line(line)

    reader = threading.Thread(target=relay, daemon=True) if piped else None
    try:
        if reader is not None:
            reader.start()
        code = proc.wait()
        if reader is not None:  # children it left behind may hold the pipe open: do not wait for them
            reader.join(timeout=2.0)
        return code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def toml_pairs(values: dict[str, object]) -> str:
    """``key=value ...`` with TOML values, as Flower's ``--run-config``/``--node-config`` take them."""
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))  # a TOML basic string

    return " ".join(f"{k}={value(v)}" for k, v in values.items())
