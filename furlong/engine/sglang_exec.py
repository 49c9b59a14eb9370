"""Run SGLang with the admin token in a 0600 config file, never on its command line.

SGLang takes its admin key only as a server argument (``--admin-api-key``) and has no
environment variable for it; a command line is readable by every local user
(`/proc/<pid>/cmdline`), and the key lets its holder replace the policy's weights. SGLang
also reads server arguments from a YAML file (``--config FILE.yaml``), so this wrapper,
started by the process manager as ``python -m furlong.engine.sglang_exec -- <sglang argv>``
with the token in ``$FURLONG_ADMIN_TOKEN``:

1. writes ``admin-api-key: <token>`` to a file of mode 0600 in a fresh 0700 directory;
2. runs the SGLang argv with ``--config <that file>`` appended, in a child that dies with
   this process, and passes SIGTERM/SIGINT on to it;
3. removes the file when SGLang exits, and exits with SGLang's status.

The wrapper runs on the node the server runs on, so the file is where SGLang reads it, with
Ray or without. The token is also removed from the environment SGLang inherits. Without a
token it runs the argv unchanged. It needs an SGLang whose ``launch_server`` takes
``--config`` (UNTESTED WITHOUT A GPU: CI runs it with a stand-in ``sglang`` package).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from furlong.core.processes import ADMIN_TOKEN_ENV

KEY_FILE = "sglang-admin.yaml"


def key_config(token: str, directory: str | Path) -> Path:
    """The SGLang config file that sets ``admin-api-key`` to `token` (mode 0600) in `directory`."""
    path = Path(directory) / KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"admin-api-key: {json.dumps(token)}\n")  # a JSON string is a YAML string, quoted as needed
    return path


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run(argv: list[str]) -> int:
    """Run `argv` (SGLang's), its admin key from the environment in a private config file; its exit status."""
    token = os.environ.pop(ADMIN_TOKEN_ENV, None)
    if not token:
        os.execvp(argv[0], argv)
    directory = tempfile.mkdtemp(prefix="furlong-sglang-key-")  # mode 0700
    try:
        argv = [*argv, "--config", str(key_config(token, directory))]
        pid = os.fork()
        if pid == 0:  # the child: becomes SGLang
            _die_with_parent()
            try:
                os.execvp(argv[0], argv)
            finally:
                os._exit(127)

        def forward(sig: int, _frame: object) -> None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # already gone
                pass

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        _, status = os.waitpid(pid, 0)  # retried after each handled signal (PEP 475)
        return os.waitstatus_to_exitcode(status)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m furlong.engine.sglang_exec -- <sglang argv>", file=sys.stderr)
        return 2
    code = run(args)
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main())
