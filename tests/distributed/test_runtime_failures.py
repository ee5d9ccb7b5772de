"""A dead, stuck or misplaced rank ends the job with an error that names it, never a silent hang.

Ranks are started one by one with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR...), not under torchrun, whose agent would kill the survivors as soon
as one rank dies and so hide what they report.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from factories import make_cluster, make_plan, mlp_digits_profile
from hetrain.models.registry import build_layers
from hetrain.models.user import resolve_model
from hetrain.plan import Plan, load_plan
from hetrain.runtime.command import run_train
from hetrain.runtime.config import TrainConfig
from hetrain.runtime.state.checkpoint import save_checkpoint
from hetrain.runtime.step.executor import StageModule

#: a rank of ``hetrain train``, forked from the fork server (the ``fork_rank`` fixture)
TRAIN = ["-m", "hetrain.runtime.command"]


def pipeline_plan(p: int, nodes: tuple[str, ...] = ("n0",)) -> Plan:
    """mlp-digits (3 layers) as one pipeline of ``p`` stages over devices n0:0..n0:{p-1}, 1F1B, 4 micro-batches."""
    bounds = {1: [0, 3], 2: [0, 1, 3], 3: [0, 1, 2, 3]}[p]
    return make_plan(make_cluster(dict.fromkeys(nodes, p)), mlp_digits_profile(),
                     [([f"n0:{j}" for j in range(p)], bounds, 16, 4)])


def start_ranks(fork_rank, clean_env, port: int, world: int, args: list[str], node: str | None = "n0") -> list:
    env = {**clean_env, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if node is not None:
        env["HETRAIN_NODE"] = node
    return [fork_rank([*TRAIN, *args], {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]


def wait_for_lines(path: Path, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {count} lines within {timeout_s} s")


def train_args(tmp_path: Path, timeout_s: float) -> list[str]:
    plan = pipeline_plan(3)
    plan.save(tmp_path / "plan.json")
    return ["--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--data", "synthetic",
            "--steps", "1000000", "--metrics-out", str(tmp_path / "metrics.jsonl"), "--timeout-s", str(timeout_s),
            "--no-progress"]


def test_a_killed_rank_is_named_by_the_others_within_the_timeout(tmp_path, fork_rank, clean_env, free_port):
    timeout_s = 10.0
    ranks = start_ranks(fork_rank, clean_env, free_port(), 3, train_args(tmp_path, timeout_s))
    wait_for_lines(tmp_path / "metrics.jsonl", 3, 60)  # training is under way
    killed_at = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGKILL)  # the middle stage: both neighbours wait for it
    for r in (0, 2):
        _, stderr = ranks[r].communicate(timeout=timeout_s + 20)
        assert ranks[r].returncode == 1, stderr[-3000:]
        assert time.monotonic() - killed_at < timeout_s + 10
        assert "hetrain train: error: rank" in stderr, stderr[-3000:]
        assert "rank 1 (n0:1)" in stderr, stderr[-3000:]
        assert "(step " in stderr and any(k in stderr for k in ("RECV_", "SEND_", "STEP", "ALLREDUCE")), stderr


def test_a_stuck_rank_is_named_after_the_timeout(tmp_path, fork_rank, clean_env, free_port):
    timeout_s = 3.0
    ranks = start_ranks(fork_rank, clean_env, free_port(), 3, train_args(tmp_path, timeout_s))
    wait_for_lines(tmp_path / "metrics.jsonl", 3, 60)
    stopped_at = time.monotonic()
    os.kill(ranks[2].pid, signal.SIGSTOP)  # the last stage hangs (its heartbeat stops too)
    try:
        _, stderr = ranks[1].communicate(timeout=timeout_s + 20)
        waited = time.monotonic() - stopped_at
        assert ranks[1].returncode == 1, stderr[-3000:]
        assert timeout_s - 0.5 < waited < timeout_s + 10
        # rank 1 waited for rank 2: a receive (from the last stage) or its send's completion
        assert "no answer from rank 2 (n0:2) within 3 s, waiting at " in stderr, stderr[-3000:]
        assert "rank 2 (n0:2): silent for" in stderr, stderr[-3000:]
        _, stderr0 = ranks[0].communicate(timeout=timeout_s + 20)
        assert ranks[0].returncode == 1, stderr0[-3000:]
        assert "rank 1 (n0:1)" in stderr0, stderr0[-3000:]
        assert "rank 2 (n0:2): silent for" in stderr0, stderr0[-3000:]  # the culprit, though not rank 0's peer
    finally:
        os.kill(ranks[2].pid, signal.SIGCONT)


def dp_args(tmp_path: Path, timeout_s: float) -> list[str]:
    """Pure data parallelism of mlp-digits on n0:0 and n0:1: its one segment is a whole stage on both, which DDP's
    reducer all-reduces inside the backward (``runtime.sync.reducer``)."""
    vws = [(["n0:0"], [0, 3], 8, 1), (["n0:1"], [0, 3], 8, 1)]
    plan = make_plan(make_cluster({"n0": 2}), mlp_digits_profile(), vws, first_bucket_bytes=20_000,
                     bucket_bytes=60_000)
    plan.save(tmp_path / "plan.json")
    return ["--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--data", "synthetic",
            "--steps", "1000000", "--metrics-out", str(tmp_path / "metrics.jsonl"), "--timeout-s", str(timeout_s),
            "--no-progress"]


#: how the survivor names a DP peer that failed during the reducer's all-reduce (most of a DP step), or, where the
#: death fell elsewhere (the step's loss sum), the wait that met it
REDUCER_FAILED = "(DDP's reducer) among rank 0 (n0:0), rank 1 (n0:1) "
PEER_WAIT = ("rank 1 (n0:1) failed or closed its connection", "no answer from rank 1 (n0:1)")


def test_a_killed_dp_peer_is_named_from_the_reducers_all_reduce(tmp_path, fork_rank, clean_env, free_port):
    timeout_s = 10.0
    ranks = start_ranks(fork_rank, clean_env, free_port(), 2, dp_args(tmp_path, timeout_s))
    wait_for_lines(tmp_path / "metrics.jsonl", 3, 60)
    killed_at = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGKILL)
    _, stderr = ranks[0].communicate(timeout=timeout_s + 20)
    assert ranks[0].returncode == 1, stderr[-3000:]
    assert time.monotonic() - killed_at < timeout_s + 10
    assert "hetrain train: error: rank 0 (n0:0): " in stderr, stderr[-3000:]
    assert f"{REDUCER_FAILED}failed" in stderr or any(k in stderr for k in PEER_WAIT), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_stuck_dp_peer_is_named_from_the_reducers_all_reduce_after_the_timeout(tmp_path, fork_rank, clean_env,
                                                                                  free_port):
    timeout_s = 3.0
    ranks = start_ranks(fork_rank, clean_env, free_port(), 2, dp_args(tmp_path, timeout_s))
    wait_for_lines(tmp_path / "metrics.jsonl", 3, 60)
    stopped_at = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGSTOP)  # it hangs (its heartbeat stops too)
    try:
        _, stderr = ranks[0].communicate(timeout=timeout_s + 20)
        waited = time.monotonic() - stopped_at
        assert ranks[0].returncode == 1, stderr[-3000:]
        assert timeout_s - 0.5 < waited < timeout_s + 10, waited
        assert "hetrain train: error: rank 0 (n0:0): " in stderr, stderr[-3000:]
        assert f"{REDUCER_FAILED}did not finish within 3 s" in stderr or PEER_WAIT[1] in stderr, stderr[-3000:]
        assert "rank 1 (n0:1): silent for" in stderr, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
    finally:
        os.kill(ranks[1].pid, signal.SIGCONT)


def test_ranks_on_a_node_the_plan_does_not_know_are_told_what_the_plan_expects(tmp_path, fork_rank, clean_env,
                                                                                 free_port):
    plan = pipeline_plan(2)
    plan.save(tmp_path / "plan.json")
    args = ["--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--data", "synthetic", "--steps", "1",
            "--timeout-s", "20"]
    ranks = start_ranks(fork_rank, clean_env, free_port(), 2, args, node="box")
    for p in ranks:
        _, stderr = p.communicate(timeout=60)
        assert p.returncode == 1, stderr[-3000:]
        assert "the world does not match the plan" in stderr
        assert "rank 0 reports device box:0, which is not in the plan's cluster" in stderr
        assert "no rank drives n0:1 (stage 1 of VW0, layers [1, 3))" in stderr
        assert "nodes n0 (n0:0, n0:1)" in stderr and "rank 0 -> box:0, rank 1 -> box:1" in stderr


def test_a_rank_that_cannot_resume_is_named_by_the_other_in_one_line(tmp_path, fork_rank, clean_env, free_port):
    """The checkpoint is of a model whose stage 1 ([1, 3)) has other widths than the plan's and the model's,
    stage 0 ([0, 1)) not: rank 0 resumes, and stops naming rank 1 rather than failing on a closed connection
    once training starts."""
    pipeline_plan(2).save(tmp_path / "plan.json")
    other = StageModule(build_layers("mlp-digits", seed=0, hidden=[256, 128]))
    save_checkpoint(tmp_path / "ckpt", 4, {n: t.detach() for n, t in other.state_dict().items()}, {}, {"step": 4})
    args = ["--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--data", "synthetic", "--steps", "6",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--timeout-s", "20", "--no-progress"]
    ranks = start_ranks(fork_rank, clean_env, free_port(), 2, args)
    stderr = [p.communicate(timeout=60)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [1, 1], stderr
    for err in stderr:
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    step_dir = tmp_path / "ckpt" / "step-00000004"
    assert (f"hetrain train: error: checkpoint step 4 ({step_dir}) holds 'layers.1.0.weight' of shape [128, 256], "
            "but n0:1's stage has shape [256, 256]") in stderr[1], stderr[1]
    assert (f"hetrain train: error: rank 0 (n0:0) stops: rank 1 (n0:1) could not resume: checkpoint step 4 "
            f"({step_dir}) holds 'layers.1.0.weight'") in stderr[0], stderr[0]


def test_a_rank_whose_layers_are_not_the_plans_is_named_by_the_other(tmp_path, fork_rank, clean_env, free_port):
    """Stage 1's layers are of other widths than the plan's profile counted (``--set``), stage 0's are not:
    rank 1 refuses them in one line, and rank 0, whose layers are right, names it at once rather than at its
    timeout."""
    pipeline_plan(2).save(tmp_path / "plan.json")
    args = ["--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--set", "hidden=[256, 128]",
            "--data", "synthetic", "--steps", "2", "--timeout-s", "30", "--no-progress"]
    start = time.monotonic()
    ranks = start_ranks(fork_rank, clean_env, free_port(), 2, args)
    stderr = [p.communicate(timeout=90)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [1, 1], stderr
    assert time.monotonic() - start < 25, stderr  # not rank 0's 30 s timeout
    for err in stderr:
        assert "Traceback" not in err, err[-3000:]
    assert (f"hetrain train: error: {tmp_path / 'plan.json'} was made for another model: layer 1 (fc1) of its "
            "profile (mlp-digits) has 263,168 bytes of parameters, model mlp-digits's has 131,584") in stderr[1], \
        stderr[1]
    assert "rank 1 (n0:1)" in stderr[0] and "made for another model" in stderr[0], stderr[0]


def test_a_model_that_does_not_fit_the_plan_is_refused(tmp_path, capsys):
    pipeline_plan(1).save(tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")  # refused before any process group:
    assert run_train(plan, resolve_model("gpt-tiny"), TrainConfig(steps=1)) == 1
    assert "model 'gpt-tiny' has 6 layers but the plan (mlp-digits) has 3" in capsys.readouterr().err


def test_a_rank_that_never_starts_is_reported_within_the_timeout(tmp_path, fork_rank, clean_env, free_port):
    pipeline_plan(2).save(tmp_path / "plan.json")
    env = {**clean_env, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "HETRAIN_NODE": "n0", "RANK": "0", "LOCAL_RANK": "0"}
    start = time.monotonic()
    p = fork_rank([*TRAIN, "--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--data", "synthetic",
               "--timeout-s", "2"], env)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 1, stderr[-3000:]
    assert "rank 0 could not join the job within 2 s" in stderr, stderr[-3000:]
    assert "1/2 clients joined" in stderr or "did not all report" in stderr, stderr[-3000:]
    assert time.monotonic() - start < 30


def test_a_bad_label_deep_in_the_data_is_one_line_naming_the_step_and_the_loss(tmp_path, fork_rank, clean_env,
                                                                                 free_port):
    """A target out of range, far enough into the data that the first batches pass: the last stage's loss
    raises mid-training. Both ranks end in one line, the failing one naming the step and the loss function,
    the other naming it as its peer's report; no traceback."""
    pipeline_plan(2).save(tmp_path / "plan.json")
    (tmp_path / "bad_data.py").write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "def dataset():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.randn(256, 64, generator=g)\n"
        "    y = torch.randint(0, 10, (256,), generator=g)\n"
        "    y[200] = 999  # no such class: cross-entropy raises on it\n"
        "    return TensorDataset(x, y)\n")
    args = ["--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--data",
            f"{tmp_path / 'bad_data.py'}:dataset", "--steps", "40", "--timeout-s", "20", "--no-progress",
            "--data-seed", "0"]
    ranks = start_ranks(fork_rank, clean_env, free_port(), 2, args)
    stderr = [p.communicate(timeout=90)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [1, 1], stderr
    for err in stderr:
        assert "Traceback" not in err, err[-3000:]
    failing = [line for line in stderr[1].splitlines() if line.startswith("hetrain train: error:")]
    assert len(failing) == 1, stderr[1]
    assert "on rank 1 (n0:1): the loss function raised IndexError: Target 999 is out of bounds" in failing[0]
    assert failing[0].startswith("hetrain train: error: step ") and "step 0 " not in failing[0], failing[0]
    assert "rank 1 (n0:1)" in stderr[0] and "Target 999 is out of bounds" in stderr[0], stderr[0]


def test_a_layer_that_raises_is_named_by_its_index() -> None:
    import pytest
    import torch
    from torch import nn

    from hetrain.runtime.step.executor import LayerFailure

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("out of cheese\nsecond line")

    for recompute in ((), (4,)):  # run plainly, and inside a checkpointed run
        stage = StageModule([nn.Linear(3, 3), Boom()], first=3, recompute=recompute)
        with pytest.raises(LayerFailure) as err:
            stage(torch.randn(2, 3, requires_grad=True))
        assert err.value.layer == 4 and isinstance(err.value.cause, RuntimeError)
        assert str(err.value) == "layer 4 raised RuntimeError: out of cheese"


def test_a_stage_output_that_cannot_cross_to_the_next_stage_is_named(tmp_path, fork_rank, clean_env, free_port):
    """Layer 0 of the user's model returns a tuple holding None, which a single process runs (the check on
    two samples passes) but which cannot go to the next stage of the plan's pipeline: the layer, the element
    and the way out are named in one line at the first forward; the other rank names the rank that failed."""
    pipeline_plan(2).save(tmp_path / "plan.json")
    (tmp_path / "net.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from torch.utils.data import TensorDataset\n"
        "class First(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(64, 256)\n"
        "    def forward(self, x):\n"
        "        return (torch.relu(self.fc(x)), None)\n"
        "class Second(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(256, 256)\n"
        "    def forward(self, pair):\n"
        "        return torch.relu(self.fc(pair[0]))\n"
        "def build():\n"
        "    return [First(), Second(), nn.Linear(256, 10)]\n"
        "def dataset():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return TensorDataset(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))\n")
    spec = str(tmp_path / "net.py")
    args = ["--plan", str(tmp_path / "plan.json"), "--model", f"{spec}:build", "--data", f"{spec}:dataset",
            "--steps", "2", "--timeout-s", "20", "--no-progress"]
    ranks = start_ranks(fork_rank, clean_env, free_port(), 2, args)
    stderr = [p.communicate(timeout=60)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [1, 1], stderr
    expected = ("layer 0 (fc0) raised TypeError: its output goes to the next stage, which takes a tensor or a tuple "
                "of tensors, but it is a tuple holding NoneType at index 1")
    for err in stderr:
        assert "Traceback" not in err, err[-3000:]
    assert expected in stderr[0], stderr[0]
    # rank 1 names rank 0, with its report where it could still read it (rank 0 hosts the job's store)
    assert "rank 0 (n0:0)" in stderr[1], stderr[1]
