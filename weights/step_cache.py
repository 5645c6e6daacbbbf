"""The cache directory of compiled steps: each entry built once per machine, found again by its key.

    ~/.cache/speculative-llama/compiled/       # or $SPECULATIVE_CACHE, or --cache-dir
        3f9c.../manifest.json                  # the entry's key, its file's size and hash, when it was built
        3f9c.../step.pt2                       # the compiled step (model/fast/aot.py)
        3f9c....lock                           # held while a process builds that entry
        measured.json                          # per machine and model: the step times --compile measured,
                                               # which decide whether the default run uses the compiled steps
        guard_costs.json                       # per machine and set-up: what a sampled run's guard reads

An entry's name is a hash of its key (model/fast/aot.py's entry_key: the model's weights and config,
dtype, set-up, shape, torch, the CPU or GPU, the threads), so an entry of another model, torch or
machine is never found. What is found is checked before it is used (:meth:`StepCache.find`): a
manifest that does not parse, names another key, or a file whose size or hash is not the
manifest's is refused with the reason (:class:`EntryError`), and the caller rebuilds it or runs
eagerly. An entry is built in a folder of its own and renamed into place when complete, under
a lock per entry: two processes building one entry leave one whole entry, and the second waits
for the first and loads its result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.host import setting

ENV = (
    "SPECULATIVE_CACHE"  # read by model.host.setting: $SPECULATIVE_LLAMA_CACHE too, for one release
)
PAYLOAD = "step.pt2"
MANIFEST = "manifest.json"
MEASURED = "measured.json"


class EntryError(Exception):
    """An entry that is there but cannot be used: the reason, in a few words."""


def default_dir() -> Path:
    """$SPECULATIVE_CACHE, else the platform's user cache: ~/.cache (or $XDG_CACHE_HOME) on
    Linux, ~/Library/Caches on macOS, %LOCALAPPDATA% on Windows; then speculative-llama/compiled."""
    folder = setting(ENV)
    if folder:
        return Path(folder).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "speculative-llama" / "compiled"


def digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Entry:
    """One entry as listed: its folder, key, size in bytes and build date; ``problem`` when broken."""

    path: Path
    key: dict[str, Any]
    size: int
    built: str
    problem: str = ""


class StepCache:
    """Entries of compiled steps under ``root`` (default: :func:`default_dir`)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root).expanduser() if root else default_dir()

    @staticmethod
    def name(key: dict[str, Any]) -> str:
        return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()

    def folder(self, key: dict[str, Any]) -> Path:
        return self.root / self.name(key)

    def find(self, key: dict[str, Any]) -> Path | None:
        """The entry's file, checked against its manifest; None when there is no entry. Raises
        EntryError when there is one that must not be used."""
        folder = self.folder(key)
        if not folder.is_dir():
            return None
        manifest = self._manifest(folder)
        if manifest.get("key") != key:
            other = {k: v for k, v in manifest.get("key", {}).items() if key.get(k) != v}
            raise EntryError(f"its manifest names another {', '.join(sorted(other)) or 'key'}")
        payload = folder / PAYLOAD
        size = payload.stat().st_size if payload.is_file() else -1
        if size != manifest.get("size"):
            raise EntryError(
                f"its file has {max(size, 0)} bytes, the manifest says {manifest.get('size')} "
                "(truncated or replaced)"
            )
        if digest(payload) != manifest.get("digest"):
            raise EntryError("its file's hash is not the manifest's (damaged)")
        return payload

    def build(
        self,
        key: dict[str, Any],
        make: Callable[[Path], None],
        wait: Callable[[], None] | None = None,
    ) -> Path:
        """The entry's file, made by ``make(path)`` unless another process made it meanwhile: under
        the entry's lock (``wait()`` is called when another process holds it), in a private folder
        renamed into place when the file and its manifest are complete."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock(key, wait):
            try:
                found = self.find(key)
            except EntryError:
                found = None
                self.discard(key)
            if found is not None:
                return found
            work = Path(tempfile.mkdtemp(prefix=f".build-{self.name(key)[:8]}-", dir=self.root))
            try:
                make(work / PAYLOAD)
                manifest = {
                    "key": key,
                    "size": (work / PAYLOAD).stat().st_size,
                    "digest": digest(work / PAYLOAD),
                    "built": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
                (work / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
                try:
                    os.replace(work, self.folder(key))
                except OSError:
                    pass  # another builder (with no lock to share) renamed its whole entry first
            finally:
                shutil.rmtree(work, ignore_errors=True)
        found = self.find(key)
        if found is None:
            raise EntryError("it vanished as it was written")
        return found

    def discard(self, key: dict[str, Any]) -> None:
        """Remove the entry (a broken one, before it is rebuilt)."""
        shutil.rmtree(self.folder(key), ignore_errors=True)

    def entries(self) -> list[Entry]:
        """Every entry under the root, broken ones with their problem."""
        found = []
        for folder in sorted(
            p for p in self.root.glob("*") if p.is_dir() and not p.name.startswith(".")
        ):
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            try:
                manifest, problem = self._manifest(folder), ""
            except EntryError as err:
                manifest, problem = {}, str(err)
            found.append(
                Entry(folder, manifest.get("key", {}), size, manifest.get("built", "?"), problem)
            )
        return found

    def clear(self) -> tuple[int, int]:
        """Remove every entry, lock and measurement; returns (entries, bytes) removed."""
        entries = self.entries()
        for entry in entries:
            shutil.rmtree(entry.path, ignore_errors=True)
        if self.root.is_dir():
            for leftover in self.root.iterdir():
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
        return len(entries), sum(e.size for e in entries)

    # ------------------------------------------------------------------------- what compiling gained here
    def measured(
        self, machine: str, model: str | None = None, file: str = MEASURED
    ) -> dict[str, Any] | None:
        """What was recorded for ``model`` (model/fast/setup.py's record_key) on ``machine`` (a
        device and thread count); without ``model``, every model's record on that machine. ``file``:
        another record of the store (guard_costs.json: a sampled run's guard, speculative/cli/costs.py)."""
        known = self.measurements(file).get(machine)
        if not isinstance(known, dict):
            return None
        return known if model is None else known.get(model)

    def measurements(self, file: str = MEASURED) -> dict[str, Any]:
        """Every record, by machine then model ({} when there is none or it does not parse)."""
        try:
            known = json.loads((self.root / file).read_text())
        except (OSError, ValueError):
            return {}
        return known if isinstance(known, dict) else {}

    def record(
        self, machine: str, model: str, measurement: dict[str, Any], file: str = MEASURED
    ) -> None:
        """Keep ``measurement`` for ``model`` on ``machine`` (the file written whole, then renamed
        into place)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            known = self.measurements(file)
            on_machine = known.get(machine) if isinstance(known.get(machine), dict) else {}
            known[machine] = {**on_machine, model: measurement}
            fd, tmp = tempfile.mkstemp(prefix=".measured-", dir=self.root)
            with os.fdopen(fd, "w") as f:
                json.dump(known, f, indent=1, sort_keys=True)
            os.replace(tmp, self.root / file)
        except OSError:
            pass  # a measurement that cannot be kept: the default stays eager, which is always right

    # ------------------------------------------------------------------------- internals
    @staticmethod
    def _manifest(folder: Path) -> dict[str, Any]:
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            raise EntryError("it has no manifest (an unfinished build)") from None
        except (OSError, ValueError):
            raise EntryError("its manifest does not parse") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("key"), dict):
            raise EntryError("its manifest has no key")
        return manifest

    @contextlib.contextmanager
    def _lock(self, key: dict[str, Any], wait: Callable[[], None] | None) -> Iterator[None]:
        try:
            import fcntl  # POSIX only: imported where it is used, so that the module loads everywhere
        except ImportError:  # no advisory locks (Windows): the rename alone keeps entries whole
            yield
            return
        with open(self.root / f"{self.name(key)}.lock", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if wait is not None:
                    wait()
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
