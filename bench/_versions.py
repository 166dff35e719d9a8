"""Two versions of the sidecar side by side in one run, and a scratch directory for the run.

- :func:`scratch`: one directory for everything a run writes (process logs, work directories,
  ``TMPDIR`` of this process and its children, git worktrees), under ``--scratch`` (by default
  ``scratch-bench`` beside the checkout), removed at the end: nothing lands in ``/tmp``.
- :class:`Version`: the code a sidecar runs: the checkout as it is (the editable install), or a
  revision checked out into a git worktree and run from there with this venv:
  ``PYTHONPATH=<worktree>``, **and** the worktree as the working directory. Both matter: ``python
  -m`` puts the working directory first on ``sys.path``, ahead of ``PYTHONPATH``, so from the
  checkout's root the checkout's ``sidecar`` is imported whatever ``PYTHONPATH`` says.
  :meth:`Version.verify` asks the interpreter, with the same environment and directory, which
  ``sidecar`` it imports.
- :class:`VersionedSidecar`: ``tests.support.harness.Sidecar`` run from a :class:`Version`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.harness import ROOT, Proc, Sidecar
from tests.support.processes import set_log_dir

DEFAULT_SCRATCH = ROOT.parent / "scratch-bench"


@contextlib.contextmanager
def scratch(base: Path, name: str, keep: bool = False) -> Iterator[Path]:
    """A fresh directory under ``base`` for one run: ``TMPDIR`` (this process's and its
    children's) and the process logs point into it; removed on exit (``base`` too, when this run
    made it and it is empty), unless ``keep``."""
    made_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    tmp = where / "tmp"
    tmp.mkdir()
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    set_log_dir(where / "logs")
    try:
        yield where
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        if keep:
            print(f"kept {where}", file=sys.stderr)
        else:
            shutil.rmtree(where, ignore_errors=True)
            if made_base:
                with contextlib.suppress(OSError):
                    base.rmdir()


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def short(revision: str) -> str:
    return git("rev-parse", "--short", revision)


@dataclass(frozen=True)
class Version:
    """The code a sidecar runs: ``tree`` None is the checkout as it is (``ROOT``)."""

    label: str
    revision: str  # a short commit, or the checkout's state
    tree: Path | None = None

    @property
    def cwd(self) -> Path:
        return self.tree if self.tree is not None else ROOT

    def env(self, env: dict[str, str]) -> dict[str, str]:
        env = dict(env)
        if self.tree is None:
            env.pop("PYTHONPATH", None)
        else:
            env["PYTHONPATH"] = str(self.tree)
        return env

    def verify(self, env: dict[str, str]) -> str:
        """The ``sidecar`` package this version's interpreter imports; raise if it is not the
        version's."""
        done = subprocess.run(
            [sys.executable, "-c", "import sidecar; print(sidecar.__file__)"],
            cwd=self.cwd,
            env=self.env(env),
            capture_output=True,
            text=True,
            check=True,
        )
        found = done.stdout.strip()
        expected = self.cwd / "sidecar" / "__init__.py"
        if Path(found).resolve() != expected.resolve():
            raise RuntimeError(f"{self.label}: imports {found}, expected {expected}")
        return found


@contextlib.contextmanager
def worktree(revision: str, parent: Path) -> Iterator[Path]:
    """``revision`` checked out (detached) in a git worktree under ``parent``, removed on exit."""
    where = parent / f"worktree-{short(revision)}"
    git("worktree", "add", "--detach", str(where), revision)
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, capture_output=True
        )
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


CHECKOUT = "checkout"


@contextlib.contextmanager
def versions(before: str | None, after: str, parent: Path) -> Iterator[list[Version]]:
    """[before, after], or [after] without ``before``. Each revision is checked out into a git
    worktree (so that edits other engineers make to the checkout during a run change nothing);
    ``after`` :data:`CHECKOUT` is the checkout as it is."""
    with contextlib.ExitStack() as stack:
        found = []
        for label, revision in (("before", before), ("after", after)):
            if revision is None:
                continue
            if revision == CHECKOUT:
                found.append(Version(label, current_state()))
                continue
            tree = stack.enter_context(worktree(revision, parent))
            found.append(Version(label, short(revision), tree))
        yield found


def current_state() -> str:
    """The checkout's commit, and whether ``sidecar/`` differs from it."""
    head = short("HEAD")
    dirty = git("status", "--porcelain", "--", "sidecar")
    return f"{head} + uncommitted changes in sidecar/" if dirty else head


class VersionedSidecar(Sidecar):
    """``python -m sidecar`` as :class:`tests.support.harness.Sidecar` starts it, run from
    ``version``'s directory with its ``PYTHONPATH``."""

    def __init__(self, version: Version, env: dict[str, str], name: str) -> None:
        self.version = version
        self.name = name
        super().__init__(env)

    def env(self) -> dict[str, str]:
        return self.version.env(self.variables)

    def spawn(
        self, argv: list[str], env: dict[str, str], name: str | None = None, nice: int | None = None
    ) -> Proc:
        # Process.spawn, with the version's working directory.
        if self.proc is not None:
            self.proc.stop(self.stop_timeout, sig=self.stop_signal, group=self.stop_group)
        self.started_at = time.monotonic()
        self.ready_after = None
        nice = self.nice if nice is None else nice
        self.proc = Proc(argv, env, name or self.name, nice=nice, cwd=self.version.cwd)
        return self.proc
