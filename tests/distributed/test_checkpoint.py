"""Checkpoints: round trips, interrupted saves, pruning, errors; Gloo ranks save under one plan, load under another.

The multi-process tests run this file as a script on each rank (``python test_checkpoint.py MODE DIR``).
A full disk is a real one: a tmpfs of ``SMALL_DISK_BYTES`` mounted for the test (``small_disk``; skipped
where mounting is not permitted).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hetrain.runtime.state.checkpoint as ckpt
from hetrain.runtime.state.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hetrain.runtime.state.resume import ResumePoint, find_resume

N_LAYERS = 8


def layer_tensors(i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s parameters, from its own seed (as every plan initialises them)."""
    g = torch.Generator().manual_seed(1000 + i)
    return {f"layers.{i}.weight": torch.randn(4, 3 + i, generator=g),
            f"layers.{i}.bias": torch.randn(4, generator=g)}


def layer_state(i: int) -> dict[str, dict[str, Any]]:
    """AdamW-like state for layer ``i``'s parameters."""
    return {name: {"exp_avg": 0.5 * t, "exp_avg_sq": t * t, "step": torch.tensor(7.0)}
            for name, t in layer_tensors(i).items()}


def stage(layers: range) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for i in layers:
        tensors.update(layer_tensors(i))
        state.update(layer_state(i))
    return tensors, state


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        if isinstance(w, dict):
            assert_same(got[name], w)
        else:
            assert torch.equal(got[name], w), name


META = {"step": 10, "data_position": [3, 128], "seeds": {"torch": 1234}, "plan": "2 VWs: 0-4|5-7, 0-1|2-7",
        "loss": 2.25}


# ---------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------


def test_round_trip_of_tensors_optimizer_state_and_meta(tmp_path):
    tensors, state = stage(range(3))
    state.pop("layers.2.bias")  # a parameter without optimizer state
    tensors["head.weight"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    path = save_checkpoint(tmp_path, 10, tensors, state, META)
    assert path == tmp_path / "step-00000010"
    assert sorted(p.name for p in path.iterdir()) == ["head.pt", "layers.0.pt", "layers.1.pt", "layers.2.pt",
                                                     "manifest.json"]
    assert latest_checkpoint(tmp_path) == (10, path)

    got, got_state, meta = load_checkpoint(tmp_path, list(tensors))
    assert_same(got, tensors)
    assert_same(got_state, state)
    assert got["head.weight"].dtype == torch.bfloat16
    assert meta == META

    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 10 and manifest["world_size"] == 1
    assert manifest["tensors"]["layers.1.weight"] == {"file": "layers.1.pt", "shape": [4, 4], "dtype": "float32",
                                                      "optimizer_state": ["exp_avg", "exp_avg_sq", "step"]}
    assert manifest["files"]["layers.0.pt"]["bytes"] == (path / "layers.0.pt").stat().st_size


def test_adamw_resumes_exactly_from_per_name_state(tmp_path):
    """Per-name optimizer state (not torch's positional state_dict) restores AdamW: the next steps match."""
    def build() -> tuple[torch.nn.Sequential, torch.optim.AdamW]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for s in steps:
            x = torch.randn(8, 5, generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(3))
    named = {f"layers.{n}": p for n, p in model.named_parameters()}  # "layers.0.weight", ...
    save_checkpoint(tmp_path, 3, named, {n: opt.state[p] for n, p in named.items()}, {})
    train(model, opt, range(3, 5))

    fresh, fresh_opt = build()
    tensors, state, _ = load_checkpoint(tmp_path, [f"layers.{n}" for n, _ in fresh.named_parameters()])
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(tensors[f"layers.{n}"])
            fresh_opt.state[p] = state[f"layers.{n}"]
    train(fresh, fresh_opt, range(3, 5))
    for (n, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_a_view_is_saved_without_its_whole_storage(tmp_path):
    flat = torch.zeros(1_000_000)
    path = save_checkpoint(tmp_path, 0, {"layers.0.weight": flat[:6].view(2, 3)}, {}, {})
    assert (path / "layers.0.pt").stat().st_size < 10_000


def test_a_save_interrupted_while_writing_files_is_ignored(tmp_path, monkeypatch):
    tensors, state = stage(range(4))
    save_checkpoint(tmp_path, 10, tensors, state, {"step": 10})
    real_save, calls = torch.save, []

    def failing_save(obj: Any, f: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        real_save(obj, f)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint step 20 could not be written to .*step-00000020: "
                       r"disk full \(simulated\); rank 0 was writing layers\.2\.pt, .* free there; the checkpoints "
                       r"there are untouched \(the newest complete one: step 10\)$"):
        save_checkpoint(tmp_path, 20, tensors, state, {"step": 20})
    monkeypatch.undo()

    assert list((tmp_path / ".step-00000020.tmp").iterdir()) == []  # the files written before are removed
    assert not (tmp_path / "step-00000020").exists()
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "step-00000010")
    got, got_state, meta = load_checkpoint(tmp_path, list(tensors))
    assert_same(got, tensors)
    assert_same(got_state, state)
    assert meta == {"step": 10}
    with pytest.raises(CheckpointError, match=r"no complete checkpoint of step 20 .*steps 10.*\.step-00000020\.tmp"):
        load_checkpoint(tmp_path, list(tensors), step=20)

    # the next save of that step goes through and clears the leftovers
    save_checkpoint(tmp_path, 20, dict(list(tensors.items())[:2]), {}, {"step": 20})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010", "step-00000020"]
    assert sorted(p.name for p in (tmp_path / "step-00000020").iterdir()) == ["layers.0.pt", "manifest.json"]


def test_a_crash_before_the_manifest_or_the_rename_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    tensors, state = stage(range(2))
    save_checkpoint(tmp_path, 1, tensors, state, {"n": 1})

    def crash(*args: Any) -> None:
        raise KeyboardInterrupt("killed (simulated)")

    monkeypatch.setattr(ckpt, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, tensors, state, {"n": 2})
    monkeypatch.undo()
    real_replace = os.replace

    def crash_on_directory_rename(src: Any, dst: Any) -> None:
        if Path(dst).name == "step-00000003":
            raise KeyboardInterrupt("killed (simulated)")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_directory_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, tensors, state, {"n": 3})
    monkeypatch.undo()

    (tmp_path / "step-00000004").mkdir()  # a step directory without manifest (copied by hand, say)
    assert latest_checkpoint(tmp_path) == (1, tmp_path / "step-00000001")
    assert load_checkpoint(tmp_path, ["layers.1.bias"])[2] == {"n": 1}


def test_keep_prunes_the_oldest_after_the_new_one_is_complete(tmp_path):
    tensors, state = stage(range(1))
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(tmp_path, step, tensors, state, {"step": step}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000005"]
    # resuming from step 3 and saving step 4 again replaces it; the newer step 5 stays
    save_checkpoint(tmp_path, 4, tensors, state, {"step": 4, "again": True}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000005"]
    assert load_checkpoint(tmp_path, [], step=4)[2] == {"step": 4, "again": True}
    save_checkpoint(tmp_path, 6, tensors, state, {}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000006"]


def test_a_missing_name_is_named_with_the_step_and_what_the_checkpoint_holds(tmp_path):
    tensors, state = stage(range(8))
    owned = {n for n in tensors if int(n.split(".")[1]) < 6}
    save_checkpoint(tmp_path, 30, tensors, state, {}, owned_names=owned)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, ["layers.0.weight", "layers.7.weight"])
    message = str(e.value)
    assert "checkpoint step 30" in message and "'layers.7.weight'" in message
    assert "12 parameters: layers 0-5" in message
    with pytest.raises(CheckpointError, match=r"did you mean 'layers.1.weight'"):
        load_checkpoint(tmp_path, ["layers.1.weigth"])
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*nowhere"):
        load_checkpoint(tmp_path / "nowhere", ["layers.0.weight"])


def test_a_damaged_or_truncated_file_is_named(tmp_path):
    tensors, state = stage(range(3))
    path = save_checkpoint(tmp_path, 5, tensors, state, {})
    damaged, truncated = path / "layers.1.pt", path / "layers.2.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:100])

    with pytest.raises(CheckpointError, match=r"layers\.1\.pt is damaged: its SHA-256"):
        load_checkpoint(tmp_path, ["layers.1.weight"])
    with pytest.raises(CheckpointError, match=r"layers\.2\.pt is truncated or damaged: 100 bytes"):
        load_checkpoint(tmp_path, ["layers.2.bias"])
    got, _, _ = load_checkpoint(tmp_path, ["layers.0.weight"])  # the intact layer still loads
    assert torch.equal(got["layers.0.weight"], tensors["layers.0.weight"])
    (path / "manifest.json").write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert latest_checkpoint(tmp_path) is None


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    tensors, state = stage(range(1))
    with pytest.raises(ValueError, match=r"owned_names has 1 name.*'layers\.9\.bias'"):
        save_checkpoint(tmp_path, 1, tensors, state, {}, owned_names={"layers.9.bias"})
    with pytest.raises(TypeError, match="meta must be JSON-able"):
        save_checkpoint(tmp_path, 1, tensors, state, {"device": torch.device("cpu")})
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        save_checkpoint(tmp_path, -1, tensors, state, {})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# a full disk (a real, small file system)
# ---------------------------------------------------------------------------

SMALL_DISK_BYTES = 1 << 20
BIG = 1 << 19  # float32 elements: 2 MiB, twice the disk


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of ``SMALL_DISK_BYTES`` mounted at ``tmp_path / "disk"``, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = _mount("-t", "tmpfs", "-o", f"size={SMALL_DISK_BYTES}", "tmpfs", str(disk))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {SMALL_DISK_BYTES} B tmpfs here (needs root or CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=True)


def fill(disk: Path) -> Path:
    """Write a file on ``disk`` until it is full (ENOSPC); return it."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    assert ckpt.free_bytes(disk) == 0
    return filler


def leftovers(directory: Path) -> list[str]:
    """Every file under ``directory`` outside its complete step directories (a partial write, a hidden save)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and not p.relative_to(directory).parts[0].startswith("step-"))


def test_a_full_disk_is_one_line_and_the_checkpoint_before_it_stays_whole(small_disk: Path) -> None:
    tensors, state = stage(range(2))
    save_checkpoint(small_disk, 10, tensors, state, {"step": 10})
    manifest = (small_disk / "step-00000010" / "manifest.json").read_bytes()
    free = ckpt.free_bytes(small_disk)
    big = {**tensors, "layers.1.buffer": torch.zeros(BIG)}  # torch.save's zip writer fails: "unexpected pos"
    with pytest.raises(CheckpointWriteError) as failed:
        save_checkpoint(small_disk, 20, big, state, {"step": 20})
    assert str(failed.value) == (
        f"checkpoint step 20 could not be written to {small_disk / 'step-00000020'}: the disk is full (ENOSPC); "
        "rank 0 was writing layers.1.pt, 0 B free there; the checkpoints there are untouched (the newest complete "
        "one: step 10)")
    assert failed.value.errno == errno.ENOSPC

    assert latest_checkpoint(small_disk) == (10, small_disk / "step-00000010")
    assert (small_disk / "step-00000010" / "manifest.json").read_bytes() == manifest
    got, got_state, meta = load_checkpoint(small_disk, list(tensors))  # sizes and SHA-256 checked
    assert_same(got, tensors)
    assert_same(got_state, state)
    assert meta == {"step": 10}
    assert leftovers(small_disk) == []  # layers.0.pt of step 20 and the partial layers.1.pt are removed
    assert ckpt.free_bytes(small_disk) == free
    save_checkpoint(small_disk, 20, tensors, state, {"step": 20})  # room again: the next save goes through
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-00000010", "step-00000020"]


def test_a_manifest_that_does_not_fit_is_named_and_nothing_is_renamed_into_place(small_disk: Path,
                                                                                   monkeypatch) -> None:
    tensors, state = stage(range(2))
    save_checkpoint(small_disk, 10, tensors, state, {"step": 10})
    write_manifest, filled = ckpt._write_manifest, []

    def fill_then_write(path: Path, manifest: dict[str, Any]) -> None:  # the disk fills up just before
        filled.append(fill(small_disk))
        write_manifest(path, manifest)

    monkeypatch.setattr(ckpt, "_write_manifest", fill_then_write)
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step 20 could not be written to .*step-00000020: "
                       r"the disk is full \(ENOSPC\); rank 0 was writing manifest\.json, 0 B free there; "):
        save_checkpoint(small_disk, 20, tensors, state, {"step": 20})
    filled[0].unlink()
    assert latest_checkpoint(small_disk) == (10, small_disk / "step-00000010")
    assert leftovers(small_disk) == []
    assert load_checkpoint(small_disk, list(tensors))[2] == {"step": 10}


def test_a_write_that_fails_for_another_cause_says_which(small_disk: Path) -> None:
    tensors, state = stage(range(1))
    save_checkpoint(small_disk, 10, tensors, state, {})
    assert _mount("-o", "remount,ro", str(small_disk)).returncode == 0
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step 20 could not be written to .*: read-only "
                       r"file system \(EROFS\); rank 0 was writing \.step-00000020\.tmp, .*step 10\)$"):
        save_checkpoint(small_disk, 20, tensors, state, {})
    assert _mount("-o", "remount,rw", str(small_disk)).returncode == 0

    # torch's zip writer without the OSError under it: a disk with no room left is taken for full, else its words
    unexpected = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4432")
    assert "0 B free" not in str(ckpt.write_failure(unexpected, small_disk, 20, 1, "layers.3.pt"))
    assert ": [enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4432; rank 1 was writing " \
        "layers.3.pt" in str(ckpt.write_failure(unexpected, small_disk, 20, 1, "layers.3.pt"))
    fill(small_disk)
    full = ckpt.write_failure(unexpected, small_disk, 20, 1, "layers.3.pt")
    assert full.errno == errno.ENOSPC
    assert ("the disk is full (ENOSPC) (no free space left after: [enforce fail at inline_container.cc:672] . "
            "unexpected pos 4480 vs 4432); rank 1 was writing layers.3.pt, 0 B free there") in str(full)


# ---------------------------------------------------------------------------
# resume: the newest intact checkpoint
# ---------------------------------------------------------------------------

SHA_DIFFERS = "is damaged: its SHA-256 differs from the manifest's"


def damage(file: Path) -> None:
    """Flip one byte in the middle of ``file``."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_a_resume_passes_over_a_damaged_newest_checkpoint_naming_the_file_and_the_step(tmp_path):
    tensors, state = stage(range(3))
    assert find_resume(tmp_path / "nowhere") is None
    for step in (10, 20):
        save_checkpoint(tmp_path, step, tensors, state, {"step": step})
    intact = find_resume(tmp_path)
    assert intact == ResumePoint(20, tmp_path / "step-00000020") and intact.notice() is None

    damage(tmp_path / "step-00000020" / "layers.1.pt")
    resume = find_resume(tmp_path)
    assert resume is not None and (resume.step, resume.path) == (10, tmp_path / "step-00000010")
    assert resume.notice() == (f"passing over damaged checkpoint step 20 ({tmp_path / 'step-00000020' / 'layers.1.pt'} "
                               f"{SHA_DIFFERS}); resuming from step 10, the newest intact checkpoint in {tmp_path}")
    # asked for by name, or as the newest, the damaged checkpoint is refused as before: never loaded
    for step in (20, None):
        with pytest.raises(CheckpointError, match=rf"layers\.1\.pt {SHA_DIFFERS}"):
            load_checkpoint(tmp_path, ["layers.1.weight"], step=step)
    assert load_checkpoint(tmp_path, list(tensors), step=resume.step)[2] == {"step": 10}
    assert (tmp_path / "step-00000020" / "layers.1.pt").is_file()  # left where it is, for a person to look at


def test_with_every_checkpoint_damaged_a_resume_is_refused_in_one_line_naming_the_files(tmp_path):
    tensors, state = stage(range(2))
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, tensors, state, {"step": step})
    damage(tmp_path / "step-00000030" / "layers.0.pt")
    (tmp_path / "step-00000020" / "layers.1.pt").write_bytes(b"short")
    (tmp_path / "step-00000010" / "manifest.json").write_text("{ not json")
    with pytest.raises(CheckpointError) as refused:
        find_resume(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"no intact checkpoint to resume from in {tmp_path}: checkpoint step 30 "
                              f"({tmp_path / 'step-00000030' / 'layers.0.pt'} {SHA_DIFFERS}), checkpoint step 20 "
                              f"({tmp_path / 'step-00000020' / 'layers.1.pt'} is truncated or damaged: 5 bytes, the "
                              f"manifest says "), message
    assert f"checkpoint step 10 ({tmp_path / 'step-00000010' / 'manifest.json'} cannot be read: " in message
    assert message.endswith("; move the damaged step directories aside to start from step 0, or put back intact "
                            "copies of their files")

    (tmp_path / "step-00000020" / "layers.1.pt").unlink()  # a missing file is damage too
    with pytest.raises(CheckpointError, match=r"layers\.1\.pt is missing \(the manifest lists it, written by rank 0\)"):
        find_resume(tmp_path)


def test_ranks_share_the_check_and_resume_from_the_same_checkpoint(tmp_path, fork_rank, clean_env, free_port):
    """Two ranks each hash half the files: a damaged file in rank 1's half sends both back to step 10."""
    tensors, state = stage(range(N_LAYERS))
    newest_damaged, all_damaged = tmp_path / "a", tmp_path / "b"
    for directory in (newest_damaged, all_damaged):
        for step in (10, 20):
            save_checkpoint(directory, step, tensors, state, {"step": step})
    damage(newest_damaged / "step-00000020" / "layers.7.pt")  # the 8th file: rank 1 checks it
    for step in (10, 20):
        damage(all_damaged / f"step-{step:08d}" / "layers.7.pt")
    port = free_port()
    ranks = [fork_rank([__file__, "resume", str(tmp_path)], rank_env(clean_env, r, 2, port))
             for r in range(2)]
    outputs = []
    for r, p in enumerate(ranks):
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, f"rank {r}:\n{stdout}\n{stderr[-3000:]}"
        outputs.append(stdout.splitlines())
    assert outputs[0] == outputs[1]
    resumed, notice, refused = outputs[0]
    assert resumed == "a: step 10"
    damaged = newest_damaged / "step-00000020" / "layers.7.pt"
    assert notice.startswith(f"a: passing over damaged checkpoint step 20 ({damaged} {SHA_DIFFERS}); resuming from "
                             "step 10"), notice
    assert refused.startswith(f"b: no intact checkpoint to resume from in {all_damaged}: checkpoint step 20 ("), refused
    assert "step-00000010/layers.7.pt" in refused


# ---------------------------------------------------------------------------
# Gloo ranks
# ---------------------------------------------------------------------------

# plan A: two VWs of two stages; layer i is written by its holder in VW 0 when i is even, in VW 1 when odd
PLAN_A = {0: range(0, 5), 1: range(5, 8), 2: range(0, 2), 3: range(2, 8)}
VW_OF = {0: 0, 1: 0, 2: 1, 3: 1}
# plan B: one pipeline of four stages, split differently
PLAN_B = {0: range(0, 1), 1: range(1, 4), 2: range(4, 7), 3: range(7, 8)}


def rank_env(env: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_ranks_save_under_plan_a_and_load_under_plan_b(tmp_path, fork_rank, clean_env, free_port):
    port = free_port()
    ranks = [fork_rank([__file__, "plans", str(tmp_path)], rank_env(clean_env, r, 4, port))
             for r in range(4)]
    for r, p in enumerate(ranks):
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, f"rank {r}:\n{stdout}\n{stderr[-3000:]}"
        assert f"rank {r} loaded plan B" in stdout
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000020"]  # keep=1 pruned step 10
    manifest = json.loads((tmp_path / "step-00000020" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    assert {f: e["rank"] for f, e in manifest["files"].items()} == {
        "layers.0.pt": 0, "layers.1.pt": 2, "layers.2.pt": 0, "layers.3.pt": 3,
        "layers.4.pt": 0, "layers.5.pt": 3, "layers.6.pt": 1, "layers.7.pt": 3}
    # plan C: everything on one device, in this process
    want, want_state = stage(range(N_LAYERS))
    got, got_state, meta = load_checkpoint(tmp_path, list(want))
    assert_same(got, want)
    assert_same(got_state, want_state)
    assert meta == {**META, "step": 20}


def test_a_failing_rank_a_shared_file_and_a_missing_rank_are_named(tmp_path, spawn, clean_env, free_port):
    """Two ranks: (1) rank 1 fails before writing, (2) both write layer 0, (3) rank 1 never comes to the save."""
    port = free_port()
    start = time.monotonic()
    ranks = [spawn([sys.executable, __file__, "failures", str(tmp_path)], rank_env(clean_env, r, 2, port))
             for r in range(2)]
    stdout, stderr = ranks[0].communicate(timeout=60)
    assert ranks[0].returncode == 3, f"{stdout}\n{stderr[-3000:]}"
    lines = stdout.splitlines()
    assert lines[0].startswith("rank 0 stops: rank 1 failed to write its part of checkpoint step 5: owned_names")
    assert float(lines[1]) < 5  # told at once, not after timeout_s = 20
    assert lines[2] == ("checkpoint step 6: layers.0.pt is written by ranks 0 and 1; every layer needs exactly one "
                        "owner (pass owned_names so that one holder of each layer writes it)")
    assert lines[3] == "checkpoint step 10: rank 1 did not reach the checkpoint barrier within 1 s (rank 0 waited)"
    assert time.monotonic() - start < 30
    assert "rank 1 stops: checkpoint step 6: layers.0.pt is written by ranks 0 and 1" in ranks[1].stdout.readline()
    assert latest_checkpoint(tmp_path) is None
    assert not any(p.name.startswith("step-") for p in tmp_path.iterdir())


def test_a_full_disk_stops_every_rank_with_the_same_named_cause(small_disk, fork_rank, clean_env, free_port):
    """Two ranks on a 1 MiB disk: step 10 fits; at step 20 rank 1 overflows it, at 30 rank 0, at 40 both; 50 fits."""
    port = free_port()
    ranks = [fork_rank([__file__, "full_disk", str(small_disk)], rank_env(clean_env, r, 2, port))
             for r in range(2)]
    lines: dict[int, list[str]] = {}
    for r, p in enumerate(ranks):
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, f"rank {r}:\n{stdout}\n{stderr[-3000:]}"
        lines[r] = stdout.splitlines()
    final = {step: small_disk / f"step-{step:08d}" for step in (20, 30, 40)}
    full = "the disk is full (ENOSPC); rank {} was writing {}, 0 B free there; the checkpoints there are " \
           "untouched (the newest complete one: step 10)"
    rank1 = f"checkpoint step 20 could not be written to {final[20]}: {full.format(1, 'layers.4.pt')}"
    rank0 = f"checkpoint step 30 could not be written to {final[30]}: {full.format(0, 'layers.0.pt')}"
    assert lines[0][:2] == [f"20: rank 0 stops: {rank1}", f"30: {rank0}"], lines[0]
    assert lines[1][:2] == [f"20: {rank1}", f"30: rank 1 stops: {rank0}"], lines[1]
    for r in (0, 1):  # both overflow: each names its own file
        assert lines[r][2] == (f"40: checkpoint step 40 could not be written to {final[40]}: "
                               f"{full.format(r, f'layers.{4 * r}.pt')}"), lines[r]
    told_s = [float(x) for x in lines[0][3:] + lines[1][3:]]
    assert len(told_s) == 2 and max(told_s) < 5  # the rank that waited was told at once, not after timeout_s = 20

    assert sorted(p.name for p in small_disk.iterdir()) == ["step-00000010", "step-00000050"]  # 50 cleared the rest
    want, want_state = stage(range(N_LAYERS))
    for step in (10, 50):
        got, got_state, meta = load_checkpoint(small_disk, list(want), step=step)
        assert_same(got, want)
        assert_same(got_state, want_state)
        assert meta == {"step": step}


def test_the_store_host_returns_from_a_save_only_once_every_rank_has_seen_it_complete(tmp_path, fork_rank,
                                                                                        clean_env, free_port):
    """Rank 0 serves the store and exits the moment its last save returns; rank 1 polls the store slowly
    (as a rank starved of CPU does): it must still see the save complete, not lose the store."""
    port = free_port()
    ranks = [fork_rank([__file__, "last_save", str(tmp_path)], rank_env(clean_env, r, 2, port)) for r in range(2)]
    for r, p in enumerate(ranks):
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, f"rank {r}:\n{stdout}\n{stderr[-3000:]}"
        assert stdout.splitlines() == [f"rank {r} saved step 10"]
    want, want_state = stage(range(N_LAYERS))
    got, got_state, _ = load_checkpoint(tmp_path, list(want), step=10)
    assert_same(got, want)
    assert_same(got_state, want_state)


def _last_save(directory: Path, rank: int) -> None:
    """Rank 1 looks at the store only every 0.5 s; rank 0 leaves the process (and the store) at once after the save."""
    import hetrain.distributed.barrier as barrier

    if rank == 1:
        poll = barrier.poll

        def slow_poll(*args: Any, **kwargs: Any) -> bool:
            time.sleep(0.5)
            return poll(*args, **kwargs)
        barrier.poll = slow_poll  # type: ignore[assignment]
    tensors, state = stage(range(4 * rank, 4 * rank + 4))
    save_checkpoint(directory, 10, tensors, state, {"step": 10}, timeout_s=20)
    print(f"rank {rank} saved step 10", flush=True)
    os._exit(0)


def _full_disk(directory: Path, rank: int) -> None:
    """Each rank holds four layers; a big buffer in a rank's last layer overflows the disk."""
    tensors, state = stage(range(4 * rank, 4 * rank + 4))
    big = {**tensors, f"layers.{4 * rank}.buffer": torch.zeros(BIG)}
    save_checkpoint(directory, 10, tensors, state, {"step": 10}, timeout_s=20)
    told = []
    for step, overflowing in ((20, {1}), (30, {0}), (40, {0, 1})):
        mine = rank in overflowing
        t0 = time.monotonic()
        try:  # a rank that does not overflow writes nothing: it fails only by the other's failure, at the barrier
            save_checkpoint(directory, step, big if mine else tensors, state, {"step": step},
                            owned_names=None if mine else set(), timeout_s=20)
        except CheckpointError as e:
            print(f"{step}: {e}", flush=True)
            if not mine:
                told.append(time.monotonic() - t0)
    # both ranks' step-40 writes over before step 50 needs the room: the rank that failed first freed its files,
    # and the other, still writing its big buffer, filled that room again (CI: step 50 then met a full disk)
    import torch.distributed as dist
    dist.barrier()
    save_checkpoint(directory, 50, tensors, state, {"step": 50}, timeout_s=20)
    for s in told:
        print(f"{s:.2f}", flush=True)


def _resume(directory: Path) -> None:
    """``find_resume`` of ``a`` (newest damaged), then of ``b`` (all damaged), then leave at once, as a refused run
    does: rank 0, the store's host, only once rank 1 has read what it needs."""
    resume = find_resume(directory / "a", timeout_s=20)
    assert resume is not None
    print(f"a: step {resume.step}\na: {resume.notice()}", flush=True)
    try:
        find_resume(directory / "b", timeout_s=20)
    except CheckpointError as e:
        print(f"b: {e}", flush=True)
        os._exit(0)
    os._exit(1)


def _worker(mode: str, directory: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    if mode == "full_disk":
        _full_disk(directory, rank)
        dist.barrier()
        dist.destroy_process_group()
        return
    if mode == "resume":
        _resume(directory)
    if mode == "last_save":
        _last_save(directory, rank)
    if mode == "failures":
        tensors, state = stage(range(2))
        t0 = time.monotonic()
        try:  # (1) rank 1 fails before it writes: both stop at once
            save_checkpoint(directory, 5, tensors, state, {}, owned_names={"layers.9.bias"} if rank else None,
                            timeout_s=20)
        except (CheckpointError, ValueError) as e:
            if rank == 0:
                print(f"{e}\n{time.monotonic() - t0:.2f}", flush=True)
        try:  # (2) both ranks write layer 0
            save_checkpoint(directory, 6, tensors, state, {}, timeout_s=20)
        except CheckpointError as e:
            print(e, flush=True)
        if rank == 1:  # (3) joined the group, never comes to the next save; the test ends this process
            time.sleep(60)
            os._exit(0)
        try:
            save_checkpoint(directory, 10, tensors, state, META, timeout_s=1.0)
        except CheckpointError as e:
            print(e, flush=True)
            os._exit(3)
        os._exit(0)

    held = PLAN_A[rank]
    tensors, state = stage(held)
    owned = {n for n in tensors if int(n.split(".")[1]) % 2 == VW_OF[rank]}
    for step in (10, 20):
        path = save_checkpoint(directory, step, tensors, state, {**META, "step": step}, owned_names=owned, keep=1)
        assert path.name == f"step-{step:08d}" and (path / "manifest.json").is_file()

    want, want_state = stage(PLAN_B[rank])
    got, got_state, meta = load_checkpoint(directory, list(want))
    assert_same(got, want)
    assert_same(got_state, want_state)
    assert meta == {**META, "step": 20}
    print(f"rank {rank} loaded plan B layers {PLAN_B[rank].start}-{PLAN_B[rank].stop - 1}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
