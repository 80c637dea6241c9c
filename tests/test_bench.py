"""The benchmark script: its reference implementations agree with ours, and a section runs."""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402

import common  # noqa: E402


def test_dense_reference_equals_chunked_retrieval():
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(40, 16, generator=g), dim=-1)
    t2i = torch.arange(40).repeat_interleave(5)
    txt = F.normalize(img[t2i] + torch.randn(200, 16, generator=g), dim=-1)
    assert bench.dense_retrieval(img, txt, t2i) == common.retrieval_metrics(img, txt, t2i, max_chunk_scores=300)


def test_dns_section_writes_records(tmp_path):
    out = tmp_path / "results.json"
    bench.RECORDS.clear()
    bench.main(["--quick", "--only", "dns", "--out", str(out)])
    recs = json.loads(out.read_text())
    names = [r["name"] for r in recs]
    assert any("update-mode projection" in n for n in names) and any("rebuild" in n for n in names)
    assert all(r["value"] > 0 for r in recs)
