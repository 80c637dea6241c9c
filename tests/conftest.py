import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# pytest.ini runs the suite in pytest-xdist workers (-n auto: one per core). Each worker gets a cache folder of
# its own (CLIPFT_CACHE, read by plumbing.base at import, so set before the lab loads; the processes a test starts
# inherit it), removed when the worker ends: no cached weights, classifier or row check is shared between workers.
# The processes a test starts (the CLI, the two-process runs, the demos' subprocesses) also inherit one OpenMP
# thread: with the workers filling the cores, a child on torch's default of a thread per core oversubscribes them,
# and OpenMP's spinning threads then slow everything on the machine (measured on 2 cores: a step of the Long-CLIP
# demo's ERCLIP run took 0.46 s alone and ~3.0 s beside a second 2-thread demo, 6.5x, not 2x).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    WORKER_CACHE = tempfile.mkdtemp(prefix=f"clipft-cache-{WORKER}-")
    os.environ["CLIPFT_CACHE"] = WORKER_CACHE
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lab  # noqa: E402,F401  the synthetic world and the tiny backbone register themselves with common and eval
# one torch thread per worker (the workers fill the cores); serially (-n 0) two, as before (the test modules that
# set one thread at import still do)
torch.set_num_threads(1 if WORKER else min(2, os.cpu_count() or 1))


def pytest_unconfigure(config):
    if WORKER:
        shutil.rmtree(WORKER_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seeds_reset():
    """A demo run with --seeds leaves lab.seeds() at its seeds (its checks read them after main()); every
    test after it starts on lab.SEEDS again."""
    yield
    lab.take_seeds_flag([])


@pytest.fixture(autouse=True)
def _not_evaluating():
    """eval.main marks its process as evaluating (plumbing.runfolder.EVALUATING: what an interrupt's message says,
    issue 72.3); one process runs one command, but a test worker runs many: the next test starts without it."""
    yield
    from plumbing import runfolder
    runfolder.EVALUATING = None


@pytest.fixture(scope="session")
def _tiny_random_once():
    from plumbing import models
    torch.manual_seed(0)
    return models.load_model("tiny", "random")


@pytest.fixture
def tiny_random(_tiny_random_once):
    """A randomly initialised tiny backbone (no pretraining): (model, train_tf, eval_tf, tokenizer), built once
    per worker, the model copied for each test. A test that trains it, or wraps it in a method that freezes
    its temperature (ERCLIP, m2-Mix with a fixed tau), leaves the next test's model as built; with one shared
    model, test_param_groups_no_decay failed whenever such a test ran before it on the same worker."""
    import copy
    model, *rest = _tiny_random_once
    return (copy.deepcopy(model), *rest)


@pytest.fixture
def shrink_world(monkeypatch):
    """Shrinks the lab's splits for the demos' plumbing tests:
    shrink_world(size_of) with size_of(split name) -> n, or None to keep it."""
    from lab import world

    def shrink(size_of):
        monkeypatch.setattr(world, "SPLITS", {k: (d, size_of(k) or n, s) for k, (d, n, s) in world.SPLITS.items()})
    return shrink


@pytest.fixture
def check_demo_results():
    """The checks every demo's results share: every seed of every named run is
    kept (of a construction check in `checks`: the first seed's), at least
    min_claims claims carry the agreed keys and a verdict, the PNG exists.
    Returns the saved results."""
    import json

    def check(out, png: str, names, min_claims: int, checks=()) -> dict:
        saved = json.loads((out / "results.json").read_text())
        # two seeds: the fewest a paired verdict (mean +- se) takes; the demo tests run two to fit the suite's time
        assert saved["seeds"] == list(lab.seeds()) and len(lab.seeds()) >= 2
        for name in names:
            want = list(lab.seeds())[:1] if name in checks else list(lab.seeds())
            assert [r["seed"] for r in saved["per_seed"][name]] == want
        assert len(saved["claims"]) >= min_claims
        for c in saved["claims"]:
            assert set(c) >= {"claim", "paper", "mean", "std", "n_seeds", "per_seed", "verdict"}
            assert c["n_seeds"] == len(c["per_seed"])  # a construction check may run on the first seed only
            assert c["n_seeds"] == len(lab.seeds()) or c["verdict"] == "by construction" and c["n_seeds"] >= 1
            assert c["verdict"] in ("reproduced", "opposite", "not resolved", "by construction", "about equal",
                                    "outside the lab's regime")
        assert (out / png).stat().st_size > 10_000
        assert not list(out.rglob("checkpoints")) and not list(out.glob("*-seed*/**/model.pt"))  # numbers, not models
        return saved
    return check


# What README.md ("Taking a model out") says each training entry writes of a model (issue 40.8)
README_MODEL_FILES = {**dict.fromkeys(("erclip", "longclip", "m2mix", "cclip"),
                                      {"model.pt", "model.pt.json", "model.safetensors", "model.safetensors.json"}),
                      "gmc": {"model.pt"}, "dns": set()}


@pytest.fixture
def model_files_as_readme_says():
    """check(entry, out): the model files in the run folder `out` are those README.md says `entry` writes (each
    entry's end-to-end test calls it on its run; tests/test_layout.py checks the README's sentence)."""
    def check(entry, out):
        found = {p.name for p in Path(out).iterdir() if p.name.startswith("model")}
        assert found == README_MODEL_FILES[entry], f"{entry} wrote {sorted(found)}"
    check.claims = README_MODEL_FILES
    return check


def _no_constant(name):
    raise ValueError(f"bare {name} in a results file (strict JSON readers refuse it)")


@pytest.fixture
def results_files_are_strict_json():
    """check(folder, method): every .json file under the run folder parses with a strict parser (a bare NaN or
    Infinity is an error, as in JSON.parse), and its results.json is plumbing.results' schema: `method`, and
    records of task, metric, value (a number, or null with a reason) and stage. Returns the results.json
    (issue 42.3; every method's end-to-end test calls it)."""
    import json

    def check(folder, method: str) -> dict:
        files = [p for p in Path(folder).rglob("*.json")]
        for p in files:
            json.loads(p.read_text(), parse_constant=_no_constant)
        saved = json.loads((Path(folder) / "results.json").read_text())
        assert saved["schema"] == "clipft-results/1" and saved["method"] == method and "config" in saved
        assert saved["records"], "no records"
        for r in saved["records"]:
            assert {"task", "metric", "value", "stage"} <= set(r), r
            assert isinstance(r["value"], (int, float)) or r["value"] is None and r["reason"], r
        return saved
    return check


@pytest.fixture(autouse=True)
def _csv_columns_of_one_test():
    """plumbing.flags.CSV_COLUMNS is a run's open_clip CSV flags (parse_config sets them): one test's never
    reach the next."""
    from plumbing import flags
    saved = dict(flags.CSV_COLUMNS)
    yield
    flags.CSV_COLUMNS.update(saved)


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request):
    """A test that leaves SIGINT / SIGTERM handled otherwise than it found them fails, and the handlers are put
    back: a later test in the same worker would otherwise run under them (issue 68.5: the signal tests assume a
    script's handlers, as a shell gives them)."""
    import signal
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    after = {s: signal.getsignal(s) for s in before}
    for s, handler in before.items():
        if handler is not None and after[s] is not handler:
            signal.signal(s, handler)
    if after != before:
        pytest.fail(f"{request.node.nodeid} left the signal handlers {after} (found {before})")
