"""``hetrain plan`` on devices smaller than the runtime's reserve (CUDA context, communication buffers): the error
says so with the figures, never a negative capacity."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.cluster import load_cluster
from hetrain.cost import runtime_footprint, tensor_budget
from hetrain.models.analytic import build_profile
from hetrain.units import format_bytes


def plan_error(tmp_path: Path, devices: str, model: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``hetrain plan`` for one node of ``devices``: (status, its one error line)."""
    cluster = tmp_path / "tinymem.toml"
    cluster.write_text(f'name = "tinymem"\n[[node]]\nname = "n1"\ndevices = [{devices}]\n')
    capsys.readouterr()
    code = main(["plan", "--cluster", str(cluster), "--model", model, "--global-batch", "8"])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert not re.search(r"-\d", lines[0]), f"a negative figure: {lines[0]}"
    return code, lines[0]


def test_devices_smaller_than_the_runtime_reserve_are_named_as_such(tmp_path, capsys) -> None:
    code, line = plan_error(tmp_path, '{type="T4", memory="1MB", count=2}', "gpt-tiny", capsys)
    device = load_cluster(tmp_path / "tinymem.toml").devices[0]
    reserved = format_bytes(runtime_footprint(build_profile("gpt-tiny"), device).fixed_bytes)  # 900.0 MB
    assert code == 2
    assert f"each device's 1.0 MB is less than the {reserved} reserved for the CUDA context and runtime" in line, line
    assert "fits no arrangement of cluster 'tinymem': it needs at least 16.5 MB" in line, line


def test_of_devices_that_differ_the_largest_is_named(tmp_path, capsys) -> None:
    _, line = plan_error(tmp_path, '{type="T4", memory="1MB"}, {type="T4", memory="2MB"}', "gpt-tiny", capsys)
    assert "the largest device's (n1:1) 2.0 MB is less than the" in line, line


def test_a_device_without_room_offers_nothing_rather_than_a_negative_amount(tmp_path, capsys) -> None:
    _, line = plan_error(tmp_path, '{type="T4", memory="1MB", count=2}, {type="T4", memory="1GB"}', "mlp", capsys)
    assert "the largest any arrangement offers is 47.6 MB (3 devices" in line, line  # the 1 GB device's room only


def test_a_forced_data_parallel_plan_that_fits_nowhere_names_its_need_per_device_and_the_devices_short(
        tmp_path, capsys) -> None:
    """gpt2-medium on 8 and 6 GB cards, neither TP nor sharding: a pipeline fits, pure data parallelism
    (--strategy dp) does not. The refusal says what dp needs on each device, what ZeRO-2 over every device would,
    and which devices fall short, by type, in one line."""
    cluster = tmp_path / "small8.toml"
    cluster.write_text('name = "small8"\n[[node]]\nname = "n1"\nnic = "25Gbit/s"\n'
                       'devices = [{type="RTX2080", count=4}]\n[[node]]\nname = "n2"\nnic = "25Gbit/s"\n'
                       'devices = [{type="RTX2080", count=2}, {type="RTX2060", count=2}]\n')
    args = ["plan", "--cluster", str(cluster), "--model", "gpt2-medium", "--global-batch", "8", "--time-budget", "0",
            "--max-tp", "1", "--shard", "none"]
    capsys.readouterr()
    assert main([*args, "--strategy", "pp"]) == 0  # the model fits these devices, as a pipeline
    capsys.readouterr()
    assert main([*args, "--strategy", "dp"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    need = re.search(r"Pure data parallelism \(--strategy dp\) holds the whole model on each device: it needs at "
                     r"least ([0-9.]+) GB per device \(", line)
    assert need, line
    profile, devices = build_profile("gpt2-medium"), load_cluster(cluster).devices
    rooms = {d.type_name: tensor_budget(profile, d) for d in devices}  # what a card has for tensors
    assert float(need.group(1)) * 1e9 > max(rooms.values())
    assert re.search(r"with the state and gradients sharded over all 8 devices \(ZeRO-2, --shard "
                     r"optimizer\+gradients\), at least [0-9.]+ [GM]B\.", line), line
    assert f"Short of {need.group(1)} GB: 6 x RTX2080 ({format_bytes(rooms['RTX2080'])} for tensors), 2 x RTX2060 " \
        f"({format_bytes(rooms['RTX2060'])} for tensors)." in line, line
