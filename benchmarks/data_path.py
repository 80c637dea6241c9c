"""Where a training sample's time goes on the lab's data path (issue 71.4's premise), as shares of one run.

    python benchmarks/data_path.py            # the lab's task-photo split (600 samples), best of 3; ~10 s

A sample as common.train reads it: SeededSamples seeds torch's, Python's and NumPy's generators from the sample's
index (plumbing.loading.seeded), then ManifestDataset.__getitem__ decodes the PNG and applies the training
transform. Measured in one process on one torch thread: the whole, the seeding alone (an empty function under
seeded), the decoding alone and the transform alone (on images decoded before), each as microseconds a sample and
as a share of the whole. Writes benchmarks/results-data-path.json. The lab's demos multiply these by the samples
they read (C-CLIP's: methods x seeds x tasks x steps x batch) to put the data path against a demo's wall time.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(split: str = "task-photo", data_root="data", n: int | None = None, repeats: int = 3) -> dict:
    import torch

    import common
    import lab
    from plumbing import loading, models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, train_tf, _, _ = models.load_model("tiny", "", world=lab.WORLD)
        ds = common.ManifestDataset(lab.synthetic_manifest(split, data_root, n), train_tf, check_images=False,
                                    draw_caption=True)
        rows, count = ds.rows, len(ds)

        def best(fn) -> float:  # microseconds a sample, the best of `repeats`
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times) / count * 1e6
        whole = best(lambda: [loading.seeded(i * 7919, ds.__getitem__, i) for i in range(count)])
        seeding = best(lambda: [loading.seeded(i * 7919, int) for i in range(count)])
        decoding = best(lambda: [ds._image(r) for r in rows])
        images = [ds._image(r) for r in rows]
        transform = best(lambda: [train_tf(im) for im in images])
    finally:
        torch.set_num_threads(threads)
    parts = {"seeding": seeding, "decoding": decoding, "transform": transform}
    return {"split": split, "samples": count, "us per sample": {"whole": whole, **parts},
            "share of the whole": {k: v / whole for k, v in parts.items()},
            "machine": lab.machine_info()}


def main(argv=None) -> dict:
    out = measure()
    path = ROOT / "benchmarks" / "results-data-path.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    us, share = out["us per sample"], out["share of the whole"]
    print(f"{out['samples']} samples of {out['split']}: {us['whole']:.0f} us a sample; seeding "
          f"{share['seeding']:.0%}, decoding {share['decoding']:.0%}, transform {share['transform']:.0%} -> {path}")
    return out


if __name__ == "__main__":
    main()
