"""The verifier pipeline's plots: the reliability diagram, the calls-vs-quality trade-off and the estimator comparison (PNG)."""

from __future__ import annotations

from pathlib import Path

from common.lab.plots import saved_figure
from edge.verifier_training.evaluate import EvalRow
from edge.verifier_training.replay import ALL, ESTIMATOR_BUDGET, EXACT, HINDSIGHT, LEARNED, ReplayRow


def plot_reliability(tables: dict[str, list[dict]], label: str, path: Path) -> None:
    """Reliability diagram: predicted acceptance probability vs the observed rate, per verifier."""

    with saved_figure(path, figsize=(4.5, 4.5)) as (fig, ax):
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
        for name, table in tables.items():
            ax.plot([r["predicted"] for r in table], [r["observed"] for r in table], marker="o", label=name)
        ax.set_xlabel("predicted acceptance probability")
        ax.set_ylabel("observed acceptance rate (test prompts)")
        ax.set_title(f"verifier reliability ({label} label)")
        ax.legend()


def plot_tradeoff(rows: list[EvalRow], path: Path) -> None:
    """Cloud calls per token vs quality, one curve per (mode, verifier)."""

    qualities = [("target_nll_per_token", "target NLL per token (lower is better)")]
    if rows and rows[0].agreement_with_target is not None:
        qualities.insert(0, ("agreement_with_target", "agreement with target (greedy)"))
    with saved_figure(path, 1, len(qualities), figsize=(5.5 * len(qualities), 4.2), squeeze=False) as (fig, axes):
        for ax, (key, label) in zip(axes[0], qualities):
            for mode, verifier, style in (("sprinter", "learned", "o-"), ("sprinter", "confidence", "s--"),
                                          ("sprinter-exact", "learned", "^-"), ("sprinter-exact", "confidence", "v--")):
                points = sorted((r.target_calls_per_token, getattr(r, key)) for r in rows
                                if r.mode == mode and r.verifier == verifier and "goodput" not in r.method)
                if points:
                    ax.plot(*zip(*points), style, label=f"{mode} ({verifier})")
            for r in rows:
                if r.verifier == "-":
                    ax.plot(r.target_calls_per_token, getattr(r, key), "k*", markersize=10)
                    ax.annotate(r.method, (r.target_calls_per_token, getattr(r, key)), textcoords="offset points",
                                xytext=(4, 4), fontsize=8)
            ax.set_xlabel("target calls per token (cloud cost)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle("verifier trade-off on held-out prompts")


def plot_replay(rows: list[ReplayRow], path: Path) -> None:
    """Per RTT: tokens/s against calls per token for every replayed policy, with the
    hindsight oracle's call rate and 1.2x of it marked."""

    rtts = sorted({r.rtt_ms for r in rows})
    with saved_figure(path, 1, len(rtts), figsize=(4.2 * len(rtts), 4.0), squeeze=False, sharey=True) as (fig, axes):
        for ax, rtt in zip(axes[0], rtts):
            at = [r for r in rows if r.rtt_ms == rtt and r.category == ALL]
            fixed = sorted((r for r in at if r.policy.startswith("fixed:")), key=lambda r: r.calls_per_token)
            ax.plot([r.calls_per_token for r in fixed], [r.tokens_per_s for r in fixed], "s--", color="grey", label="fixed K")
            for r in fixed:
                ax.annotate(r.policy.split(":")[1], (r.calls_per_token, r.tokens_per_s), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
            for prefix, style in ((EXACT, "o-"), (LEARNED, "^-")):
                curve = sorted((r for r in at if r.policy == prefix or r.policy.startswith(prefix + " +price")),
                               key=lambda r: r.calls_per_token)
                ax.plot([r.calls_per_token for r in curve], [r.tokens_per_s for r in curve], style,
                        label=f"{prefix} (+ call price)")
            for r in at:
                if r.policy == ESTIMATOR_BUDGET:
                    ax.plot(r.calls_per_token, r.tokens_per_s, "rD", label=ESTIMATOR_BUDGET)
            hindsight = next(r for r in at if r.policy == HINDSIGHT)
            ax.plot(hindsight.calls_per_token, hindsight.tokens_per_s, "k*", markersize=11, label=HINDSIGHT)
            ax.axvspan(hindsight.calls_per_token, 1.2 * hindsight.calls_per_token, color="green", alpha=0.12,
                       label="within 1.2x of its calls")
            ax.set_title(f"RTT {rtt:g} ms")
            ax.set_xlabel("target calls per token")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("tokens/s (modelled rounds)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle("call policies replayed on held-out traces")


def plot_comparison(result: dict, path: Path) -> None:
    """`sprinter verifier compare`: reliability on the reached held-out tokens, and calibration by block position."""
    with saved_figure(path, 1, 2, figsize=(9.5, 4.5)) as (fig, (left, right)):
        left.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
        for name, table in result["reliability"].items():
            left.plot([r["predicted"] for r in table], [r["observed"] for r in table], marker="o", label=name)
        left.set_xlabel("predicted acceptance probability")
        left.set_ylabel("observed acceptance rate (reached held-out tokens)")
        left.legend(fontsize=8)
        rows = result["by_position"]
        positions = [r["position"] for r in rows]
        right.plot(positions, [r["observed"] for r in rows], color="black", marker="s", label="observed")
        for name in result["reliability"]:
            right.plot(positions, [r[name]["predicted"] for r in rows], marker="o", label=f"{name} (mean predicted)")
        right.set_xlabel("position in the block (0: first drafted token)")
        right.set_ylabel("acceptance rate")
        right.legend(fontsize=8)
        data = result["data"]
        fig.suptitle(f"{data['draft']} -> {data['target']}, {data['label']} label: calibration on held-out prompts")
