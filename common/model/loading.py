"""Load draft and target models: offline presets, tiny random models, any Hugging Face id or directory.

A model spec is a preset name, a Hugging Face id or a local directory, optionally followed by
`:layers=N` to keep only the first N decoder layers (a cheap self-draft: same vocabulary, same
embeddings, many rejections). GGUF presets are dequantised once and cached as bf16 safetensors under
`cache_root()`, so later loads take about a second.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from common.arguments import DTYPE_NAMES
from common.errors import PairMismatch, UsageError
if TYPE_CHECKING:
    from common.sampling.grammar import GrammarCompiler

from common.model.presets import GGUF_PRESETS, TINY_PRESETS, build_tiny_model, gguf_path, keep_first_layers

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


class UnknownModel(UsageError, OSError):
    """A model spec that names no preset, no local directory, and no Hugging Face model reachable from here."""


@dataclass
class LoadedModel:
    spec: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.model.generation_config.eos_token_id, self.tokenizer)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model's tokenizer and logits (made at first use: it converts the
        tokenizer, a fraction of a second for 150k tokens)."""
        from common.sampling.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.vocab_size)


def eos_token_ids(configured: int | list[int] | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens that end a generation: the generation config's (one id or several) and the tokenizer's."""
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def cache_root() -> Path:
    """Where converted weights live: $SPRINTER_CACHE, else the user's cache directory."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("SPRINTER_CACHE") or user_cache_dir("sprinter"))


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'name:layers=N' -> ('name', N); 'name' -> ('name', None)."""
    name, sep, option = spec.rpartition(":layers=")
    if not sep:
        return spec, None
    if not option.isdigit() or int(option) < 1:
        raise ValueError(f"bad model spec {spec!r}: ':layers=' takes a positive integer")
    return name, int(option)


def load_model(spec: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> LoadedModel:
    """The model `spec` names, in `dtype`, its weights on `device` (common/model/devices.py)."""
    name, n_layers = parse_spec(spec)
    if name in TINY_PRESETS:
        model, tokenizer = build_tiny_model(name)
    elif name in GGUF_PRESETS:
        source = _dense_dir(name)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    else:
        model, tokenizer = _load_hub_or_directory(name, dtype)
    if n_layers is not None:
        keep_first_layers(model, n_layers)
    model.to(device).eval()
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer)


def _load_hub_or_directory(name: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A Hugging Face id or a local directory; a name that is neither loadable here is an `UnknownModel`."""
    presets = ", ".join([*TINY_PRESETS, *GGUF_PRESETS])
    unknown = f"model {name!r} is neither a preset ({presets}) nor a local directory, and it does not load as a " \
              "Hugging Face id from here"
    problem = None if Path(name).is_dir() else _hub_problem(name)
    if problem is not None:
        raise UnknownModel(f"{unknown} ({problem})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as err:
        if Path(name).is_dir():
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnknownModel(f"{unknown} ({reason})") from err
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), tokenizer


def _hub_problem(name: str) -> str | None:
    """Why `name` cannot come from the Hugging Face hub, asked once (transformers retries an unreachable hub for
    most of a minute), or None when it is cached here or the hub has it."""
    import huggingface_hub

    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
        return None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
    try:
        huggingface_hub.model_info(name, timeout=10)
    except Exception as err:  # noqa: BLE001 - unreachable, unknown, gated, a malformed id: each said in its words
        text = str(err).strip()
        return f"asking the hub: {text.splitlines()[0] if text else type(err).__name__}"
    return None


def model_dir(spec: str) -> Path | str:
    """The spec as a checkpoint another engine can load (vLLM): a GGUF preset's dense copy (converted once),
    a tiny or truncated model saved once under `cache_root()`, or the Hugging Face id or directory as it is."""
    name, n_layers = parse_spec(spec)
    if name not in TINY_PRESETS and n_layers is None:
        return _dense_dir(name) if name in GGUF_PRESETS else name
    saved = cache_root() / "models" / "saved" / spec.replace("/", "--").replace(":", "--")
    if not (saved / "config.json").exists():
        loaded = load_model(spec, torch.float32 if name in TINY_PRESETS else torch.bfloat16)
        partial = _partial(saved)
        loaded.model.save_pretrained(partial)
        loaded.tokenizer.save_pretrained(partial)
        _publish(partial, saved)
    return saved


def gguf_file(spec: str) -> Path:
    """The GGUF file behind `spec`, for an engine that runs GGUF as shipped (llama.cpp): a GGUF preset's (assembled
    and checked on first use) or a path to a .gguf file; anything else is refused, saying what would do."""
    if spec in GGUF_PRESETS:
        return gguf_path(spec, cache_root())
    if spec.endswith(".gguf") and Path(spec).is_file():
        return Path(spec)
    presets = ", ".join(GGUF_PRESETS)
    raise UnknownModel(f"model {spec!r} is not a GGUF file: this engine loads a GGUF preset ({presets}) or a path to "
                       "a .gguf file as it is, never a converted or truncated model")


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file carries (transformers reads it from the file's metadata, not its weights)."""
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load_pair(target_spec: str, draft_spec: str, dtype: torch.dtype = torch.bfloat16) -> tuple[LoadedModel, LoadedModel]:
    target = load_model(target_spec, dtype)
    draft = target if draft_spec == target_spec else load_model(draft_spec, dtype)
    check_pair(target, draft)
    return target, draft


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculative decoding compares distributions token by token: the vocabularies must be identical."""
    if vocab_fingerprint(target.tokenizer) != vocab_fingerprint(draft.tokenizer) or target.vocab_size != draft.vocab_size:
        raise PairMismatch(
            f"draft {draft.spec!r} and target {target.spec!r} have different vocabularies "
            f"({len(draft.tokenizer)} tokens / {draft.vocab_size} logits vs {len(target.tokenizer)} / {target.vocab_size}); "
            "speculative decoding needs a draft that shares the target's tokenizer"
        )


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over the token -> id table: equal fingerprints mean token ids mean the same text."""
    table = "\n".join(f"{token}\t{idx}" for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]))
    return hashlib.sha256(table.encode()).hexdigest()


def _dense_dir(preset: str) -> Path:
    """The preset's dense bf16 copy, converted from its GGUF on first use."""
    target = cache_root() / "models" / preset
    if (target / "config.json").exists():
        return target
    source = gguf_path(preset, cache_root())
    log.info("converting %s from GGUF to dense bf16 once (30-60 s); cached in %s", preset, target)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16)
    # save_pretrained refuses a model that still looks GGUF-quantised; its weights are already dense.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = _partial(target)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    _publish(partial, target)
    return target


def _partial(target: Path) -> Path:
    """Where this process writes a cached model before publishing it: its own, so that two processes filling the
    cache at once (two daemons, two test workers) never write into one folder."""
    return target.with_name(f"{target.name}.partial-{os.getpid()}")


def _publish(partial: Path, target: Path) -> None:
    """Rename the written folder into place (atomic on one filesystem); where another process published it
    meanwhile, keep theirs."""
    try:
        partial.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)
        log.info("another process cached %s meanwhile; keeping its copy", target.name)
