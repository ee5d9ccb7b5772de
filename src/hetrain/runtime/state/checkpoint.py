"""Checkpoints in per-layer files with global names: atomic, collective, loadable under any plan.

Parameters are named by global layer index (``layers.3.weight``, DESIGN.md decision 6)
and stored one file per layer, so a rank under another plan reads only the layers it
holds. On disk::

    DIR/
      step-00000020/              complete: it has a manifest
        manifest.json             written last, by rank 0 (step, world size, files, names, meta)
        layers.0.pt               {"tensors": {name: tensor}, "optimizer_state": {name: {key: value}}}
        layers.1.pt               ...
        ps.layers.0.pt            wsp / hybrid-ps: the parameter-server shard's global weights of layer 0
      step-00000030/
      .step-00000040.tmp/         a save in progress, or one a crash interrupted: ignored

A save under torch.distributed is a collective over the default group::

    every rank   write own files into .step-N.tmp/ (each: tmp file, fsync, rename)
                 post "arrived" with its file list in the job store (hetrain.distributed.store)
    barrier      every rank waits at most timeout_s for all others; names the missing ranks
                 (hetrain.distributed.barrier)
    rank 0       check the lists (one writer per file, every file visible, sizes), write
                 manifest.json (tmp, fsync, rename), rename .step-N.tmp/ -> step-N/,
                 fsync DIR, post "done"; then prune to the newest ``keep`` checkpoints
    other ranks  wait at most timeout_s for "done"; name rank 0 if it does not come

A rank that fails posts its error in the store and every rank raises it. A write that
fails (a full disk: ``OSError`` ENOSPC, or torch.save's zip writer's ``unexpected pos``
after it) is one line on every rank naming the step, the directory, the cause, the rank
and its file (``write_failure``); each rank removes the files it wrote for that save.
A crash at any point leaves either a hidden ``.step-N.tmp/`` (ignored, removed by the next save)
or a complete ``step-N/``; older checkpoints are deleted only after the new one is
complete, and renamed to a hidden name before they are removed, so a crash while
deleting never leaves a damaged directory that looks complete. Saving a step that
already exists replaces it; between the two renames that do so, only the replaced
step is out of sight (it lies in ``.step-N.replaced/``).

Files are written with ``torch.save`` and read with ``torch.load(weights_only=True)``
(no pickled code runs on load). ``torch.distributed.checkpoint`` was not used: it
writes one file per rank rather than per layer, loading is itself a collective,
its files are written in place (no rename) and carry no checksum. Here every file
has its size and SHA-256 in the manifest and is checked before it is read.

All ranks write into the same directory: under several hosts it must be on a shared
file system (rank 0 says so when a file another rank wrote is not visible to it).

Example:
    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> w = {"layers.0.weight": torch.ones(2, 2)}
    >>> path = save_checkpoint(d, 10, w, {"layers.0.weight": {"step": 1.0}}, {"loss": 0.5})
    >>> path.name, latest_checkpoint(d)[0]
    ('step-00000010', 10)
    >>> tensors, state, meta = load_checkpoint(d, ["layers.0.weight"])
    >>> tensors["layers.0.weight"].sum().item(), state["layers.0.weight"], meta
    (4.0, {'step': 1.0}, {'loss': 0.5})
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetrain.distributed.barrier import Barrier, BarrierError
from hetrain.distributed.store import JobStore, StoreError, hosts_store
from hetrain.distributed.work import first_line
from hetrain.errors import RunError
from hetrain.units import format_bytes

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointWriteError",
    "latest_checkpoint",
    "layer_file_name",
    "load_checkpoint",
    "load_manifest",
    "save_checkpoint",
    "step_dir_name",
]

FORMAT = "hetrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LEFTOVER = re.compile(r"^\.step-(\d{8,})\.(tmp|replaced|deleting)$")
_LAYER = re.compile(r"^((?:ps\.)?layers\.\d+)\.")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_SAVES = itertools.count()  # save_checkpoint calls in this process: keeps the store keys of two saves apart
_CHUNK_BYTES = 1 << 20


class CheckpointError(RunError):
    """A checkpoint cannot be saved or loaded; the message names the step, file, name or rank."""


class CheckpointWriteError(CheckpointError):
    """A rank could not write its files of a checkpoint (the disk is full, ...): names the step, the directory,
    the cause, the rank and its file (``write_failure``).

    Attributes:
        errno: the cause's error number (``errno.ENOSPC``: the disk is full), or None when none is known.
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


def step_dir_name(step: int) -> str:
    """``step-00000010``: the directory of a complete checkpoint of ``step``."""
    return f"step-{step:08d}"


def layer_file_name(name: str) -> str:
    """The file that holds parameter ``name``: ``layers.3.weight`` -> ``layers.3.pt``.

    A parameter server's global weights of a layer (``ps.layers.3.weight``, written by the shard's
    host, ``runtime.sync.modes``) go to ``ps.layers.3.pt``. Names outside ``layers.{i}.`` go by their first
    component (``head.bias`` -> ``head.pt``).
    """
    match = _LAYER.match(name)
    group = match.group(1) if match else name.split(".", 1)[0]
    group = _UNSAFE.sub("_", group)
    if not group or group.startswith("."):
        group = "_" + group
    return f"{group}.pt"


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    tensors: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Mapping[str, Any]],
    meta: Mapping[str, Any],
    *,
    owned_names: Iterable[str] | None = None,
    keep: int | None = 3,
    timeout_s: float = 60.0,
) -> Path:
    """Write a checkpoint of ``step``; a collective over the default group when torch.distributed is up.

    Args:
        directory: where ``step-NNNNNNNN/`` directories live (created if needed).
        step: the step number, ``>= 0``; the same on every rank.
        tensors: this rank's parameters by global name (``layers.3.weight``).
        optimizer_state: per global name, that parameter's optimizer state (AdamW: ``exp_avg``,
            ``exp_avg_sq``, ``step``); names without state may be left out.
        meta: JSON-able facts to keep (data position, seeds, plan summary, loss); rank 0's is written.
        owned_names: the names this rank writes; under data parallelism exactly one holder of
            each layer owns it. Default: all of ``tensors``.
        keep: how many checkpoints to keep (the newest steps, and always the one just written);
            ``None`` keeps all. Older ones are removed only after this one is complete.
        timeout_s: how long a rank waits for the others (from when its own files are written).

    Returns:
        The complete checkpoint's directory, on every rank once rank 0 has completed it.

    Raises:
        CheckpointWriteError: this rank could not write its files (the disk is full, ...): one line naming
            the step, the directory, the cause (``ENOSPC``), the rank and its file (``write_failure``).
        CheckpointError: another rank failed (its one line, on every rank) or did not arrive within
            ``timeout_s`` (named), two ranks wrote the same file, or a file is not visible to rank 0.
        ValueError, TypeError: bad arguments (a name not in ``tensors``, meta not JSON-able, ...).

    Example:
        >>> state = {n: opt.state[p] for n, p in stage.named_parameters()}    # doctest: +SKIP
        >>> save_checkpoint("ckpt", 100, dict(stage.named_parameters()), state, {"loss": 1.7},
        ...                 owned_names=mine)                                  # doctest: +SKIP
    """
    directory = Path(directory)
    rendezvous = _Rendezvous(step, timeout_s)
    try:
        owned = set(tensors) if owned_names is None else set(owned_names)
        _check_save_arguments(step, tensors, optimizer_state, meta, owned, keep, timeout_s)
        tmp = directory / f".{step_dir_name(step)}.tmp"
        report = _write_files(directory, step, rendezvous.rank, tensors, optimizer_state, owned)
    except CheckpointWriteError as e:  # names its rank, step and cause already
        rendezvous.abort(str(e))
        raise
    except Exception as e:
        rendezvous.abort(f"rank {rendezvous.rank} failed to write its part of checkpoint step {step}: {e}")
        raise
    try:
        reports = rendezvous.gather({"step": step, **report})
    except CheckpointError:  # another rank failed: this rank's files are of no use, and take space
        _discard(tmp, report["files"])
        raise
    final = directory / step_dir_name(step)
    if reports is None:  # not rank 0
        rendezvous.wait_done()
        return final
    try:
        _complete(directory, tmp, final, step, reports, dict(meta))
    except Exception as e:
        rendezvous.abort(str(e))
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rendezvous.done()
    if keep is not None:
        _prune(directory, keep, step)
    return final


def _is_step(step: object) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _check_save_arguments(step: int, tensors: Mapping[str, torch.Tensor],
                          optimizer_state: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any],
                          owned: set[str], keep: int | None, timeout_s: float) -> None:
    if not _is_step(step):
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (or None to keep every checkpoint), got {keep}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
    unknown = sorted(owned - set(tensors))
    if unknown:
        raise ValueError(f"owned_names has {len(unknown)} name(s) not in tensors: {_preview(unknown)}")
    stray = sorted(set(optimizer_state) - set(tensors))
    if stray:
        raise ValueError(f"optimizer_state has {len(stray)} name(s) not in tensors: {_preview(stray)}")
    for name, state in optimizer_state.items():
        for key in state:
            if not isinstance(key, str):
                raise TypeError(f"optimizer_state[{name!r}] has key {key!r}: keys must be strings")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta must be JSON-able (str, int, float, bool, None, lists, dicts): {e}") from None


def _write_files(directory: Path, step: int, rank: int, tensors: Mapping[str, torch.Tensor],
                 optimizer_state: Mapping[str, Mapping[str, Any]], owned: set[str]) -> dict[str, Any]:
    """Write this rank's per-layer files into ``.step-N.tmp/``; return ``{"files": {file: {bytes, sha256, names}}}``.

    Raises:
        CheckpointWriteError: a file could not be written (the disk is full, ...); this rank's files of this
            save are removed first.
    """
    tmp = directory / f".{step_dir_name(step)}.tmp"
    files: dict[str, Any] = {}
    file = tmp.name
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for file, names in _files_of(owned).items():
            files[file] = _write_layer_file(tmp / file, names, tensors, optimizer_state)
        file = tmp.name
        fsync_path(tmp)
    except (OSError, _FailedWrite) as e:
        _discard(tmp, files)
        raise write_failure(e, directory, step, rank, file) from None
    except BaseException:
        _discard(tmp, files)
        raise
    return {"files": files}


def _files_of(owned: set[str]) -> dict[str, list[str]]:
    """The names ``owned`` by the file that holds them (``layer_file_name``)."""
    by_file: dict[str, list[str]] = {}
    for name in sorted(owned):
        by_file.setdefault(layer_file_name(name), []).append(name)
    return by_file


def _write_layer_file(path: Path, names: list[str], tensors: Mapping[str, torch.Tensor],
                      optimizer_state: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Write one layer file atomically; return its manifest entry ``{bytes, sha256, names}``."""
    content: dict[str, Any] = {"tensors": {}, "optimizer_state": {}}
    described: dict[str, Any] = {}
    for name in names:
        t = _portable(tensors[name], name)
        content["tensors"][name] = t
        state = optimizer_state.get(name) or {}
        if state:
            content["optimizer_state"][name] = {k: _portable(v, f"{name} / {k}") for k, v in state.items()}
        described[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                           "optimizer_state": sorted(state)}
    size, digest = _save_atomic(path, content)
    return {"bytes": size, "sha256": digest, "names": described}


def _discard(tmp: Path, files: Iterable[str]) -> None:
    """Remove this rank's ``files`` of a failed save from ``tmp`` (the hidden directory itself stays: another
    rank may still be writing into it; the next save removes it)."""
    for file in files:
        with contextlib.suppress(OSError):
            (tmp / file).unlink()


def _portable(value: Any, where: str) -> Any:
    """A copy fit for ``torch.save`` and ``torch.load(weights_only=True)``: tensors on the CPU, compact."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            return t.cpu()  # a new, compact tensor
        whole = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
        # torch.save writes a view's whole storage: copy views (of a flat buffer, say) to their own
        return t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v, where) for v in value)
    if isinstance(value, dict):
        return {k: _portable(v, where) for k, v in value.items()}
    raise TypeError(f"optimizer state {where} is a {type(value).__name__}: only tensors, numbers, strings, "
                    "None, lists and dicts can be saved")


def _part(path: Path) -> Path:
    """A hidden temporary beside ``path``, its name unique to this write (two ranks may aim at one file)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.part")


def _save_atomic(path: Path, content: Any) -> tuple[int, str]:
    """``torch.save`` to a hidden temporary, fsync, rename onto ``path``; return (bytes, SHA-256)."""
    part = _part(path)
    with _removed_on_failure(part):
        with open(part, "wb") as f:
            torch.save(content, f)
            f.flush()
            os.fsync(f.fileno())
        size, digest = _digest(part)
        os.replace(part, path)
    return size, digest


def _write_text_atomic(path: Path, text: str) -> None:
    part = _part(path)
    with _removed_on_failure(part):
        with open(part, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)


class _FailedWrite(Exception):
    """A temporary's write failed (``cause``); ``free_bytes``: the file system's free space measured before the
    partial temporary was removed (None where it cannot be asked)."""

    def __init__(self, cause: BaseException, free_bytes: int | None) -> None:
        super().__init__(str(cause))
        self.cause, self.free_bytes = cause, free_bytes


@contextlib.contextmanager
def _removed_on_failure(part: Path) -> Iterator[None]:
    """Remove the temporary ``part`` when its write fails (half a file is of no use, and takes space); an
    ``OSError`` or torch's ``RuntimeError`` comes out as ``_FailedWrite``, with the free space there was."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's zip writer, after a write failed under it
        free = free_bytes(part.parent)
        with contextlib.suppress(OSError):
            part.unlink()
        raise _FailedWrite(e, free) from e
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise


def free_bytes(path: Path) -> int | None:
    """The bytes an unprivileged writer may still use on ``path``'s file system (``statvfs``), or None."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return None
    return st.f_bavail * st.f_frsize


def write_failure(error: BaseException, directory: Path, step: int, rank: int, file: str,
                  action: str = "writing") -> CheckpointWriteError:
    """The one line that says why ``rank`` could not write (``action``) ``file`` of checkpoint ``step`` in
    ``directory``.

    The cause is the ``errno`` of the ``OSError`` in ``error``'s chain (torch.save's zip writer reports a failed
    write as ``RuntimeError: ... unexpected pos N vs M``, the ``OSError`` in its context); without one, a file
    system with no free space left is taken for full (ENOSPC), else ``error``'s own first line is given.
    """
    free = error.free_bytes if isinstance(error, _FailedWrite) else free_bytes(directory)
    if isinstance(error, _FailedWrite):
        error = error.cause
    cause = _os_error(error)
    code = cause.errno if cause is not None else errno.ENOSPC if free == 0 else None
    if code == errno.ENOSPC:
        reason = "the disk is full (ENOSPC)"
        if cause is None:
            reason += f" (no free space left after: {first_line(error)})"
    elif code is not None:
        reason = f"{os.strerror(code).lower()} ({errno.errorcode.get(code, code)})"
    else:
        reason = first_line(error)
    room = "" if free is None else f", {format_bytes(free)} free there"
    complete = [s for s, _ in complete_checkpoints(directory)]
    kept = (f"the checkpoints there are untouched (the newest complete one: step {complete[-1]})" if complete else
            "no earlier complete checkpoint is there")
    return CheckpointWriteError(f"checkpoint step {step} could not be written to {directory / step_dir_name(step)}: "
                                f"{reason}; rank {rank} was {action} {file}{room}; {kept}", code)


def _os_error(error: BaseException) -> OSError | None:
    """The first ``OSError`` with an ``errno`` in ``error``, its cause and its context, or None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [e.__cause__, e.__context__]
    return None


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def fsync_path(path: Path) -> None:
    """Make ``path`` durable: a file's bytes, or the renames inside a directory (POSIX; a no-op where it
    cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _complete(directory: Path, tmp: Path, final: Path, step: int, reports: list[dict[str, Any]],
              meta: dict[str, Any]) -> None:
    """Rank 0: check every rank's report, write the manifest, rename the step directory into place."""
    steps = {r: rep["step"] for r, rep in enumerate(reports)}
    if len(set(steps.values())) > 1:
        raise CheckpointError(f"ranks disagree about the step to save: {_by_value(steps)}")
    writer: dict[str, int] = {}
    files: dict[str, Any] = {}
    names: dict[str, Any] = {}
    for rank, rep in enumerate(reports):
        for file, entry in rep["files"].items():
            if file in writer:
                raise CheckpointError(
                    f"checkpoint step {step}: {file} is written by ranks {writer[file]} and {rank}; every layer "
                    "needs exactly one owner (pass owned_names so that one holder of each layer writes it)")
            writer[file] = rank
            files[file] = {"bytes": entry["bytes"], "sha256": entry["sha256"], "rank": rank}
            for name, described in entry["names"].items():
                names[name] = {"file": file, **described}
    for file, entry in files.items():
        try:
            size = (tmp / file).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint step {step}: {file}, written by rank {entry['rank']}, is not visible to rank 0 in "
                f"{tmp}; the checkpoint directory must be on a file system that every rank shares") from None
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint step {step}: {file} in {tmp} has {size} bytes, rank "
                                  f"{entry['rank']} wrote {entry['bytes']}")
    for stale in tmp.iterdir():  # left by an interrupted save of the same step
        if stale.name not in files:
            _remove(stale)
    manifest = {
        "format": FORMAT, "version": VERSION, "step": step, "world_size": len(reports),
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "files": dict(sorted(files.items(), key=lambda kv: _natural_key(kv[0]))),
        "tensors": dict(sorted(names.items(), key=lambda kv: _natural_key(kv[0]))),
        "meta": meta,
    }
    try:
        _write_manifest(tmp / MANIFEST, manifest)
    except _FailedWrite as e:
        raise write_failure(e, directory, step, 0, MANIFEST) from None
    fsync_path(tmp)
    replaced = directory / f".{final.name}.replaced"
    try:
        if final.exists():
            _remove(replaced)
            os.replace(final, replaced)
        os.replace(tmp, final)
    except OSError as e:
        raise write_failure(e, directory, step, 0, tmp.name, "renaming") from None
    fsync_path(directory)
    _remove(replaced)


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    _write_text_atomic(path, json.dumps(manifest, indent=1) + "\n")


def _prune(directory: Path, keep: int, current: int) -> None:
    """Keep the ``keep`` newest complete checkpoints and step ``current``; clear leftovers of older saves.

    Leftovers (``.step-N.tmp``, ``.replaced``, ``.deleting``) of steps after ``current`` stay: the other
    ranks, already released, might be writing the next save.
    """
    complete = complete_checkpoints(directory)
    kept = {step for step, _ in complete[-keep:]} | {current}
    doomed = [path for step, path in complete if step not in kept]
    for entry in directory.iterdir():
        match = _LEFTOVER.match(entry.name)
        if match and int(match.group(1)) <= current and entry.is_dir():
            doomed.append(entry)
    for path in doomed:
        try:
            if not path.name.startswith("."):  # out of sight first: a crash mid-delete leaves nothing that looks whole
                hidden = directory / f".{path.name}.deleting"
                os.replace(path, hidden)
                path = hidden
            shutil.rmtree(path)
        except OSError as e:
            warnings.warn(f"could not remove old checkpoint {path}: {e}", RuntimeWarning, stacklevel=3)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ---------------------------------------------------------------------------
# the barrier: the process group's store, with timeouts that name ranks
# ---------------------------------------------------------------------------


class _Rendezvous:
    """Gather the ranks' file lists at rank 0 and hand its verdict back, through the default group's store.

    Without torch.distributed (or with one rank) every method is immediate. Keys live in the job
    store (``hetrain.distributed.store``) under ``checkpoint/{k}/``, ``k`` counting this process's
    saves (the same on every rank, since a save is collective): ``arrived/{rank}`` (that rank's
    report), ``done/0`` (rank 0, once ``step-N/`` is in place), ``left/{rank}`` (a rank saw it; rank 0 returns only
    after every ``left`` where it serves the store), ``error/{rank}`` (an error a rank
    posts, which every other rank raises at once).
    """

    def __init__(self, step: int, timeout_s: float) -> None:
        self.step, self.timeout_s = step, timeout_s
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.barrier: Barrier | None = None
        if self.world > 1:
            # The store the default group was set up with (torchrun's, or env:// / tcp:// / file://).
            # No tensor collective is used, so this works the same under Gloo and NCCL.
            store = JobStore.of_default_group(f"checkpoint/{next(_SAVES)}")
            if store is not None:
                self.barrier = Barrier(store, self.rank, self.world, timeout_s)

    def gather(self, report: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Post ``report``; wait for every rank's. Rank 0 gets all reports (by rank), the others ``None``."""
        if self.barrier is None:
            return [report]
        with self._named():
            self.barrier.arrive("arrived", json.dumps(report))
            self.barrier.wait("arrived", "reach the checkpoint barrier")
            if self.rank != 0:
                return None
            return [json.loads(self.barrier.store.get(f"arrived/{r}")) for r in range(self.world)]

    def done(self) -> None:
        """On rank 0, once ``step-N/`` is in place: tell the others. Where rank 0 serves the store, it then
        waits until every rank has seen that (``left``): a rank 0 that returned and exited at once would take
        the store with it while a slower rank still polls it (at the last save of a job)."""
        if self.barrier is not None:
            with self._named():
                self.barrier.arrive("done")
                if hosts_store(self.rank):
                    self.barrier.wait("left", "confirm the checkpoint (rank 0 serves the job's store)",
                                      ranks=list(range(1, self.world)))

    def wait_done(self) -> None:
        if self.barrier is not None:
            with self._named():
                self.barrier.wait("done", "complete the checkpoint (manifest and rename)", ranks=[0])
                self.barrier.arrive("left")

    def abort(self, message: str) -> None:
        """Post an error so the other ranks raise it at once instead of waiting for this rank."""
        if self.barrier is not None:
            with contextlib.suppress(Exception):
                self.barrier.store.post_error(self.rank, message)

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """Barrier and store errors as CheckpointErrors that name the step and the ranks; a timeout is posted."""
        try:
            yield
        except BarrierError as e:
            if e.failed:
                raise CheckpointError(f"rank {self.rank} stops: {e.failed[min(e.failed)]}") from None
            message = (f"checkpoint step {self.step}: {_ranks(e.late)} did not {e.what} within "
                       f"{self.timeout_s:g} s (rank {self.rank} waited)")
            self.abort(message)
            raise CheckpointError(message) from None
        except StoreError as e:  # the store's host (rank 0 or the torchrun agent) went away
            raise CheckpointError(f"checkpoint step {self.step}: rank {self.rank} lost the process group's "
                                  f"store: {first_line(e.cause)}") from None


# ---------------------------------------------------------------------------
# find and load
# ---------------------------------------------------------------------------


def latest_checkpoint(directory: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The newest complete checkpoint in ``directory`` as ``(step, path)``, or ``None``.

    Complete means a ``step-NNNNNNNN/`` directory with a readable manifest; interrupted
    saves (hidden ``.step-*.tmp/``, or a step directory without manifest) are ignored.

    Example:
        >>> found = latest_checkpoint("ckpt")                                   # doctest: +SKIP
        >>> start = 0 if found is None else found[0]                            # doctest: +SKIP
    """
    for step, path in reversed(_step_dirs(Path(directory))):
        try:
            _read_manifest(path, step)
        except CheckpointError as e:
            if (path / MANIFEST).exists():  # a manifest that exists but cannot be read is worth a word
                warnings.warn(f"skipping {path}: {e}", RuntimeWarning, stacklevel=2)
            continue
        return step, path
    return None


def load_manifest(directory: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The manifest of checkpoint ``step`` (default: the newest complete one) as a dict.

    Keys: ``format``, ``version``, ``step``, ``world_size``, ``saved_at``, ``torch_version``,
    ``files`` (``{file: {bytes, sha256, rank}}``), ``tensors`` (``{name: {file, shape, dtype,
    optimizer_state}}``), ``meta``.
    """
    return _read_manifest(_find(Path(directory), step), step)


def load_checkpoint(
    directory: str | os.PathLike[str],
    names: Iterable[str],
    step: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]:
    """Read the parameters ``names`` (global names) and their optimizer state from a checkpoint.

    Opens only the files that hold ``names``, checks each one's size and SHA-256 against the
    manifest, and loads it with ``torch.load(weights_only=True)`` onto the CPU. Needs no
    process group: every rank reads what its plan holds, whatever plan wrote the checkpoint.

    Args:
        directory: the directory ``save_checkpoint`` wrote into.
        names: the global parameter names to read (``layers.3.weight``, ...).
        step: which checkpoint; default the newest complete one (``latest_checkpoint``).

    Returns:
        ``(tensors, optimizer_state, meta)``: tensors by name (CPU); optimizer state by name,
        only for names that had some; the ``meta`` given to ``save_checkpoint``.

    Raises:
        CheckpointError: no such checkpoint, a name it does not hold (named, with the step and
            what it holds), or a file that is missing, truncated or damaged (named).

    Example:
        >>> mine = [n for n, _ in stage.named_parameters()]                     # doctest: +SKIP
        >>> tensors, state, meta = load_checkpoint("ckpt", mine)                 # doctest: +SKIP
    """
    if isinstance(names, str):
        raise TypeError(f"names must be a collection of names, not one string ({names!r})")
    path = _find(Path(directory), step)
    manifest = _read_manifest(path, step)
    held: dict[str, Any] = manifest["tensors"]
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in held]
    if missing:
        raise CheckpointError(_missing_message(missing, manifest, path))
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(held[name]["file"], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, dict[str, Any]] = {}
    for file, group in by_file.items():
        content = _read_layer_file(path / file, manifest["files"].get(file))
        for name in group:
            try:
                tensors[name] = content["tensors"][name]
            except (KeyError, TypeError):
                raise CheckpointError(f"{path / file} does not hold {name!r}, which the manifest puts there") from None
            state = content.get("optimizer_state", {}).get(name)
            if state:
                optimizer_state[name] = state
    return tensors, optimizer_state, manifest["meta"]


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Every ``(step, path)`` in ``directory`` whose step directory has a manifest file, oldest first (whether
    the manifest reads, and its files match it, is not asked)."""
    return [(s, p) for s, p in _step_dirs(directory) if (p / MANIFEST).is_file()]


def _find(directory: Path, step: int | None) -> Path:
    if step is None:
        latest = latest_checkpoint(directory)
        if latest is None:
            raise CheckpointError(f"no complete checkpoint in {directory}{_incomplete_note(directory)}")
        return latest[1]
    path = directory / step_dir_name(step)
    if not (path / MANIFEST).is_file():
        steps = [s for s, _ in complete_checkpoints(directory)]
        have = f"complete checkpoints: steps {', '.join(map(str, steps))}" if steps else "no complete checkpoint"
        why = " (its directory has no manifest: the save was interrupted)" if path.is_dir() else ""
        raise CheckpointError(f"no complete checkpoint of step {step} in {directory}{why}; {have}"
                              f"{_incomplete_note(directory)}")
    return path


def _incomplete_note(directory: Path) -> str:
    if not directory.is_dir():
        return " (the directory does not exist)"
    partial = sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))
    return f"; interrupted saves: {', '.join(partial)}" if partial else ""


def _read_manifest(path: Path, step: int | None) -> dict[str, Any]:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the save of this checkpoint was interrupted") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} cannot be read: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a hetrain checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {manifest.get('version')}; this hetrain reads {VERSION}")
    if step is not None and manifest.get("step") != step:
        raise CheckpointError(f"{file} says step {manifest.get('step')}, its directory says {step}")
    for key in ("files", "tensors", "meta"):
        if not isinstance(manifest.get(key), dict):
            raise CheckpointError(f"{file} lacks its {key!r} table")
    return manifest


def check_file(file: Path, expected: Mapping[str, Any]) -> str | None:
    """Whether ``file`` has the size and SHA-256 its manifest entry ``expected`` gives: None, or what is wrong
    in one clause naming the file (``.../layers.1.pt is damaged: its SHA-256 differs from the manifest's``)."""
    try:
        size, digest = _digest(file)
    except FileNotFoundError:
        return f"{file} is missing (the manifest lists it, written by rank {expected.get('rank')})"
    except OSError as e:
        return f"{file} cannot be read: {e.strerror or e}"
    if size != expected["bytes"]:
        return f"{file} is truncated or damaged: {size} bytes, the manifest says {expected['bytes']}"
    if digest != expected["sha256"]:
        return f"{file} is damaged: its SHA-256 differs from the manifest's"
    return None


def _read_layer_file(file: Path, expected: Mapping[str, Any] | None) -> dict[str, Any]:
    if expected is None:
        raise CheckpointError(f"{file.parent / MANIFEST} lists no entry for {file.name}")
    wrong = check_file(file, expected)
    if wrong is not None:
        raise CheckpointError(wrong)
    try:
        content = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{file} cannot be loaded: {e}") from None
    if not isinstance(content, dict) or not isinstance(content.get("tensors"), dict):
        raise CheckpointError(f"{file} is not a hetrain layer file")
    return content


def _missing_message(missing: list[str], manifest: dict[str, Any], path: Path) -> str:
    held = list(manifest["tensors"])
    hint = difflib.get_close_matches(missing[0], held, n=1)
    return (f"checkpoint step {manifest['step']} ({path}) has no parameter {_preview(missing)}; it holds "
            f"{_describe_names(held)}" + (f"; did you mean {hint[0]!r}?" if hint else ""))


def _describe_names(names: list[str]) -> str:
    """``16 parameters: layers 0-7`` (plus names outside ``layers.{i}.``)."""
    layers = sorted({int(m.group(1).rsplit(".", 1)[1]) for n in names if (m := _LAYER.match(n))})
    others = sorted(n for n in names if not _LAYER.match(n))
    parts = [f"layers {_ranges(layers)}"] if layers else []
    if others:
        parts.append(_preview(others))
    return f"{len(names)} parameter{'s' if len(names) != 1 else ''}" + (f": {'; '.join(parts)}" if parts else "")


# ---------------------------------------------------------------------------
# words
# ---------------------------------------------------------------------------


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2, 5, 7-8``."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(values), key=lambda iv: iv[1] - iv[0]):
        vals = [v for _, v in run]
        out.append(str(vals[0]) if len(vals) == 1 else f"{vals[0]}-{vals[-1]}")
    return ", ".join(out)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"


def _preview(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _by_value(by_rank: dict[int, Any]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in by_rank.items():
        groups.setdefault(repr(value), []).append(rank)
    return "; ".join(f"{_ranks(rs)} {v}" for v, rs in groups.items())


def _natural_key(name: str) -> list[Any]:
    """Sort ``layers.10`` after ``layers.9``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]
