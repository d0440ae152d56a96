"""What a user of this machine would run instead, measured in the sweep beside our modes (`--baselines`).

    llama-server      llama.cpp's server, the target's GGUF alone, on the cloud's core
    llama-server-sd   the same with llama.cpp's own speculative decoding: the draft's GGUF (`-md`,
                      `--spec-type draft-simple`) drafting on the edge's core

Both run locally: there is no network in them, so they are measured at every RTT of the sweep like any
other row (their figures do not depend on it). Each request is the same prompt, as the same token ids
(the target's chat template applied by the same tokenizer), streamed from /completion with greedy or
the sweep's temperature; its record has the fields of an edge request's (sim/sweep/run.py), so the
summary, the quality judge and the plots read it as they read ours.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from common.model.loading import gguf_file, load_gguf_tokenizer
from common.lab.prompt_sets import PromptRecord
from common.model.prompting import encode_prompt
from sim.processes import answers, free_port, stop_process, wait_ready
LLAMA_SERVER = "llama-server"  # llama.cpp's server alone: the baseline a bench measures beside its own rows
DRAFT_BLOCK = 5  # llama.cpp's --spec-draft-n-max, as the edge's block (k) defaults to
STARTUP_S = 180.0


def server_command(name: str, target: Path, draft: Path | None, port: int, cloud_cpus: set[int] | None,
                   edge_cpus: set[int] | None) -> list[str]:
    """llama-server's command line for a baseline: one thread for the target (and one for the draft), pinned."""
    program = llama_program("llama-server")
    command = [program, "-m", str(target), "-t", "1", "-tb", "1", "--port", str(port), "-c", "4096", "-np", "1",
               "--no-webui"]
    cores = set(cloud_cpus or ())
    if name == "llama-server-sd":
        command += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(DRAFT_BLOCK),
                    "-td", "1", "-tbd", "1"]
        if cloud_cpus and edge_cpus:
            (cloud,), (edge,) = sorted(cloud_cpus)[:1], sorted(edge_cpus)[:1]
            command += ["-Cr", f"{cloud}-{cloud}", "-Crd", f"{edge}-{edge}"]
            cores |= edge_cpus
    return (["taskset", "-c", ",".join(map(str, sorted(cores)))] if cores else []) + command


def llama_program(name: str) -> str:
    """One of llama.cpp's programs (llama-server, llama-bench), as `make llama-cpp` links them beside this
    environment's python (or on the PATH)."""
    path = Path(sys.executable).parent / name
    if path.exists():
        return str(path)
    if found := shutil.which(name):
        return found
    raise FileNotFoundError(f"{name} is missing: run `make llama-cpp` (it builds llama.cpp's programs)")


class LocalBaselines:
    """The baselines' llama-server processes, started together, each on its own port; `request` streams one."""

    def __init__(self, names: tuple[str, ...], target: str, draft: str, out: Path,
                 cloud_cpus: set[int] | None, edge_cpus: set[int] | None) -> None:
        self.names = names
        # the draft's GGUF only where llama.cpp's own speculation drafts with it: llama-server alone needs none, so a
        # draft with no GGUF (a truncated model) does not keep the target's baseline from running
        self.target = gguf_file(target)
        self.draft = gguf_file(draft) if "llama-server-sd" in names else None
        self.tokenizer = load_gguf_tokenizer(self.target)
        self.out, self.cloud_cpus, self.edge_cpus = out, cloud_cpus, edge_cpus
        self.ports: dict[str, int] = {}
        self._stack = ExitStack()

    def __enter__(self) -> "LocalBaselines":
        try:
            for name in self.names:
                self.ports[name] = self._start(name)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self, name: str) -> int:
        port = free_port()
        command = server_command(name, self.target, self.draft, port, self.cloud_cpus, self.edge_cpus)
        log_file = open(self.out / f"{name}.log", "w")
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()
        self._stack.callback(stop_process, process, 15, 10)
        wait_ready(lambda: answers(f"http://127.0.0.1:{port}/health"), process, STARTUP_S, 0.5,
                   lambda code: f"{name} exited with {code} (see {self.out / f'{name}.log'})",
                   f"{name} did not come up within {STARTUP_S:.0f} s (see {self.out / f'{name}.log'})")
        return port

    async def request(self, client: httpx.AsyncClient, prompt: PromptRecord, name: str, max_tokens: int,
                      temperature: float, seed: int) -> dict[str, Any]:
        """One streamed /completion of `prompt`'s token ids, timed at the client, as a sweep record."""
        ids = encode_prompt(self.tokenizer, prompt.prompt, prompt.chat)
        streamed = await self.stream(client, name, ids, max_tokens, temperature, seed)
        tokens, event_ms = streamed["token_ids"], streamed["event_ms"]
        return {"mode": name, "pipeline": "off", "prompt_id": prompt.id, "category": prompt.category,
                "chat": prompt.chat, "ttft_ms": streamed["first_s"] * 1e3, "wall_ms": streamed["wall_s"] * 1e3,
                "text": streamed["text"], "token_ids": tokens, "prompt_tokens": len(ids),
                "completion_tokens": len(tokens), "finish_reason": streamed["finish_reason"], "degraded": False,
                "client_event_ms": event_ms, "engine": "llama.cpp (llama-server)",
                "sprinter": {"token_ids": tokens, "target_calls": 0, "stats": {"token_times_ms": event_ms}}}

    async def stream(self, client: httpx.AsyncClient, name: str, ids: list[int], max_tokens: int,
                     temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
        """/completion streamed for the token ids `ids` (with llama-server's prompt cache, its default): the tokens,
        the text, each token's arrival (ms) and the seconds to the first token and to the end."""
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": temperature, "seed": seed, "top_k": 0,
                "top_p": 1.0, "min_p": 0.0, "stream": True, "return_tokens": True}
        if temperature == 0:
            body["top_k"] = 1
        tokens, text, event_ms, first_s, stop = [], [], [], None, None
        started = time.perf_counter()
        async with client.stream("POST", f"http://127.0.0.1:{self.ports[name]}/completion", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                now_s = time.perf_counter() - started
                if event.get("tokens"):
                    first_s = now_s if first_s is None else first_s
                    tokens += event["tokens"]
                    event_ms += [now_s * 1e3] * len(event["tokens"])
                    text.append(event.get("content", ""))
                if event.get("stop"):
                    stop = "stop" if event.get("stop_type") == "eos" else "length"
                    break
        return {"token_ids": tokens, "text": "".join(text), "event_ms": event_ms, "first_s": first_s,
                "wall_s": time.perf_counter() - started, "finish_reason": stop}


def llama_server_alone(target: str, draft: str, out: Path, cloud_cpus: frozenset[int] | None) -> LocalBaselines:
    """llama-server alone, serving the target's GGUF on the cloud's cores (which sit idle while it serves): what a
    bench measures its own rows against, in the same run. Enter it to start the server."""
    return LocalBaselines((LLAMA_SERVER,), target, draft, out, set(cloud_cpus) if cloud_cpus else None, None)

