"""Run one rank's Actions of one iteration: the same Actions the simulator replays.

The executor is an interpreter of ``hetrain.schedule``'s action language; it
holds no schedule of its own. Per micro-batch ``i`` it keeps what the next
actions need::

    RECV_F i   the input activation arrives          -> inputs[i]   (requires grad)
    F i        out = stage(inputs[i])                -> outputs[i]  (last stage: losses[i])
    SEND_F i   post outputs[i] to stage j + 1
    RECV_B i   the gradient of outputs[i] arrives    -> grads[i]
    B i        backward from losses[i], or outputs[i] with grads[i]; the input's gradient -> input_grads[i]
    SEND_B i   post input_grads[i] to stage j - 1
    ALLREDUCE s, STEP   after every B: sum segment s among its owners; wait for the sends, optimizer step
    ALLREDUCE_START s b the ALLREDUCE_STARTs after a B are armed before it runs: each bucket's all-reduce is
                        posted from the backward, once its gradients are final (GradientSync's hooks; for a
                        segment that is a whole stage, DDP's reducer: runtime.sync.reducer)
    ALLREDUCE_WAIT s b  wait for the bucket's all-reduce (a DDP segment's finished within the backward)

The last stage's loss of micro-batch ``i`` counts as ``loss_fn(out, target) * n_i / N``
(``loss_fn`` a mean over the micro-batch, ``n_i`` its samples, ``N`` the global
batch; the backward starts from ``n_i / N`` instead of multiplying), so the
gradients summed over micro-batches and owners are the global batch's mean
gradient, whatever the VWs' mini-batch sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetrain import amp
from hetrain.distributed.health import Health
from hetrain.errors import RunError
from hetrain.models.layers import LayerRange
from hetrain.models.user import describe_error
from hetrain.runtime.lifecycle.roles import Role
from hetrain.runtime.report.metrics import Recorder
from hetrain.runtime.step.p2p import Transport, flatten, grad_slots
from hetrain.runtime.step.tp_transfer import gather_whole, part_like, scatter_parts, shapes_of
from hetrain.runtime.sync.allreduce import GradientSync
from hetrain.runtime.sync.modes import ModeSync
from hetrain.schedule import Action, ActionKind, BucketSync, Compute, SegmentSync, Step, Transfer
from hetrain.timeline import Event

K = ActionKind
LossFn = Callable[[Any, Any], torch.Tensor]


class _At:
    """``"RECV_B 1->0 mb2 from n0:1 (step 7)"``, formatted only when a message needs it."""

    __slots__ = ("action", "step")

    def __init__(self, action: Action, step: int) -> None:
        self.action = action
        self.step = step

    def __str__(self) -> str:
        return f"{self.action} (step {self.step})"


class LayerFailure(RunError):
    """A layer of the user's model (or the loss function, ``layer`` None) raised while a stage ran it.

    Attributes:
        layer: the global index of the layer, or None for the loss function.
        cause: what it raised.
    """

    def __init__(self, layer: int | None, cause: BaseException) -> None:
        self.layer = layer
        self.cause = cause
        super().__init__(self.where())

    def where(self, name: str | None = None) -> str:
        """``layer 4 (block3) raised KeyError: 'x'``: the layer (with its ``name`` where given), or the loss
        function, and the first line of what it raised (``models.user.describe_error``)."""
        if self.layer is None:
            return f"the loss function raised {describe_error(self.cause)}"
        return f"layer {self.layer}{f' ({name})' if name else ''} raised {describe_error(self.cause)}"


# torch.utils.checkpoint stops a recomputation early by raising this through the layers: not a failure
_CONTROL_FLOW: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if isinstance(t, type))


def _run_indexed(layers: Sequence[tuple[int, nn.Module]], x: Any) -> Any:
    """``run_layers`` over ``(global index, layer)`` pairs, a failure named by its layer (``LayerFailure``)."""
    for k, layer in layers:
        try:
            x = layer(x)
        except LayerFailure:
            raise
        except Exception as e:  # the user's code: named by its layer, in one line
            if isinstance(e, _CONTROL_FLOW):
                raise
            raise LayerFailure(k, e) from e
    return x


class StageModule(LayerRange):
    """A stage's layers with global names (``layers.{k}.…``); runs of recompute-set layers are checkpointed.

    Consecutive layers of the recompute set form one ``torch.utils.checkpoint``
    call (non-reentrant): only the run's input is kept after forward, and the
    run is computed again during backward.

    Example:
        >>> stage = StageModule(build_layers("mlp-digits", 0, 2), first=0, recompute=(1,))  # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[nn.Module], first: int = 0, recompute: Iterable[int] = ()) -> None:
        super().__init__(layers, first)
        self.recompute = frozenset(recompute)
        outside = sorted(k for k in self.recompute if not self.first <= k < self.end)
        if outside:
            raise ValueError(f"recompute layers {outside} are outside the stage's layers [{self.first}, {self.end})")
        self._runs: list[tuple[bool, list[tuple[int, nn.Module]]]] = []
        for k in range(self.first, self.end):
            rc = k in self.recompute
            if self._runs and self._runs[-1][0] == rc:
                self._runs[-1][1].append((k, self[k]))
            else:
                self._runs.append((rc, [(k, self[k])]))

    def forward(self, x: Any) -> Any:
        """Run the stage's layers; a layer that raises is named (``LayerFailure``)."""
        for rc, layers in self._runs:
            if rc and torch.is_grad_enabled():
                x = checkpoint(_run_indexed, layers, x, use_reentrant=False)
            else:
                x = _run_indexed(layers, x)
        return x


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


class Executor:
    """Executes one rank's Actions, iteration after iteration.

    Args:
        role: where the rank sits in the plan.
        module: its stage.
        loss_fn: ``loss_fn(output, target)``, the mean over a micro-batch (last stage only).
        transport: sends and receives to the neighbours.
        sync: gradient buffers and all-reduce.
        optimizer: steps the stage's parameters.
        health: where the rank's current action is published.
        recorder: times the actions when active.
        device: where inputs go.
        precision: the plan's precision: under bf16 / fp16 an iteration runs under autocast, each
            backward with it off, and the cast weights are dropped after anything that changes the
            weights (``hetrain.amp``).
        early_receives: whether the receives from the previous stage, and from the next, are posted one
            ahead of the RECV that waits for them, or at it (the plan's sync option, ``p2p.early_receives``).

    Attributes:
        before_step: called as ``before_step(step)`` at each STEP, after the sends are waited for and before
            the optimizer steps (every ALLREDUCE of the iteration has been waited for by then): tied
            gradients, fp16's unscaling, gradient clipping (``runtime.step.clip``). It returns False to skip
            the optimizer step (an fp16 overflow). None: nothing.
        on_losses: called as ``on_losses(loss_sum)`` once the iteration's last F has run (the sum of this
            rank's scaled micro-batch losses is then complete), so that the losses can be summed over the
            ranks while the backward and its all-reduces run (``runtime.step.losses``). None: nothing.
        grad_scale: the loss scale the backward starts from (fp16's ``amp.LossScaler.scale``; 1 otherwise),
            read at the start of each iteration.
        compute_s: the host's seconds of the last iteration's F and B actions (on a GPU: their launch and
            whatever waits they hold, not the kernels' time), for the drift watch (``runtime.lifecycle.drift_watch``).
    """

    def __init__(self, role: Role, module: StageModule, loss_fn: LossFn, transport: Transport, sync: GradientSync,
                 optimizer: torch.optim.Optimizer, health: Health, recorder: Recorder, device: torch.device,
                 modes: ModeSync | None = None, precision: str = "fp32",
                 early_receives: tuple[bool, bool] = (True, True)) -> None:
        self.role = role
        self.module = module
        self.loss_fn = loss_fn
        self.transport = transport
        self.sync = sync
        self.optimizer = optimizer
        self.health = health
        self.recorder = recorder
        self.device = device
        self.modes = modes
        self.precision = precision
        self.early_f, self.early_b = early_receives
        self.early_posts = 0  # receives posted ahead of their RECV, over all iterations (tests read it)
        self.before_step: Callable[[int], bool | None] | None = None
        self.on_losses: Callable[[torch.Tensor], None] | None = None
        self.grad_scale = 1.0
        self.compute_s = 0.0  # host seconds of the last iteration's F and B actions (lifecycle.drift_watch)
        # BSP: n_i / N, as the seed of each micro-batch's backward: the gradient of loss * n_i / N, without the product
        # other sync modes: n_i / (this VW's mini-batch): each VW steps on its own mean gradient (docs/sync.md)
        total = role.global_batch if modes is None else sum(role.micro_batch_sizes)
        self.loss_scale = [torch.full((), n / total, device=device) for n in role.micro_batch_sizes]
        self._seeds = self.loss_scale  # loss_scale times grad_scale, made when grad_scale changes
        self._seeds_for = 1.0
        # the reported loss is always the global batch's mean: n_i / N; in a TP group every rank computes the same
        # loss, and the lead alone reports it (0 from the others), so the sum over the ranks counts it once
        report = 1.0 if role.tp_rank == 0 else 0.0
        self.report_scale = [torch.full((), report * n / role.global_batch, device=device)
                             for n in role.micro_batch_sizes]
        self._record_memory = device.type == "cuda"
        # per action list: (the list, micro-batches of its RECV_Fs, of its RECV_Bs, buckets armed before each B,
        # how many Fs it has)
        self._orders: dict[int, tuple[Sequence[Action], list[int], list[int], dict[int, list[tuple[int, int]]],
                                      int]] = {}
        # where SEND_F and SEND_B go: the neighbour, or with TP the members of its group paired with this rank
        paired = bool(role.send_f_ranks or role.send_b_ranks or role.tp_ranks)  # build_roles says: none may be
        self._send_f_ranks = role.send_f_ranks if paired else tuple(r for r in (role.next_rank,) if r is not None)
        self._send_b_ranks = role.send_b_ranks if paired else tuple(r for r in (role.prev_rank,) if r is not None)
        #: this rank's TP group (``runtime.tp.build_tp_groups``), for the all-gather of a split boundary
        self.tp_group: Any = None
        self._transfers: dict[ActionKind, Callable[[Transfer], None]] = {
            K.SEND_F: self._send_f, K.RECV_F: self._recv_f, K.SEND_B: self._send_b, K.RECV_B: self._recv_b,
        }

    def run(self, actions: Sequence[Action], step: int, inputs: Sequence[Any] | None,
            targets: Sequence[Any] | None) -> torch.Tensor:
        """Run one iteration.

        Args:
            actions: this rank's Actions (``build_schedule(plan)[device]``).
            step: the iteration's number (for messages).
            inputs: the micro-batches' inputs (first stage), else None.
            targets: the micro-batches' targets (last stage), else None.

        Returns:
            The sum of this rank's scaled micro-batch losses (0 except on last stages).
        """
        self.step = step
        self.inputs_mb = inputs
        self.targets_mb = targets
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.in_tuple: dict[int, bool] = {}
        self.outputs: dict[int, Any] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self.loss_sum = torch.zeros((), device=self.device)
        self.compute_s = 0.0
        # receives are posted one ahead of the one being waited for, per direction (see _post_ahead_*)
        orders = self._orders.get(id(actions))
        if orders is None or orders[0] is not actions:
            orders = self._orders[id(actions)] = (actions, _received(actions, K.RECV_F), _received(actions, K.RECV_B),
                                                  _armed_buckets(actions),
                                                  sum(isinstance(a, Compute) and a.kind is K.F for a in actions))
        _, self._recv_f_order, self._recv_b_order, self._arms, self._forwards_left = orders
        self._posted_f = self._posted_b = 0  # how many of each list are posted
        self._done_f = self._done_b = 0  # how many were received
        self.sync.zero()
        if self.grad_scale != self._seeds_for:
            self._seeds = [s * self.grad_scale for s in self.loss_scale]
            self._seeds_for = self.grad_scale
        self._post_ahead_f()
        rec = self.recorder
        with amp.autocast(self.device, self.precision):  # one cast of each weight per iteration (hetrain.amp)
            for a in actions:
                self.health.doing = (step, a)  # formatted by the heartbeat thread, only when it beats
                if rec.active:
                    start = rec.now()
                    self._do(a)
                    self._record(a, start, rec.now())
                else:
                    self._do(a)
        if self.transport.posted_receives():
            raise RuntimeError(f"internal error: receives {self.transport.posted_receives()} were posted ahead in "
                               f"step {step} and never used")
        self.health.doing = (step, "between iterations")
        return self.loss_sum

    def _do(self, a: Action) -> None:
        """Run one action: one method per kind."""
        match a:
            case Compute():
                t0 = time.perf_counter()
                if a.kind is K.F:
                    self._forward(a)
                else:
                    self._backward(a)
                self.compute_s += time.perf_counter() - t0
            case Transfer():
                self._transfers[a.kind](a)
            case BucketSync():
                if a.kind is K.ALLREDUCE_START:
                    self.sync.start(a.segment, a.bucket)
                else:
                    self.sync.wait(a.segment, a.bucket, self._where(a))
            case SegmentSync():
                if a.kind is K.ALLREDUCE:
                    self.sync.allreduce(a.segment, self._where(a))
                else:
                    self._mode_action(a)
                    amp.clear_cast_cache(self.precision)  # an average or a pull changed the weights
            case Step():
                self._step(a)

    # --- compute -----------------------------------------------------------------

    def _forward(self, a: Compute) -> None:
        i = a.micro_batch
        if self.role.is_first:
            assert self.inputs_mb is not None
            x = _to(self.inputs_mb[i], self.device)
        else:
            tensors = self.inputs[i]
            x = tuple(tensors) if self.in_tuple.pop(i) else tensors[0]
        out = self.module(x)
        if self.role.is_last:
            assert self.targets_mb is not None
            try:
                loss = self.loss_fn(out, _to(self.targets_mb[i], self.device))
            except Exception as e:  # the user's code
                raise LayerFailure(None, e) from e
            self.losses[i] = loss
            self.loss_sum.addcmul_(loss.detach(), self.report_scale[i])
        else:
            try:
                flatten(out)  # it crosses to the next stage: only tensors do
            except TypeError as e:
                raise LayerFailure(self.module.end - 1, e) from None
            self.outputs[i] = out
            self._post_ahead_b()
        self._forwards_left -= 1
        if self._forwards_left == 0 and self.on_losses is not None:
            self.on_losses(self.loss_sum)

    def _backward(self, a: Compute) -> None:
        i = a.micro_batch
        arm = self._arms.get(i)
        if arm is not None:  # the bucket all-reduces that start during this backward
            self.sync.arm(arm)
        with amp.no_autocast(self.device, self.precision):
            try:
                self._run_backward(i)
            except RuntimeError as e:  # a DDP reducer's all-reduce runs inside it: a failed peer is named
                failure = e if arm is None else self.sync.backward_failure(e, self._where(a))
                if failure is e:
                    raise
                raise failure from None
        if not self.role.is_first:
            tensors = self.inputs.pop(i)
            grads_in = [tensors[k].grad for k in grad_slots(tensors)]
            self.input_grads[i] = [g if g is not None else torch.zeros_like(tensors[k])
                                   for k, g in zip(grad_slots(tensors), grads_in, strict=True)]

    def _run_backward(self, i: int) -> None:
        if self.role.is_last:
            loss = self.losses.pop(i)
            self.sync.before_backward([loss])
            torch.autograd.backward([loss], [self._seeds[i]])
        else:
            outs, _ = flatten(self.outputs.pop(i))
            grads = self.grads.pop(i)
            pairs = [(outs[k], g) for k, g in zip(grad_slots(outs), grads, strict=True) if outs[k].requires_grad]
            self.sync.before_backward([o for o, _ in pairs])
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    # --- communication ---------------------------------------------------------------

    def _send_f(self, a: Transfer) -> None:
        i = a.micro_batch
        tensors, is_tuple = flatten(self.outputs[i])
        if self.role.split_next:  # a k-th per rank, the receivers all-gather (step.tp_transfer)
            tensors = scatter_parts(tensors, self.role.tp, self.role.tp_rank, with_shapes=True)
        for peer in self._send_f_ranks:  # with TP: each receiver of the next group that takes this rank's copy
            self.transport.send(tensors, is_tuple, peer, i, True, self._where(a))
        if self.recorder.active:
            self.recorder.sent.append(("send_f", a.peer or "", i, self.recorder.now(), self._link_label(a)))

    def _recv_f(self, a: Transfer) -> None:
        i = a.micro_batch
        assert self.role.prev_rank is not None
        self._posted_f = max(self._posted_f, self._done_f + 1)  # not posted ahead: the receive posts itself
        tensors, is_tuple = self.transport.recv_activation(self.role.prev_rank, i, self._where(a))
        if self.role.split_prev:
            tensors = gather_whole(tensors[1:], shapes_of(tensors[0]), self.role.tp, self.tp_group,
                                   self.role.tp_ranks, self._where(a))
        for t in tensors:
            if t.is_floating_point():
                t.requires_grad_(True)
        self.inputs[i] = tensors
        self.in_tuple[i] = is_tuple
        self._done_f += 1
        self._post_ahead_f()
        if self.recorder.active:
            self.recorder.received.append(("send_f", a.peer or "", i, self.recorder.now()))

    def _send_b(self, a: Transfer) -> None:
        i = a.micro_batch
        grads = self.input_grads.pop(i)
        if self.role.split_prev:
            grads = scatter_parts(grads, self.role.tp, self.role.tp_rank, with_shapes=False)
        for peer in self._send_b_ranks:
            self.transport.send(grads, False, peer, i, False, self._where(a))
        if self.recorder.active:
            self.recorder.sent.append(("send_b", a.peer or "", i, self.recorder.now(), self._link_label(a)))

    def _recv_b(self, a: Transfer) -> None:
        i = a.micro_batch
        assert self.role.next_rank is not None
        outs, _ = flatten(self.outputs[i])
        like = [outs[k] for k in grad_slots(outs)]
        self._posted_b = max(self._posted_b, self._done_b + 1)
        grads = self.transport.recv_gradients(self._grad_like(like), self.role.next_rank, i, self._where(a))
        if self.role.split_next:
            grads = gather_whole(grads, [tuple(t.shape) for t in like], self.role.tp, self.tp_group,
                                 self.role.tp_ranks, self._where(a))
        self.grads[i] = grads
        self._done_b += 1
        self._post_ahead_b()
        if self.recorder.active:
            self.recorder.received.append(("send_b", a.peer or "", i, self.recorder.now()))

    def _grad_like(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the gradients of ``like`` arrive in: shaped like them, or one k-th of each from a group of this
        stage's degree (``step.tp_transfer``)."""
        return [part_like(t, self.role.tp) for t in like] if self.role.split_next else like

    def _post_ahead_f(self) -> None:
        """Post the next activation receive early (its shapes are known from the first iteration)."""
        if not self.early_f:
            return
        n = self._posted_f
        if n <= self._done_f and n < len(self._recv_f_order):
            i = self._recv_f_order[n]
            assert self.role.prev_rank is not None
            if self.transport.can_post_activation(self.role.prev_rank, i):
                self.transport.post_activation(self.role.prev_rank, i)
                self._posted_f += 1
                self.early_posts += 1

    def _post_ahead_b(self) -> None:
        """Post the next gradient receive early, once the forward it belongs to has run."""
        if not self.early_b:
            return
        n = self._posted_b
        if n <= self._done_b and n < len(self._recv_b_order):
            i = self._recv_b_order[n]
            assert self.role.next_rank is not None
            if i in self.outputs:
                outs, _ = flatten(self.outputs[i])
                self.transport.post_gradients(self._grad_like([outs[k] for k in grad_slots(outs)]),
                                              self.role.next_rank, i)
                self._posted_b += 1
                self.early_posts += 1

    # --- sync and step -------------------------------------------------------------

    def _mode_action(self, a: SegmentSync) -> None:
        if self.modes is None:
            raise RuntimeError(f"{a}: the executor was built for bsp, which has no such action")
        self.modes.run(a, self.step, self._where(a))

    def _step(self, a: Step) -> None:
        if self.recorder.active:
            start = self.recorder.now()
            self.transport.wait_sends(self._where(a))
            self.recorder.events.append(_event(start, self.recorder.now(), "send", "wait for sends", None))
        else:
            self.transport.wait_sends(self._where(a))
        if self.before_step is None or self.before_step(self.step) is not False:
            self.optimizer.step()
            amp.clear_cast_cache(self.precision)

    # --- helpers ---------------------------------------------------------------------

    def _where(self, a: Action) -> _At:
        return _At(a, self.step)

    def _link_label(self, a: Transfer) -> str:
        src, dst = a.stages_joined
        return f"{a.kind.value} {src}->{dst} mb{a.micro_batch} {self.role.device}->{a.peer}"

    def _record(self, a: Action, start: float, end: float) -> None:
        match a:
            case Compute():
                ev = _event(start, end, "forward" if a.kind is K.F else "backward", str(a), a.micro_batch)
            case Transfer():
                ev = _event(start, end, "send" if a.is_send else "recv", str(a), a.micro_batch)
            case SegmentSync() | BucketSync():
                ev = _event(start, end, "sync", str(a), None)
            case Step():  # its wait for sends was recorded as its own event
                sends = self.recorder.events[-1] if self.recorder.events else None
                ev = _event(sends.end_s if sends is not None else start, end, "optimizer", "STEP", None)
        self.recorder.events.append(ev)
        if self._record_memory:
            self.recorder.memory.append((end, float(torch.cuda.memory_allocated(self.device))))


def _armed_buckets(actions: Sequence[Action]) -> dict[int, list[tuple[int, int]]]:
    """Micro-batch of a B -> the (segment, bucket) of the ALLREDUCE_STARTs right after it (before the next F or B)."""
    out: dict[int, list[tuple[int, int]]] = {}
    last_b: int | None = None
    for a in actions:
        if isinstance(a, Compute):
            last_b = a.micro_batch if a.kind is K.B else None
        elif isinstance(a, BucketSync) and a.kind is K.ALLREDUCE_START and last_b is not None:
            out.setdefault(last_b, []).append((a.segment, a.bucket))
    return out


def _received(actions: Sequence[Action], kind: ActionKind) -> list[int]:
    """The micro-batches of the receives of ``kind`` among ``actions``, in order."""
    return [a.micro_batch for a in actions if isinstance(a, Transfer) and a.kind is kind]


def _event(start: float, end: float, kind: str, label: str, i: int | None) -> Event:
    return Event(start, end, kind, label, i)
