"""benchmarks/sglang_capacity_predict.py on a hand-countable case: 2 sessions, 2 turns, 4
output tokens, SGLang's real pools and radix cache (stock, and the plugin's with IntentKV).

Turn 1 of session x: ``S`` (20 shared system tokens) + ``A_x`` (10); turn 2: turn 1's prompt
+ ``Y_x`` (8). Both sessions arrive together, so both turn-1 prompts are computed in one
prefill batch (neither finds the other's ``S`` in the tree). A request samples its first
token with the prefill and finishes after 3 decode steps (``#token`` is read before each)."""

from __future__ import annotations

import sys
from pathlib import Path

from agentkv.integrations.sglang.request_plan import encode_tags
from agentkv.policies import IntentKV
from agentkv.token_tagger import TokenTags
from agentkv.wire import KVPayload, encode_payload

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from sglang_capacity_predict import Turn, simulate  # noqa: E402

S = list(range(1000, 1020))


def prompts(x: int) -> tuple[list[int], list[int]]:
    a = list(range(2000 + 100 * x, 2010 + 100 * x))
    y = list(range(5000 + 100 * x, 5008 + 100 * x))
    return S + a, S + a + y


def stock_sessions() -> list[list[Turn]]:
    return [[Turn(t1), Turn(t2)] for t1, t2 in map(prompts, range(2))]


def intentkv_turn(ids: list[int], act: int, session: str) -> Turn:
    """IntentKV, budget 8 (below the forced set): system block protected (20), the last
    ``act`` tokens actionable, no tail."""
    n = len(ids)
    tags = TokenTags(ids, [0] * n, [-1] * n, 20, [i >= n - act for i in range(n)], n)
    payload = encode_payload(KVPayload(session_id=session, policy=IntentKV(budget=8)))
    return Turn(ids, {"agentkv": payload, "agentkv_tags": encode_tags(tags)})


def test_stock_tree_holds_the_shared_prefix_once_and_the_earlier_turns():
    r = simulate(stock_sessions(), plugin=False, pool=4096, max_new=4)
    assert r.holds and r.max_running == 2 and r.retractions == 0
    # turn 1: b's copy of S is freed at its insert: 20 + 10 + 10 = 40, +2 per decode step
    # turn 2: S + A_a + A_b locked (40) + Y_a + Y_b (16) = 56, 58, 60; turn 1's 3 output
    # tokens per session stay in the tree, evictable (not in #token)
    assert r.peak_tokens == 60
    assert r.cached_tokens == 60  # turn 2 matches S + A_x (the outputs diverge)
    assert r.prompt_tokens == 2 * 30 + 2 * 38
    assert r.decode_steps == 6


def test_stock_pool_too_small_for_both_sessions_at_once():
    # a needs 30 + 4 + 1 < 40 to be admitted, then b's 35 does not fit the 5 left: b waits;
    # later neither a turn of one (>= 8 + 5 new) fits beside the other's 30 + 4
    r = simulate(stock_sessions(), plugin=False, pool=40, max_new=4)
    assert not r.holds and r.max_running == 1 and r.retractions == 0


def test_plugin_intentkv_keeps_the_forced_set_and_the_sessions_namespaces():
    sessions = []
    for x in range(2):
        t1, t2 = prompts(x)
        sessions.append([intentkv_turn(t1, 6, f"s{x}"), intentkv_turn(t2, 5, f"s{x}")])
    r = simulate(sessions, plugin=True, pool=4096, max_new=4)
    assert r.holds and r.max_running == 2 and r.planned == 4
    # turn 1: forced = S + 6 actionable = 26 of 30 live: 4 evicted per session. Both S
    # copies stay (each session's namespace holds its own row): 2 x 26 + DEAD = 53, 55, 57
    # turn 2: the session's generation matches S + A_x (30, 4 holes); live 26 + 8 new,
    # forced S + 5 = 25 (budget 8 below it): 9 evicted (6 old positions the tree keeps, 3
    # new ones freed). Per session: the locked path (20 + 6) + 5 new = 31; the 3 turn-1
    # outputs are evictable. 2 x 31 + DEAD = 63, 65, 67
    assert r.evicted == 2 * 4 + 2 * 9
    assert r.peak_tokens == 67
    assert r.cached_tokens == 60


# ---- admission as SGLang's scheduler does it: queueing vs retraction --------------------------


def long_turn_sessions(y: int) -> list[list[Turn]]:
    """Turn 2 of session x: turn 1's prompt + ``y`` new tokens (its own block)."""
    out = []
    for x in range(2):
        t1, _ = prompts(x)
        out.append([Turn(t1), Turn(t1 + list(range(7000 + 100 * x, 7000 + 100 * x + y)))])
    return out


def test_stock_a_turn_that_waits_fails_no_queue_but_not_no_retraction():
    # turn 1: both fit (35 + 35 < 100). Turn 2: a2 matches S + A_a (30, locked) and needs
    # 40 + 4 + 1 = 45 < 100 - 30; b2 then needs 45 < 100 - 30 - 10 (A_b locked) - 45: no
    # (NO_TOKEN). SGLang then tries no prefill until a running request leaves: b2 waits for
    # a2 to finish and runs alone. Nothing is retracted; both sessions ran at once in turn 1.
    r = simulate(long_turn_sessions(40), plugin=False, pool=100, max_new=4)
    assert r.retractions == 0 and r.max_running == 2
    assert r.peak_queue == 1
    assert r.holds_under("no-retraction") and not r.holds_under("no-queue")
    assert not r.holds  # the default criterion is no-queue
    r = simulate(
        long_turn_sessions(40), plugin=False, pool=100, max_new=4, criterion="no-retraction"
    )
    assert r.holds
    # with room for both turn-2 requests nothing waits: holds under both
    r = simulate(long_turn_sessions(40), plugin=False, pool=200, max_new=4)
    assert r.peak_queue == 0 and r.holds_under("no-queue") and r.holds


def test_plugin_a_request_held_back_with_nothing_running_is_tried_again_after_the_plan():
    # pool 64 (63 usable beside DEAD): a (30 + 4 + 1) is admitted, b's 35 does not fit the 28
    # left: NO_TOKEN, batch_is_full set on the running batch, which is empty. SGLang's next
    # get_next_batch_to_run merges the extend batch into it by replacing it (its flag is the
    # extend batch's, False), so the adder runs again after a's plan freed 4 slots: b fits
    # (it matches S: 10 + 5 < 63 - 26 - 3 x 0.7), with or without the plugin's release.
    sessions = []
    for x in range(2):
        t1, _ = prompts(x)
        sessions.append([intentkv_turn(t1, 6, f"s{x}")])
    for release in (True, False):
        r = simulate(sessions, plugin=True, pool=64, max_new=4, release_latch=release)
        assert r.retractions == 0 and r.max_running == 2 and r.peak_queue == 0
        assert r.latch_releases == 0 and r.evicted == 2 * 4
    old = simulate(sessions, plugin=True, pool=64, max_new=4, sglang_admission=False)
    assert old.max_running == 2


def three_sessions() -> list[list[Turn]]:
    return [[intentkv_turn(prompts(x)[0], 6, f"s{x}")] for x in range(3)]


def test_plugin_without_the_release_a_request_held_back_stays_out_after_a_plan_frees_room():
    # 3 sessions, 30-token prefill chunks: a runs alone in the first batch (26 live after its
    # plan). Pool 56 (55 usable): in the second batch b (10 + 5 < 55 - 26 - 3 x 0.7) is
    # admitted and c's 15 does not fit what is left (11.9): NO_TOKEN, with a running. b's
    # plan frees 4 of its slots, enough for c (15 < 55 - 26 - 6 - 2 x 3 x 0.7), but with
    # AGENTKV_SGLANG_RELEASE_LATCH=0 SGLang's batch_is_full keeps c out until a leaves.
    r = simulate(three_sessions(), plugin=True, pool=56, max_new=4, chunk=30, release_latch=False)
    assert r.evicted == 3 * 4 and r.latch_releases == 0
    assert r.retractions == 0 and r.max_running == 2 and r.peak_queue == 1
    assert not r.holds_under("no-queue") and not r.holds_under("no-retraction")


def test_plugin_the_release_admits_a_request_held_back_once_the_plan_frees_room():
    # as above with the plugin's default: after b's plan freed slots, after_extend clears
    # batch_is_full; the adder runs at the next step and admits c: all three run at once and
    # c is never left waiting on a logged line (the overlap scheduler logs b's batch once the
    # next one is formed)
    r = simulate(three_sessions(), plugin=True, pool=56, max_new=4, chunk=30)
    assert r.evicted == 3 * 4 and r.latch_releases == 1
    assert r.retractions == 0 and r.max_running == 3 and r.peak_queue == 0
    assert r.holds_under("no-queue")
    # the release only lets the adder look again: at pool 52 b's 4 freed slots are short of
    # c's 15 (51 - 32 - 4.2 = 14.8): c waits, as without it
    r = simulate(three_sessions(), plugin=True, pool=52, max_new=4, chunk=30)
    assert r.latch_releases == 1 and r.max_running == 2 and r.peak_queue == 1
    # stock plans nothing: the release never fires
    stock = [[Turn(prompts(x)[0])] for x in range(3)]
    r = simulate(stock, plugin=False, pool=56, max_new=4, chunk=30)
    assert r.latch_releases == 0 and r.evicted == 0
