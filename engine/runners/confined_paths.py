"""Names a remote client gives for files, confined to one folder that the server was given: what `kvscope
serve` resolves save_state, load_state, load_model and chat-script paths with (engine/runners/served_files.py).

    states = ConfinedFolder("/srv/kvscope-state", "state folder", "--state-dir")
    states.write_bytes("run.state", data, "save_state")      # /srv/kvscope-state/run.state, nothing else
    states.resolve("../.bashrc", "load_state")               # PathRefusedError

A name is refused when it is absolute, holds a '..', or resolves (symbolic links followed) outside the
folder. The refusal depends on the name and on what lies inside the folder only, never on whether a file
outside exists, so that a client cannot probe the server's machine through the error text. Torch-free.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path, PurePosixPath

from engine.errors import KvscopeError
from engine.watch.protocol import PathRefusedError

log = logging.getLogger("kvscope.serve")

# Open each folder on the way without following links, and the file itself likewise: a link that
# someone swaps in between the check and the write is refused instead of followed (where the platform
# opens relative to a folder's descriptor; elsewhere only the last component is protected).
_WALKS_BY_DESCRIPTOR = os.open in os.supports_dir_fd
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted in the folder fails at once instead of blocking a thread


class ConfinedFolder:
    """One folder and the file names inside it that a client may use (see the module docstring)."""

    def __init__(self, root: str | Path, what: str, flag: str, *, create: bool = False) -> None:
        """what: how errors name the folder ("state folder"); flag: the option that sets it ("--state-dir").
        create: make the folder (mode 0700) on first use; otherwise it must exist now."""
        self.what, self.flag, self.create = what, flag, create
        self.root = Path(os.path.realpath(os.path.abspath(os.fspath(root))))
        if not create and not self.root.is_dir():
            raise KvscopeError(f"{flag} {root}: no such folder" if not self.root.exists()
                               else f"{flag} {root}: not a folder")
        if self.root.is_dir() and self.root.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            log.warning("kvscope serve: the %s %s (%s) is writable by other users: they can put files there that "
                        "clients then load (nothing is written outside it)", what, self.root, flag)

    def __repr__(self) -> str:
        return f"ConfinedFolder({str(self.root)!r})"

    # ---- names -------------------------------------------------------------------------------------
    def resolve(self, name, command: str) -> Path:
        """The real path of `name` inside the folder (links followed); PathRefusedError when it is not a
        plain relative name or leads out of the folder. The file itself need not exist."""
        relative = self._relative(name, command)
        try:
            real = Path(os.path.realpath(self.root / relative))
        except OSError as e:  # a link inside the folder changed while it was read
            raise self._cannot(command, "resolve", name, e) from None
        if real != self.root and self.root not in real.parents:
            raise PathRefusedError(f"{command}: refused {name!r}: a symbolic link leads out of the {self.what} "
                                   f"{self.root} ({self.flag}); name a file inside it")
        if real == self.root:
            raise PathRefusedError(f"{command}: refused {name!r}: that is the {self.what} itself; name a file in it")
        return real

    def _relative(self, name, command: str) -> PurePosixPath:
        if not isinstance(name, str):
            raise PathRefusedError(f"{command}: a file name in the {self.what} must be a str, got "
                                   f"{type(name).__name__}")
        if not name.strip() or "\0" in name:
            raise PathRefusedError(f"{command}: refused {name!r}: name a file in the {self.what} {self.root} "
                                   f"({self.flag})")
        path = PurePosixPath(name)
        if path.is_absolute() or os.path.isabs(name):
            raise PathRefusedError(f"{command}: refused {name!r}: an absolute path; this server takes names relative "
                                   f"to its {self.what} {self.root} ({self.flag})")
        if ".." in path.parts:
            raise PathRefusedError(f"{command}: refused {name!r}: '..' is not allowed; name a file inside the "
                                   f"{self.what} {self.root} ({self.flag})")
        return path

    # ---- files -------------------------------------------------------------------------------------
    def write_bytes(self, name, data: bytes, command: str) -> int:
        """Write `data` to `name` in the folder; returns its size. Written to a new file that then takes the
        name, so that a link or a hard link already at that name is replaced, never written through, and
        a failed write leaves the old file as it was."""
        real = self.resolve(name, command)
        folder_fd = self._open_folder(real.parent, name, command, "write")
        spare = f".kvscope-{os.getpid()}-{os.urandom(4).hex()}.partial"  # short: any name that fits, fits beside it
        try:
            try:
                fd = self._open_in(folder_fd, real.parent, spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                self._rename_in(folder_fd, real.parent, spare, real.name)
            except OSError as e:
                self._unlink_in(folder_fd, real.parent, spare)
                raise self._cannot(command, "write", name, e) from None
        finally:
            self._close(folder_fd)
        return len(data)

    def read_bytes(self, name, command: str) -> bytes:
        """The bytes of the regular file `name` in the folder."""
        real = self.resolve(name, command)
        folder_fd = self._open_folder(real.parent, name, command, "read")
        try:
            fd = self._open_in(folder_fd, real.parent, real.name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
        except OSError as e:
            raise self._cannot(command, "read", name, e) from None
        finally:
            self._close(folder_fd)
        with os.fdopen(fd, "rb") as source:
            if not stat.S_ISREG(os.fstat(source.fileno()).st_mode):
                raise PathRefusedError(f"{command}: cannot read {name!r} in the {self.what} {self.root}: not a "
                                       f"regular file")
            return source.read()

    def _open_folder(self, folder: Path, name, command: str, doing: str) -> int | None:
        """A descriptor of `folder` (inside the root), reached one folder at a time without following links;
        None where the platform has no descriptor-relative open."""
        if self.create and not self.root.exists():
            try:
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:
                raise self._cannot(command, doing, name, e) from None
        if not _WALKS_BY_DESCRIPTOR:
            return None
        try:
            fd = os.open(self.root, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
        except OSError as e:
            raise self._cannot(command, doing, name, e) from None
        for part in folder.relative_to(self.root).parts:
            try:
                inner = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise self._cannot(command, doing, name, e) from None
            finally:
                os.close(fd)
            fd = inner
        return fd

    @staticmethod
    def _open_in(folder_fd: int | None, folder: Path, name: str, flags: int) -> int:
        if folder_fd is None:
            return os.open(folder / name, flags, 0o600)
        return os.open(name, flags, 0o600, dir_fd=folder_fd)

    @staticmethod
    def _rename_in(folder_fd: int | None, folder: Path, old: str, new: str) -> None:
        if folder_fd is None:
            os.replace(folder / old, folder / new)
        else:
            os.replace(old, new, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)

    @staticmethod
    def _unlink_in(folder_fd: int | None, folder: Path, name: str) -> None:
        try:
            if folder_fd is None:
                os.unlink(folder / name)
            else:
                os.unlink(name, dir_fd=folder_fd)
        except OSError:  # never made, or already gone: the write's own error is what the client hears
            pass

    @staticmethod
    def _close(folder_fd: int | None) -> None:
        if folder_fd is not None:
            os.close(folder_fd)

    def _cannot(self, command: str, doing: str, name, error: OSError) -> PathRefusedError:
        """An OS error inside the folder, told without the path the OS names (the client's name instead)."""
        return PathRefusedError(f"{command}: cannot {doing} {name!r} in the {self.what} {self.root}: "
                                f"{error.strerror or type(error).__name__}")
