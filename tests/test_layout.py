"""The repository's shape, as the user asked for it: method files of a few
hundred lines of method, a one-way import graph (common <- eval <- methods <-
lab), and the lab out of every real path. Parsed from the source (ast), so a
circle or a stray import cannot come back unnoticed."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("erclip", "longclip", "m2mix", "cclip", "dns", "gmc")
PROJECT = {"common", "eval", "plumbing", "lab", "benchmarks", *METHODS}
# (lines, docstring lines, the first loss or module line) at most: the shape issue's targets, except dns.py's
# length: its target is 650, and the learner with both settings' drivers comes to 665 after the move and a
# tightening pass (docs/dns.md, "File size"); the bound keeps it from growing
# dns.py's is 690 since issue 25 added the code's covariance bookkeeping (--covariance code) and recall protocol
# (the target, 650, is missed by 36 lines)
# Issue 26 raised each by 10: the settings now come before the method's imports, with the two lines that answer
# --help and flag errors before torch loads (flags.answer_early), and base.json keeps the evaluation before training
# Issue 30 raised m2mix.py's by 40 (its first function by 10) for --backbone bert-resnet50 (Sec. 5.4): its six flags,
# deviations T1-T6 and Table 3
TARGETS = {"erclip": (460, 90, 160), "longclip": (460, 90, 160), "m2mix": (500, 90, 170), "cclip": (460, 90, 160),
           "dns": (700, 90, 160), "gmc": (460, 90, 160)}  # gmc.py: issue 31
# common.py's target is 1,600 too; it is 1,747 lines after the move and a tightening pass, with every name in it
# used by two or more files (docs/training.md, "Size"): the bound keeps it from growing. Raised to 1,880 in issues
# 24-26 for CachedTokenizer, run_continual's first_row, float32 (every loss), --decay-all, train(schedule=),
# foreign_checkpoint (Long-CLIP's and m2-Mix's files), check_finite, the settings' ranges, to_rgb, printable;
# eval.py's to 1,695 when m2-Mix's training-set builders and C-CLIP's headline row moved there from the methods
# and CMCL's recall protocol, Long-CLIP's CIFAR protocol and flickr30k-full came in
# Issue 26 (reliability pass 2): common.py's section 1 moved to flags.py (torch-free, 120 lines), and common.py
# grew by resume's checks against the checkpoint (settings, data fingerprint), live_holder, kept_result, the
# interrupt messages and the tiny cache's repair; eval.py by its torch-free command line (section 0) and the
# feature files' checks (_h5_rows, _read_array)
# Issue 27 (the way in and out): common.py +110 (model.safetensors beside model.pt, open_clip's hub layout,
# --lock-image / --lock-text through open_clip's own lock functions, tensorboard, --val-every that leaves the run
# unchanged), eval.py +70 (validator, CLIP_benchmark's files, mean_per_class_recall), flags.py +35 (open_clip's
# flag spellings, --batch-size-per-gpu). common.py is past 2,000 lines: its section 8 (the run folder) is the
# next thing to move into a module of its own
# Issue 28 (in part): common.py +65 (the row check split across ranks and kept on disk, --check-images, replaced
# images counted, CompactRows), flags.py +25 (Slurm's environment, UsageError moved here)
# Issue 28 (the rest): the run folder (section 8: lock, leftovers, --overwrite, --resume's settings) moved out of
# common.py into runfolder.py (-220); common.py +125 for exact gradient accumulation (common.Method's two parts,
# accumulated_backward, average_gradients, split_batch) and the shard loader's hook; shards.py is new (webdataset)
# Issue 29: vlcl.py (C-CLIP's benchmark from its public sources) is new
# Issue 30: towers.py (uni-modal towers as open_clip models) is new; eval.py +10 for m2-Mix's Table 3 and Table 5's
# BERT + ResNet-50 column; issue 31: +10 for Table 4 (CMU-MOSEI)
SHARED_LINES = {"common": 2175, "eval": 1890, "flags": 200, "export": 200, "runfolder": 240, "shards": 260,
                "towers": 275, "vlcl": 420}


def _imports(path: Path):
    """[(module, names, enclosing function or None)] of the project's imports in path."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            f = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                out.extend((a.name, (), func) for a in child.names if a.name.split(".")[0] in PROJECT)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module \
                    and child.module.split(".")[0] in PROJECT:
                out.append((child.module, tuple(a.name for a in child.names), func))
            visit(child, f)
    visit(tree, None)
    return out


def test_common_imports_no_project_module_but_flags():
    """common.py imports the settings (flags) and its own parts in modules of their own (the run folder;
    shards, when --train-data names them; towers, for a backbone of uni-modal towers), never a method file,
    eval.py or the lab."""
    assert sorted({m for m, _, _ in _imports(ROOT / "common.py")}) == ["plumbing", "plumbing.flags"]
    assert {n for m, n, func in _imports(ROOT / "common.py") if m == "plumbing" and func is None} == {("runfolder",)}
    assert {m for m, _, func in _imports(ROOT / "plumbing" / "towers.py") if func is None} == {"common"}
    assert {m for m, _, func in _imports(ROOT / "plumbing" / "shards.py") if func is None} == {"common"}
    assert {m for m, _, func in _imports(ROOT / "plumbing" / "runfolder.py") if func is None} == {"common"}


def test_export_imports_only_common():
    assert {m for m, _, func in _imports(ROOT / "plumbing" / "export.py") if func is None} == {"common"}


def test_flags_imports_the_standard_library_only():
    """flags.py answers --help before torch loads (issue 26.15): nothing of the project, nothing installed."""
    tree = ast.parse((ROOT / "plumbing" / "flags.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


def test_eval_imports_only_common_and_the_lab_only_in_main():
    for module, names, func in _imports(ROOT / "eval.py"):
        if func is None:  # and under __main__, eval itself: the module the lab registers its sets in
            assert module in ("common", "plumbing", "plumbing.flags") or module == "eval" and names == (), module
        else:  # the command line loads the lab when it names the tiny backbone or a synthetic set
            assert func == "main" and module.split(".")[0] == "lab", (module, func)


@pytest.mark.parametrize("method", METHODS)
def test_method_files_import_only_common_and_eval(method):
    for module, names, func in _imports(ROOT / f"{method}.py"):
        top = module.split(".")[0]
        if func is None:
            # a method built on another method's function imports just that function
            assert top in ("common", "eval", "plumbing") or (top in METHODS and names and "*" not in names), \
                module
        else:  # main() dispatches to the lab (its demo, the synthetic world) with a lazy import
            assert func == "main" and top == "lab", (method, module, func)


@pytest.mark.parametrize("method", METHODS)
def test_method_files_meet_the_size_targets(method):
    text = (ROOT / f"{method}.py").read_text()
    tree = ast.parse(text)
    lines, doc_max, first_max = TARGETS[method]
    assert len(text.splitlines()) <= lines
    doc = tree.body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    assert doc.end_lineno <= doc_max
    first = min(n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                and not n.name.endswith("Config"))
    assert first <= first_max, first


@pytest.mark.parametrize("name", ["common", "eval", "flags", "export", "runfolder", "shards", "towers", "vlcl"])
def test_shared_modules_do_not_grow(name):
    path = ROOT / f"{name}.py" if name in ("common", "eval") else ROOT / "plumbing" / f"{name}.py"
    assert len(path.read_text().splitlines()) <= SHARED_LINES[name]


def test_the_lab_imports_no_circle_back():
    """No top-level module imports the lab at module level (the lab, the
    benchmarks and the tests are the experiments' side: they may)."""
    for path in ROOT.glob("*.py"):
        for module, _, func in _imports(path):
            if module.split(".")[0] == "lab":
                assert func == "main", (path.name, module)


def test_importing_every_method_file_leaves_the_lab_unloaded():
    code = ("import sys; import common, eval, " + ", ".join(METHODS) +
            "; print(sorted(m for m in sys.modules if m == 'lab' or m.startswith('lab.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
