"""Runs a test's script on the CPU under Triton's interpreter, in a subprocess: TRITON_INTERPRET must
be set before triton is imported, so a test that drives the Triton backend through the layer or the
ops does it in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _interpreter_env() -> dict:
    """The environment of a subprocess under Triton's interpreter on the CPU, the checkout on its path;
    skips the test when triton is absent."""
    pytest.importorskip("triton")
    return dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def run_under_interpreter(script: str, timeout: float = 600) -> dict:
    """Runs `script` (python source printing one JSON object as its last `{`-line) with
    TRITON_INTERPRET=1 on the CPU, the checkout on its path; returns that object. Skips the test
    when triton is absent."""
    proc = subprocess.run([sys.executable, "-c", script], env=_interpreter_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


# A test module's cases served one at a time by a long-lived interpreter subprocess: each pytest worker
# starts one per module on first use and asks it only for the cases that worker runs, so the cases
# spread over the workers like any others (no scheduling constraint, no case run twice).

_REPLY = "@@interpreter-case "


class InterpreterServer:
    """`python <script> *args` under Triton's interpreter on the CPU, serving `run(case)`: the script
    calls `serve(run_case)` (below) on its side."""

    def __init__(self, script: str, *args: str, timeout: float = 600):
        import queue
        import tempfile
        import threading

        env = _interpreter_env()
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([sys.executable, script, *args], env=env, cwd=ROOT, text=True, bufsize=1,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._lines: queue.Queue = queue.Queue()
        self._timeout = timeout

        def pump():  # a thread, so that a case that hangs fails its test after `timeout` rather than the run
            for line in self._proc.stdout:
                if line.startswith(_REPLY):
                    self._lines.put(json.loads(line[len(_REPLY):]))
            self._lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def run(self, case: str) -> str:
        """"ok", or what went wrong in `case` (a traceback, or the subprocess's end)."""
        import queue

        if self._proc.poll() is not None:
            return self._ended()
        self._proc.stdin.write(case + "\n")
        self._proc.stdin.flush()
        try:
            reply = self._lines.get(timeout=self._timeout)
        except queue.Empty:
            self.close()
            return f"case {case!r}: no answer within {self._timeout} s"
        if reply is None:
            return self._ended()
        assert reply["case"] == case, reply
        return reply["result"]

    def _ended(self) -> str:
        self._stderr.seek(0)
        return f"the interpreter subprocess ended (exit {self._proc.wait()}):\n{self._stderr.read()[-5000:]}"

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def serve(run_case) -> None:
    """The subprocess side: for each case name read from stdin, the result of `run_case(name)` ("ok", or
    a refusal's text), or the traceback of what it raised, answered on stdout."""
    import traceback

    for line in sys.stdin:
        case = line.strip()
        try:
            result = run_case(case)
        except Exception:  # reported by the test of this case
            result = traceback.format_exc(limit=6)[-3000:]
        print(_REPLY + json.dumps({"case": case, "result": result}), flush=True)
