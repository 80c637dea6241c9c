"""One results.json for every method (issue 42.3): a list of records plus the run's settings, in strict JSON.
Standard library only, so that a reader (m2mix.py --collect, longclip.py --erclip-results, a user's notebook)
needs no torch.

The schema (SCHEMA), the same for erclip.py, longclip.py, m2mix.py, cclip.py, dns.py, gmc.py and eval.py:

    {"schema": "clipft-results/1", "method": "erclip",
     "records": [{"task": "/data/own/test.jsonl", "metric": "i2t_R@1", "value": 41.3, "stage": "tuned", ...}],
     "config": {every setting}, "switches": {the settings off their defaults},
     ... the method's own keys (summary, tables, continual, ...)
     "non_finite": [{"at": ["records", 7, "value"], "was": "nan"}]}       (only when there was one)

A record: task (an eval.py task name or a manifest path), metric (i2t_R@K / t2i_R@K image->text and text->image
recall at K, top1 / top5 zero-shot accuracy, all in percent; the analyses' names), value (a number, or null with
a 'reason'), stage (which model: STAGES), and what the evaluation adds (protocol, text_mode, n, missing, model,
weights; window for Long-CLIP, seed for GMC, alpha for WiSE-FT, row for eval.py --continual).

Strict JSON: Python's json writes NaN and Infinity bare, which strict readers (JSON.parse, jq, Go, Rust) refuse.
to_json writes null in their place and lists each place in 'non_finite' with what stood there; from_json parses
strictly and, with restore=True, puts the NaN / Infinity back (a resumed run reads its own state exactly)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from plumbing.base import DataError, markdown_table

SCHEMA = "clipft-results/1"
STAGES = {"base": "before fine-tuning (a task sequence: before its first task)",
          "tuned": "after fine-tuning", "task i": "a task sequence after its task i (cclip.py, dns.py)",
          "eval": "eval.py's model (its weights: the record's 'weights')",
          "alpha A": "eval.py --wise-ft: the weights interpolated at alpha A"}
RECALLS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10")
OWN_METRICS = (*RECALLS, "top1")  # the table of a user's own tasks: retrieval both ways, zero-shot top-1


def task_tags(tasks) -> dict[str, str]:
    """{task: its tag in metric names (val/<tag>/<metric>)}: an eval.py name as it is, a manifest by its file's stem,
    a folder (or imagefolder:DIR, DIR#column) by its last part, never the absolute path (issue 72.5: tags read
    val//<absolute path>/i2t_R@1); a tag two tasks share gets -2, -3, ... in order."""
    tags, seen = {}, {}
    for task in tasks:
        spec, _, column = str(task).partition("#")
        kind, colon, rest = spec.partition(":")
        path = Path(rest if colon and kind == "imagefolder" else spec)
        tag = (path.stem if path.suffix else path.name) if ("/" in spec or path.exists()) else spec
        tag = (tag or spec).replace("/", "-") + (f"#{column}" if column else "")
        seen[tag] = seen.get(tag, 0) + 1
        tags[task] = tag if seen[tag] == 1 else f"{tag}-{seen[tag]}"
    return tags


def staged(records, stage: str | None, reasons: dict | None = None, **extra) -> list[dict]:
    """eval.evaluate's records (or any {task, metric, value, ...}) with their stage (None: kept) and `extra` set;
    a value that is not a finite number gets a 'reason' (reasons: {metric: why}; else what stood there), and
    to_json writes it as null."""
    out = []
    for r in records:
        r = {**r, **({"stage": stage} if stage is not None else {}), **extra}
        v = r.get("value")
        if isinstance(v, float) and not math.isfinite(v):
            r["reason"] = (reasons or {}).get(r["metric"], f"{v} (not a finite number)")
        out.append(r)
    return out


def sequence_stage(i: int) -> str:
    """The stage of a task sequence's row i: 'base' before the first task, else 'task i'."""
    return "base" if i == 0 else f"task {i}"


def continual_records(summary: dict, tasks, reasons: dict | None = None) -> list[dict]:
    """The records of a task sequence (common.summarize_continual's dict): R[i][j] of every metric as (task j,
    metric, stage 'task i'; row 0 'base'), and each row's scalars (zero-shot sets: '<set>_top1' or
    '<set>/<metric>') as (set, metric, the row's stage)."""
    out = [{"task": t, "metric": metric, "value": v, "stage": sequence_stage(i)}
           for metric, R in summary["matrices"].items() for i, row in enumerate(R) for t, v in zip(tasks, row)]
    for i, scalars in enumerate(summary.get("scalars", [])):
        for key, v in scalars.items():
            task, metric = (key[:-len("_top1")], "top1") if key.endswith("_top1") else key.rpartition("/")[::2]
            out.append({"task": task, "metric": metric, "value": v, "stage": sequence_stage(i)})
    return staged(out, None, reasons)


def document(method: str, records, **rest) -> dict:
    """A results.json's content: the schema's name, the method, the records, the method's own keys (common.
    write_results adds the settings)."""
    return {"schema": SCHEMA, "method": method, "records": list(records), **rest}


def of_sequence(method: str, summary: dict, names, reasons: dict | None = None, **rest) -> dict:
    """A task sequence's results.json content (cclip.py, dns.py): its records (continual_records) and the summary
    under 'continual', with the task names (the matrices' columns) as its 'tasks'; names: str or common.Task."""
    names = [getattr(t, "name", t) for t in names]
    return document(method, continual_records(summary, names, reasons), continual={"tasks": names, **summary},
                    **rest)


def sequence_table(summary: dict, tasks, metrics=OWN_METRICS) -> str:
    """own_table of a task sequence: every task's test set and zero-shot set before the first task and after
    the last (the R[i][j] matrices hold the rows between)."""
    records = continual_records(summary, [getattr(t, "name", t) for t in tasks])
    ends = ("base", records[-1]["stage"]) if records else ()
    return own_table([r for r in records if r["stage"] in ends], metrics,
                     title=f"Your tasks (base: before the first task; {ends[-1] if ends else ''}: after the last)")


def _clean(x, at: list, found: list):
    """x with every non-finite float (numpy / torch scalars too) as None, each place appended to found."""
    if isinstance(x, dict):
        return {k: _clean(v, [*at, k], found) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v, [*at, i], found) for i, v in enumerate(x)]
    if x is None or isinstance(x, (str, bool, int)):
        return x
    try:
        v = float(x)  # numpy and torch scalars, as json.dumps(default=float) read them
    except (TypeError, ValueError):
        return x  # json.dumps then names the type it cannot write
    if math.isfinite(v):
        return v
    found.append({"at": at, "was": str(v)})
    return None


def to_json(obj, indent: int | None = 1) -> str:
    """Strict JSON text of obj: NaN / Infinity as null, each place listed in a top-level 'non_finite' (a dict obj;
    a record's null also carries a 'reason')."""
    found = []
    clean = _clean(obj, [], found)
    if found and isinstance(clean, dict):
        for place in found:
            if len(place["at"]) >= 2 and place["at"][-1] == "value" and isinstance(record := _get(
                    clean, place["at"][:-1]), dict) and "metric" in record:
                record.setdefault("reason", f"{place['was']} (not a finite number)")
        clean.pop("non_finite", None)
        clean["non_finite"] = []  # last: filled below
    text = json.dumps(clean, indent=indent, allow_nan=False)
    if found and isinstance(clean, dict) and indent is not None:  # one line per place, however deep it is
        pad = " " * (2 * indent)
        places = ",\n".join(pad + json.dumps(p, allow_nan=False) for p in found)
        return text.removesuffix("[]\n}") + f"[\n{places}\n{' ' * indent}]\n}}"
    if found and isinstance(clean, dict):
        clean["non_finite"] = found
        text = json.dumps(clean, allow_nan=False)
    return text


def _get(obj, at):
    for k in at:
        obj = obj[k]
    return obj


def _refuse(name):
    raise ValueError(f"{name} is not JSON (strict: write null)")


def from_json(text: str, restore: bool = False, strict: bool = True):
    """Strict parse (a bare NaN / Infinity is an error, as in JSON.parse; strict=False reads the files written
    before issue 42.3); restore=True: the NaN / Infinity that to_json replaced by null put back at their places,
    'non_finite' dropped."""
    obj = json.loads(text, **({"parse_constant": _refuse} if strict else {}))
    if restore and isinstance(obj, dict):
        for place in obj.pop("non_finite", []):
            *parent, key = place["at"]
            _get(obj, parent)[key] = float(place["was"])
    return obj


def read(path, what: str = "results.json") -> dict:
    """A results file of this schema, NaN restored (or of the earlier per-method layouts, bare NaN allowed: records
    built from 'base' / 'tuned'); DataError naming the file when it is not readable JSON."""
    try:
        doc = from_json(Path(path).read_text(), restore=True, strict=False)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise DataError(f"{what} {path}: not a readable results file ({type(e).__name__}: {e})") from None
    if "schema" not in doc and "records" not in doc:  # before issue 42.3: erclip / longclip kept base and tuned
        doc["records"] = [*staged(doc.get("base", []), "base"), *staged(doc.get("tuned", []), "tuned")]
    return doc


def pick(records, **match) -> list[dict]:
    """The records whose fields equal every given value (pick(records, stage='tuned', task=t))."""
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def own_table(records, metrics=OWN_METRICS, by=("stage", "task"), title: str = "") -> str:
    """The user's own numbers: a row per distinct `by` (stage, task), a column per metric that some record has;
    a text mode, window, seed or alpha becomes a column too where one row would otherwise hold several; `title`
    above it. Empty string when no record has such a metric."""
    records = [r for r in records if r["metric"] in metrics]
    groups = {}
    for r in records:
        for k in ("text_mode", "window", "seed", "alpha"):
            groups.setdefault((tuple(r.get(b) for b in by), r["metric"], k), set()).add(r.get(k))
    keys = [*by, *(k for k in ("text_mode", "window", "seed", "alpha") if k not in by
                   and any(len(v) > 1 for (_, _, kk), v in groups.items() if kk == k))]
    rows = {}
    for r in records:
        row = rows.setdefault(tuple(r.get(k) for k in keys), {k: r.get(k) for k in keys})
        row[r["metric"]] = r["value"]
    shown = [m for m in metrics if any(m in row for row in rows.values())]
    table = markdown_table(list(rows.values()), [*keys, *shown])
    return (f"{title}\n\n{table}" if title else table) if rows else ""
