"""The shared continual driver: matrices, resume at a task boundary, task parsing."""
import json

import pytest
import torch

import common
from plumbing.base import DataError


class Counter:
    """A stand-in method: its 'model' is the list of tasks learned so far."""
    def __init__(self, fail_at=None):
        self.learned, self.fail_at = [], fail_at

    def learn(self, i, task, out, resume):
        if i == self.fail_at:
            raise RuntimeError("crash")
        self.learned.append(task.name)
        return {"steps": 10 + i}

    def evaluate(self, n_tasks):
        # task j scores 50 + 10 * (times learned) - 5 * (tasks learned after it)
        per = [50.0 + (10 if f"t{j}" in self.learned else 0) - 5 * max(0, len(self.learned) - 1 - j)
               * (f"t{j}" in self.learned) for j in range(n_tasks)]
        return {"per_task": {"R@1": per}, "scalars": {"zs": 70.0 - 3 * len(self.learned)}}

    def save(self, path):
        torch.save(list(self.learned), path)

    def load(self, path):
        self.learned = torch.load(path)


def _run(tmp_path, method, resume=False):
    tasks = [common.Task(f"t{j}", "unused", "unused") for j in range(3)]
    return common.run_continual(tmp_path / "cl", tasks, method.learn, lambda: method.evaluate(3), method.save,
                                method.load, resume=resume, log=lambda *a: None)


def test_matrices_metrics_and_pd(tmp_path):
    s = _run(tmp_path, Counter())
    R = s["matrices"]["R@1"]
    assert R[0] == [50, 50, 50] and R[1] == [60, 50, 50] and R[3] == [50, 55, 60]
    assert s["metrics"]["R@1"] == common.continual_metrics(R)
    assert s["pd"] == {"zs": pytest.approx(9.0)}
    assert s["steps_per_task"] == [10, 11, 12]
    saved = json.loads((tmp_path / "cl" / "continual.json").read_text())
    assert len(saved["rows"]) == 4


def test_resume_after_a_crash_equals_uninterrupted(tmp_path):
    full = _run(tmp_path / "a", Counter())
    with pytest.raises(RuntimeError, match="crash"):
        _run(tmp_path / "b", Counter(fail_at=2))
    resumed = _run(tmp_path / "b", Counter(), resume=True)  # a fresh process: state comes from boundary.pt
    assert resumed["matrices"] == full["matrices"] and resumed["pd"] == full["pd"]


def test_a_given_first_row_is_not_evaluated_again(tmp_path):
    """Sequences that start from the same weights (the C-CLIP demo's) pass row 0 in: the same summary, one
    evaluation fewer."""
    full, method, calls = _run(tmp_path / "a", Counter()), Counter(), []

    def evaluate():
        calls.append(len(method.learned))
        return method.evaluate(3)
    tasks = [common.Task(f"t{j}", "unused", "unused") for j in range(3)]
    first = {"per_task": {"R@1": full["matrices"]["R@1"][0]}, "scalars": full["scalars"][0]}
    given = common.run_continual(tmp_path / "b", tasks, method.learn, evaluate, method.save, method.load,
                                 log=lambda *a: None, first_row=first)
    assert given["matrices"] == full["matrices"] and given["pd"] == full["pd"] and calls == [1, 2, 3]


def test_parse_tasks(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(""), b.write_text("")
    tasks = common.parse_tasks(f"x={a}:{b},y={b}")
    assert [(t.name, t.train, t.test) for t in tasks] == [("x", str(a), str(b)), ("y", str(b), str(b))]
    with pytest.raises(ValueError, match="name=train_manifest"):
        common.parse_tasks(str(a))
    with pytest.raises(DataError, match="manifest not found"):
        common.parse_tasks(f"x={tmp_path / 'nope.jsonl'}")
    with pytest.raises(ValueError, match="unique"):
        common.parse_tasks(f"x={a},x={b}")
