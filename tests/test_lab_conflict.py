"""The continual world's conflict knob (issue 71, item 1; lab/world.py: conflict_names, conflict_manifest): strength 0
is today's world byte for byte; a strength > 0 renames only the declared words (a domain's colour and shape words),
alike in every split of one domain and differently across domains."""
import hashlib
import json
import re
from pathlib import Path

import pytest

from plumbing.manifests import read_manifest
import lab
from lab import world

# sha256 (first 16 hex digits) of every split's short and long captions, all scenes, and the world's fingerprint,
# measured on 31f9dae, the world before the knob existed
TODAYS_CAPTIONS, TODAYS_FINGERPRINT = "ada4683030b634b8", "d2718afe"
STRENGTHS = (1 / 6, 0.5, 1.0)
WORDS = set(world.COLORS) | set(world.SHAPES)


def _captions_digest() -> str:
    h = hashlib.sha256()
    for dom, size, seed in world.SPLITS.values():
        for s in world.world_split(dom, size, seed):
            h.update(json.dumps([s["caption"], s["long_caption"]]).encode())
    return h.hexdigest()[:16]


def test_strength_zero_is_todays_world(tmp_path):
    assert _captions_digest() == TODAYS_CAPTIONS
    assert world.world_fingerprint() == TODAYS_FINGERPRINT  # the data folder and the tiny model's weights' key
    assert all(world.conflict_names(d, 0.0) == {} for d in world.TASK_DOMAINS)
    assert world.task_manifests(tmp_path, 12, 12, conflict=0.0) == world.task_manifests(tmp_path, 12, 12)
    for _, tr, te in world.task_manifests(tmp_path, 12, 12, conflict=0.0):
        assert world.conflict_manifest(tr, 0.0) == tr and world.conflict_manifest(te, 0) == te
    assert world.long_task_manifests(tmp_path, conflict=0.0) == world.long_task_manifests(tmp_path)
    assert world.scene_labelled_tasks(tmp_path, test="val", conflict=0.0) == \
        world.scene_labelled_tasks(tmp_path, test="val")


def _pairs(original: str, renamed: str) -> set:
    """(word, its name) at every position where the two captions differ; only the a / an before a renamed word
    may differ otherwise."""
    a, b = re.findall(r"\w+|[^\w\s]", original), re.findall(r"\w+|[^\w\s]", renamed)
    assert len(a) == len(b)
    pairs = set()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y and {x, y} <= {"a", "an"}:
            assert a[i + 2] != b[i + 2] or a[i + 1] != b[i + 1]  # the article of a renamed word
        elif x != y:
            pairs.add((x, y))
    return pairs


@pytest.mark.parametrize("strength", STRENGTHS)
def test_conflict_renames_only_a_domains_declared_words(tmp_path, strength):
    mappings = {}
    for d, dom in world.TASK_DOMAINS.items():
        names = world.conflict_names(d, strength)
        assert names == world.conflict_names(d, strength)  # deterministic
        assert set(names) <= set(dom.colors) | set(dom.shapes)  # only the domain's own colour and shape words
        assert len(names) == int(strength * 6 + 0.5)
        assert all((a in world.COLORS) == (b in world.COLORS) and a != b for a, b in names.items())
        kept = (set(dom.colors) | set(dom.shapes)) - set(names)
        assert len(set(names.values())) == len(names) and not set(names.values()) & kept  # one-to-one in the domain
        seen = set()
        for split in (f"task-{d}", f"task-{d}-test", f"task-{d}-val"):  # every split of the domain alike
            path = world.synthetic_manifest(split, tmp_path, 30)
            copy = world.conflict_manifest(path, strength)
            assert copy != path and world.conflict_manifest(path, strength) == copy
            rows, renamed = read_manifest(path), read_manifest(copy)
            assert len(rows) == len(renamed) == 30
            for r, c in zip(rows, renamed):
                assert {k: v for k, v in r.items() if "caption" not in k} == \
                    {k: v for k, v in c.items() if "caption" not in k}  # images and labels untouched
                for col in ("caption", "long_caption"):
                    seen |= _pairs(r[col], c[col])
        assert {a for a, _ in seen} <= WORDS and dict(seen) == {a: names[a] for a, _ in seen}
        assert len(dict(seen)) == len(seen)  # a word has one name in every split
        assert set(dict(seen)) == set(names)  # 90 scenes show every renamed word
        mappings[d] = names
    ds = list(mappings)
    assert all(mappings[a] != mappings[b] for i, a in enumerate(ds) for b in ds[i + 1:])  # differently per domain


def test_conflict_is_nested_and_reaches_the_tasks(tmp_path):
    for d in world.TASK_DOMAINS:
        previous = set()
        for k in range(7):
            now = set(world.conflict_names(d, k / 6))
            assert previous <= now and len(now) == k  # a higher strength renames the same words and more
            previous = now
    with pytest.raises(ValueError):
        world.conflict_names("photo", 1.5)
    with pytest.raises(ValueError):
        world.conflict_manifest(world.synthetic_manifest("test", tmp_path, 12), 0.5)  # not a continual domain's
    long = world.long_task_manifests(tmp_path, conflict=0.5)
    assert [d for d, _, _ in long] == list(world.TASK_DOMAINS)
    for (d, tr, te), (_, tr0, te0) in zip(long, world.long_task_manifests(tmp_path)):
        assert "conflict0.5" in tr and "conflict0.5" in te
        r, r0 = read_manifest(te)[0], read_manifest(te0)[0]
        assert r["caption"] == r["long_caption"] and r["image"] == r0["image"]
    spec = lab.scene_labelled_tasks(tmp_path, test="val", conflict=0.5)
    te = spec.split(",")[0].split(":")[-1]
    assert "scene-labels-conflict0.5" in te and {"position", "count"} <= set(read_manifest(te)[0])


def test_conflict_world_hands_the_renamed_tasks_on(tmp_path):
    from papers import cclip_tasks
    assert lab.conflict_world(0.0) is lab.WORLD
    cfg = type("Cfg", (), {"tasks": "synthetic-long", "data_root": str(tmp_path)})()
    renamed = cclip_tasks.resolve_tasks(cfg, lab.conflict_world(0.5))
    today = cclip_tasks.resolve_tasks(cfg, lab.WORLD)
    assert [t.name for t in renamed] == [t.name for t in today] == list(world.TASK_DOMAINS)
    assert all("conflict0.5-long-as-caption" in str(t.train) and "conflict0.5" in str(t.test) for t in renamed)
    assert not any("conflict" in Path(t.train).name + Path(t.test).name for t in today)
