"""Output files that appear only when a command succeeds (no torch needed)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from fxq.cli.errors import CliError

__all__ = ["AtomicOutputs"]


class AtomicOutputs:
    """Output files written under temporary names in their own folder, renamed into place
    by ``commit``; ``discard`` (or leaving the ``with`` block by an exception) removes them."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, Path]] = []

    def __enter__(self) -> AtomicOutputs:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.discard()

    @staticmethod
    def check(final: str | Path, flag: str) -> Path:
        """The output path, after checking its folder exists (before any work is done)."""
        final = Path(final)
        parent = final.parent
        if not parent.is_dir():
            raise CliError(f"{flag} {final}: the folder {parent} does not exist")
        if final.is_dir():
            raise CliError(f"{flag} {final} is a folder; give a file name")
        return final

    def file(self, final: Path) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        os.close(fd)
        self.pending.append((Path(tmp), final))
        return Path(tmp)

    def folder(self, final: Path) -> Path:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        self.pending.append((tmp, final))
        return tmp

    def commit(self) -> None:
        umask = os.umask(0)
        os.umask(umask)
        for tmp, final in self.pending:
            # mkstemp / mkdtemp make private files; give them the usual permissions
            tmp.chmod((0o777 if tmp.is_dir() else 0o666) & ~umask)
            if tmp.is_dir() and final.is_dir():
                shutil.rmtree(final)
            os.replace(tmp, final)
        self.pending = []

    def discard(self) -> None:
        for tmp, _ in self.pending:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        self.pending = []
