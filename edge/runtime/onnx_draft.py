"""The edge's draft runtime: an ONNX export of the draft run by ONNX Runtime, same interface as `CachedLM`.

`OnnxCachedLM.advance_to(context, n_logits)` keeps the longest cached prefix of `context`, rolls the
KV cache back past it and feeds the rest in one `session.run`, exactly like the torch `CachedLM`
(which stays as the reference and the fallback: `edge.runtime.draft.load_draft_runtime(..., runtime="torch")`).

The KV cache stays in ONNX Runtime's hands between calls: numpy arrays on CPU (ORT reads numpy
inputs in place, and its outputs come back without a further copy), `OrtValue`s bound through IO
binding on CUDA, so there the cache never leaves the device. On CPU the binding measured ~0.5 ms
slower per step on SmolLM2 (120 bind calls from Python) and no faster on Qwen2.5-0.5B: the cache is
small next to the weights a step reads.

Rollback keeps the first `length` positions, which must be one contiguous tensor per layer again
(the graph takes nothing else), so it copies the kept cache once (Qwen2.5-0.5B: 24 layers x 2 x 2
heads x 64 x 4 bytes = 24 KB per token, 19.5 MB at 800 tokens):
- bound (CUDA; CPU when `io_binding=True`): through `edge.runtime.kv_slice.KvSlicer`, a separate
  graph of Slice ops on the same provider, so a CUDA cache is cut on the device instead of going
  to the host and back (two 19.5 MB PCIe copies at 800 tokens, the old way). The CPU-bound path
  runs the very same code with device "cpu"; that is what the tests exercise.
- numpy (the CPU default): `np.ascontiguousarray` of the slice, ~20% faster here than the slice graph.
Measured on CPU (AMD EPYC, AVX-512, no AMX; one core, shared with other jobs, so steps are noisy),
Qwen2.5-Coder-0.5B, rollback of 5 tokens: numpy 0.3-1.0 ms at 300 tokens and 1.8-2.1 ms at 800;
one single-token step 90-170 ms (int8) and 120-350 ms (float32). Even a rollback every round of
five steps is under 1% of the draft's time; and `sprinter bench proposer` (code-edit and passage-qa,
one prompt each, 48 tokens, both proposers) rolled the draft back once in 25 rounds (0.5 ms). So on
CPU rollback is cheap already; the slice graph is for CUDA, where a step is a few ms and the host
round trip was not. A lazy rollback (slicing at the next forward) would save nothing: the next
forward always follows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from common.model.cached_lm import Fork, ForwardOutput, common_prefix_length, shared_prefix
from edge.runtime.kv_slice import KvSlicer
from edge.runtime.ort_sessions import make_session

log = logging.getLogger(__name__)


class OnnxCachedLM:
    """A draft LM exported by `edge.onnx_export` plus its KV cache and the tokens that cache holds.

    `session` shares an existing InferenceSession (and its weights) between caches, one per
    conversation (see `OnnxDraftModel`); ORT sessions accept concurrent runs.
    """

    def __init__(self, onnx_path: Path | str, with_hidden: bool = False, threads: int | None = None,
                 optimization: str = "all", providers: list[str] | None = None, io_binding: bool | None = None,
                 session: ort.InferenceSession | None = None, slicer: KvSlicer | None = None) -> None:
        self.onnx_path = Path(onnx_path)
        self.with_hidden = with_hidden
        self.session = session or make_session(self.onnx_path, threads, optimization, providers)
        self._device = session_device(self.session)
        # None: bind on CUDA, where it keeps the cache on the device; plain numpy on CPU (see module docstring).
        self.io_binding = self._device == "cuda" if io_binding is None else io_binding
        self._past_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past_")]
        self._output_names = [o.name for o in self.session.get_outputs()]
        self._slicer = (slicer or kv_slicer(self.session)) if self.io_binding else None
        self.tokens: list[int] = []
        self.forward_calls = 0
        self._fork: Fork | None = None  # the branches' rows (`advance_batch`), until the next single forward
        # OrtValues with IO binding, numpy arrays without (the plain `session.run` path).
        self._past: list[ort.OrtValue | np.ndarray] = self._empty_past()

    def _empty_past(self) -> list[ort.OrtValue | np.ndarray]:
        _, kv_heads, _, head_dim = self.session.get_inputs()[2].shape
        return [self._wrap(np.zeros((1, kv_heads, 0, head_dim), dtype=np.float32)) for _ in self._past_names]

    def _wrap(self, array: np.ndarray) -> ort.OrtValue | np.ndarray:
        return ort.OrtValue.ortvalue_from_numpy(array, self._device) if self.io_binding else array

    def reset(self) -> None:
        self.tokens.clear()
        self._past = self._empty_past()

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        if len(self.tokens) <= length:
            return
        if self.io_binding:  # on the cache's device: a CUDA cache never visits the host
            self._past = self._slicer.bound(self._past, length)
        else:  # numpy's copy measured ~20% faster on CPU than the slice graph (module docstring)
            self._past = [np.ascontiguousarray(p[:, :, :length]) for p in self._past]
        del self.tokens[length:]

    reusable = True  # one contiguous tensor per layer: any prefix of it is the KV of that prefix
    batches = True  # the export has a batch axis: a tree's branches at one point are drafted side by side

    def kv_snapshot(self) -> tuple[list[ort.OrtValue | np.ndarray], int]:
        """An owned copy of the KV of `tokens` (the edge's draft cache keeps it across requests), and its bytes;
        a bound cache is copied on its device by the slice graph."""
        if self.io_binding:
            kv = self._slicer.bound(self._past, len(self.tokens))
            return kv, sum(int(np.prod(value.shape())) * 4 for value in kv)  # float32
        kv = [np.array(p, copy=True) for p in self._past]
        return kv, sum(p.nbytes for p in kv)

    def start_from(self, tokens: list[int], kv: list[ort.OrtValue | np.ndarray]) -> None:
        """Replace the cache with a copy of the first len(tokens) positions of a snapshot of `tokens` (or more)."""
        if self.io_binding:
            self._past = self._slicer.bound(kv, len(tokens))
        else:
            self._past = [np.array(p[:, :, :len(tokens)], copy=True) for p in kv]  # contiguous, never shared
        self.tokens = list(tokens)

    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput:
        """Make the cache hold `context`; return logits (and hidden states) of its last `n_logits` positions.

        Like `CachedLM`, `n_logits` larger than the fed tokens gives all of them, and 0 means all.
        """
        if not context:
            raise ValueError("context must hold at least one token")
        self._fork = None
        keep = min(common_prefix_length(self.tokens, context), len(context) - 1)
        self.rollback(keep)
        new_tokens = context[keep:]
        n = len(new_tokens)
        k = n if n_logits <= 0 else min(n_logits, n)
        input_ids = np.asarray([new_tokens], dtype=np.int64)
        logits_index = np.arange(n - k, n, dtype=np.int64)
        logits, hidden, self._past = self._run(input_ids, logits_index, self._past)
        self.tokens.extend(new_tokens)
        self.forward_calls += 1
        hidden_rows = torch.from_numpy(hidden[0, n - k:]) if self.with_hidden else None
        return ForwardOutput(logits=torch.from_numpy(logits[0]), hidden=hidden_rows)

    def advance_batch(self, contexts: list[list[int]]) -> torch.Tensor:
        """The next-token logits [B, V] after each of `contexts`, in one batched run: a tree's branches at one point
        (one shared prefix, one length, growing in step). As `CachedLM.advance_batch`: the first call makes the cache
        hold the common prefix and copies it into one row per context (a bound cache on its device, `KvSlicer.tiled`);
        later calls feed each row its new tokens. The cache itself keeps that prefix."""
        fork = self._fork
        if fork is None or not fork.continued_by(contexts):
            shared = shared_prefix(contexts)
            self.advance_to(contexts[0][:shared])
            rows = (self._slicer.tiled(self._past, len(contexts)) if self.io_binding
                    else [np.repeat(p, len(contexts), axis=0) for p in self._past])
            fork = Fork(rows, [contexts[0][:shared]] * len(contexts))
        new_tokens = np.asarray([c[len(r):] for c, r in zip(contexts, fork.rows)], dtype=np.int64)
        logits, _, fork.cache = self._run(new_tokens, np.asarray([new_tokens.shape[1] - 1], dtype=np.int64),
                                          fork.cache)
        fork.rows = [list(c) for c in contexts]
        self._fork = fork
        self.forward_calls += 1
        return torch.from_numpy(logits[:, -1])

    def _run(self, input_ids: np.ndarray, logits_index: np.ndarray,
             past: list) -> tuple[np.ndarray, np.ndarray, list]:
        """One forward over `past`. Returns logits [b, k, V], hidden [b, n, H] and the presents (the new past)."""
        if self.io_binding:
            return self._run_bound(input_ids, logits_index, past)
        feed = {"input_ids": input_ids, "logits_index": logits_index}
        feed.update(zip(self._past_names, past))
        outputs = self.session.run(self._output_names, feed)
        return outputs[0], outputs[1], outputs[2:]

    def _run_bound(self, input_ids: np.ndarray, logits_index: np.ndarray,
                   past: list[ort.OrtValue]) -> tuple[np.ndarray, np.ndarray, list[ort.OrtValue]]:
        """`_run` through IO binding: the cache goes in and out as OrtValues on the provider's device."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("logits_index", logits_index)
        for name, value in zip(self._past_names, past):
            binding.bind_ortvalue_input(name, value)
        # logits and hidden come back to the host; presents stay wherever the provider put them.
        binding.bind_output("logits", "cpu")
        binding.bind_output("hidden", "cpu")
        for name in self._output_names[2:]:
            binding.bind_output(name, self._device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), outputs[1].numpy(), list(outputs[2:])


class OnnxDraftModel:
    """One exported draft and its session: the weights, loaded once, behind any number of caches."""

    def __init__(self, onnx_path: Path | str, threads: int | None = None, optimization: str = "all",
                 providers: list[str] | None = None, io_binding: bool | None = None) -> None:
        self.onnx_path = Path(onnx_path)
        self.session = make_session(self.onnx_path, threads, optimization, providers)
        self.io_binding = io_binding
        binds = session_device(self.session) == "cuda" if io_binding is None else io_binding
        self.slicer = kv_slicer(self.session) if binds else None  # one per session, shared by its caches

    def new_lm(self, with_hidden: bool = False) -> OnnxCachedLM:
        """A fresh, empty KV cache over the shared session."""
        return OnnxCachedLM(self.onnx_path, with_hidden=with_hidden, io_binding=self.io_binding,
                            session=self.session, slicer=self.slicer)


def session_device(session: ort.InferenceSession) -> str:
    """Where the session's provider keeps tensors: "cuda" or "cpu"."""
    return "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"


def kv_slicer(session: ort.InferenceSession) -> KvSlicer:
    """The rollback's slicer for the caches of `session`, on the same provider and device."""
    past = [i for i in session.get_inputs() if i.name.startswith("past_")]
    _, kv_heads, _, head_dim = past[0].shape
    return KvSlicer(len(past), kv_heads, head_dim, session.get_providers(), session_device(session))
