"""Profiles combined: merged across device types, averaged across devices of a type, scaled to types never
measured.

Pure Python and numpy, no torch: the planning side and the profiler both use it.

- ``merge_profiles``: profiles of one model measured on several device types -> one.
- ``average_profiles``: profiles of one model measured on several devices of a type -> one, the medians.
- ``scale_to``: figures for catalog device types never measured, derived by the
  roofline ratio of ``cost.estimate_layer_time`` and marked ``source = "scaled"``.

Example:
    >>> both = merge_profiles([load_profile("cpu.json"), load_profile("a100.json")])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import replace

from hetrain.catalog import lookup_device_type
from hetrain.cluster import Device
from hetrain.cost import estimate_layer_time
from hetrain.fit import estimate_common_spread
from hetrain.profile import DeviceFigures, LayerProfile, Measurement, ModelProfile, ProfileError


def _measured_only(layer: LayerProfile) -> tuple[tuple[str, tuple[Measurement, ...]], ...]:
    kept = ((t, tuple(m for m in ms if m.source == "measured")) for t, ms in layer.measured)
    return tuple((t, ms) for t, ms in kept if ms)


def _check_same_model(profiles: Sequence[ModelProfile]) -> None:
    """Raise unless every profile has the first one's layers (count, parameter bytes), precision and seq_len."""
    if not profiles:
        raise ProfileError("merging profiles needs at least one profile")
    first = profiles[0]
    for k, p in enumerate(profiles[1:], start=1):
        if p.num_layers != first.num_layers:
            raise ProfileError(f"profile {k} ({p.name!r}) has {p.num_layers} layers, "
                               f"profile 0 ({first.name!r}) has {first.num_layers}: not the same model")
        if p.precision != first.precision:
            raise ProfileError(f"profile {k} ({p.name!r}) is {p.precision}, profile 0 is {first.precision}")
        if p.seq_len != first.seq_len:
            raise ProfileError(f"profile {k} ({p.name!r}) was measured at seq_len {p.seq_len}, profile 0 at "
                               f"{first.seq_len}: re-profile at one length")
        for i, (a, b) in enumerate(zip(first.layers, p.layers, strict=True)):
            if abs(a.param_bytes - b.param_bytes) > 1e-9 * max(a.param_bytes, 1.0):
                raise ProfileError(f"layer {i}: profile 0 has {a.param_bytes:.0f} parameter bytes "
                                   f"({a.name}), profile {k} has {b.param_bytes:.0f} ({b.name})")


def _with_measured(profiles: Sequence[ModelProfile], i: int,
                   measured: tuple[tuple[str, tuple[Measurement, ...]], ...]) -> LayerProfile:
    """Layer ``i`` of the first profile with ``measured``; byte and FLOP counts the largest any profile reports
    (saved bytes can differ a little between backends)."""
    tp: dict[tuple[str, int], tuple[Measurement, ...]] = {}
    for p in profiles:  # TP-rank times: a later profile's (type, degree) replaces an earlier one's
        tp.update({(t, k): ms for t, k, ms in p.layers[i].measured_tp})
    return dataclasses.replace(
        profiles[0].layers[i],
        output_bytes_per_sample=max(p.layers[i].output_bytes_per_sample for p in profiles),
        saved_bytes_per_sample=max(p.layers[i].saved_bytes_per_sample for p in profiles),
        forward_flops_per_sample=max(p.layers[i].forward_flops_per_sample for p in profiles),
        measured=measured,
        measured_tp=tuple((t, k, ms) for (t, k), ms in tp.items()),
    )


def merge_profiles(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile holding the measurements of several (one per device type, typically).

    Layers must match one to one (same count, same parameter bytes) and precisions
    must agree. Measured figures win over scaled ones; for the same device type and
    micro-batch size a later profile's measurement replaces an earlier one's, and so
    for the optimizer step of the same device type and optimizer, and for a type's
    calibrated action overhead. Byte
    and FLOP counts are taken as the largest reported (saved bytes can differ a
    little between backends). Name and input come from the first profile.

    Raises:
        ProfileError: naming the profile and layer that do not match.

    Example:
        >>> both = merge_profiles([load_profile("cpu.json"), load_profile("a100.json")])  # doctest: +SKIP
    """
    _check_same_model(profiles)
    first = profiles[0]
    layers = []
    for i in range(first.num_layers):
        by_type: dict[str, dict[int, Measurement]] = {}
        for p in profiles:
            for type_name, ms in p.layers[i].measured:
                slot = by_type.setdefault(type_name, {})
                for m in ms:
                    old = slot.get(m.micro_batch)
                    if old is None or m.source == "measured" or old.source != "measured":
                        slot[m.micro_batch] = m
        layers.append(_with_measured(profiles, i, tuple((t, tuple(slot[b] for b in sorted(slot)))
                                                        for t, slot in by_type.items())))
    figures: dict[str, DeviceFigures] = {}
    rates: dict[str, dict[str, float]] = {}
    for p in profiles:
        figures.update(dict(p.measured_on))
        for type_name, by_optimizer in p.optimizer_step_s_per_byte:
            rates.setdefault(type_name, {}).update(by_optimizer)
    overheads: dict[str, float] = {}
    per_iteration: dict[str, float] = {}
    common: dict[str, float] = {}
    overhead_spreads: dict[str, float] = {}
    for p in profiles:
        overheads.update(dict(p.action_overhead_s))
        overhead_spreads.update(dict(p.action_overhead_spread_s))
        per_iteration.update(dict(p.iteration_overhead_s))
        common.update(dict(p.common_spread))
    return dataclasses.replace(first, layers=tuple(layers), measured_on=tuple(figures.items()),
                               optimizer_step_s_per_byte=tuple((t, tuple(r.items())) for t, r in rates.items()),
                               action_overhead_s=tuple(overheads.items()),
                               iteration_overhead_s=tuple(per_iteration.items()),
                               common_spread=tuple(common.items()),
                               action_overhead_spread_s=tuple(overhead_spreads.items()))


def _iqr_spread(values: Sequence[float]) -> float:
    """IQR / 1.349 (``profiler.layers.estimate_spread``) of two or more values."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 1.349


def _common_between(profiles: Sequence[ModelProfile]) -> dict[str, float]:
    """Per device type measured by two or more of ``profiles`` (devices of that type profiled at once): the
    shift common to all of a device's layers that sets the devices apart (``estimate_common_spread`` of their
    whole-model forward + backward times against the layers' own spreads between devices), at the largest
    micro-batch size every layer was measured at on each of them."""
    out: dict[str, float] = {}
    types = {t for p in profiles for layer in p.layers for t, _ in _measured_only(layer)}
    for type_name in sorted(types):
        # per profile: {micro_batch: [f + b of each layer]}, complete sizes only
        per_profile: list[dict[int, list[float]]] = []
        for p in profiles:
            sizes: dict[int, list[float]] = {}
            for layer in p.layers:
                for m in dict(_measured_only(layer)).get(type_name, ()):
                    sizes.setdefault(m.micro_batch, []).append(m.forward_s + m.backward_s)
            complete = {b: ts for b, ts in sizes.items() if len(ts) == p.num_layers}
            if complete:
                per_profile.append(complete)
        common_sizes = set.intersection(*(set(d) for d in per_profile)) if len(per_profile) >= 2 else set()
        if not common_sizes:
            continue
        b = max(common_sizes)
        rows = [d[b] for d in per_profile]  # rows[device][layer]
        totals = [sum(r) for r in rows]
        parts = [_iqr_spread([r[i] for r in rows]) for i in range(len(rows[0]))]
        out[type_name] = estimate_common_spread(_iqr_spread(totals), parts, statistics.median(totals))
    return out


def _spread_of(spreads: Sequence[float | None], medians: Sequence[float]) -> float | None:
    """The spread of a median over devices: the larger of the devices' median spread over their own repeats and
    the spread between their medians (``profiler.layers.estimate_spread``: IQR / 1.349); None where no device
    knew its spread and there is one device."""
    known = [s for s in spreads if s is not None]
    within = statistics.median(known) if known else None
    if len(medians) < 2:
        return within
    q1, _, q3 = statistics.quantiles(medians, n=4, method="inclusive")
    return max(within or 0.0, (q3 - q1) / 1.349)


def _median_measurement(ms: Sequence[Measurement]) -> Measurement:
    """Several devices' measurements of one layer at one size as one: the medians and their spread."""
    forward, backward = [m.forward_s for m in ms], [m.backward_s for m in ms]
    return Measurement(ms[0].micro_batch, statistics.median(forward), statistics.median(backward), "measured",
                       _spread_of([m.forward_spread_s for m in ms], forward),
                       _spread_of([m.backward_spread_s for m in ms], backward))


def average_profiles(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile from several measurements of the same device type(s): each measured time (per type, layer
    and micro-batch size) and each optimizer-step rate is the median over the profiles that have it; the
    spread of a time is the larger of the devices' spread over their repeats and the spread between devices;
    so is a type's ``common_spread`` (the devices' own, and the shift common to all layers that sets the
    devices apart, ``_common_between``).

    Several devices of one type, profiled at once, each time the same layers with their
    own noise (10-15% per layer on an emulated device); the median of two or more halves
    it or better. Scaled figures are dropped; byte and FLOP counts are the largest reported.

    Raises:
        ProfileError: the profiles are not of the same model (as ``merge_profiles``).

    Example:
        >>> slow = average_profiles([load_profile("slow-0.json"), load_profile("slow-1.json")])  # doctest: +SKIP
    """
    _check_same_model(profiles)
    layers = []
    for i in range(profiles[0].num_layers):
        samples: dict[str, dict[int, list[Measurement]]] = {}
        for p in profiles:
            for type_name, ms in _measured_only(p.layers[i]):
                for m in ms:
                    samples.setdefault(type_name, {}).setdefault(m.micro_batch, []).append(m)
        measured = tuple((t, tuple(_median_measurement(by_b[b]) for b in sorted(by_b))) for t, by_b in samples.items())
        layers.append(_with_measured(profiles, i, measured))
    figures: dict[str, DeviceFigures] = {}
    rates: dict[str, dict[str, list[float]]] = {}
    for p in profiles:
        figures.update(dict(p.measured_on))
        for type_name, by_optimizer in p.optimizer_step_s_per_byte:
            for name, rate in by_optimizer:
                rates.setdefault(type_name, {}).setdefault(name, []).append(rate)
    # a type's common shift: the larger of its devices' own (median) and the one that sets them apart
    own: dict[str, list[float]] = {}
    for p in profiles:
        for type_name, fraction in p.common_spread:
            own.setdefault(type_name, []).append(fraction)
    between = _common_between(profiles)
    common = {t: max(statistics.median(own[t]) if t in own else 0.0, between.get(t, 0.0))
              for t in [*own, *(t for t in between if t not in own)]}
    return dataclasses.replace(profiles[0], layers=tuple(layers), measured_on=tuple(figures.items()),
                               optimizer_step_s_per_byte=tuple(
                                   (t, tuple((n, statistics.median(v)) for n, v in r.items()))
                                   for t, r in rates.items()),
                               common_spread=tuple(common.items()))


def _catalog_device(type_name: str) -> Device:
    try:
        t = lookup_device_type(type_name)
    except KeyError as e:
        raise ProfileError(f"cannot scale to {e.args[0]}") from None
    return Device(name=f"scaled:{t.name}", node="scaled", index=0, type_name=t.name,
                  peak_fp32_flops=t.peak_fp32_flops, peak_fp16_flops=t.peak_fp16_flops,
                  memory_bytes=t.memory_bytes, memory_bandwidth_bytes_per_s=t.memory_bandwidth_bytes_per_s,
                  peak_bf16_flops=t.peak_bf16_flops)


def scale_to(profile: ModelProfile, device_types: Sequence[str]) -> ModelProfile:
    """Add ``source = "scaled"`` measurements for catalog types that were not measured.

    For each layer and each micro-batch size it was measured at, the time on the
    new type is ``cost.estimate_layer_time``: the measured time times the ratio of
    the two types' roofline times (DESIGN.md cost model). Types already measured
    are left as they are; scaled entries from an earlier call are recomputed from
    the measured ones, never from other scaled ones.

    Raises:
        ProfileError: an unknown device type (with near names), or a layer with no
            measurement to scale from.

    Example:
        >>> p = scale_to(profile_on_cpu, ["A100-40GB", "T4"])        # doctest: +SKIP
        >>> p.layers[0].measurements("T4")[0].source                 # doctest: +SKIP
        'scaled'
    """
    base = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, measured=_measured_only(layer)) for layer in profile.layers))
    devices = [_catalog_device(t) for t in device_types]
    layers = []
    for i, layer in enumerate(base.layers):
        if not layer.measured:
            raise ProfileError(f"layer {i} ({layer.name}) has no measured times to scale from")
        measured = dict(layer.measured)
        sizes = sorted({m.micro_batch for _, ms in layer.measured for m in ms})
        for dev in devices:
            if dev.type_name in measured:
                continue
            measured[dev.type_name] = tuple(
                Measurement(b, *estimate_layer_time(base, i, dev, b), source="scaled") for b in sizes)
        layers.append(dataclasses.replace(layer, measured=tuple(measured.items())))
    return dataclasses.replace(base, layers=tuple(layers))


def with_tp_splits(measured: ModelProfile, analytic: ModelProfile) -> tuple[ModelProfile, str]:
    """``measured`` with each layer's TP split (``LayerProfile.tp``) taken from ``analytic``, the analytic profile
    of the same model (``models.analytic``, ``models.hf_analytic``), and a line saying what was done.

    The layers must line up: as many, each with its parameter bytes within 1% of the analytic layer's (a cut at
    other split points does not). Each split figure keeps the analytic layer's share of the measured figure (the
    split share of its parameters, FLOPs and saved activations); the all-reduced bytes scale with the measured
    output. Times at TP degrees stay estimated (``cost.tp_rank_profile``): the profile has no ``measured_tp``.
    Where the layers do not line up, ``measured`` comes back as it is: its layers are replicated on a TP group.
    """
    if measured.num_layers != analytic.num_layers:
        return measured, (f"no TP splits: {measured.num_layers} layers measured, the analytic profile of "
                          f"{analytic.name} has {analytic.num_layers}")
    layers = []
    for i, (m, a) in enumerate(zip(measured.layers, analytic.layers, strict=True)):
        if abs(m.param_bytes - a.param_bytes) > 0.01 * max(a.param_bytes, 1.0):
            return measured, (f"no TP splits: layer {i} ({m.name}) has {m.param_bytes:.0f} parameter bytes, the "
                              f"analytic profile's {a.param_bytes:.0f}")
        if a.tp is None:
            layers.append(m)
            continue

        def share(part: float, whole: float, of: float) -> float:
            return of * part / whole if whole > 0 else 0.0

        t = a.tp
        layers.append(replace(m, tp=replace(
            t, split_param_bytes=share(t.split_param_bytes, a.param_bytes, m.param_bytes),
            split_flops_per_sample=share(t.split_flops_per_sample, a.forward_flops_per_sample,
                                         m.forward_flops_per_sample),
            split_saved_bytes_per_sample=share(t.split_saved_bytes_per_sample, a.saved_bytes_per_sample,
                                               m.saved_bytes_per_sample),
            allreduce_bytes_per_sample=share(t.allreduce_bytes_per_sample, a.output_bytes_per_sample,
                                             m.output_bytes_per_sample))))
    split = sum(1 for layer in layers if layer.tp is not None)
    return replace(measured, layers=tuple(layers)), (
        f"TP splits of {split} layer(s) from the analytic profile of {analytic.name}; their times on a TP group "
        f"are estimated (tp_efficiency {measured.tp_efficiency:g}) unless timed on one "
        f"(`hetrain profile --tp K` under torchrun)")
