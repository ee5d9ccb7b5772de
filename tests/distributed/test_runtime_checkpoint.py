"""Save under plan A, crash, and resume under plan B by torchrun's restart: the weights of uninterrupted training.

One torchrun job of 3 Gloo ranks, ``--max-restarts 1``::

    attempt 0   plan A: pipeline n0:0 [0,3) -> n0:1 [3,6), GPipe; n0:2 unused (it idles, and joins the
                checkpoint writes); checkpoints at steps 3 and 6; rank 1 dies at the start of step 8
    attempt 1   plan B: VW0 n0:0 [0,6) (5 samples), VW1 n0:1 [0,2) -> n0:2 [2,6) (3 samples in 3), 1F1B;
                resumes by itself from step 6 and trains to step 10 (checkpoints 9 and 10)

The fault (and the switch of plan) is injected by a wrapper script; the runtime
knows nothing of it. SGD with momentum, so the optimizer state must survive too.

And what a resume refuses or skips, in a world of one Gloo process: a checkpoint of
other model settings (one line naming the tensor and both shapes), one already at
or past ``--steps`` (a notice that nothing is trained), and a damaged newest checkpoint
(passed over for the newest intact one, named; none intact: one line naming the files).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import factories
from factories import make_cluster, mlp_digits_profile
from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.models.analytic import build_profile
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.plan import Plan
from hetrain.runtime.state.checkpoint import latest_checkpoint, load_checkpoint, load_manifest
from hetrain.runtime.trainer import build_optimizer_fn

GPT = {"hidden": 32, "heads": 2, "seq_len": 16}
STEPS, EVERY, DIES_AT = 10, 3, 7  # DIES_AT: the 0-based step at whose start rank 1 dies in attempt 0
LR, MOMENTUM = 0.1, 0.9

WRAPPER = textwrap.dedent(f"""
    import os, sys
    from hetrain.runtime import command
    from hetrain.runtime.step import executor

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    plan_a, plan_b, *args = sys.argv[1:]
    if attempt == 0 and os.environ["RANK"] == "1":
        run = executor.Executor.run

        def run_or_die(self, actions, step, inputs, targets):
            if step == {DIES_AT}:
                os._exit(17)
            return run(self, actions, step, inputs, targets)

        executor.Executor.run = run_or_die
    sys.exit(command.main(["--plan", plan_a if attempt == 0 else plan_b, *args]))
""")


def make_plan(vws: list[tuple[list[str], list[int], int, int]], schedule: str) -> Plan:
    return factories.make_plan(make_cluster({"n0": 3}), build_profile("gpt-tiny", **GPT), vws, schedule=schedule,
                               optimizer="momentum")


PLAN_A = make_plan([(["n0:0", "n0:1"], [0, 3, 6], 8, 4)], "gpipe")
PLAN_B = make_plan([(["n0:0"], [0, 6], 5, 1), (["n0:1", "n0:2"], [0, 2, 6], 3, 3)], "1f1b")


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = build_optimizer_fn("momentum", LR, MOMENTUM)(list(net.parameters()))
    data = build_datasets("synthetic", "gpt-tiny", seed=0, **GPT).train  # as the train command builds it
    losses = []
    for x, y in iter_batches(data, 8, seed=0, steps=STEPS):
        opt.zero_grad()
        loss = loss_fn("gpt-tiny")(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses


def test_a_job_restarted_by_torchrun_resumes_under_another_plan(tmp_path: Path, spawn, clean_env) -> None:
    PLAN_A.save(tmp_path / "a.json")
    PLAN_B.save(tmp_path / "b.json")
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    settings = [f"--set={k}={v}" for k, v in GPT.items()]
    p = spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               "--max-restarts", "1", "--monitor-interval", "0.2", str(tmp_path / "wrapper.py"),
               str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--model", "gpt-tiny", "--data", "synthetic",
               *settings, "--steps", str(STEPS), "--lr", str(LR),  # the plans' optimizer: momentum
               "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--metrics-out", str(metrics),
               "--timeout-s", "30", "--no-progress"], {**clean_env, "HETRAIN_NODE": "n0"})
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-4000:]
    # attempt 0 did fail: torchrun reports whichever rank it saw exit first, rank 1 itself
    # (exit 17) or a peer that found rank 1 gone and left with the error naming it
    assert "(exitcode: 17)" in stderr or "rank 1 (n0:1) failed" in stderr, stderr[-4000:]
    assert "resuming at step 6" in stdout, stdout

    want, losses = reference()
    found = latest_checkpoint(ckpt)
    assert found is not None and found[0] == STEPS
    got, state, meta = load_checkpoint(ckpt, list(want))
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"worst relative error {worst:.2e}"
    assert set(state) == {n for n, t in want.items() if t.is_floating_point()}  # every momentum buffer saved
    assert meta["step"] == STEPS and meta["devices"] == PLAN_B.devices_used
    six = load_manifest(ckpt, 6)  # written under plan A, with the unused rank taking part
    assert six["world_size"] == 3 and six["meta"]["devices"] == PLAN_A.devices_used

    rows: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():  # attempt 1 appends; a step run twice keeps its last line
        row = json.loads(line)
        rows[row["step"]] = row
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert [rows[s]["loss"] for s in sorted(rows)] == pytest.approx(losses, rel=1e-5)


# --- resuming what cannot, or need not, be resumed ------------------------------------------------------------

RESUME_STEPS = 2


def train_one_rank(fork_rank, clean_env, plan: Path, ckpt: Path, *args: str) -> tuple[int, str, str]:
    """``hetrain train`` of mlp-digits on synthetic data, a world of one Gloo process; (status, stdout, stderr)."""
    p = fork_rank(["-m", "hetrain.runtime.command", "--plan", str(plan), "--model", "mlp-digits",
                   "--data", "synthetic", "--checkpoint-dir", str(ckpt), "--timeout-s", "30", "--no-progress", *args],
                  clean_env)
    stdout, stderr = p.communicate(timeout=120)
    return p.returncode, stdout, stderr


@pytest.fixture
def trained(tmp_path: Path, fork_rank, clean_env) -> tuple[Path, Path]:
    """A one-stage mlp-digits plan and a checkpoint directory whose newest checkpoint is of step RESUME_STEPS."""
    plan = factories.make_plan(make_cluster({"n0": 1}, name="cpu"), mlp_digits_profile(), [(["n0:0"], [0, 3], 8, 2)],
                               optimizer="momentum")
    plan.save(tmp_path / "plan.json")
    status, _, stderr = train_one_rank(fork_rank, clean_env, tmp_path / "plan.json", tmp_path / "ckpt",
                                       "--steps", str(RESUME_STEPS))
    assert status == 0, stderr[-3000:]
    return tmp_path / "plan.json", tmp_path / "ckpt"


def test_resuming_with_other_model_settings_is_one_line_naming_the_layer_and_both_sizes(trained, fork_rank,
                                                                                       clean_env) -> None:
    """A model of other settings than the plan's is refused before its checkpoint is read (the plan's memory
    and time are another model's); a checkpoint of other shapes under a plan that fits the model is refused
    by ``restore_stage`` (tests/distributed/test_runtime_trainer_parts.py)."""
    plan, ckpt = trained
    status, _, stderr = train_one_rank(fork_rank, clean_env, plan, ckpt, "--steps", "4", "--set", "hidden=[128, 128]")
    assert status == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert ("was made for another model: layer 0 (fc0) of its profile (mlp-digits) has 66,560 bytes of "
            "parameters, model mlp-digits's has 33,280") in errors[0], errors[0]


def test_resuming_at_or_past_the_steps_asked_for_says_nothing_is_trained(trained, fork_rank, clean_env,
                                                                          tmp_path: Path) -> None:
    plan, ckpt = trained
    metrics = tmp_path / "metrics.jsonl"
    for steps in (RESUME_STEPS - 1, RESUME_STEPS):
        status, stdout, stderr = train_one_rank(fork_rank, clean_env, plan, ckpt, "--steps", str(steps),
                                                "--metrics-out", str(metrics))
        assert status == 0, stderr[-3000:]
        assert (f"hetrain train: nothing to train: checkpoint step {RESUME_STEPS} in {ckpt} is already at or past "
                f"--steps {steps}") in stdout, stdout
        assert "validation loss" not in stdout and not metrics.exists()  # nothing run, nothing logged
    assert latest_checkpoint(ckpt) == (RESUME_STEPS, ckpt / "step-00000002")


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path: Path, fork_rank,
                                                                               clean_env) -> None:
    plan = factories.make_plan(make_cluster({"n0": 1}, name="cpu"), mlp_digits_profile(), [(["n0:0"], [0, 3], 8, 2)],
                               optimizer="momentum")
    plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    status, _, stderr = train_one_rank(fork_rank, clean_env, tmp_path / "plan.json", ckpt, "--steps", "2",
                                       "--checkpoint-every", "1")
    assert status == 0, stderr[-3000:]
    damaged = ckpt / "step-00000002" / "layers.1.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))

    status, stdout, stderr = train_one_rank(fork_rank, clean_env, tmp_path / "plan.json", ckpt, "--steps", "3",
                                            "--checkpoint-every", "1")
    assert status == 0, stderr[-3000:]
    assert (f"hetrain: passing over damaged checkpoint step 2 ({damaged} is damaged: its SHA-256 differs from the "
            f"manifest's); resuming from step 1, the newest intact checkpoint in {ckpt}") in stdout.splitlines(), stdout
    assert "resuming at step 1" in stdout, stdout
    assert load_manifest(ckpt, 2)["meta"]["step"] == 2  # written again, intact, on the way to step 3
    assert latest_checkpoint(ckpt) == (3, ckpt / "step-00000003")

    for step in (1, 2, 3):
        (ckpt / f"step-{step:08d}" / "layers.0.pt").write_bytes(b"damaged")
    status, stdout, stderr = train_one_rank(fork_rank, clean_env, tmp_path / "plan.json", ckpt, "--steps", "4")
    assert status == 1, stdout + stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert errors[0].startswith(f"hetrain train: error: no intact checkpoint to resume from in {ckpt}: checkpoint "
                                f"step 3 ({ckpt / 'step-00000003' / 'layers.0.pt'} is truncated or damaged: 7 bytes"), \
        errors[0]
    assert all(f"step-{step:08d}/layers.0.pt" in errors[0] for step in (1, 2, 3))
