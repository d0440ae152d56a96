"""What `--mode auto` would choose on clouds this project cannot run here, beside the fleet simulator's speeds
(`sprinter fleet choose`, sim/fleet/choose_command.py, says what it prints). The clouds are data, their
assumptions written beside their numbers (CLOUDS).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean

from common.spec.round_cost import request_rate, edge_speculation_rate
from sim.fleet.costs import FleetCosts, ForwardModel, ModeProfile, RttModel, demo_profiles
from sim.fleet.simulation import run_fleet

EDGE_DRAFT_MS = 23.0  # ONNX int8 0.5B draft, one core (issue 57: 43.5 tokens/s)
VERIFIER_MS = 0.8


def _amdahl(t1_ms: float, t2_ms: float, threads: int) -> float:
    """A step at `threads` from its times at 1 and 2 threads, by Amdahl's law (serial share s: t2/t1 = s + (1-s)/2)."""
    serial = max(0.0, min(1.0, 2 * t2_ms / t1_ms - 1))
    return t1_ms * (serial + (1 - serial) / threads)


def _line(decode_ms: float, verify6_ms: float) -> ForwardModel:
    """t(b, n) = c0 + c_tok n through a 1-token decode step and a 6-token verify."""
    c_tok = max(0.0, (verify6_ms - decode_ms) / 5)
    return ForwardModel(decode_ms - c_tok, c_tok)


# llama-bench on this machine kind (AMD EPYC, AVX-512), Qwen2.5-Coder-1.5B Q8 GGUF: tg32 26.4 / 38.2 tokens/s and
# pp6 38.3 / 72.6 tokens/s at 1 / 2 threads; the 0.5B draft GGUF 47 tokens/s at 1 thread (issue 57).
TG_MS = (1e3 / 26.4, 1e3 / 38.2)
PP6_MS = (6e3 / 38.3, 6e3 / 72.6)
DRAFT_TG_MS = 1e3 / 47.0


@dataclass(frozen=True)
class Cloud:
    name: str
    forward: ForwardModel  # the target's forward
    draft_forward: ForwardModel  # the cloud's own draft step (cloud-sd)
    assumption: str


CLOUDS = {
    "this-cpu": Cloud(
        "this-cpu", _line(TG_MS[0], PP6_MS[0]), ForwardModel(DRAFT_TG_MS, 0.0),
        "llama.cpp, one thread of this machine kind: the 1.5B's measured decode step and 6-token verify (llama-bench "
        "tg32 and pp6); the draft's step measured likewise"),
    "this-cpu-resident": Cloud(
        "this-cpu-resident", _line(1e3 / 4.42, 1.1e3 / 4.42), ForwardModel(0.40e3 / 4.42, 0.0),
        "the resident engine, bf16 in eager PyTorch, on this machine kind: a decode step at 4.42 tokens/s (bench "
        "llama-cpp's resident row), a 6-token verify about one step, as issue 56 measured it (1.1x here), the cloud's "
        "0.5B draft step 0.40x the target's (bench capacity's measured step ratio)"),
    "cpu-16": Cloud(
        "cpu-16", _line(_amdahl(*TG_MS, 16), _amdahl(*PP6_MS, 16)),
        ForwardModel(_amdahl(DRAFT_TG_MS, DRAFT_TG_MS * TG_MS[1] / TG_MS[0], 16), 0.0),
        "llama.cpp on 16 cores of one server: each step extrapolated from its llama-bench times at 1 and 2 threads "
        "by Amdahl's law (decode: serial share 0.38; a 6-token verify: 0.05), the draft's decode scaling as the "
        "target's; an ASSUMPTION, not measured: memory bandwidth may cap decode sooner"),
    "h100": Cloud(
        "h100", ForwardModel(24.2, 0.0), ForwardModel(24.2 * 24 / 28, 0.0),
        "resident engine, bf16, eager, on an H100 (docs/benchmarks/gpu.md): a forward takes 24-25 ms whatever its "
        "batch, context and tokens (host-bound: kernel launches from Python); the draft's step by its layers "
        "(24 of the target's 28), an ASSUMPTION, since the cloud draft was not timed there"),
}


def fleet_costs(cloud: Cloud, rtt_ms: float) -> FleetCosts:
    return FleetCosts(draft_step_ms=EDGE_DRAFT_MS, verifier_ms=VERIFIER_MS, forward=cloud.forward,
                      draft_forward=cloud.draft_forward, rtt=RttModel(mean_ms=rtt_ms), max_batch=16)


def predicted(cloud: Cloud, profiles: dict[str, ModeProfile], rtt_ms: float, tokens: int) -> dict[str, float]:
    """Each option's tokens/s by the cost model, as the edge would predict it with these costs."""
    edge, sd = profiles["sprinter-exact"], profiles["cloud-sd"]
    gamma, cloud_gamma = mean(edge.block_lengths), mean(sd.block_lengths)
    verify = cloud.forward.t_forward_ms(1, round(gamma) + 1)
    cloud_round = cloud_gamma * cloud.draft_forward.t_forward_ms(1, 1) + cloud.forward.t_forward_ms(1, round(cloud_gamma) + 1)
    return {"target": request_rate(tokens, 1.0, cloud.forward.t_forward_ms(1, 1), rtt_ms),
            "sprinter-exact": edge_speculation_rate(mean(edge.emitted), round(gamma), EDGE_DRAFT_MS + VERIFIER_MS,
                                                    rtt_ms, verify),
            "cloud-sd": request_rate(tokens, mean(sd.emitted), cloud_round, rtt_ms)}


def simulated(cloud: Cloud, profiles: dict[str, ModeProfile], rtt_ms: float, tokens: int) -> dict[str, float]:
    """Each option's tokens/s for one edge in the fleet simulator, call by call."""
    costs = fleet_costs(cloud, rtt_ms)
    return {mode: run_fleet(costs, profiles[mode], 1, tokens_per_request=tokens, requests=3).tokens_per_s_mean
            for mode in ("target", "sprinter-exact", "cloud-sd")}


def choose(clouds: tuple[str, ...], rtts_ms: tuple[float, ...], tokens: int) -> list[dict[str, object]]:
    profiles = {p.mode: p for p in demo_profiles()}
    rows = []
    for name in clouds:
        cloud = CLOUDS[name]
        for rtt in rtts_ms:
            model, sim = predicted(cloud, profiles, rtt, tokens), simulated(cloud, profiles, rtt, tokens)
            choice, best = max(model, key=model.__getitem__), max(sim, key=sim.__getitem__)
            rows.append({"cloud": name, "rtt_ms": rtt, "predicted": model, "simulated": sim, "choice": choice,
                         "simulated_best": best, "agrees": choice == best, "auto_over_best": sim[choice] / sim[best]})
    return rows


def table(rows: list[dict[str, object]]) -> str:
    modes = ("target", "sprinter-exact", "cloud-sd")
    lines = ["| cloud | RTT ms | " + " | ".join(f"{m} model / sim" for m in modes) + " | auto | sim best | auto/best |",
             "|" + " --- |" * (len(modes) + 5)]
    for r in rows:
        pairs = " | ".join(f"{r['predicted'][m]:.1f} / {r['simulated'][m]:.1f}" for m in modes)  # type: ignore[index]
        lines.append(f"| {r['cloud']} | {r['rtt_ms']:g} | {pairs} | {r['choice']} | {r['simulated_best']} | "
                     f"{r['auto_over_best']:.2f} |")
    notes = [f"- {c.name}: {c.assumption}." for c in CLOUDS.values() if any(r["cloud"] == c.name for r in rows)]
    return "\n".join(lines + ["", "Tokens/s of one user. The clouds' assumptions:", *notes])
