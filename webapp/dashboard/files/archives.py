"""Unpacking an uploaded run directory (a .zip or a .tar.gz) without trusting it.

Every entry is checked before anything is written: a plain file or folder (no symbolic or hard
links, no devices), a relative name that stays inside the destination (no absolute path, no
`..`), at most `max_files` entries and `max_bytes` unpacked in all (the sizes the archive
declares, which extraction never exceeds). tarfile's `data` filter checks the same again while
extracting; zip entries are copied by hand, counting bytes (zipfile has no such filter).
"""
from __future__ import annotations

import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

CONFIG = "config.toml"


class ArchiveError(ValueError):
    """An archive refused, with why."""


def _check_name(name: str) -> None:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or name.startswith(("/", "\\")) or (p.parts and ":" in p.parts[0]):
        raise ArchiveError(f"{name!r}: absolute paths are not allowed")
    if ".." in p.parts or "\\" in name:
        raise ArchiveError(f"{name!r}: a path leaving the archive's folder is not allowed")


class _Budget:
    def __init__(self, max_files: int, max_bytes: int):
        self.max_files, self.max_bytes, self.files, self.bytes = max_files, max_bytes, 0, 0

    def take(self, size: int) -> None:
        self.files += 1
        self.bytes += size
        if self.files > self.max_files:
            raise ArchiveError(f"more than {self.max_files} entries (RLPILOT_MAX_IMPORT_FILES)")
        if self.bytes > self.max_bytes:
            raise ArchiveError(f"more than {self.max_bytes} bytes unpacked (RLPILOT_MAX_IMPORT_BYTES)")


def _extract_tar(src: Path, dest: Path, budget: _Budget) -> None:
    with tarfile.open(src, "r:*") as tf:
        members = []
        for m in tf:   # headers one by one: a flood of entries stops at the budget
            _check_name(m.name)
            if m.issym() or m.islnk():
                raise ArchiveError(f"{m.name!r}: links are not allowed")
            if not (m.isfile() or m.isdir()):
                raise ArchiveError(f"{m.name!r}: only files and folders are allowed")
            budget.take(m.size if m.isfile() else 0)
            members.append(m)
        try:
            tf.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as e:
            raise ArchiveError(str(e)) from None


def _extract_zip(src: Path, dest: Path, budget: _Budget) -> None:
    root = dest.resolve()
    with zipfile.ZipFile(src) as zf:
        infos = zf.infolist()
        for info in infos:
            _check_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise ArchiveError(f"{info.filename!r}: links are not allowed")
            if mode and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ArchiveError(f"{info.filename!r}: only files and folders are allowed")
            if info.flag_bits & 0x1:
                raise ArchiveError(f"{info.filename!r}: encrypted entries are not supported")
            budget.take(0 if info.is_dir() else info.file_size)
        for info in infos:
            target = (dest / info.filename).resolve()
            if target != root and root not in target.parents:
                raise ArchiveError(f"{info.filename!r}: a path leaving the archive's folder is not allowed")
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as fin, open(target, "xb") as fout:
                left = info.file_size
                while chunk := fin.read(1 << 20):
                    left -= len(chunk)
                    if left < 0:
                        raise ArchiveError(f"{info.filename!r}: larger than the archive says")
                    fout.write(chunk)


def extract(src: str | Path, dest: str | Path, *, max_bytes: int, max_files: int) -> Path:
    """Unpack the archive `src` into the empty folder `dest`; returns the run directory in it:
    `dest` itself when config.toml is at the archive's top, else its one top-level folder."""
    src, dest = Path(src), Path(dest)
    budget = _Budget(max_files, max_bytes)
    try:
        if zipfile.is_zipfile(src):
            _extract_zip(src, dest, budget)
        elif tarfile.is_tarfile(src):
            _extract_tar(src, dest, budget)
        else:
            raise ArchiveError("not a .zip or .tar.gz archive")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise ArchiveError(f"the archive cannot be read: {e}") from None
    if (dest / CONFIG).is_file():
        return dest
    top = list(dest.iterdir())
    if len(top) == 1 and top[0].is_dir() and (top[0] / CONFIG).is_file():
        return top[0]
    raise ArchiveError(f"no {CONFIG} at the archive's top or in its one top-level folder: "
                       "archive the run directory itself")
