"""Fit KVzap surrogates (``agentkv train-kvzap``): collect KVzip+ targets, fit per layer,
report R^2, write the surrogates and plots.

Per layer ``l`` the data are pairs ``(h, log s+)``: ``h [D_h]`` the layer input at a context
position, ``log s+ [Hkv]`` its KVzip+ targets (:mod:`agentkv.train.kvzip_targets`). Inputs are
standardised with the training mean / std of each feature; the standardisation is folded
into the first layer when saving.

- ``linear``: ridge regression in closed form (float64 normal equations).
- ``mlp``: ``D_h -> D_h/8 -> GELU -> Hkv`` trained with AdamW on the MSE (cosine schedule).

Validation holds out whole texts. R^2 per head is the squared Pearson correlation between
prediction and target on the validation pairs (as the paper reports it).

Outputs in ``--out DIR``: ``linear.safetensors``, ``mlp.safetensors`` (load with
``KVzap(surrogate_path=DIR)``), ``metrics.json`` (data size, wall times, R^2 per layer and
head), ``loss.png`` (MLP train / validation MSE per epoch, mean over layers, with the linear
validation MSE) and ``r2_per_head.png``.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from agentkv.methods.kvzap_surrogate import Surrogate, SurrogateMeta
from agentkv.train.kvzap_corpus import trace_windows, wiki_passages
from agentkv.train.kvzip_targets import kvzip_plus_scores, repeat_prompt


@dataclass
class TrainConfig:
    """Knobs of ``agentkv train-kvzap`` (defaults sized for a 2-core CPU and the default model)."""

    out: Path
    model: str | None = None
    device: str | None = None
    wiki_texts: int = 200
    trace_texts: int = 100
    prompt_tokens: int = 256
    tokens_per_text: int = 96
    val_fraction: float = 0.1
    ridge: float = 1.0
    epochs: int = 30
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0


@dataclass
class Dataset:
    """``x [N, L, D_h]`` float16 layer inputs, ``y [N, L, Hkv]`` float32 targets, ``val [N]``."""

    x: torch.Tensor
    y: torch.Tensor
    val: torch.Tensor
    texts: dict[str, int]


def load_eager_model(model: str | None, device: str | None) -> tuple[Any, Any, str]:
    """The model with eager attention (probabilities returned), its tokenizer and its name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentkv.engine.model_loader import default_device, resolve_model_dir

    path = resolve_model_dir(model)
    device = device or default_device()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    name = Path(model).name if model else "SmolLM2-135M-Instruct"
    return lm.to(device).eval(), tok, name


def collect(model: Any, tokenizer: Any, cfg: TrainConfig) -> Dataset:
    """KVzip+ targets over the corpus; ``tokens_per_text`` random positions of each text."""
    from agentkv.engine.chat_template import ChatRenderer

    texts = wiki_passages(tokenizer, cfg.wiki_texts, cfg.prompt_tokens, cfg.seed)
    n_wiki = len(texts)
    texts += trace_windows(ChatRenderer(tokenizer), cfg.trace_texts, cfg.prompt_tokens, cfg.seed)
    rng = random.Random(cfg.seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    n_val = max(1, int(round(cfg.val_fraction * len(texts))))
    val_texts = set(order[:n_val])
    xs, ys, vals = [], [], []
    gen = torch.Generator().manual_seed(cfg.seed)
    for i, text in enumerate(tqdm(texts, desc="KVzip+ targets", unit="text")):
        sample = kvzip_plus_scores(model, repeat_prompt(tokenizer, text))
        n = sample.hidden.shape[1]
        pick = torch.randperm(n, generator=gen)[: cfg.tokens_per_text]
        xs.append(sample.hidden[:, pick].transpose(0, 1).to(torch.float16))
        ys.append(sample.log_scores[:, pick].transpose(0, 1))
        vals.append(torch.full((pick.numel(),), i in val_texts))
    return Dataset(
        torch.cat(xs),
        torch.cat(ys),
        torch.cat(vals),
        {"wiki": n_wiki, "traces": len(texts) - n_wiki, "validation": n_val},
    )


def r2_per_head(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared Pearson correlation per column: ``[n, H]`` x2 -> ``[H]``."""
    p = pred.double() - pred.double().mean(0)
    t = y.double() - y.double().mean(0)
    r = (p * t).sum(0) / (p.norm(dim=0) * t.norm(dim=0)).clamp_min(1e-12)
    return (r**2).float()


def _standardise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mu = x.mean(0)
    sd = x.std(0).clamp_min(1e-4)
    return mu, sd


def fit_linear(
    x: torch.Tensor, y: torch.Tensor, ridge: float, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression (float64 on ``device``); ``x [n, D]`` float32, ``y [n, H]`` ->
    ``(W [H, D], b [H])`` on the CPU, in the raw input space (standardisation folded in)."""
    x, y = x.to(device), y.to(device)
    mu, sd = _standardise(x)
    z = ((x - mu) / sd).double()
    ym = y.double().mean(0)
    a = z.T @ z + ridge * torch.eye(z.shape[1], dtype=torch.float64, device=device)
    w = torch.linalg.solve(a, z.T @ (y.double() - ym))  # [D, H]
    w_raw = (w / sd.double()[:, None]).T  # [H, D]
    b = ym - (mu.double() / sd.double()) @ w
    return w_raw.float().cpu(), b.float().cpu()


def fit_mlp(
    x: torch.Tensor,
    y: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    cfg: TrainConfig,
    hidden: int,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """One-hidden-layer GELU MLP, trained on ``device``; returns ``([w1, b1, w2, b2] raw space
    on the CPU, train, val MSE per epoch)``. The weights are those of the epoch with the lowest
    validation MSE (early stopping: with ~20k pairs per layer the MLP overfits after a few
    epochs)."""
    torch.manual_seed(cfg.seed)
    x, y, x_val, y_val = (t.to(device) for t in (x, y, x_val, y_val))
    mu, sd = _standardise(x)
    z, zv = (x - mu) / sd, (x_val - mu) / sd
    d, h_out = x.shape[1], y.shape[1]
    l1 = torch.nn.Linear(d, hidden).to(device)
    l2 = torch.nn.Linear(hidden, h_out).to(device)
    with torch.no_grad():
        l2.bias.copy_(y.mean(0))
    params = [*l1.parameters(), *l2.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=1e-4)
    steps = cfg.epochs * math.ceil(len(z) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    train_curve, val_curve = [], []
    best: tuple[float, list[torch.Tensor]] | None = None
    for _ in range(cfg.epochs):
        perm = torch.randperm(len(z), device=device)
        total = torch.zeros((), device=device)
        for s in range(0, len(z), cfg.batch_size):
            idx = perm[s : s + cfg.batch_size]
            loss = F.mse_loss(l2(F.gelu(l1(z[idx]))), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.detach() * len(idx)
        train_curve.append(float(total) / len(z))
        with torch.no_grad():
            val_curve.append(float(F.mse_loss(l2(F.gelu(l1(zv))), y_val)))
            if best is None or val_curve[-1] < best[0]:
                best = (val_curve[-1], [p.detach().clone() for p in params])
    assert best is not None
    w1_std, b1_std, w2, b2 = best[1]
    w1 = w1_std / sd[None, :]
    b1 = b1_std - w1_std @ (mu / sd)
    return [t.cpu() for t in (w1, b1, w2, b2)], train_curve, val_curve


def _plots(out: Path, metrics: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = range(1, len(metrics["mlp_train_mse"]) + 1)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(ep, metrics["mlp_train_mse"], label="MLP train")
    ax.plot(ep, metrics["mlp_val_mse"], label="MLP validation")
    ax.axhline(metrics["linear_val_mse"], color="gray", ls="--", label="linear validation")
    ax.set_xlabel("epoch")
    ax.set_ylabel("MSE of log s+ (mean over layers)")
    ax.set_title(f"KVzap surrogates, {metrics['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(6, 6), sharey=True)
    for ax, kind in zip(axes, ("linear", "mlp"), strict=True):
        r2 = torch.tensor(metrics[f"{kind}_r2_per_head"])
        im = ax.imshow(r2.numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"{kind}: mean {r2.mean():.3f}", fontsize=10)
        ax.set_xlabel("KV head")
        ax.set_xticks(range(r2.shape[1]))
    axes[0].set_ylabel("layer")
    fig.suptitle(f"KVzap validation R^2 per head, {metrics['model']}")
    fig.colorbar(im, ax=axes, shrink=0.8, label="validation R^2")
    fig.savefig(out / "r2_per_head.png", dpi=120)
    plt.close(fig)


def train_kvzap(cfg: TrainConfig) -> dict[str, Any]:
    """Collect, fit, evaluate and write; returns the metrics (also in ``metrics.json``)."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    model, tokenizer, name = load_eager_model(cfg.model, cfg.device)
    c = model.config
    data = collect(model, tokenizer, cfg)
    t_collect = time.perf_counter() - t0
    fit_device = str(next(model.parameters()).device)
    del model
    L, D = data.x.shape[1], data.x.shape[2]
    hidden = max(D // 8, 1)
    tr, va = ~data.val, data.val
    lin_w, lin_b, mlp_p = [], [], []
    r2 = {"linear": [], "mlp": []}
    lin_val_mse, mlp_train, mlp_val = [], [], []
    t1 = time.perf_counter()
    for layer in tqdm(range(L), desc="fit layers", unit="layer"):
        x = data.x[:, layer].float()
        y = data.y[:, layer]
        w, b = fit_linear(x[tr], y[tr], cfg.ridge, fit_device)
        pred = x[va] @ w.T + b
        lin_val_mse.append(float(F.mse_loss(pred, y[va])))
        r2["linear"].append(r2_per_head(pred, y[va]).tolist())
        lin_w.append(w)
        lin_b.append(b)
        p, tc, vc = fit_mlp(x[tr], y[tr], x[va], y[va], cfg, hidden, fit_device)
        with torch.no_grad():
            pred = F.linear(F.gelu(F.linear(x[va], p[0], p[1])), p[2], p[3])
        r2["mlp"].append(r2_per_head(pred, y[va]).tolist())
        mlp_p.append(p)
        mlp_train.append(tc)
        mlp_val.append(vc)
    t_fit = time.perf_counter() - t1

    def meta(kind: str) -> SurrogateMeta:
        return SurrogateMeta.for_config(c, name, kind)

    linear = Surrogate(meta("linear"), torch.stack(lin_w), torch.stack(lin_b))
    mlp = Surrogate(meta("mlp"), *(torch.stack([p[i] for p in mlp_p]) for i in range(4)))
    linear.save(cfg.out / "linear.safetensors")
    mlp.save(cfg.out / "mlp.safetensors")
    metrics: dict[str, Any] = {
        "model": name,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "texts": data.texts,
        "pairs_per_head": {"train": int(tr.sum()), "validation": int(va.sum())},
        "data_bytes": data.x.numel() * data.x.element_size() + data.y.numel() * 4,
        "collect_seconds": round(t_collect, 1),
        "fit_seconds": round(t_fit, 1),
        "target_mean": float(data.y.mean()),
        "target_std": float(data.y.std()),
        "linear_r2_per_head": r2["linear"],
        "mlp_r2_per_head": r2["mlp"],
        "linear_r2_per_layer": [sum(r) / len(r) for r in r2["linear"]],
        "mlp_r2_per_layer": [sum(r) / len(r) for r in r2["mlp"]],
        "linear_val_mse": sum(lin_val_mse) / L,
        "mlp_train_mse": [sum(c[e] for c in mlp_train) / L for e in range(cfg.epochs)],
        "mlp_val_mse": [sum(c[e] for c in mlp_val) / L for e in range(cfg.epochs)],
        "file_bytes": {k: (cfg.out / f"{k}.safetensors").stat().st_size for k in ("linear", "mlp")},
        "params": {"linear": linear.num_params, "mlp": mlp.num_params},
    }
    for kind in ("linear", "mlp"):
        per_layer = metrics[f"{kind}_r2_per_layer"]
        metrics[f"{kind}_r2_mean"] = sum(per_layer) / len(per_layer)
    (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    _plots(cfg.out, metrics)
    return metrics
