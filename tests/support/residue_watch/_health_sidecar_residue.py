"""What a process of the test session makes in the temporary directory, watched from inside it.

Python's audit hooks (PEP 578) see each file, directory, link and unix socket a process creates.
The test session installs this hook in pytest itself and, through ``sitecustomize`` in this
directory (on ``PYTHONPATH``), in every Python process the tests start. Each records the names of
the temporary directory's top-level entries it made, so that the residue check blames the tests
only for what they made, never for what other programs on the machine wrote there meanwhile.

Plain Python (3.8 and later, no imports of the project): it also runs in the engines' own venvs.
"""

import os
import sys

ROOT = "HEALTH_SIDECAR_RESIDUE_ROOT"  # the temporary directory watched
LOG = "HEALTH_SIDECAR_RESIDUE_LOG"  # a directory: one file per process, one name per line
PASS_OVER = "HEALTH_SIDECAR_RESIDUE_PASS_OVER"  # top-level names not to record (pytest's root)

_CREATING = {"os.mkdir": 0, "os.rename": 1, "os.symlink": 1, "os.link": 1}


def _created(event, args):
    """The path an audit event creates, or None."""
    if event == "open":
        path, _mode, flags = args
        return path if flags & os.O_CREAT else None
    if event == "socket.bind":
        address = args[1]
        if isinstance(address, (str, bytes)) and address[:1] not in ("\0", b"\0", "", b""):
            return address
        return None
    index = _CREATING.get(event)
    return None if index is None else args[index]


def install(root, pass_over, record):
    """Call ``record(name)`` for each top-level entry of ``root`` this process creates."""
    roots = {os.path.abspath(root), os.path.realpath(root)}
    pass_over = frozenset(pass_over)
    busy = []  # recording may itself open a file: no event while one is recorded

    def hook(event, args):
        if busy or (event not in _CREATING and event not in ("open", "socket.bind")):
            return
        path = _created(event, args)
        if path is None or isinstance(path, int):
            return
        try:
            path = os.path.abspath(os.fsdecode(path))
        except (TypeError, ValueError):
            return
        for top in roots:
            if path.startswith(top + os.sep):
                name = path[len(top) + 1 :].split(os.sep, 1)[0]
                if name and name not in pass_over:
                    busy.append(True)
                    try:
                        record(name)
                    finally:
                        busy.clear()
                return

    sys.addaudithook(hook)


def _append(log_dir):
    def record(name):
        fd = os.open(
            os.path.join(log_dir, str(os.getpid())), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
        )
        try:
            os.write(fd, os.fsencode(name) + b"\n")
        finally:
            os.close(fd)

    return record


def install_from_environment():
    """In a process the tests started: record into the session's log directory."""
    root, log_dir = os.environ.get(ROOT), os.environ.get(LOG)
    if root and log_dir and os.path.isdir(log_dir):
        install(root, os.environ.get(PASS_OVER, "").split(os.pathsep), _append(log_dir))


def recorded(log_dir):
    """Every name the session's processes recorded in ``log_dir``."""
    names = set()
    try:
        entries = os.listdir(log_dir)
    except OSError:
        return names
    for entry in entries:
        try:
            with open(os.path.join(log_dir, entry), encoding="utf-8", errors="replace") as lines:
                names.update(line.rstrip("\n") for line in lines if line.strip())
        except OSError:
            continue
    return names
