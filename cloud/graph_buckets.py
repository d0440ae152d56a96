"""Which captured CUDA graph a paged forward would replay, the padding that reaches it, and how its buffer is refilled.

A CUDA graph replays fixed shapes from fixed addresses. A paged forward (cloud/paged_attention.py) has fixed shapes
for a given count of sessions and query rows: the fused plan spans the whole pool and lists up to every page per
query block, so only R (sessions) and N (rows) vary. As vLLM captures a graph per batch size, the engine would
capture one per bucket of sessions x rows and pad each forward up to the smallest bucket that holds it; a forward
past the largest bucket, or with a tree block (its ancestor table's width varies), runs eagerly.

The plan runs the same on a CPU (sim/gpu_check's dry run plans the owed forward with it): `bucket_for` picks the
bucket, `refill_plan` says where each part of the packed ints goes in the bucket's static buffer and what its padding
holds, and `padded_to` builds those ints, which a replay would copy into the static buffer; run eagerly they give the
unpadded forward's rows (tests/cloud/test_graph_buckets.py), which is what a replay of their capture computes. Padding keeps every row a real row's copy, never a fully masked one:
    - a padding row repeats the last real row (token, position, session, entry), as a query tile's padding does;
    - its KV goes to the scratch slot (a pool slot no session owns), so it overwrites nothing;
    - a padding session has no pages (its page_index row is all -1) and no row of its own;
    - a padding kept row reads row 0, whose logits are dropped on the host.
Capture and replay themselves (torch.cuda.CUDAGraph in the resident engine's verify and decode forwards) are not
built yet: issue 59 owes them, with the figures of a GPU host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cloud.packed_forward import PackedInputs

SESSION_BUCKETS = (1, 2, 4, 8)  # sessions per captured forward: a tiled forward holds at most 128 / 16 of them
ROW_BUCKETS = (16, 32, 64, 128)  # query rows, padding included: whole 16-row query tiles, up to one 128-row block


@dataclass(frozen=True)
class Bucket:
    """One captured shape: R sessions and N query rows (N kept rows and N written entries at most)."""

    sessions: int
    rows: int


@dataclass(frozen=True)
class BucketChoice:
    """A forward's bucket and the padding that reaches it; `bucket` None: it runs eagerly, for `reason`."""

    bucket: Bucket | None
    pad_sessions: int = 0
    pad_rows: int = 0
    reason: str = ""


def bucket_for(sessions: int, rows: int, has_tree: bool = False, session_buckets: tuple[int, ...] = SESSION_BUCKETS,
               row_buckets: tuple[int, ...] = ROW_BUCKETS) -> BucketChoice:
    """The smallest bucket holding a forward of `sessions` sessions and `rows` query rows (after query tiles)."""
    if sessions < 1 or rows < sessions:
        raise ValueError(f"a forward has >= 1 session and >= 1 row per session, got {sessions} sessions, {rows} rows")
    if has_tree:
        return BucketChoice(None, reason="a tree block's ancestor table changes shape with the tree: eager")
    fits_sessions = [b for b in session_buckets if b >= sessions]
    fits_rows = [b for b in row_buckets if b >= rows]
    if not fits_sessions or not fits_rows:
        return BucketChoice(None, reason=f"{sessions} sessions x {rows} rows is past the largest bucket "
                                         f"({max(session_buckets)} x {max(row_buckets)}): eager")
    bucket = Bucket(min(fits_sessions), min(fits_rows))
    return BucketChoice(bucket, bucket.sessions - sessions, bucket.rows - rows)


@dataclass(frozen=True)
class Segment:
    """One part of the static buffer: `length` ints at `offset`; `real` of them are refilled from the forward, the
    rest hold `padding` (what a padding entry is: module docstring)."""

    name: str
    offset: int
    length: int
    real: int
    padding: str


def refill_plan(bucket: Bucket, sessions: int, rows: int, kept: int, written: int, pool_pages: int,
                q_block: int) -> list[Segment]:
    """Where a forward of `sessions` x `rows` (`kept` kept rows, `written` new entries) lands in `bucket`'s static buffer, in the
    order of the packed ints (cloud/packed_forward.py `pack`, cloud/paged_attention.py `PagedPlan`): ids,
    positions, kept rows, slots, written rows, query sessions, entries, page_index [R, P], kv_num_blocks [B],
    kv_indices [B, P]. The fused plan's P is the pool's pages; B = rows / q_block."""
    if (sessions > bucket.sessions or rows > bucket.rows or not 1 <= kept <= rows or not 1 <= written <= rows
            or bucket.rows % q_block):
        raise ValueError(f"{sessions} sessions x {rows} rows ({kept} kept, {written} written) do not fit {bucket} in {q_block}-row blocks")
    blocks, real_blocks = bucket.rows // q_block, -(-rows // q_block)
    parts = [("ids", bucket.rows, rows, "the last real row's token"),
             ("positions", bucket.rows, rows, "the last real row's position"),
             ("kept_rows", bucket.rows, kept, "row 0 (dropped on the host)"),
             ("slots", bucket.rows, written, "the scratch slot"),
             ("written_rows", bucket.rows, written, "a padding row"),
             ("q_session", bucket.rows, rows, "the last real row's session"),
             ("entries", bucket.rows, rows, "the last real row's entry"),
             ("page_index", bucket.sessions * pool_pages, sessions * pool_pages, "-1 (a padding session has no pages)"),
             ("kv_num_blocks", blocks, real_blocks, "the last real block's count"),
             ("kv_indices", blocks * pool_pages, real_blocks * pool_pages, "the last real block's pages")]
    segments, offset = [], 0
    for name, length, real, padding in parts:
        segments.append(Segment(name, offset, length, real, padding))
        offset += length
    return segments


def padded_to(inputs: PackedInputs, bucket: Bucket, scratch_slot: int) -> PackedInputs:
    """`inputs` (a tiled, fused, chain-only paged forward's) padded to `bucket`: the ints a captured graph's static
    buffer is refilled with, their padding as the module docstring says. Run eagerly, the padded forward's first
    `inputs.k` rows are the unpadded forward's rows and it writes the same KV, plus the scratch slot."""
    plan = inputs.plan
    if plan is None or not plan.tiled or plan.tree_width or plan.width != plan.pool.pages:
        raise ValueError("only a paged forward with query tiles, the fused plan and no tree block pads to a bucket")
    segments = refill_plan(bucket, plan.sessions, inputs.n, inputs.k, plan.n_written, plan.pool.pages, plan.q_block)
    real = dict(zip([s.name for s in segments], inputs.host.split([s.real for s in segments])))
    padding_rows = sorted(set(range(bucket.rows)) - set(real["written_rows"].tolist()))
    pads = {"ids": real["ids"][-1:], "positions": real["positions"][-1:], "kept_rows": torch.zeros(1, dtype=torch.long),
            "slots": torch.tensor([scratch_slot]), "q_session": real["q_session"][-1:],
            "entries": real["entries"][-1:], "page_index": torch.tensor([-1]),
            "kv_num_blocks": real["kv_num_blocks"][-1:], "kv_indices": real["kv_indices"][-plan.pool.pages:]}
    parts = []
    for segment in segments:
        part = real[segment.name]
        if segment.name == "written_rows":
            parts += [part, torch.tensor(padding_rows, dtype=torch.long)]
            continue
        missing = segment.length - segment.real
        pad = pads[segment.name]
        parts += [part, pad.repeat(-(-missing // len(pad)))[:missing]]
    padded_plan = replace(plan, n_tokens=bucket.rows, n_written=bucket.rows, sessions=bucket.sessions,
                          q_blocks=bucket.rows // plan.q_block, host=torch.cat(parts[6:]))
    return PackedInputs(torch.cat(parts), bucket.rows, bucket.rows, padded_plan)
