"""The computer-use agent end to end: the real LangGraph agent drives the REAL headless
Chromium (Debian's package, through Playwright) over the example's shop on 127.0.0.1, every
model call goes through the real engine's HTTP server on the default model (scripted mode),
and the per-node policies are checked in the server's own telemetry."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("playwright")
pytest.importorskip("langgraph")

from agentkv.annotation import annotate_messages  # noqa: E402
from agentkv.tags import Modality, Role  # noqa: E402


def _chromium_or_skip() -> None:
    from examples.computer_use.browser import BrowserMissing, find_chromium

    try:
        find_chromium()
    except BrowserMissing as e:
        if os.geteuid() == 0:  # `make test` installs it as root: missing here is a failure
            pytest.fail(f"{e} (make chromium)")
        pytest.skip(str(e))


def _images(messages) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image_url"
    )


def test_browser_tools_drive_the_shop():
    """The agent's tools on the real Chromium, no model: search, open, add to cart; a failed
    click is an observation; scroll and go_back move around. Each returns [text, image]."""
    _chromium_or_skip()
    from examples.computer_use.agent import browser_tools
    from examples.computer_use.browser import Browser
    from examples.computer_use.web_app import ShopServer

    with ShopServer() as shop, Browser() as b:
        first = b.goto(shop.url)
        assert 'searchbox "Search products"' in first.tree
        assert first.screenshot[:2] == b"\xff\xd8"  # a JPEG
        tools = {t.name: t for t in browser_tools(b)}

        def text(parts):
            assert [p["type"] for p in parts] == ["text", "image_url"]
            assert parts[1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
            return parts[0]["text"]

        found = text(
            tools["type"].invoke(
                {"role": "searchbox", "name": "Search products", "text": "blue mug", "submit": True}
            )
        )
        assert "/search?q=blue+mug" in found and 'link "Blue ceramic mug"' in found
        text(tools["click"].invoke({"role": "link", "name": "Blue ceramic mug"}))
        added = text(tools["click"].invoke({"role": "button", "name": "Add to cart"}))
        assert "/cart" in added and shop.state.cart == {1: 1}
        missing = text(tools["click"].invoke({"role": "button", "name": "No such button"}))
        assert missing.startswith("Failed: clicked button 'No such button'")
        assert text(tools["scroll"].invoke({"direction": "down"})).startswith("Done: scrolled")
        assert "/product/1" in text(tools["go_back"].invoke({}))


@pytest.fixture(scope="module")
def report(server):
    _chromium_or_skip()
    from examples.computer_use.agent import SHORT_TASK
    from examples.computer_use.run import run_computer_use

    return run_computer_use(
        SHORT_TASK,
        base_url=server.base_url,
        scripted=True,
        max_tokens=4,
        vlm_cost=False,
        progress=False,
    )


@pytest.mark.slow
def test_agent_operates_the_real_browser(report):
    """Scripted mode still acts in Chromium: the shop's cart holds the blue mug."""
    assert report.mode == "scripted"
    assert report.chromium.split(".")[0].isdigit()  # a real Chromium answered
    assert report.cart == {1: 1}
    assert len(report.answers) == 2


@pytest.mark.slow
def test_per_node_policies_in_the_servers_telemetry(report):
    # the server's own session record: which node sent which policy
    by_node = report.session["by_node"]
    assert set(by_node) == {"act", "report"}
    assert by_node["act"]["policies"] == ["intentkv(budget=512)"]
    assert by_node["report"]["policies"] == ["uniform_quant()"]  # bits=4 is the default
    # turn 1: one action then done; turn 2: two actions then done; one report per turn
    assert by_node["act"]["requests"] == 5 and by_node["report"]["requests"] == 2
    rows = report.rows()
    assert rows["act"]["evicted"] > 0 and rows["act"]["quantized"] == 0  # IntentKV evicts
    assert rows["report"]["quantized"] > 0 and rows["report"]["evicted"] == 0  # INT4 keeps all
    assert rows["act"]["prefix_hits"] > 0  # the growing conversation reuses its prefix


@pytest.mark.slow
def test_screenshots_are_tagged_obs_image_and_dropped_with_a_count(report):
    """The client tags the tool results' parts obs/text + obs/image; the text-only engine
    drops exactly the screenshots it was sent and says so in every response."""
    assert len(report.calls) == len(report.requests) == 7
    sent = [_images(messages) for _, messages, _ in report.calls]
    assert sent == [u["dropped_image_parts"] for u in report.requests]
    assert sent[-1] == 3  # every screenshot of the session is still in the conversation
    _, last, _ = report.calls[-1]
    tool_results = [a for a in annotate_messages(last) if a.role == "tool"]
    assert len(tool_results) == 3
    for a in tool_results:
        assert [(p.semantic, p.modality) for p in a.parts] == [
            (Role.OBS, Modality.TEXT),
            (Role.OBS, Modality.IMAGE),
        ]


@pytest.mark.slow
def test_vlm_screenshot_cost_ages_through_the_buckets(report, gemma3):
    from examples.computer_use.vlm_cost import screenshot_cost

    costs = screenshot_cost(report.calls[-2:], gemma3)  # the last act call, the last report
    act = costs[0]
    assert act.node == "act" and act.images == 3
    assert act.image_tokens == 3 * 258
    # turn 1's screenshot is a turn old; turn 2's two are current
    assert act.image_tokens_by_bucket == {"current": 516, "turn_m1": 258, "turn_m2": 0, "older": 0}
