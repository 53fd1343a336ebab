"""The browsing agent (examples/browsing/): its tools over the real Wikipedia corpus, its
research tasks checked against that corpus, and one task run end to end on the real default
model through a real HTTP server on 127.0.0.1, with each node's KV policy verified from the
server's telemetry."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "browsing"))

from research_tasks import TASKS, ResearchTask  # noqa: E402
from wiki_corpus import WikiCorpus, make_tools  # noqa: E402

from agentkv import FullCache, GraphPolicy, IntentKV, SnapKV  # noqa: E402


@pytest.fixture(scope="module")
def corpus() -> WikiCorpus:
    return WikiCorpus.load()


@pytest.fixture(scope="module")
def tools(corpus: WikiCorpus) -> dict[str, Any]:
    return {t.name: t for t in make_tools(corpus)}


def test_corpus_is_the_whole_package_and_bm25_ranks_it(corpus: WikiCorpus, tools) -> None:
    assert len(corpus.articles) == 10033
    hits = corpus.search("Eiffel Tower Paris")
    assert hits[0][0].title == "Eiffel Tower"
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    assert corpus.search("the of and") == []  # stopwords only: nothing to rank
    out = tools["search"].invoke({"query": "Marie Curie"})
    assert out.splitlines()[0].startswith("1. Marie Curie (")
    assert tools["open"].invoke({"title": "marie curie"}).startswith("# Marie Curie\n")
    assert "No article titled" in tools["open"].invoke({"title": "Marie Curie II"})
    assert tools["find_in_page"].invoke({"title": "Radium", "text": "atomic number"}) == (
        "- Radium is a chemical element; it has symbol Ra and atomic number 88."
    )
    assert "does not occur" in tools["find_in_page"].invoke({"title": "Radium", "text": "zebra"})


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_task_answers_are_in_what_the_script_reads(task: ResearchTask, tools) -> None:
    """Every fact a turn's answer needs occurs in the observations of that turn's script
    (or of earlier turns, which the agent keeps in its history)."""
    seen = ""
    for turn in task.turns:
        for step in turn.script:
            out = tools[step.name].invoke(step.args)
            assert not out.startswith(("No article", f"{step.args.get('text')!r} does not")), (
                step,
                out,
            )
            seen += out + "\n"
        for fact in turn.facts:
            assert fact in seen, (turn.question, fact)


# ---------------------------------------------------------------- end to end on the model
@pytest.mark.slow
def test_agent_runs_per_node_policies_on_the_engine(server, corpus, tmp_path) -> None:
    from browsing_demo import node_rows, run_demo, write_report

    budget = 64
    per_node = GraphPolicy(
        default=FullCache(),
        nodes={
            "plan": SnapKV(budget=256),
            "browse": IntentKV(budget=budget),
            "answer": "uniform_quant",
        },
    )
    task = ResearchTask("everest-1", TASKS[2].turns[:1])  # search, open: 4 model calls
    lines: list[str] = []
    result = run_demo(
        server.base_url,
        scripted=True,
        tasks=[task],
        configs={"FullCache": GraphPolicy(default=FullCache()), "per-node": per_node},
        max_tokens=2,
        corpus=corpus,
        end_sessions=False,
        print_fn=lines.append,
    )
    assert lines[0].startswith("mode: SCRIPTED")
    records = result["records"]
    for config, policy in (("FullCache", None), ("per-node", per_node)):
        recs = [r for r in records if r.config == config]
        assert [r.node for r in recs] == ["plan", "browse", "browse", "answer"]
        for r in recs:  # the server saw each node, with that node's policy
            assert r.kv is not None and r.kv["node"] == r.node
            want = FullCache() if policy is None else policy.nodes[r.node]
            assert r.kv["policy"] == want.describe()
    rows = node_rows(records)
    full = rows["FullCache"]
    assert full["ALL"]["evicted_tokens"] == 0 and full["ALL"]["quantized_entries"] == 0
    assert full["ALL"]["prefix_hit_tokens"] > 0  # later calls reuse the thread's earlier ones
    browse = [r.kv for r in records if r.config == "per-node" and r.node == "browse"]
    assert sum(kv["evicted_tokens"] for kv in browse) > 0
    for kv in browse:  # IntentKV's budget: the forced set, or the budget when it is larger
        assert kv["planned_live_kv_tokens"] <= max(budget, kv["forced_tokens"]) + 1
    answer = next(r.kv for r in records if r.config == "per-node" and r.node == "answer")
    assert answer["quantized_entries"] > 0
    assert answer["resident_kv_bytes"] < 0.6 * answer["live_kv_bytes"]
    assert rows["per-node"]["ALL"]["peak_live_kv_tokens"] < full["ALL"]["peak_live_kv_tokens"]
    # the server's per-session view agrees: browse ran under its own policy
    root = server.base_url.removesuffix("/v1")
    for session in result["sessions"]:
        url = f"{root}/v1/agentkv/sessions/{session['thread_id']}"
        params = {"cache_salt": session["cache_salt"]}
        r = httpx.get(url, params=params, timeout=30)
        assert r.status_code == 200, r.text
        by_node = r.json()["by_node"]
        assert set(by_node) == {"plan", "browse", "answer"}
        assert by_node["browse"]["requests"] == 2
        per_node_run = session["config"] == "per-node"
        want = f"intentkv(budget={budget})" if per_node_run else "full()"
        assert by_node["browse"]["policies"] == [want]
        assert (by_node["browse"]["evicted_tokens"] > 0) == per_node_run
        assert httpx.delete(url, params=params, timeout=30).status_code == 200
    # the report: the table has one row per node with the policy the server applied
    paths = write_report(result, tmp_path, print_fn=lines.append)
    table = paths["table"].read_text()
    assert f"| per-node | browse | intentkv(budget={budget}) | 2 |" in table
    assert "| FullCache | ALL |  | 4 |" in table
    saved = json.loads(paths["results"].read_text())
    assert len(saved["records"]) == 8 and saved["mode"] == "scripted"
    assert paths["plot"].read_bytes().startswith(b"\x89PNG")


def test_demo_server_reports_a_serve_that_fails_to_start(tmp_path) -> None:
    """`make demo` starts `agentkv serve` itself; when it exits, the demo says so and where
    its log is (here: a model directory that does not exist)."""
    from browsing_demo import agentkv_server

    log = tmp_path / "server.log"
    with (
        pytest.raises(SystemExit, match=r"agentkv serve exited with 2; see .*server\.log"),
        agentkv_server(model=str(tmp_path / "nope"), log_path=log, timeout_s=120),
    ):
        pass
    assert "not a HF model directory" in log.read_text()
