"""``agentkv`` command line: ``serve``, ``demo``, ``train-intentkv``, ``calibrate-intentkv``,
``train-kvzap`` and ``bench replay|compare|export|merge``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from agentkv.engine.tenancy import DEFAULT_MAX_REQUEST_BYTES  # stdlib only, no torch

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="agentkv: agent-aware KV-cache policies"
)
bench_app = typer.Typer(no_args_is_help=True, help="benchmarks")
app.add_typer(bench_app, name="bench")

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="local HF model directory (default: SmolLM2-135M-Instruct)"),
]
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cpu, cuda, ... (default: cuda if available)")
]
SlotsOpt = Annotated[int, typer.Option("--kv-slots", help="KV pool size in tokens")]
SystemCharsOpt = Annotated[
    int | None, typer.Option(help="cheap runs: cut system prompts to N characters")
]
CalledToolsOpt = Annotated[
    bool, typer.Option(help="cheap runs: keep only the tools a session calls")
]


class ImagePartsChoice(str, Enum):
    """``--image-parts``: what the text-only engine does with image content parts."""

    drop = "drop"
    reject = "reject"


_SERVE_HELP = """Serve the OpenAI-compatible API (/v1/chat/completions, /v1/models, /health)
with the embedded engine.

The KV-cache policy is chosen per request by the client, not here: agentkv's integrations
(with_kv_policy for LangGraph, KVPolicyMiddleware for create_agent, kv_client for the OpenAI
SDK) send it in extra_body.custom_params.agentkv; a request without one runs FullCache.
A policy is an object (IntentKV(budget=512)), its dict ({"method": "h2o", "budget": 32}) or
a spec string "method:key=value,...": "full", "intentkv:budget=512,memory_decay=0.7",
"streamingllm:budget=1024,sinks=4", "snapkv:budget=1024", "h2o:budget=32".

GET /v1/agentkv/capabilities lists the methods this engine implements (others are answered
with HTTP 400 and clients warn at wrap time); GET /v1/agentkv/sessions/{id} gives a
session's KV telemetry with a per-node breakdown; every request is logged (node, policy,
prompt and prefix-hit tokens, live and evicted KV, wall time).

Shared by several clients: give each tenant its own --api-key; a tenant's prefix cache,
sessions and telemetry are out of every other tenant's reach (docs/security.md).

--engine sglang starts SGLang's server instead (python -m sglang.launch_server, SGLang 0.5.17
installed in this Python) with the agentkv plugin enabled (SGLANG_PLUGINS=agentkv,
--attention-backend agentkv, --radix-cache-backend agentkv, --page-size 1); every argument
agentkv does not know is an SGLang server argument and passes through, e.g.
"agentkv serve --engine sglang --model Qwen/Qwen3-8B -- --tp 2 --mem-fraction-static 0.8"
(docs/sglang.md).
"""
#: one line per paragraph: typer's rich help keeps hard line breaks
SERVE_HELP = "\n\n".join(" ".join(p.split()) for p in _SERVE_HELP.split("\n\n"))


def _startup_line(engine, host: str, port: int, kv_slots: int) -> str:
    """The line ``agentkv serve`` prints once the model is loaded."""
    from agentkv.engine.model_loader import fused_ops
    from agentkv.methods import registered_methods

    shape = engine.shape
    bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    bytes_per_token *= engine.dtype.itemsize
    fused = fused_ops(engine.model)
    fused_note = f" + fused {'/'.join(fused)}" if fused else ""  # (CUDA only)
    return (
        f"agentkv serve: model {engine.model_name} on {engine.device} ({str(engine.dtype)[6:]}), "
        f"KV pool {kv_slots} tokens ({kv_slots * bytes_per_token / 2**20:.0f} MiB), "
        f"decode on {engine.decode_attention}{' + CUDA graphs' if engine.decode_graph else ''}"
        f"{fused_note}, "
        f"policies {', '.join(sorted(registered_methods()))}; "
        f"serving http://{host}:{port}/v1"
    )


@app.command(
    help=SERVE_HELP,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve(
    ctx: typer.Context,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
    device: DeviceOpt = None,
    kv_slots: SlotsOpt = 32768,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            help="require 'Authorization: Bearer KEY' on /v1 routes; repeat for more keys, one "
            "tenant each (env AGENTKV_API_KEY, comma-separated)",
        ),
    ] = None,
    admin_api_key: Annotated[
        str | None,
        typer.Option(
            "--admin-api-key",
            help="key for admin routes (POST /v1/agentkv/flush; env AGENTKV_ADMIN_API_KEY)",
        ),
    ] = None,
    max_request_bytes: Annotated[
        int,
        typer.Option(help="reject request bodies larger than this (HTTP 413)", min=1024),
    ] = DEFAULT_MAX_REQUEST_BYTES,
    image_parts: Annotated[
        ImagePartsChoice,
        typer.Option(
            help="image content parts, which the text-only model cannot read: 'drop' them from "
            "the prompt (counted in usage.agentkv.dropped_image_parts) or 'reject' (HTTP 400)",
        ),
    ] = ImagePartsChoice.drop,
    engine_name: Annotated[
        str,
        typer.Option(
            "--engine",
            help="'embedded' (HF transformers, this process) or 'sglang' (python -m "
            "sglang.launch_server with the agentkv plugin; any further argument is an SGLang "
            "server argument, passed through)",
        ),
    ] = "embedded",
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="with --engine sglang: print the command, do not run it"),
    ] = False,
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            help="on CUDA, replay each decode step from a CUDA graph (captured once per "
            "decode-index epoch); --no-cuda-graphs launches every step eagerly",
        ),
    ] = True,
    fused_ops: Annotated[
        bool,
        typer.Option(
            help="on CUDA, run the model's RMSNorm, rotary embedding and SiLU-gated activation "
            "as agentkv's kernels and its q/k/v and gate/up projections as one GEMM each; "
            "--no-fused-ops keeps transformers' own ops (its numerics to the last bit, slower)",
        ),
    ] = True,
) -> None:
    if engine_name == "sglang":
        _serve_sglang(model, host, port, api_key, ctx.args, dry_run)
        return
    if engine_name != "embedded":
        raise typer.BadParameter("must be 'embedded' or 'sglang'", param_hint="--engine")
    if ctx.args:
        raise typer.BadParameter(f"unknown arguments {ctx.args} (SGLang's go with --engine sglang)")
    from agentkv.engine.engine import Engine
    from agentkv.engine.model_loader import ModelNotFound
    from agentkv.engine.server import serve as run_server
    from agentkv.engine.tenancy import ServerOptions

    options = ServerOptions.from_env(api_key, admin_api_key, max_request_bytes, image_parts.value)
    if not fused_ops:  # (process-wide switches: this process serves one engine)
        from agentkv.engine.model_loader import fusion_paths

        for path in fusion_paths().values():
            path.enabled = False

    try:
        engine = Engine(
            model, device=device, kv_slots=kv_slots, cuda_graphs=None if cuda_graphs else False
        )
    except ModelNotFound as e:  # a user error: say so, no traceback
        typer.echo(f"agentkv serve: {e}", err=True)
        raise typer.Exit(2) from None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    agentkv_log = logging.getLogger("agentkv")
    agentkv_log.addHandler(handler)
    agentkv_log.setLevel(logging.INFO)
    typer.echo(_startup_line(engine, host, port, kv_slots), err=True)
    run_server(engine, host=host, port=port, options=options)


def _serve_sglang(
    model: str | None,
    host: str,
    port: int,
    api_key: list[str] | None,
    extra: list[str],
    dry_run: bool,
) -> None:
    """Replace this process with SGLang's server, the agentkv plugin enabled."""
    import os
    import shlex

    from agentkv.engine.sglang_launch import sglang_command

    if not model:
        raise typer.BadParameter(
            "--engine sglang needs --model (a path or hub id)", param_hint="--model"
        )
    if api_key and len(api_key) > 1:
        raise typer.BadParameter("SGLang takes one --api-key", param_hint="--api-key")
    argv, env = sglang_command(model, host, port, api_key[0] if api_key else None, extra)
    line = f"SGLANG_PLUGINS={env['SGLANG_PLUGINS']} " + shlex.join(argv)
    if dry_run:
        typer.echo(line)
        return
    typer.echo(f"agentkv serve: {line}", err=True)
    os.execvpe(argv[0], argv, env)


@app.command()
def demo(
    model: ModelOpt = None,
    device: DeviceOpt = None,
    budgets: Annotated[str, typer.Option(help="comma-separated IntentKV budgets")] = "128,256",
    trace: Annotated[int, typer.Option(help="tau-bench trajectory index")] = 0,
    max_messages: Annotated[
        int, typer.Option(help="replay the first N messages of the trajectory")
    ] = 14,
) -> None:
    """A wrapped LangGraph graph on the embedded engine: per-node KV telemetry per policy."""
    from agentkv.bench.demo import run_demo

    run_demo(
        model=model,
        device=device,
        budgets=[int(b) for b in budgets.split(",") if b],
        trace_index=trace,
        max_messages=max_messages,
    )


@app.command("train-intentkv")
def train_intentkv(
    out: Annotated[Path, typer.Option(help="folder for head.safetensors, metrics and curves")],
    model: ModelOpt = None,
    device: DeviceOpt = None,
    tau_sessions: Annotated[
        int, typer.Option(help="tau-bench trajectories (outside the replay's sample)")
    ] = 6,
    bfcl_sessions: Annotated[
        int, typer.Option(help="BFCL multi-turn sessions (miss_param, miss_func)")
    ] = 6,
    max_tokens: Annotated[
        int, typer.Option(help="truncate each session to this many tokens")
    ] = 4096,
    budget: Annotated[int, typer.Option(help="IntentKV budget the sessions replay under")] = 256,
    epochs: Annotated[int, typer.Option(help="maximum epochs (early stopping on validation)")] = 30,
    seed: Annotated[int, typer.Option(help="split and initialisation seed")] = 0,
    system_chars: SystemCharsOpt = None,
    called_tools_only: CalledToolsOpt = False,
    traces: Annotated[
        Path | None,
        typer.Option(help="more sessions from a JSONL (`agentkv bench export`, e.g. BFCL)"),
    ] = None,
    label: Annotated[
        str,
        typer.Option(
            help="arguments: future tool-call arguments; attention: what the next reply "
            "attends to under FullCache (fidelity-aligned); both: their union"
        ),
    ] = "arguments",
    attention_top: Annotated[
        float | None,
        typer.Option(help="attention labels: positive fraction (default: what the budget keeps)"),
    ] = None,
    calibrate_traces: Annotated[
        int,
        typer.Option(help="pick alpha_max on N held-out tau-bench sessions' replay fidelity"),
    ] = 0,
    alpha_grid: Annotated[
        str, typer.Option(help="comma-separated alpha_max values to calibrate over")
    ] = "0,0.25,0.5,1,2",
    calibrate_budgets: Annotated[
        str | None,
        typer.Option(help="comma-separated budgets to calibrate at (default: --budget)"),
    ] = None,
    calibrate_max_tokens: Annotated[
        str | None,
        typer.Option(help="comma-separated length cuts to calibrate at (default: --max-tokens)"),
    ] = None,
) -> None:
    """Train IntentKV's residual head (Phase-2) for a model on replayed agent sessions.

    Use it with ``IntentKV(mode="learned")``: put OUT under $AGENTKV_INTENTKV_HEADS."""
    from agentkv.train.intentkv_fit import FitConfig, TrainConfig, train_intentkv

    if label not in ("arguments", "attention", "both"):
        raise typer.BadParameter("one of arguments, attention, both", param_hint="--label")
    grid = _alpha_grid(alpha_grid)
    budgets = (
        None if calibrate_budgets is None else _int_list(calibrate_budgets, "--calibrate-budgets")
    )
    cuts = (
        None
        if calibrate_max_tokens is None
        else _int_list(calibrate_max_tokens, "--calibrate-max-tokens")
    )

    with _user_errors():
        m = train_intentkv(
            TrainConfig(
                out=out,
                model=model,
                device=device,
                tau_sessions=tau_sessions,
                bfcl_sessions=bfcl_sessions,
                max_tokens=max_tokens,
                budget=budget,
                system_chars=system_chars,
                called_tools_only=called_tools_only,
                traces_file=traces,
                label=label,
                attention_top=attention_top,
                calibrate_traces=calibrate_traces,
                alpha_grid=grid,
                calibrate_budgets=budgets,
                calibrate_max_tokens=cuts,
                fit=FitConfig(epochs=epochs, seed=seed),
            )
        )
    d = m["dataset"]
    print(
        f"{d['rows']} rows from {d['sessions']} sessions ({d['candidates']} candidates, "
        f"positive rate {d['positive_rate']:.4f}); validation AUC rule {m['rule']['auc']:.3f} "
        f"-> head {m['head']['auc']:.3f}; wrote {out}/head.safetensors"
    )
    if "calibration" in m:
        from agentkv.train.intentkv_fit import calibration_lines

        c = m["calibration"]
        print("alpha_max calibration (top-1 agreement):")
        print("\n".join(calibration_lines(c)))
        print(f"chose alpha_max {c['alpha_max']:g}")


@app.command("calibrate-intentkv")
def calibrate_intentkv(
    head: Annotated[
        Path, typer.Option(help="folder with the head.safetensors to recalibrate (not retrained)")
    ],
    model: ModelOpt = None,
    device: DeviceOpt = None,
    traces: Annotated[
        int,
        typer.Option(help="held-out tau-bench sessions (outside the replay's seeded 50)"),
    ] = 8,
    budgets: Annotated[str, typer.Option(help="comma-separated budgets")] = "256,1024",
    max_tokens: Annotated[
        str, typer.Option(help="comma-separated length cuts (tokens per session)")
    ] = "4096,8192",
    alpha_grid: Annotated[
        str, typer.Option(help="comma-separated alpha_max values (0, the rule, always added)")
    ] = "0,0.25,0.5,1,2",
    out: Annotated[
        Path | None,
        typer.Option(help="folder for head.safetensors, calibration.json/.png (default: --head)"),
    ] = None,
    system_chars: SystemCharsOpt = None,
    called_tools_only: CalledToolsOpt = False,
    trained_tau_sessions: Annotated[
        int,
        typer.Option(
            help="a head without training-trace metadata: also leave out the tasks of "
            "train-intentkv --tau-sessions N's sample (the shipped head: 24)"
        ),
    ] = 0,
) -> None:
    """Recalibrate an IntentKV head's alpha_max over budgets x length cuts, without retraining.

    Writes the same weights with the new alpha_max (the clip ``IntentKV(mode="learned")`` uses
    by default) to OUT; the pick never loses significantly to the rule in any setting
    (agentkv/train/intentkv_fit.py)."""
    from agentkv.methods.intentkv_head import HEAD_FILE, SHIPPED_DIR
    from agentkv.train.intentkv_fit import CalibrateConfig, calibration_lines, recalibrate

    if not (head / HEAD_FILE).is_file():
        raise typer.BadParameter(f"no {HEAD_FILE} in {head}", param_hint="--head")
    if traces < 1:
        raise typer.BadParameter("at least 1 held-out session", param_hint="--traces")
    if trained_tau_sessions < 0:
        raise typer.BadParameter("0 or more", param_hint="--trained-tau-sessions")
    cfg = CalibrateConfig(
        head=head,
        out=head if out is None else out,
        model=model,
        device=device,
        traces=traces,
        budgets=_int_list(budgets, "--budgets"),
        max_tokens=_int_list(max_tokens, "--max-tokens"),
        alpha_grid=_alpha_grid(alpha_grid),
        system_chars=system_chars,
        called_tools_only=called_tools_only,
        trained_tau_sessions=trained_tau_sessions,
    )
    if out is None and _packaged(head, SHIPPED_DIR):
        raise typer.BadParameter(
            f"{head} is a head shipped in the package: give --out (a new folder, or this one "
            "explicitly to overwrite it)",
            param_hint="--out",
        )
    with _user_errors():
        c = recalibrate(cfg)
    print("alpha_max calibration (top-1 agreement):")
    print("\n".join(calibration_lines(c)))
    print(
        f"chose alpha_max {c['alpha_max']:g} (was {c['alpha_max_before']}); wrote "
        f"{cfg.out / HEAD_FILE}, calibration.json, calibration.png"
    )


def _packaged(folder: Path, shipped: Path) -> bool:
    """Whether ``folder`` is a head folder of the package (this install's, or a checkout's)."""
    p = folder.resolve()
    return p.is_relative_to(shipped.resolve()) or p.parent.parts[-3:] == (
        "agentkv",
        "methods",
        "intentkv_heads",
    )


def _int_list(value: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, or a BadParameter naming ``option``."""
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        items = ()
    if not items or any(v <= 0 for v in items):
        raise typer.BadParameter(
            f"comma-separated positive integers, got {value!r}", param_hint=option
        )
    return items


def _alpha_grid(value: str) -> tuple[float, ...]:
    try:
        items = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        items = ()
    if not items or any(not v >= 0 for v in items):
        raise typer.BadParameter(
            f"comma-separated non-negative numbers, got {value!r}", param_hint="--alpha-grid"
        )
    return items


@app.command("train-kvzap")
def train_kvzap(
    out: Annotated[Path, typer.Option(help="folder for the surrogates, metrics and plots")],
    model: ModelOpt = None,
    device: DeviceOpt = None,
    wiki_texts: Annotated[int, typer.Option(help="Wikipedia passages")] = 200,
    trace_texts: Annotated[
        int, typer.Option(help="tau-bench windows (trajectories outside the replay sample)")
    ] = 100,
    prompt_tokens: Annotated[int, typer.Option(help="tokens per training context")] = 256,
    tokens_per_text: Annotated[
        int, typer.Option(help="positions sampled per context (training pairs)")
    ] = 96,
    epochs: Annotated[int, typer.Option(help="MLP epochs")] = 30,
    batch_size: Annotated[int, typer.Option(help="MLP minibatch (pairs)")] = 256,
    seed: Annotated[int, typer.Option(help="sampling and initialisation seed")] = 0,
) -> None:
    """Train KVzap surrogates (linear and MLP) for a model on KVzip+ targets it computes.

    Load the result with ``KVzap(surrogate_path=OUT)``."""
    from agentkv.train.kvzap_fit import TrainConfig
    from agentkv.train.kvzap_fit import train_kvzap as run

    with _user_errors():
        m = run(
            TrainConfig(
                out=out,
                model=model,
                device=device,
                wiki_texts=wiki_texts,
                trace_texts=trace_texts,
                prompt_tokens=prompt_tokens,
                tokens_per_text=tokens_per_text,
                epochs=epochs,
                batch_size=batch_size,
                seed=seed,
            )
        )
    print(
        f"R^2 (validation, mean over layers and heads): linear {m['linear_r2_mean']:.3f}, "
        f"mlp {m['mlp_r2_mean']:.3f}; wrote {out}/linear.safetensors, {out}/mlp.safetensors"
    )


@bench_app.command("replay")
def bench_replay(
    traces: Annotated[
        Path | None, typer.Argument(help="JSONL of {messages, tools} trajectories")
    ] = None,
    source: Annotated[str | None, typer.Option(help="tau-bench | bfcl")] = None,
    policy: Annotated[
        list[str], typer.Option("--policy", help="e.g. full, intentkv:budget=512")
    ] = ["full"],  # noqa: B006
    limit: Annotated[
        int | None, typer.Option(help="replay N trajectories (deterministic sample)")
    ] = None,
    out: Annotated[Path, typer.Option(help="output folder")] = Path("out/replay"),
    model: ModelOpt = None,
    device: DeviceOpt = None,
    max_tokens: Annotated[
        int, typer.Option(help="truncate each trajectory to this many tokens")
    ] = 4096,
    greedy_tokens: Annotated[
        int, typer.Option(help="greedy continuation tokens compared per turn")
    ] = 32,
    skip: Annotated[int, typer.Option(help="skip the first N sampled trajectories")] = 0,
    max_seconds: Annotated[
        float | None, typer.Option(help="start no new trajectory after this many seconds")
    ] = None,
    shard: Annotated[
        str | None, typer.Option(help="i/n: replay every n-th trajectory from the i-th")
    ] = None,
    skip_done: Annotated[
        list[Path] | None,
        typer.Option(help="results.json of earlier runs: skip the trajectories they hold"),
    ] = None,
) -> None:
    """Replay multi-turn trajectories under several policies; fidelity vs FullCache and memory."""
    from agentkv.bench.replay import run_replay_cli

    with _user_errors():
        run_replay_cli(
            traces=traces,
            source=source,
            policies=policy,
            limit=limit,
            out=out,
            model=model,
            device=device,
            max_tokens=max_tokens,
            greedy_tokens=greedy_tokens,
            skip=skip,
            max_seconds=max_seconds,
            shard=shard,
            skip_done=skip_done or [],
        )


@bench_app.command("export")
def bench_export(
    source: Annotated[str, typer.Option(help="tau-bench | bfcl | bfcl:<category>")],
    out: Annotated[Path, typer.Option(help="JSONL file to write")],
    limit: Annotated[
        int | None, typer.Option(help="N trajectories (the sample `replay --limit N` uses)")
    ] = None,
) -> None:
    """Write a trace source as JSONL (one trajectory a line), to replay where the source's
    package or data is not installed (`agentkv bench replay FILE.jsonl`)."""
    from agentkv.bench.replay import load_traces

    with _user_errors():
        traces = load_traces(None, source, limit)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(t.to_json() + "\n" for t in traces), encoding="utf-8")
    print(f"wrote {len(traces)} trajectories to {out}", file=sys.stderr)


@bench_app.command("merge")
def bench_merge(
    results: Annotated[list[Path], typer.Argument(help="results.json files of one run's shards")],
    out: Annotated[Path, typer.Option(help="output folder")] = Path("out/replay"),
) -> None:
    """Merge sharded replay results into one results.json, summary.md and plot."""
    from agentkv.bench.replay import merge_results, summary_table, write_outputs

    report = merge_results(results)
    write_outputs(report, out)
    print(summary_table(report))


@bench_app.command("compare")
def bench_compare(
    results: Annotated[Path, typer.Argument(help="results.json of a replay")],
    a: Annotated[str, typer.Argument(help="policy label, e.g. 'snapkv(budget=1024)'")],
    b: Annotated[str, typer.Argument(help="the policy to compare it with")],
) -> None:
    """Paired bootstrap (over trajectories) of the top-1 agreement difference A - B."""
    from agentkv.bench.replay import compare_policies, merge_results

    with _user_errors():
        print(compare_policies(merge_results([results]), a, b))


@contextmanager
def _user_errors() -> Iterator[None]:
    """Bad input (traces, policy specs, paths) -> one line on stderr and exit code 2."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
