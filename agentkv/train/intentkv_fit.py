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
"""

from __future__ import annotations

import json
import random
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


def training_traces(cfg: TrainConfig) -> list[Any]:
    """tau-bench trajectories of tasks outside the replay's evaluation sample (the seeded 50)
    and BFCL sessions of the given categories (never ``multi_turn_base``, the replay's)."""
    import warnings

    from agentkv.bench.traces import load_tau_bench, sample

    traces = []
    if cfg.tau_sessions:
        tau = load_tau_bench()
        # whole tasks are held out: another trial of an evaluated task is not training data
        held_out = {t.id.rsplit("/", 1)[0] for t in sample(tau, limit=50, seed=0)}
        rest = [t for t in tau if t.id.rsplit("/", 1)[0] not in held_out]
        traces += sample(rest, limit=cfg.tau_sessions, seed=1)
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
    from agentkv.train.intentkv_data import collect_rows

    cfg.out.mkdir(parents=True, exist_ok=True)
    engine = Engine(cfg.model, device=cfg.device)
    policy = IntentKV(budget=cfg.budget, protect_system=False)
    traces = [compact(t, cfg.system_chars, cfg.called_tools_only) for t in training_traces(cfg)]
    rows, stats = collect_rows(engine, traces, policy, cfg.max_tokens, progress=progress)
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
            "fit": asdict(cfg.fit),
        },
    }
    head.save(cfg.out / HEAD_FILE, {"model": engine.model_name})
    (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot_curves(result["history"], rule, cfg.out / "curves.png")
    return metrics
