"""Throughput of a method's training step against the chip's peak (issue 75.1), for benchmarks/gpu_check.py.

Per method, batch and precision: pairs per second over a fixed-shape loop (the same batch every step, so neither
CUDA's caching allocator nor a compiled graph sees a new shape), the GFLOP each pair costs (forward and backward,
counted by torch.utils.flop_counter on the step as the run computes it: captions trimmed to the batch's longest,
ERCLIP's sentences, the teacher's forward), and the model FLOP utilisation, MFU = pairs/s x FLOP per pair / the
chip's dense bf16 / fp16 tensor peak. The peak comes from the vendor's table by device name (PEAK_TFLOPS) with a
measured large bf16 matmul rate beside it, so a chip missing from the table still has a ceiling. Timing: >= 30
steps after a warm-up, each between CUDA events (perf_counter on CPU), reported as median and (min, max).

Also: a batch sweep up to the memory limit; --accum-freq's parts timed apart (accum_breakdown: the no-graph
feature pass, the loss, the replays with their backward), to name where a slow accumulated step goes; the real
loop with data loading (JPEG decode and RandomResizedCrop in DataLoader workers) beside the synthetic step.
Everything runs on CPU too (tests/test_throughput.py, tiny backbone), where the numbers mean nothing of a GPU.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from plumbing.base import markdown_table

# Dense (no sparsity) bf16 / fp16 tensor-core peak in TFLOP/s, from NVIDIA's datasheets, which print the sparse
# figure (2x) beside it: H100 SXM5 and H200 SXM 1,979 sparse; H100 PCIe 1,513; H100 NVL 1,671; A100 624.
PEAK_TFLOPS = {"H200": 989.5, "H100 NVL": 835.5, "H100 PCIe": 756.5, "H100": 989.5, "A100": 312.0}


def peak_tflops(device_name: str) -> tuple[float | None, str]:
    """(dense bf16/fp16 TFLOP/s, the table's key) for a CUDA device name; (None, '') for a chip not in the table.
    The first key the name contains, in the table's order (H100 NVL / PCIe before the SXM default)."""
    for key, tflops in PEAK_TFLOPS.items():
        if key in device_name:
            return tflops, key
    return None, ""


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Seconds of one call: between CUDA events on a GPU (what the device spent, launches included), else
    perf_counter."""
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def time_steps(fn, n: int, device) -> list[float]:
    """Seconds of each of n calls of fn back to back. On CUDA between events recorded after each call and read
    once at the end, so the host never waits inside the loop and runs ahead of the device as training does
    (a host read per step, as gpu_check.Stepper's float(loss), would serialise launches and device work)."""
    if torch.device(device).type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            fn()
            events[i + 1].record()
        events[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def training_step(stepper):
    """stepper's step as common.train takes it: common.train_step with a NonFiniteGuard (the loss checked on the
    device) and nothing read back to the host; the step counter and generator advance as in training."""
    guard = common.NonFiniteGuard(stepper.device)
    case = stepper.case

    def step():
        i = stepper.step_index
        ctx = SimpleNamespace(step=i, epoch=0, total_steps=0, device=stepper.device, precision=stepper.precision,
                              generator=common.step_generator(stepper.seed, i))
        common.train_step(case.net, case.batch, ctx, stepper.opt, stepper.scaler, stepper.sched,
                          grad_clip=stepper.grad_clip, hooks=case.hooks, guard=guard, accum=stepper.accum)
        stepper.step_index += 1
    step.guard = guard
    return step


def spread(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def count_flops(fn) -> int:
    """FLOPs of fn() by torch.utils.flop_counter (matrix products, convolutions, attention; CPU's attention
    kernels mapped to the registered formulas, as benchmarks/bench.py does)."""
    from bench import count_flops as counted
    return counted(fn)


def op_count(fn) -> int:
    """How many aten operations fn() dispatches (views and casts included): on a GPU each costs the host a few
    microseconds whatever its size, so a step whose device work per operation is small runs at the host's pace,
    and its time follows this count rather than its FLOPs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))
    with Counter():
        fn()
    return Counter.n


def matmul_tflops(device, n: int = 8192, repeat: int = 20, dtype=torch.bfloat16) -> float:
    """Measured TFLOP/s of an n x n x n bf16 matrix product (the ceiling a step's matmuls could reach here)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = Timer(device)
    for _ in range(3):
        a @ b
    sync(device)
    t = statistics.median(timer(lambda: a @ b) for _ in range(repeat))
    return 2 * n ** 3 / t / 1e12


def step_throughput(stepper, batch_size: int, *, steps: int = 30, warmup: int = 5, peak: float | None = None,
                    flops: int | None = None) -> dict:
    """Pairs/s of `stepper` (gpu_check.Stepper: its net, batch, optimizer and scaler; stepped as training_step
    does) over `steps` timed steps after `warmup`; GFLOP per pair counted on one more step (flops: given, to skip
    the count); MFU against `peak` TFLOP/s."""
    device = stepper.device
    step = training_step(stepper)
    for _ in range(warmup):
        step()
    sync(device)
    times = time_steps(step, steps, device)
    step.guard.check()  # a non-finite loss in the timed steps is an error, not a throughput
    if flops is None:
        flops = count_flops(step)
    t = spread(times)
    achieved = flops / t["median"] / 1e12
    return {"batch_size": batch_size, "precision": stepper.precision, "steps": steps, "seconds": t,
            "pairs_per_s": batch_size / t["median"], "gflop_per_pair": flops / batch_size / 1e9,
            "achieved_tflops": achieved, "peak_tflops": peak, "mfu": achieved / peak if peak else None}


def batch_sweep(make_stepper, batches, **kw) -> list[dict]:
    """step_throughput at each batch in turn until one does not fit (CUDA out of memory: recorded, the sweep
    ends). make_stepper(batch) -> Stepper."""
    rows = []
    for b in batches:
        try:
            rows.append(step_throughput(make_stepper(b), b, **kw))
        except torch.cuda.OutOfMemoryError:
            rows.append({"batch_size": b, "out_of_memory": True})
            break
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def accum_breakdown(case, device, precision: str, k: int, repeat: int = 10) -> dict:
    """The parts of common.accumulated_backward timed apart on `case` (its net and batch): the k feature passes
    without a graph, the loss over the whole batch with its backward, the k replays with their backward; and the
    plain step's forward + backward on the whole batch beside them. Median seconds each; beside them both sides'
    aten operation counts and FLOPs. Exact accumulation costs one more no-graph forward of the towers: 4/3 of
    the plain FLOPs, but k times the operations twice over (ViT-B/16, k = 4: 5.36x the operations before the step
    kept one autocast cast cache, issue 75.2). The counts are of common.accumulated_backward itself. Where the
    parts sum to far more than 4/3 of the plain step, the step runs at the host's dispatch pace (docs/benchmarks.md,
    issue 75.2), and only a micro-batch that fills the device (or fewer operations: --torchcompile) lowers it."""
    net, batch = case.net, case.batch
    ctx = SimpleNamespace(step=0, epoch=0, total_steps=0, device=torch.device(device), precision=precision,
                          generator=common.step_generator(0, 0))
    micro = getattr(net, "split_batch", common.split_batch)(batch, k)
    timer = Timer(device)
    state = {}

    def features():
        with torch.no_grad():
            state["parts"] = []
            for mb in micro:
                with common.autocast(ctx.device, precision):
                    state["parts"].append(net.features(mb, ctx))

    def loss():
        whole = {key: torch.cat([p[key] for p in state["parts"]]) for key in state["parts"][0]}
        for v in whole.values():
            v.requires_grad_(v.is_floating_point())
        with common.autocast(ctx.device, precision):
            total = common.summed_loss(net.losses(whole, ctx), ctx, None)
        total.backward()
        state["whole"] = whole

    def replays():
        start = 0
        for mb in micro:
            with common.autocast(ctx.device, precision):
                f = net.features(mb, SimpleNamespace(**{**vars(ctx), "replay": True}))
            rows = slice(start, start + len(next(iter(f.values()))))
            start = rows.stop
            pairs = [(v, state["whole"][key].grad[rows]) for key, v in f.items()
                     if v.requires_grad and state["whole"][key].grad is not None]
            if pairs:
                torch.autograd.backward(*zip(*pairs))

    def plain():
        with common.autocast(ctx.device, precision):
            total = common.summed_loss(net(batch, ctx), ctx, None)
        total.backward()

    out = {}
    for name, fn in (("features_no_graph", features), ("loss_and_backward", loss), ("replays_and_backward", replays),
                     ("plain_forward_backward", plain)):
        fn()  # warm-up (and the state the next part reads)
        sync(device)
        out[name] = statistics.median(timer(fn) for _ in range(repeat))
        net.zero_grad(set_to_none=True)
    out["accumulated"] = out["features_no_graph"] + out["loss_and_backward"] + out["replays_and_backward"]
    out["ratio_to_plain"] = out["accumulated"] / out["plain_forward_backward"]
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)
    accumulated = lambda: common.accumulated_backward(net, batch, ctx, scaler, k)  # noqa: E731  (as training runs it)
    out["ops"] = {"plain": op_count(plain), "accumulated": op_count(accumulated)}
    out["flops"] = {"plain": count_flops(plain), "accumulated": count_flops(accumulated)}
    net.zero_grad(set_to_none=True)
    out["k"] = k
    return out


def data_loop_throughput(stepper, train_tf, tokenizer, batch_size: int, *, workers: int = 4, steps: int = 30,
                         warmup: int = 5, image_px: int = 320) -> dict:
    """The real loop's pairs/s: JPEG files decoded and augmented by the model's train transform in DataLoader
    workers (pinned memory on CUDA), collated and tokenised, then stepper's step on each batch; beside it the
    loader alone. The synthetic step's rate over this one says what the data path costs."""
    from PIL import Image
    device = stepper.device
    n = batch_size * (steps + warmup)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        g = torch.Generator().manual_seed(0)
        for i in range(min(n, 4 * batch_size)):  # a few distinct images, listed again to fill the loop
            pixels = torch.randint(0, 256, (image_px, image_px, 3), generator=g, dtype=torch.uint8).numpy()
            path = Path(tmp) / f"{i:05d}.jpg"
            Image.fromarray(pixels).save(path, quality=90)
            rows.append({"image": str(path), "caption": f"a photo number {i} of a random scene"})
        manifest = Path(tmp) / "train.jsonl"
        import json
        manifest.write_text("".join(json.dumps(rows[i % len(rows)]) + "\n" for i in range(n)))
        dataset = common.ManifestDataset(manifest, train_tf)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, drop_last=True,
                                             collate_fn=common.Collate(tokenizer), persistent_workers=workers > 0,
                                             pin_memory=device.type == "cuda")

        step = training_step(stepper)

        def run(with_step: bool) -> float:
            """Seconds per batch over the `steps` after `warmup`, the device synchronised once at the end."""
            it = iter(loader)
            for i in range(steps + warmup):
                if i == warmup:
                    sync(device)
                    t0 = time.perf_counter()
                batch = next(it)
                if with_step:
                    stepper.case.batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                                          for k, v in batch.items()}
                    step()
            sync(device)
            return (time.perf_counter() - t0) / steps

        fixed = stepper.case.batch  # put back after (the loop reassigns it, never mutates it)
        loop, data = run(True), run(False)
        step.guard.check()
        stepper.case.batch = fixed
    return {"batch_size": batch_size, "workers": workers, "image_px": image_px, "steps": steps,
            "loop_seconds_per_step": loop, "loop_pairs_per_s": batch_size / loop,
            "data_only_pairs_per_s": batch_size / data}


# =============================================================================
# Issue 75.3: what a GPU run would cost, on paper (no device lent): counts here, times from a committed GPU run
# =============================================================================
def project(gpu_results: Path, backbone: str = "ViT-B/16", batch: int = 4, efficiency: float = 0.6) -> list[dict]:
    """Per method of a committed gpu_check run (its fp16 seconds per step at its batch, on its device): the aten
    operations and GFLOP per pair of one step counted here on CPU (random weights, `batch` pairs; the operation
    count does not grow with the batch), the MFU that run reached, the host's seconds per operation if the step
    ran at the host's dispatch pace (its seconds / its operations), and the projection from that model: device
    seconds = FLOPs / (efficiency x peak) against host seconds = operations x the plain step's seconds per
    operation; the batch from which the device's work outlasts the host's (the step stops being host-bound),
    and the MFU projected there. A model for planning the next lent run, not a measurement."""
    import json
    import gpu_check
    from plumbing import models
    doc = json.loads(Path(gpu_results).read_text())
    device, gpu_batch = doc["info"]["device"], doc["info"]["batch_size"]
    peak, _ = peak_tflops(device)
    seconds = {r["method"]: r["sec_per_step"] for r in doc["results"]
               if r.get("method") and "accum" not in r["check"] and r.get("sec_per_step")}
    torch.manual_seed(0)
    base, _, _, tok = models.load_model(backbone, "random")
    rows = []
    for method, sec in seconds.items():
        case = gpu_check.build(method, copy_model(base), tok, batch, "cpu", backbone=backbone)
        step = training_step(gpu_check.Stepper(case, "cpu", "bf16"))
        step()  # optimizer state made
        rows.append({"method": method, "ops": op_count(step), "gflop_per_pair": count_flops(step) / batch / 1e9,
                     "gpu_seconds": sec, "gpu_batch": gpu_batch})
    per_op = next(r for r in rows if r["method"] == "plain")
    host_per_op = per_op["gpu_seconds"] / per_op["ops"]
    for r in rows:
        flops = r["gflop_per_pair"] * 1e9
        r["mfu_measured"] = flops * r["gpu_batch"] / r["gpu_seconds"] / (peak * 1e12) if peak else None
        r["seconds_per_op"] = r["gpu_seconds"] / r["ops"]
        r["host_seconds_projected"] = r["ops"] * host_per_op
        device_per_pair = flops / (efficiency * peak * 1e12) if peak else None
        r["host_bound_below_batch"] = r["host_seconds_projected"] / device_per_pair if peak else None
        # step seconds ~ max(host, batch x device per pair): MFU = efficiency x min(1, batch / that batch)
        r["mfu_projected_at_gpu_batch"] = (efficiency * min(1.0, r["gpu_batch"] / r["host_bound_below_batch"])
                                           if peak else None)
    return rows


def accum_op_counts(backbone: str = "ViT-B/16", k: int = 4, batch: int = 4, precision: str = "bf16") -> dict:
    """Issue 75.2 on paper: the aten operations of one plain step's forward + backward and of one
    common.accumulated_backward over k micro-batches, as training runs it (one autocast cast cache for the step)
    and with the cache dropped after every pass (the step before issue 75.2), on CPU with random weights. The
    count does not grow with the batch; on a host-bound GPU step it is the step's time (docs/benchmarks.md)."""
    import gpu_check
    from plumbing import models
    torch.manual_seed(0)
    base, _, _, tok = models.load_model(backbone, "random")
    case = gpu_check.build("plain", base, tok, batch, "cpu", backbone=backbone)
    ctx = SimpleNamespace(step=0, epoch=0, total_steps=0, device=torch.device("cpu"), precision=precision,
                          generator=common.step_generator(0, 0))
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def plain():
        with common.autocast(ctx.device, precision):
            total = common.summed_loss(case.net(case.batch, ctx), ctx, None)
        total.backward()
    out = {"backbone": backbone, "k": k, "batch": batch, "precision": precision, "plain": op_count(plain),
           "accumulated": op_count(lambda: common.accumulated_backward(case.net, case.batch, ctx, scaler, k)),
           "accumulated_cast_per_pass": op_count(
               lambda: common._accumulated_backward(case.net, case.batch, ctx, scaler, k))}
    out["ratio"] = out["accumulated"] / out["plain"]
    out["ratio_cast_per_pass"] = out["accumulated_cast_per_pass"] / out["plain"]
    return out


def copy_model(model):
    import copy
    return copy.deepcopy(model)


def main(argv=None):
    import argparse
    import json
    p = argparse.ArgumentParser(description="issue 75.3: a GPU run's cost on paper, from a committed gpu_check run")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--project", help="a gpu_check JSON (e.g. benchmarks/results-gpu-h200.json)")
    what.add_argument("--accum-ops", action="store_true",
                      help="issue 75.2: operation counts of a plain and an accumulated step (k = 4)")
    p.add_argument("--backbone", default="ViT-B/16")
    p.add_argument("--out", default=None, help="default benchmarks/results-projection.json "
                                               "(--accum-ops: benchmarks/results-accum-ops.json)")
    a = p.parse_args(argv)
    if a.accum_ops:
        counts = accum_op_counts(a.backbone)
        Path(a.out or "benchmarks/results-accum-ops.json").write_text(json.dumps(counts, indent=1))
        print(counts)
        return
    a.out = a.out or "benchmarks/results-projection.json"
    rows = project(Path(a.project), a.backbone)
    Path(a.out).write_text(json.dumps({"source": a.project, "backbone": a.backbone, "rows": rows}, indent=1))
    print(markdown_table(rows, ["method", "ops", "gflop_per_pair", "gpu_seconds", "mfu_measured",
                                       "mfu_projected_at_gpu_batch", "seconds_per_op", "host_seconds_projected",
                                       "host_bound_below_batch"]))


if __name__ == "__main__":
    import lab  # noqa: F401  (the tiny backbone registered, as gpu_check's import does)
    main()
