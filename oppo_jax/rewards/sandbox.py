"""A reward function's work in child processes, each call bounded by a deadline.

Reward functions run on host threads, where nothing can stop a Python computation that does
not return (a thread cannot be killed, and ``signal.alarm`` timeouts work only in the main
thread); a child process can be. A child loads one module from its file (not through the
``oppo_jax`` package, so it never imports JAX), reads one JSON request per line and writes one
JSON reply per line (JSON both ways, no pickle). A call past its deadline kills its child and
raises ``CallTimeout``; the next call starts a fresh one. Children start as callers need them
(one per concurrent caller) and are killed when the parent exits.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

# The child: load the module, say it is ready, then serve requests until stdin closes.
_BOOT = """
import importlib.util, json, os, sys
path, name, function = sys.argv[1:4]
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
fn = getattr(module, function)
replies = os.fdopen(os.dup(1), "w")  # only replies on this pipe: prints go to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
replies.write('{"ready": true}\\n')
replies.flush()
for line in sys.stdin:
    try:
        reply = {"value": fn(json.loads(line))}
    except Exception as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    replies.write(json.dumps(reply) + "\\n")
    replies.flush()
"""


class CallTimeout(TimeoutError):
    """A call ran past its deadline (its child was killed)."""


class _Child:
    """One child process and the bytes of its replies read so far."""

    def __init__(self, argv: list[str], start_timeout_s: float):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.pending = b""
        try:
            ready = self.read(start_timeout_s)
        except BaseException:
            self.kill()
            raise
        if ready != {"ready": True}:
            self.kill()
            raise RuntimeError(f"sandbox child {argv[-3]} did not start: {ready!r}")

    def read(self, timeout_s: float) -> dict | None:
        """The next reply, or None when none came within ``timeout_s`` seconds."""
        deadline, fd = time.monotonic() + timeout_s, self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                raise RuntimeError(f"sandbox child exited with code {code} (its stderr says why)")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Sandbox:
    """Calls ``function(request: dict)`` of the module at ``path`` in child processes."""

    def __init__(self, path: str, function: str, start_timeout_s: float = 120.0):
        name = os.path.splitext(os.path.basename(path))[0]
        self.argv = [sys.executable, "-P", "-c", _BOOT, path, name, function]
        self.start_timeout_s = start_timeout_s  # a child's imports, not counted in a call
        self.idle: list[_Child] = []
        self.live: set[_Child] = set()
        self.lock = threading.Lock()
        atexit.register(self.close)

    def _take(self) -> _Child:
        with self.lock:
            while self.idle:
                child = self.idle.pop()
                if child.proc.poll() is None:
                    return child
                self.live.discard(child)  # ended while idle (killed from outside): replaced
        child = _Child(self.argv, self.start_timeout_s)
        with self.lock:
            self.live.add(child)
        return child

    def _drop(self, child: _Child) -> None:
        child.kill()
        with self.lock:
            self.live.discard(child)

    def call(self, request: dict, timeout_s: float):
        """``function(request)`` computed by a child within ``timeout_s`` seconds.

        Raises ``CallTimeout`` past the deadline, and ``RuntimeError`` with the child's error
        when the function raised."""
        child = self._take()
        try:
            child.proc.stdin.write((json.dumps(request) + "\n").encode())
            reply = child.read(timeout_s)
        except BaseException:
            self._drop(child)
            raise
        if reply is None:
            self._drop(child)
            raise CallTimeout(f"no reply within {timeout_s} s (the child was killed)")
        with self.lock:
            self.idle.append(child)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["value"]

    def close(self) -> None:
        """Kill every child, busy or idle."""
        with self.lock:
            children, self.live, self.idle = list(self.live), set(), []
        for child in children:
            child.kill()
