"""Running Flower's executables in the foreground from our commands, the ``key=value`` config
strings they take, and the peak memory of process trees (``PeakMemory``: the simulation's report,
the loopback deployment's summary)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable


def run_foreground(
    cmd: list[str], env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None
) -> int:
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
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE if piped else None,
        stderr=subprocess.STDOUT if piped else None,
        text=piped,
        bufsize=1 if piped else -1,
    )
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


class PeakMemory:
    """The largest memory (MB) each group of process trees held while it ran: a thread samples
    every ``interval_s`` seconds until ``stop``. ``groups``: {name: process ids}, each counted
    with all its descendants (default {"all": [this process]}). ``field``: ``"pss"``
    (proportional set size: shared pages split between the processes sharing them, so a sum is
    what the tree occupies; reading it walks each process's page tables, ``smaps_rollup``, which
    over a dozen processes holding models once a second took ~10 % of a 2-core machine) or
    ``"rss"`` (resident set, cheap, counting shared pages in every process)."""

    def __init__(
        self, groups: dict[str, list[int]] | None = None, *, interval_s: float = 5.0, field: str = "pss"
    ) -> None:
        if field not in ("pss", "rss"):
            raise ValueError(f"unknown memory field {field!r}: pss or rss")
        self.groups = groups or {"all": [os.getpid()]}
        self.field = field
        self.peak = {name: 0.0 for name in self.groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True)
        self._thread.start()

    def _tree_bytes(self, pid: int) -> int:
        import psutil

        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:  # the process has ended
            return 0
        total = 0
        for proc in procs:
            try:
                info = proc.memory_full_info() if self.field == "pss" else proc.memory_info()
                total += getattr(info, self.field)
            except psutil.Error:  # a process that just ended
                pass
        return total

    def _sample(self, interval_s: float) -> None:
        while not self._stop.is_set():
            for name, pids in self.groups.items():
                self.peak[name] = max(self.peak[name], sum(map(self._tree_bytes, pids)) / 2**20)
            self._stop.wait(interval_s)

    def stop(self) -> dict[str, float]:
        """Stop sampling; returns {group: peak MB}, rounded to 0.1."""
        self._stop.set()
        self._thread.join()
        return {name: round(mb, 1) for name, mb in self.peak.items()}
