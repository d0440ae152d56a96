"""What each step of `sprinter gpu check` measures, on a GPU and in the CPU dry run.

The GPU sizes are the figures the project owes (docs/gpu-engine.md): the 1.5B architecture at 8 edges
x (1 + k = 6) tokens, 128/1k/4k context, and the full table over 1.5B and 7B. The dry run keeps every
step and every code path at the smallest sizes (a 2-layer Qwen2 architecture), so the command cannot rot.
"""

from __future__ import annotations

from dataclasses import dataclass

# Seconds each step may take (the whole run: at most 6.5 minutes, within one 10-minute device command); a step stops
# adding rows at its deadline and says which it did not reach, so a slot that ends early still returns what was
# measured. pytest's budget covers each CUDA test compiling the fused kernel; the table's, both architectures.
# The owed step is the first to run the paged layout, so it also pays for compiling its flex_attention kernel.
# The tree step compiles the paged kernel with the tree mask twice (8 sessions' 136 rows take the prefill tiles, one
# session's 17 the verify tiles); its 25 s are the slack of owed (44 s used of 80 on the first H100 run) and graphs
# (3 s of 25), so the total stays the same.
# The tiles step (query tiles on and off, 3 contexts) compiles the kernel for 16-row query blocks: its 25 s bring the
# whole run to 7 minutes, the ceiling (not yet measured on a GPU).
STEP_BUDGET_S = {"env": 30.0, "owed": 65.0, "table": 150.0, "graphs": 15.0, "tiles": 25.0, "prefix": 10.0,
                 "tree": 25.0, "pytest": 90.0, "profile": 10.0}
GOAL_VERIFY_P50_MS = 3.0  # 1.5B, 8 edges x 6 tokens, 1k context
GOAL_BATCHING_GAIN = 6.0  # verified tokens/s, batching on over off, 8 edges, 1k context
GOAL_CONTEXT_RATIO = 1.3  # verify p50 at 4k context over 128, 8 edges


@dataclass(frozen=True)
class Sizes:
    smoke: str  # the architecture of step 1's one-forward smoke test
    owed: str  # the architecture of the owed figures, the CUDA-graphs row and the profile
    table: tuple[str, ...]  # the full table's architectures
    edges: tuple[int, ...]
    contexts: tuple[int, ...]  # short, mid (the owed figures' "1k") and long
    owed_edges: int
    rounds: int  # timed rounds per row (the owed step doubles them)
    warmup: int
    prefix_context: int  # the prefix cache's prompt: whole pages of either layout (64 or 128 tokens) and a part
    k: int = 5  # draft tokens per verify: each edge sends 1 + k tokens

    @property
    def mid_context(self) -> int:
        return self.contexts[len(self.contexts) // 2]


GPU_SIZES = Sizes(smoke="qwen2.5-1.5b", owed="qwen2.5-1.5b", table=("qwen2.5-1.5b", "qwen2.5-7b"),
                  edges=(1, 8, 32, 64), contexts=(128, 1024, 4096), owed_edges=8, rounds=10, warmup=3,
                  prefix_context=1024 + 64)
DRY_RUN_SIZES = Sizes(smoke="tiny-qwen2", owed="tiny-qwen2", table=("tiny-qwen2",), edges=(1, 2),
                      contexts=(16, 32, 64), owed_edges=2, rounds=2, warmup=1,
                      prefix_context=2 * 64 + 32)


def sizes_for(device_type: str) -> Sizes:
    return GPU_SIZES if device_type == "cuda" else DRY_RUN_SIZES
