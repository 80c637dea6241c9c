"""The long-caption world's knob (issue 71, item 2; lab/world.py: summary_first, summary_first_manifest; lab.long_world):
lead 0 is the shared world's manifests themselves; a lead > 0 moves only whole-scene sentences, in their order, ahead
of the object sentences, and changes nothing else of a row."""
import collections

import pytest

from plumbing.manifests import read_manifest
import lab
from lab import world

LEADS = (1, 2, 3)


def _sentences(caption: str) -> list[str]:
    return [x if x.endswith(".") else x + "." for x in caption.split(". ")]


def test_lead_zero_is_the_shared_world(tmp_path):
    path = world.synthetic_manifest("val", tmp_path, 8)
    assert world.summary_first_manifest(path, 0) == path
    assert world.lead_manifest(0)("val", tmp_path, 8) == path
    assert lab.long_world(0) is lab.WORLD
    caption = read_manifest(path)[0]["long_caption"]
    assert world.summary_first(caption, 0) == caption


@pytest.mark.parametrize("lead", LEADS)
def test_lead_moves_only_whole_scene_sentences_to_the_front(tmp_path, lead):
    path = world.synthetic_manifest("val", tmp_path, 40)
    moved = read_manifest(world.summary_first_manifest(path, lead))
    assert world.summary_first_manifest(path, lead).name == f"val-40-lead{lead}.jsonl"
    for before, after in zip(read_manifest(path), moved, strict=True):
        assert {k: v for k, v in after.items() if k not in ("long_caption", "_line")} == \
            {k: v for k, v in before.items() if k not in ("long_caption", "_line")}  # pictures, short captions, labels
        old, new = _sentences(before["long_caption"]), _sentences(after["long_caption"])
        assert collections.Counter(old) == collections.Counter(new)  # the same sentences, as often
        scene_wide = [x for x in old if not x.startswith(world.OBJECT_SENTENCE)]
        k = min(lead, len(scene_wide))
        assert new[:k] == scene_wide[:k]  # the first `lead` whole-scene sentences open it, in their order
        rest = list(old)
        for x in scene_wide[:k]:
            rest.remove(x)
        assert new[k:] == rest  # the others keep their order
        assert old[0].startswith(world.OBJECT_SENTENCE) and not new[0].startswith(world.OBJECT_SENTENCE)


def test_long_world_trains_and_tests_on_the_same_order(tmp_path):
    w = lab.long_world(2)
    train = read_manifest(w.synthetic_manifest("train", tmp_path, 6))
    assert all(r["long_caption"] == world.summary_first(s["long_caption"], 2)
               for r, s in zip(train, world.world_split(*world.SPLITS["train"][:1], 6, world.SPLITS["train"][2])))
    assert w.task_manifests is lab.WORLD.task_manifests  # the continual tasks are not this knob's


def test_a_negative_lead_is_refused():
    with pytest.raises(ValueError, match="lead -1"):
        world.summary_first("There is a red circle at the top left.", -1)


def test_the_window_reads_a_third_of_a_long_caption():
    """The measure long-world states (lab.calibrate.window_share): the tiny window's share of val's long captions is
    the paper data's order (ShareGPT4V's 77 of ~207 tokens: 0.36), and no order can change it."""
    from lab import calibrate
    share = calibrate.window_share()
    assert 0.25 < share["window share"] < 0.45 and share["window tokens"] == 22
    assert 4.0 < share["characters per token"] < 5.5
