"""``agentkv train-intentkv``: fit IntentKV's residual head on replayed agent sessions.

Data (:mod:`agentkv.train.intentkv_data`): BFCL multi-turn sessions of categories other than
the replay evaluation's (``multi_turn_base``) and tau-bench airline trajectories outside the
replay's evaluation sample (the seeded 50), replayed under IntentKV (memory mode). Rows are
split by session into training and validation.

Loss per row (candidates with label >= 0; ``z = s~`` the head's scores)::

    BCE(z, y; pos_weight = clip(n_neg / n_pos, 1, max_pos_weight))
    + lambda1 * mean_{p in pos} mean_{n in top-k hard negatives} softplus(z_n - z_p)
    + lambda2 * mean(sigmoid(z))
    + lambda3 * mean((||m|| - 1)^2)

Only the head trains (the LLM is frozen: rows hold its features). AdamW, early stopping on
the validation loss; the best head is written as ``OUT/head.safetensors`` with
``metrics.json`` and ``curves.png`` (loss and ranking curves).

Labels (``TrainConfig.label``): "arguments" (future tool-call arguments, the default),
"attention" (what the next reply attends to under FullCache: fidelity-aligned) or "both"
(:mod:`agentkv.train.intentkv_data`).

Calibration (``TrainConfig.calibrate_traces > 0``, or ``agentkv calibrate-intentkv`` on an
existing head): ``s~ = rule + alpha MLP`` with ``alpha`` clipped to ``[0, alpha_max]``, and
``alpha_max = 0`` is exactly the rule. Held-out sessions (tau-bench tasks neither in the
replay's evaluation sample, the seeded 50, nor in the head's training sessions when the
checkpoint names them) are replayed (:func:`agentkv.bench.replay.replay`) under
``IntentKV(mode="learned", alpha_max=a)`` for each ``a`` of a grid (0 is always added) in
every *setting*: each budget (default: the training budget) x each length cut (default: the
training cut). The selection rule (:func:`choose_alpha_max`, the only one):

1. per setting and ``a > 0``: the paired top-1 difference ``a`` minus ``0`` (the rule) on the
   same tokens and its 95% bootstrap interval over trajectories
   (:func:`agentkv.bench.replay.compare_policies`);
2. ``a`` *loses* in a setting when that interval's upper bound is below 0; ``a`` is
   *admissible* when it loses in no setting AND its mean difference over the settings is
   >= 0 (``0``, the rule, is always admissible);
3. among the admissible values, the highest mean top-1 agreement over the settings
   (unweighted), ties: the lower mean KL to FullCache over the settings, then the smaller
   ``a``; so when no ``a > 0`` is admissible the pick is 0.

With one held-out trajectory the interval is the point estimate, so any negative difference
is a loss. The pick goes into the checkpoint (``alpha_max`` metadata), so the learned mode
does not lose to the rule in any calibrated setting by construction, and a chosen 0 says
plainly that the head did not help there. ``metrics.json`` (``calibration.json`` for
``calibrate-intentkv``) gets the table per setting and per ``a``, ``calibration.png`` the
paired differences, one line per setting.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentkv.methods.intentkv_head import HEAD_FILE, HeadConfig, ResidualHead, rule_logit
from agentkv.train.intentkv_data import Row


@dataclass
class LossConfig:
    lambda_rank: float = 0.5
    lambda_keep: float = 0.01
    lambda_norm: float = 0.01
    max_pos_weight: float = 20.0
    hard_negatives: int = 16


@dataclass
class FitConfig:
    epochs: int = 30
    lr: float = 1e-3
    weight_decay: float = 0.01
    patience: int = 5
    hidden: int = 128
    attn_heads: int = 4
    seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)


def row_loss(
    head: ResidualHead, row: Row, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one row and its parts (module docstring)."""
    z = head(rule_logit(row.rule), row.keys, row.memory, row.q_keys)
    y = row.labels
    use = y >= 0
    z, yf = z[use], (y[use] == 1).float()
    n_pos = float(yf.sum())
    n_neg = float(yf.numel()) - n_pos
    pos_weight = torch.tensor(min(max(n_neg / max(n_pos, 1.0), 1.0), cfg.max_pos_weight))
    bce = F.binary_cross_entropy_with_logits(z, yf, pos_weight=pos_weight)
    pos, neg = z[yf == 1], z[yf == 0]
    rank = z.new_zeros(())
    if pos.numel() and neg.numel():
        hard = torch.topk(neg, min(cfg.hard_negatives, neg.numel())).values
        rank = F.softplus(hard[None, :] - pos[:, None]).mean()
    keep = torch.sigmoid(z).mean()
    norm = ((row.memory_norm - 1.0) ** 2).mean()
    total = bce + cfg.lambda_rank * rank + cfg.lambda_keep * keep + cfg.lambda_norm * norm
    parts = {"bce": float(bce.detach()), "rank": float(rank.detach()), "keep": float(keep.detach())}
    return total, parts


@torch.no_grad()
def ranking_metrics(head: ResidualHead | None, rows: list[Row]) -> dict[str, float]:
    """Mean over rows of the AUC of positives vs negatives and of the recall of positives in
    the top 25% of candidates, for the head (or the rule alone when ``head`` is None)."""
    aucs, recalls = [], []
    for row in rows:
        z = (
            rule_logit(row.rule)
            if head is None
            else head(rule_logit(row.rule), row.keys, row.memory, row.q_keys)
        )
        use = row.labels >= 0
        z, y = z[use], row.labels[use] == 1
        pos, neg = z[y], z[~y]
        if not pos.numel() or not neg.numel():
            continue
        aucs.append(float((pos[:, None] > neg[None, :]).float().mean()))
        k = max(1, z.numel() // 4)
        top = torch.topk(z, k).indices
        recalls.append(float(y[top].sum()) / float(y.sum()))
    n = max(len(aucs), 1)
    return {"auc": sum(aucs) / n, "recall_top25": sum(recalls) / n}


def split_by_session(
    rows: list[Row], val_fraction: float, seed: int
) -> tuple[list[Row], list[Row]]:
    sessions = sorted({r.session for r in rows})
    random.Random(seed).shuffle(sessions)
    n_val = max(1, round(len(sessions) * val_fraction)) if len(sessions) > 1 else 0
    val = set(sessions[:n_val])
    return [r for r in rows if r.session not in val], [r for r in rows if r.session in val]


def fit(
    rows_train: list[Row],
    rows_val: list[Row],
    config: HeadConfig,
    cfg: FitConfig,
    progress: bool = True,
) -> tuple[ResidualHead, dict[str, Any]]:
    """Train a head; returns the best (lowest validation loss) head and the curves."""
    from tqdm.auto import tqdm

    torch.manual_seed(cfg.seed)
    head = ResidualHead(config)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    history: dict[str, list[float]] = {
        k: [] for k in ("train_loss", "val_loss", "val_auc", "val_recall_top25", "alpha")
    }
    best_state, best_val, best_epoch, stale = None, float("inf"), -1, 0
    eval_rows = rows_val or rows_train
    bar = tqdm(range(cfg.epochs), desc="epochs", unit="epoch", disable=not progress)
    for epoch in bar:
        head.train()
        order = list(range(len(rows_train)))
        rng.shuffle(order)
        total = 0.0
        for i in order:
            loss, _ = row_loss(head, rows_train[i], cfg.loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        head.eval()
        with torch.no_grad():
            val = sum(float(row_loss(head, r, cfg.loss)[0]) for r in eval_rows) / len(eval_rows)
        m = ranking_metrics(head, eval_rows)
        history["train_loss"].append(total / max(len(order), 1))
        history["val_loss"].append(val)
        history["val_auc"].append(m["auc"])
        history["val_recall_top25"].append(m["recall_top25"])
        history["alpha"].append(float(head.alpha.detach()))
        bar.set_postfix(val_loss=f"{val:.4f}", auc=f"{m['auc']:.3f}")
        if val < best_val - 1e-5:
            best_val, best_epoch, stale = val, epoch, 0
            best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    if best_state is not None:
        head.load_state_dict(best_state)
    head.eval()
    return head, {"history": history, "best_epoch": best_epoch, "best_val_loss": best_val}


def plot_curves(history: dict[str, list[float]], rule: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    epochs = range(1, len(history["train_loss"]) + 1)
    a.plot(epochs, history["train_loss"], label="train")
    a.plot(epochs, history["val_loss"], label="validation")
    a.set_xlabel("epoch")
    a.set_ylabel("loss")
    a.legend()
    b.plot(epochs, history["val_auc"], label="head AUC")
    b.plot(epochs, history["val_recall_top25"], label="head recall@25%")
    b.axhline(rule["auc"], ls="--", c="C0", label="rule AUC")
    b.axhline(rule["recall_top25"], ls="--", c="C1", label="rule recall@25%")
    b.set_xlabel("epoch")
    b.set_ylabel("validation ranking")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class TrainConfig:
    out: Path
    model: str | None = None
    device: str | None = None
    tau_sessions: int = 6
    bfcl_sessions: int = 6
    bfcl_categories: tuple[str, ...] = ("multi_turn_miss_param", "multi_turn_miss_func")
    max_tokens: int = 4096
    budget: int = 256
    val_fraction: float = 0.25
    #: cheap runs (CPU): cut each system prompt to this many characters (None: whole)
    system_chars: int | None = None
    #: cheap runs (CPU): keep only the tool schemas a session calls
    called_tools_only: bool = False
    #: more sessions from a JSONL (``agentkv bench export``), e.g. BFCL where bfcl-eval is absent
    traces_file: Path | None = None
    #: "arguments" | "attention" | "both" (module docstring)
    label: str = "arguments"
    #: attention labels: positive fraction of the candidates (None: what the policy keeps)
    attention_top: float | None = None
    #: held-out tau-bench sessions to calibrate alpha_max on (0: no calibration)
    calibrate_traces: int = 0
    alpha_grid: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0)
    #: budgets to calibrate at (None: ``budget``)
    calibrate_budgets: tuple[int, ...] | None = None
    #: length cuts to calibrate at (None: ``max_tokens``)
    calibrate_max_tokens: tuple[int, ...] | None = None
    fit: FitConfig = field(default_factory=FitConfig)


def compact(trace: Any, system_chars: int | None, called_tools_only: bool) -> Any:
    """A copy of ``trace`` with its system prompt cut and/or its tool list reduced to the tools
    it calls (to train on CPU in minutes; the features do not depend on the block's size)."""
    import copy

    t = copy.deepcopy(trace)
    if system_chars is not None:
        for m in t.messages:
            if m.get("role") == "system" and isinstance(m.get("content"), str):
                m["content"] = m["content"][:system_chars]
    if called_tools_only and t.tools:
        called = {
            (c.get("function") or {}).get("name")
            for m in t.messages
            for c in m.get("tool_calls") or []
        }
        t.tools = [x for x in t.tools if (x.get("function") or {}).get("name") in called]
    return t


#: checkpoint metadata: the ids of the sessions a head was trained on (JSON list)
TRAINING_TRACES = "training_traces"


def _task(trace_id: str) -> str:
    return trace_id.rsplit("/", 1)[0]


def calibration_traces(n: int, exclude: set[str]) -> list[Any]:
    """``n`` tau-bench trajectories of tasks neither in the replay's evaluation sample (the
    seeded 50) nor among the tasks of the trace ids ``exclude`` (training)."""
    from agentkv.bench.traces import load_tau_bench, sample

    tau = load_tau_bench()
    held_out = {_task(t.id) for t in sample(tau, limit=50, seed=0)} | {_task(i) for i in exclude}
    return sample([t for t in tau if _task(t.id) not in held_out], limit=n, seed=2)


def setting_name(setting: dict[str, Any]) -> str:
    return f"budget {setting['budget']}, {setting['max_tokens']} tokens"


def calibrate_alpha_max(
    engine: Any,
    head: ResidualHead,
    traces: list[Any],
    budgets: Sequence[int],
    grid: Sequence[float],
    max_tokens: Sequence[int] = (4096,),
    progress: bool = True,
) -> dict[str, Any]:
    """Replay ``traces`` under ``IntentKV(mode="learned", budget=b, alpha_max=a)`` with
    ``head`` for each budget ``b``, each ``a`` of ``grid`` (plus 0) and each length cut of
    ``max_tokens`` (one replay per cut: the FullCache reference once); the pick follows the
    module docstring's rule. Returns ``{"alpha_max", "grid", "settings", "summary",
    "traces"}``: ``settings`` one entry per (budget, cut), ``{"budget", "max_tokens",
    "traces", "turns", "tokens", "table"}``, each table row ``{"alpha_max",
    "top1_agreement", "top1_ci95", "mean_kl", "tokens"}`` and, for ``a > 0``, ``"vs_rule":
    {"difference", "ci95"}`` (paired, ``a`` minus 0); ``summary`` is
    :func:`alpha_summary`."""
    from agentkv.bench.replay import compare_policies, replay
    from agentkv.methods.intentkv import IntentKVMethod
    from agentkv.policies import IntentKV

    if not grid or any(a < 0 for a in grid):
        raise ValueError(f"alpha_grid: non-negative values needed, got {tuple(grid)}")
    if not budgets or any(b <= 0 for b in budgets):
        raise ValueError(f"budgets: positive values needed, got {tuple(budgets)}")
    if not max_tokens or any(t <= 0 for t in max_tokens):
        raise ValueError(f"max_tokens: positive values needed, got {tuple(max_tokens)}")
    grid = tuple(sorted(set(grid) | {0.0}))
    budgets, cuts = tuple(sorted(set(budgets))), tuple(sorted(set(max_tokens)))
    policies = {
        (b, a): IntentKV(budget=b, protect_system=False, mode="learned", alpha_max=a)
        for b in budgets
        for a in grid
    }
    method = engine.methods.for_policy(next(iter(policies.values())))
    assert isinstance(method, IntentKVMethod)
    settings: list[dict[str, Any]] = []
    used: list[str] = []
    method.use_head(head)
    try:
        for cut in cuts:
            report = replay(
                engine,
                traces,
                list(policies.values()),
                greedy_tokens=0,
                max_tokens=cut,
                progress=progress,
            )
            if not report.traces:
                raise ValueError(
                    f"calibration: no held-out session has an assistant turn within {cut} tokens"
                )
            used += [t for t in report.traces if t not in used]
            summaries = {s.label: s for s in report.summaries}
            for b in budgets:
                rule = policies[(b, 0.0)].describe()
                table = []
                for a in grid:
                    s = summaries[policies[(b, a)].describe()]
                    row: dict[str, Any] = {
                        "alpha_max": a,
                        "top1_agreement": s.top1_agreement,
                        "top1_ci95": list(s.top1_ci95),
                        "mean_kl": s.mean_kl,
                        "tokens": s.tokens,
                    }
                    if a > 0:
                        c = compare_policies(report, s.label, rule)
                        row["vs_rule"] = {"difference": c.top1_difference, "ci95": list(c.ci95)}
                    table.append(row)
                settings.append(
                    {
                        "budget": b,
                        "max_tokens": cut,
                        "traces": report.traces,
                        "turns": summaries[rule].turns,
                        "tokens": summaries[rule].tokens,
                        "table": table,
                    }
                )
    finally:
        method.use_head(None)
    return {
        "alpha_max": choose_alpha_max(settings),
        "grid": list(grid),
        "settings": settings,
        "summary": alpha_summary(settings),
        "traces": used,
    }


def alpha_summary(settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per grid value over the calibration ``settings`` (:func:`calibrate_alpha_max`):
    ``{"alpha_max", "mean_top1_agreement", "mean_kl", "mean_difference", "losses",
    "admissible"}``; ``losses`` names the settings where the paired difference with the rule
    is significantly negative (95% upper bound < 0); the rule (0) is always admissible."""
    if not settings:
        raise ValueError("calibration: no setting")
    grids = [[float(r["alpha_max"]) for r in s["table"]] for s in settings]
    if any(g != grids[0] for g in grids) or 0.0 not in grids[0]:
        raise ValueError("calibration: every setting needs the same grid, 0 (the rule) in it")
    n = len(settings)
    out = []
    for i, a in enumerate(grids[0]):
        rows = [s["table"][i] for s in settings]
        if a > 0:
            diffs = [float(r["vs_rule"]["difference"]) for r in rows]
            losses = [
                setting_name(s)
                for s, r in zip(settings, rows, strict=True)
                if float(r["vs_rule"]["ci95"][1]) < 0
            ]
        else:
            diffs, losses = [0.0] * n, []
        mean_diff = sum(diffs) / n
        out.append(
            {
                "alpha_max": a,
                "mean_top1_agreement": sum(float(r["top1_agreement"]) for r in rows) / n,
                "mean_kl": sum(float(r["mean_kl"]) for r in rows) / n,
                "mean_difference": mean_diff,
                "losses": losses,
                "admissible": not losses and mean_diff >= 0,
            }
        )
    return out


def choose_alpha_max(settings: list[dict[str, Any]]) -> float:
    """The calibration's pick (module docstring): among the admissible grid values (no
    significant loss to the rule in any setting, mean paired difference >= 0; the rule always
    is), the highest mean top-1 agreement over the settings, then the lowest mean KL, then the
    smaller value; 0 when no ``alpha_max > 0`` is admissible."""
    admissible = [r for r in alpha_summary(settings) if r["admissible"]]
    best = max(admissible, key=lambda r: (r["mean_top1_agreement"], -r["mean_kl"], -r["alpha_max"]))
    return float(best["alpha_max"])


def plot_calibration(calibration: dict[str, Any], path: Path) -> None:
    """Paired top-1 difference with the rule (95% interval) against ``alpha_max``, one line
    per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    grid = calibration["grid"]
    x = list(range(len(grid)))
    for k, s in enumerate(calibration["settings"]):
        d = [r["vs_rule"]["difference"] if "vs_rule" in r else 0.0 for r in s["table"]]
        ci = [r["vs_rule"]["ci95"] if "vs_rule" in r else (0.0, 0.0) for r in s["table"]]
        xs = [i + 0.04 * (k - (len(calibration["settings"]) - 1) / 2) for i in x]
        ax.errorbar(
            xs,
            d,
            yerr=[
                [v - c[0] for v, c in zip(d, ci, strict=True)],
                [c[1] - v for v, c in zip(d, ci, strict=True)],
            ],
            marker="o",
            capsize=3,
            label=setting_name(s),
        )
    ax.axhline(0.0, c="gray", lw=0.8)
    ax.axvline(grid.index(calibration["alpha_max"]), c="k", ls=":", lw=0.8)
    ax.set_xticks(x, [f"{a:g}" for a in grid])
    ax.set_xlabel("alpha_max (0 = the rule)")
    ax.set_ylabel("top-1 agreement minus the rule's")
    ax.set_title(
        f"{len(calibration['traces'])} held-out sessions, chose {calibration['alpha_max']:g}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibration_lines(calibration: dict[str, Any]) -> list[str]:
    """A short text table of a calibration (per setting: top-1 per grid value)."""
    lines = []
    for s in calibration["settings"]:
        cells = ", ".join(f"{r['alpha_max']:g}: {r['top1_agreement']:.4f}" for r in s["table"])
        lines.append(f"  {setting_name(s)} ({s['turns']} turns): {cells}")
    for r in calibration["summary"]:
        if r["alpha_max"] > 0:
            verdict = "admissible" if r["admissible"] else "not admissible"
            lost = f", loses at {'; '.join(r['losses'])}" if r["losses"] else ""
            lines.append(
                f"  alpha_max {r['alpha_max']:g}: mean difference {r['mean_difference']:+.4f}"
                f"{lost}: {verdict}"
            )
    return lines


def tau_training_sample(n: int) -> list[Any]:
    """The ``n`` tau-bench trajectories ``train-intentkv --tau-sessions n`` trains on: tasks
    outside the replay's evaluation sample (the seeded 50), sampled with seed 1."""
    from agentkv.bench.traces import load_tau_bench, sample

    tau = load_tau_bench()
    # whole tasks are held out: another trial of an evaluated task is not training data
    held_out = {_task(t.id) for t in sample(tau, limit=50, seed=0)}
    rest = [t for t in tau if _task(t.id) not in held_out]
    return sample(rest, limit=n, seed=1)


def training_traces(cfg: TrainConfig) -> list[Any]:
    """tau-bench trajectories of tasks outside the replay's evaluation sample (the seeded 50)
    and BFCL sessions of the given categories (never ``multi_turn_base``, the replay's)."""
    import warnings

    traces = []
    if cfg.tau_sessions:
        traces += tau_training_sample(cfg.tau_sessions)
    if cfg.bfcl_sessions and cfg.bfcl_categories:
        from agentkv.bench.bfcl_traces import load_bfcl

        per = -(-cfg.bfcl_sessions // len(cfg.bfcl_categories))
        for k, cat in enumerate(cfg.bfcl_categories):
            if cat.endswith("multi_turn_base"):
                raise ValueError("bfcl_categories: multi_turn_base is the replay's evaluation set")
            try:
                traces += load_bfcl(cat, limit=per, seed=1 + k)
            except (ImportError, FileNotFoundError) as e:  # bfcl-eval not installed
                warnings.warn(f"BFCL {cat} skipped: {e}", stacklevel=2)
    if cfg.traces_file is not None:
        from agentkv.bench.traces import load_jsonl

        traces += load_jsonl(cfg.traces_file)
    return traces


def train_intentkv(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Collect rows, fit, write ``head.safetensors``, ``metrics.json``, ``curves.png``."""
    from agentkv.engine.engine import Engine
    from agentkv.policies import IntentKV
    from agentkv.train.intentkv_attention import AttentionLabeler
    from agentkv.train.intentkv_data import LABELS, collect_rows

    if cfg.label not in LABELS:
        raise ValueError(f"label: one of {', '.join(LABELS)}, got {cfg.label!r}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    engine = Engine(cfg.model, device=cfg.device)
    policy = IntentKV(budget=cfg.budget, protect_system=False)
    traces = [compact(t, cfg.system_chars, cfg.called_tools_only) for t in training_traces(cfg)]
    labeler = None
    if cfg.label != "arguments":
        labeler = AttentionLabeler.load(cfg.model, str(engine.device))
    rows, stats = collect_rows(
        engine,
        traces,
        policy,
        cfg.max_tokens,
        progress=progress,
        label=cfg.label,
        labeler=labeler,
        attention_top=cfg.attention_top,
    )
    del labeler
    if len(rows) < 2:
        raise ValueError(f"only {len(rows)} training rows with a positive: add sessions")
    torch.save([asdict(r) for r in rows], cfg.out / "rows.pt")
    train, val = split_by_session(rows, cfg.val_fraction, cfg.fit.seed)
    config = HeadConfig.for_shape(
        engine.shape, model=engine.model_name, hidden=cfg.fit.hidden, attn_heads=cfg.fit.attn_heads
    )
    head, result = fit(train, val, config, cfg.fit, progress=progress)
    rule = ranking_metrics(None, val or train)
    learned = ranking_metrics(head, val or train)
    metrics = {
        "model": engine.model_name,
        "dataset": asdict(stats) | {"positive_rate": stats.positive_rate},
        "train_rows": len(train),
        "val_rows": len(val),
        "val_sessions": sorted({r.session for r in val}),
        "rule": rule,
        "head": learned,
        "alpha": float(head.alpha.detach()),
        "best_epoch": result["best_epoch"],
        "best_val_loss": result["best_val_loss"],
        "history": result["history"],
        "config": {
            "budget": cfg.budget,
            "max_tokens": cfg.max_tokens,
            "system_chars": cfg.system_chars,
            "called_tools_only": cfg.called_tools_only,
            "label": cfg.label,
            "attention_top": cfg.attention_top,
            "calibrate_traces": cfg.calibrate_traces,
            "alpha_grid": list(cfg.alpha_grid),
            "calibrate_budgets": list(cfg.calibrate_budgets or (cfg.budget,)),
            "calibrate_max_tokens": list(cfg.calibrate_max_tokens or (cfg.max_tokens,)),
            "fit": asdict(cfg.fit),
        },
    }
    meta = {"model": engine.model_name, TRAINING_TRACES: json.dumps(sorted(t.id for t in traces))}
    # written before the calibration too: a run stopped while calibrating keeps its head
    # (``agentkv calibrate-intentkv --head OUT`` then calibrates it)
    head.save(cfg.out / HEAD_FILE, meta)
    (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot_curves(result["history"], rule, cfg.out / "curves.png")
    if cfg.calibrate_traces:
        held = [
            compact(t, cfg.system_chars, cfg.called_tools_only)
            for t in calibration_traces(cfg.calibrate_traces, {t.id for t in traces})
        ]
        calibration = calibrate_alpha_max(
            engine,
            head,
            held,
            cfg.calibrate_budgets or (cfg.budget,),
            cfg.alpha_grid,
            cfg.calibrate_max_tokens or (cfg.max_tokens,),
            progress,
        )
        head.calibrated_alpha_max = calibration["alpha_max"]
        metrics["calibration"] = calibration
        plot_calibration(calibration, cfg.out / "calibration.png")
        head.save(cfg.out / HEAD_FILE, meta)
        (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


@dataclass
class CalibrateConfig:
    """``agentkv calibrate-intentkv``: recalibrate an existing head's ``alpha_max``."""

    head: Path  # folder with head.safetensors
    out: Path  # folder for head.safetensors (same weights), calibration.json, calibration.png
    model: str | None = None
    device: str | None = None
    traces: int = 8
    budgets: tuple[int, ...] = (256, 1024)
    max_tokens: tuple[int, ...] = (4096, 8192)
    alpha_grid: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0)
    system_chars: int | None = None
    called_tools_only: bool = False
    #: a head without ``training_traces`` metadata: also leave out the tasks of
    #: ``train-intentkv --tau-sessions N``'s training sample (the shipped head: 24)
    trained_tau_sessions: int = 0


def head_metadata(path: Path) -> dict[str, str]:
    """The safetensors metadata of a head checkpoint."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def recalibrate(cfg: CalibrateConfig, progress: bool = True) -> dict[str, Any]:
    """Load ``cfg.head/head.safetensors``, calibrate its ``alpha_max`` (module docstring) on
    ``cfg.traces`` held-out tau-bench sessions and write the same weights with the new
    ``alpha_max`` to ``cfg.out/head.safetensors``, plus ``calibration.json`` and
    ``calibration.png``. The held-out sample leaves out the replay's evaluation sample (the
    seeded 50) and, when the checkpoint names them (``training_traces`` metadata, written by
    ``train-intentkv``), the head's training tasks; for a head without that metadata (e.g.
    the shipped one, trained before it existed) only the seeded 50 are left out, plus the
    tasks of ``train-intentkv --tau-sessions N``'s sample when
    ``cfg.trained_tau_sessions = N`` (the shipped head: 24; without it 7 of the first 8
    held-out sessions are tasks it was trained on)."""
    from agentkv.engine.engine import Engine

    src = cfg.head / HEAD_FILE
    if not src.is_file():
        raise FileNotFoundError(f"--head: no {HEAD_FILE} in {cfg.head}")
    head = ResidualHead.load(src)
    meta = head_metadata(src)
    trained_on = set(json.loads(meta.get(TRAINING_TRACES, "[]")))
    if cfg.trained_tau_sessions:
        trained_on |= {t.id for t in tau_training_sample(cfg.trained_tau_sessions)}
    engine = Engine(cfg.model, device=cfg.device)
    if not head.config.matches(engine.shape):
        raise ValueError(
            f"--head: {src} was trained for another model shape ({head.config}) than "
            f"{engine.model_name}'s"
        )
    held = [
        compact(t, cfg.system_chars, cfg.called_tools_only)
        for t in calibration_traces(cfg.traces, trained_on)
    ]
    calibration = calibrate_alpha_max(
        engine, head, held, cfg.budgets, cfg.alpha_grid, cfg.max_tokens, progress
    )
    calibration |= {
        "head": str(src),
        "model": engine.model_name,
        "alpha_max_before": head.calibrated_alpha_max,
        "excluded_training_traces": sorted(trained_on),
        "system_chars": cfg.system_chars,
        "called_tools_only": cfg.called_tools_only,
    }
    head.calibrated_alpha_max = calibration["alpha_max"]
    cfg.out.mkdir(parents=True, exist_ok=True)
    extra = {k: v for k, v in meta.items() if k not in ("config", "alpha_max")}
    head.save(cfg.out / HEAD_FILE, extra)
    (cfg.out / "calibration.json").write_text(json.dumps(calibration, indent=2))
    plot_calibration(calibration, cfg.out / "calibration.png")
    return calibration
