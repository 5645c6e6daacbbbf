"""Peers on Spec-Bench's questions, in the same run and the same turns as benchmarks/spec_bench.py's
set-ups: llama.cpp and transformers on the same weights at the same precision.

    python -m benchmarks.spec_bench --target SMOLLM2 --per-task 20 --max-new-tokens 256 --threads 2 \\
        --peer llama.cpp=LLAMA_BIN,GGUF_DIR/smollm2-f32.gguf,GGUF_DIR/smollm2-eagle3-f32.gguf \\
        --peer transformers=GGUF_DIR/smollm2-hf --out PAGE.md

Optional and for developers only: neither llama.cpp nor transformers is a dependency of the runtime.
``--peer llama.cpp=BIN_DIR,MODEL.gguf[,HEAD.gguf]``: llama.cpp's tools in BIN_DIR (built as
benchmarks/llama_cpp.py's docstring says, with the targets llama-completion, llama-lookup and
llama-speculative-simple), on MODEL.gguf, the target's weights in GGUF (for SmolLM2's Q4_1 file read as
float32: ``python -m weights.convert gguf --gguf Q4_1.gguf --out HF_DIR --dtype float32``, then
llama.cpp's ``convert_hf_to_gguf.py HF_DIR --outtype f32``); HEAD.gguf, the EAGLE-3 head converted by the
same script with ``--target-model-dir HF_DIR``. Its rows: the target alone (llama-completion), its
prompt lookup (llama-lookup: n-grams of 1 to 4 tokens of the prompt and the output so far, up to
:data:`LOOKUP_DRAFT` tokens drafted) and, with a head, the head (llama-speculative-simple
``--spec-type draft-eagle3``, gamma :data:`HEAD_GAMMA`, every draft kept).
``--peer transformers=HF_DIR[,N...]``: transformers in float32 on HF_DIR (the folder that
``weights.convert gguf`` writes), the target alone and with prompt lookup
(``generate(..., prompt_lookup_num_tokens=N)``, each N a row; default 10, its documentation's), in a
process of its own that loads the model once.

Each peer decodes the prompt our target is given: llama.cpp its text (the ids decoded with their
special tokens written out; llama-completion's --verbose-prompt shows it reads back our very ids,
checked at every call), transformers the ids themselves; the same new tokens at most (llama-lookup
may accept a few past the limit in its last call: counted, in its seconds), the end of turn honoured, at the run's temperature, on as many threads as ours. Their tokens/s are counted as
Spec-Bench counts ours: new tokens over the seconds from the prompt's pass to the last token (the
prompt's pass included; llama.cpp: its prompt eval, eval and sampling times, or "encoded" and
"decoded" seconds, as it reports them, its model's loading excluded as ours is; transformers: the
generate call). Greedy, a peer's tokens are compared with the target alone's (llama.cpp's by their
text, :class:`SameText`); a peer computes in its own order, so a near tie may go the other way: shown
on the page, not an error.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.harness import ROOT, script_parser
from benchmarks.llama_cpp import (
    COMPLETION_SPEED,
    SPECULATIVE_SPEED,
    llama_command,
    run_llama,
    sampling,
)
from benchmarks.spec_bench import Turn

LOOKUP_DRAFT = 10  # llama-lookup's draft length, transformers' suggested prompt_lookup_num_tokens
HEAD_GAMMA = 3  # benchmarks/llama_cpp.py's gamma for the head
PROMPT_LOOKUP = (10,)  # transformers' prompt_lookup_num_tokens (its documentation's suggestion)
LLAMA_TOOLS = ("llama-completion", "llama-lookup", "llama-speculative-simple")


# ----------------------------------------------------------------------------- the prompt
def prompt_text(tokenizer: Any, prompt_ids: Sequence[int]) -> str:
    """The text a peer that reads text is given: our prompt's ids decoded with their special tokens
    written out (a chat template's markers), which the peer's tokenizer reads back as the same ids.
    A SentencePiece tokenizer decodes without its BOS, which llama.cpp adds as its metadata says."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:  # a tokenizer.json (weights.tokenizer.HFTokenizer)
        return backend.decode(list(prompt_ids), skip_special_tokens=False)
    return tokenizer.decode(list(prompt_ids))


# ----------------------------------------------------------------------------- llama.cpp's logs
PROMPT_EVAL = r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens"
EVAL = r"(?<!prompt )eval time =\s+([\d.]+) ms /\s+(\d+) runs"
SAMPLING = r"sampling time =\s+([\d.]+) ms"
ENCODED = r"encoded\s+\d+ tokens in\s+([\d.]+) seconds"
DECODED = r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"
ACCEPTED = r"n_accept\s+=\s+(\d+)"


def completion_timing(log: str) -> tuple[int, float]:
    """llama-completion's new tokens and seconds from its log: each token after the first is one eval
    run (the first comes from the prompt's pass; the last, the end of turn or the limit, is not
    evaluated), and the seconds are its prompt eval, eval and sampling times."""
    prompt_ms = float(re.findall(PROMPT_EVAL, log)[-1][0])
    eval_ms, runs = re.findall(EVAL, log)[-1]
    sampling_ms = float(re.findall(SAMPLING, log)[-1])
    return int(runs) + 1, (prompt_ms + float(eval_ms) + sampling_ms) / 1e3


def speculative_timing(log: str) -> tuple[int, float, int]:
    """llama-lookup's or llama-speculative-simple's new tokens, seconds (the prompt's "encoded" and the
    output's "decoded") and accepted drafted tokens, from its log."""
    encoded = float(re.findall(ENCODED, log)[-1])
    new, decoded = re.findall(DECODED, log)[-1]
    return int(new), encoded + float(decoded), int(re.findall(ACCEPTED, log)[-1])


def verbose_prompt_ids(log: str) -> list[int]:
    """The prompt's ids as llama-completion --verbose-prompt lists them ("number of tokens in prompt
    = N", then N lines "ID -> 'PIECE'")."""
    count = re.search(r"number of tokens in prompt = (\d+)\n", log)
    if count is None:
        return []
    # each line may begin with the log's time and level ("0.01.202.950 I ")
    listed = re.findall(r"^(?:[\d.]+ [A-Z] )? *(\d+) -> '", log[count.end() :], re.MULTILINE)
    return [int(i) for i in listed[: int(count.group(1))]]


def completion_text(stdout: str) -> str:
    """The new text in llama-completion's output (--no-display-prompt): the pieces, " [end of text]"
    and a newline where it stopped at the end of turn, then two newlines (before its figures, which go
    to stderr)."""
    return stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")


def generated_text(stdout: str, prompt: str) -> str:
    """The new text in the output of llama-lookup or llama-speculative-simple: they print two newlines,
    the prompt's pieces, the new pieces, then two newlines twice (before and after their figures,
    which go to stderr)."""
    start = stdout.find(prompt)
    text = stdout[start + len(prompt) :] if start >= 0 else stdout
    return text.removesuffix("\n\n\n\n")


def lookup_command(
    args: Any, model: Path, prompt: str, context: int, options: list[str]
) -> list[str]:
    """llama-lookup's command line: llama-completion's, less the flags only llama-completion takes, with
    :data:`LOOKUP_DRAFT` tokens drafted at most. It stops once it has more new tokens than its -n (and
    may accept a few more in that last call): -n one less than the limit, which it then reaches."""
    limit = SimpleNamespace(**{**vars(args), "max_new_tokens": max(1, args.max_new_tokens - 1)})
    cmd = llama_command(limit, str(model), None, "", 0, prompt, context, options)
    flags = [c for c in cmd[1:] if c not in ("-no-cnv", "--no-display-prompt")]
    return [str(args.bin / "llama-lookup"), *flags, "--spec-draft-n-max", str(LOOKUP_DRAFT)]


# ----------------------------------------------------------------------------- the peers
class SameText(list):
    """A llama.cpp turn's tokens: its text in our ids. llama.cpp prints text, not ids, and the model may
    split a word otherwise than our tokenizer re-encodes it, so they equal a list of ids (the target
    alone's) whose text is theirs; where llama-lookup accepted a few past the limit, whose text begins
    theirs."""

    def __init__(self, ids: list[int], tokenizer: Any, longer: bool) -> None:
        super().__init__(ids)
        self.tokenizer = tokenizer
        self.longer = longer

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list):
            return NotImplemented
        mine, theirs = (self.tokenizer.decode(list(ids)) for ids in (self, other))
        if self.longer:
            return mine.startswith(theirs)
        return mine == theirs

    __hash__ = None  # type: ignore[assignment]  # a list's


@dataclass
class LlamaCppPeer:
    """One llama.cpp configuration: ``tool`` "alone" (llama-completion), "lookup" (llama-lookup) or
    "head" (llama-speculative-simple with the EAGLE-3 head ``head``)."""

    name: str
    bin: Path
    model: Path
    tool: str
    threads: int
    tokenizer: Any
    head: Path | None = None

    @property
    def text(self) -> str:
        """What the page says of it."""
        tool = {
            "alone": "llama-completion",
            "lookup": f"llama-lookup (n-grams of 1–4 tokens, up to {LOOKUP_DRAFT} drafted)",
            "head": f"llama-speculative-simple --spec-type draft-eagle3 with `{self.head and self.head.name}` "
            f"(γ = {HEAD_GAMMA}, every draft kept)",
        }[self.tool]
        return (
            f"llama.cpp on `{self.model.name}`: {tool}, -t {self.threads}; its seconds as it reports them, "
            "the prompt's pass included; its text compared"
        )

    def turn(
        self, prompt_ids: list[int], new_tokens: int, temperature: float, seed: int | None
    ) -> Turn:
        prompt = prompt_text(self.tokenizer, prompt_ids)
        args = SimpleNamespace(bin=self.bin, max_new_tokens=new_tokens, threads=self.threads)
        context = len(prompt_ids) + new_tokens + LOOKUP_DRAFT + 8
        # the prompt in one batch, as speculative-simple requires
        options = [*sampling(temperature, seed or 0), "-b", str(context)]
        if self.tool == "alone":
            cmd = llama_command(args, str(self.model), None, "", 0, prompt, context, options)
            # special tokens printed, so that the text re-encodes to the end of turn too (the other tools
            # print them anyway); the prompt's ids listed, to check them
            proc = run_llama([*cmd, "--special", "--verbose-prompt"], COMPLETION_SPEED)
            log = proc.stderr + proc.stdout
            if verbose_prompt_ids(log) != list(prompt_ids):
                raise SystemExit(
                    "error: llama.cpp reads the prompt as other ids than ours: not the same tokenizer"
                )
            new, seconds = completion_timing(log)
            return self._turn(completion_text(proc.stdout), new, new, seconds, new_tokens)
        if self.tool == "lookup":
            cmd = lookup_command(args, self.model, prompt, context, options)
        else:
            cmd = llama_command(
                args,
                str(self.model),
                str(self.head),
                "draft-eagle3",
                HEAD_GAMMA,
                prompt,
                context,
                options,
            )
        proc = run_llama(cmd, SPECULATIVE_SPEED)
        new, seconds, accepted = speculative_timing(proc.stderr + proc.stdout)
        # each target call gives the tokens it accepted and one of its own
        text = generated_text(proc.stdout, prompt)
        return self._turn(text, new, new - accepted, seconds, new_tokens)

    def _turn(self, text: str, new: int, calls: int, seconds: float, limit: int) -> Turn:
        ids = self.tokenizer.encode_special(text)
        return Turn(SameText(ids, self.tokenizer, new > limit), new, calls, seconds)

    def close(self) -> None:
        """Nothing stays running between turns (each is a process of its own)."""


class TransformersWorker:
    """The process that holds transformers' model: one JSON request a line on its stdin, one JSON
    answer a line on its stdout (:func:`serve_transformers`)."""

    def __init__(self, folder: Path, threads: int) -> None:
        command = [sys.executable, "-m", "benchmarks.spec_bench_peers", "transformers", str(folder)]
        self.proc = subprocess.Popen(
            [*command, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(
                f"error: transformers did not load {folder} (exit status {self.proc.wait()})"
            )

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: transformers stopped (exit status {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


@dataclass
class TransformersPeer:
    """transformers alone (``lookup`` 0) or with prompt lookup of ``lookup`` tokens."""

    name: str
    worker: TransformersWorker
    folder: Path
    lookup: int
    threads: int
    stop_ids: tuple[int, ...]

    @property
    def text(self) -> str:
        from importlib.metadata import version

        how = f"prompt_lookup_num_tokens = {self.lookup}" if self.lookup else "alone"
        return (
            f"transformers {version('transformers')} on `{self.folder.name}` in float32: generate(), {how}, "
            f"{self.threads} torch threads; the call timed whole"
        )

    def turn(
        self, prompt_ids: list[int], new_tokens: int, temperature: float, seed: int | None
    ) -> Turn:
        request = {
            "ids": list(prompt_ids),
            "new": new_tokens,
            "temperature": temperature,
            "seed": seed,
            "lookup": self.lookup,
            "stop": list(self.stop_ids),
        }
        got = self.worker.ask(request)
        return Turn(got["tokens"], len(got["tokens"]), got["calls"], got["seconds"])

    def close(self) -> None:
        self.worker.close()


def serve_transformers(folder: str, threads: int) -> None:
    """The worker's side: the model loaded once in float32, then :func:`transformers_turn` of each
    request line."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(transformers_turn(model, **json.loads(line))), flush=True)


def transformers_turn(
    model: Any,
    ids: list[int],
    new: int,
    temperature: float,
    seed: int | None,
    lookup: int,
    stop: list[int],
) -> dict[str, Any]:
    """One generate call timed whole (the prompt's pass included): its new tokens (the end of turn
    among them, as ours), its seconds and its target calls (a streamer is handed the prompt, then the
    tokens of each call)."""
    import torch

    class Calls:
        count = -1  # the prompt's own put

        def put(self, value: Any) -> None:
            Calls.count += 1

        def end(self) -> None:
            pass

    if temperature:
        options = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    else:
        options = {"do_sample": False}
    if lookup:
        options["prompt_lookup_num_tokens"] = lookup
    if seed is not None:
        torch.manual_seed(seed)
    prompt = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            eos_token_id=stop,
            pad_token_id=stop[0],
            streamer=Calls(),
            **options,
        )
    seconds = time.perf_counter() - start
    return {"tokens": out[0, len(ids) :].tolist(), "seconds": seconds, "calls": Calls.count}


# ----------------------------------------------------------------------------- --peer
def make_peers(specs: Sequence[str], named: Any, threads: int) -> list[Any]:
    """The peers of spec_bench's ``--peer`` options (``named``: the target alone's NamedPair, for its
    tokenizer and end of turn); ValueError, one line, for a spec it cannot run."""
    peers: list[Any] = []
    for spec in specs:
        kind, _, value = spec.partition("=")
        paths = [p for p in value.split(",") if p]
        if kind == "llama.cpp":
            peers += llama_cpp_peers(paths, named.spec.tokenizer, threads)
        elif kind == "transformers":
            peers += transformers_peers(paths, named.spec.stop_ids, threads)
        else:
            raise ValueError(
                f"--peer {spec}: the peers are llama.cpp=BIN_DIR,MODEL.gguf[,HEAD.gguf] and transformers=HF_DIR[,N...]"
            )
    return peers


def llama_cpp_peers(paths: list[str], tokenizer: Any, threads: int) -> list[LlamaCppPeer]:
    if len(paths) not in (2, 3):
        raise ValueError(
            "--peer llama.cpp=BIN_DIR,MODEL.gguf[,HEAD.gguf]: give its tools' folder and a GGUF file"
        )
    bin_dir, model = Path(paths[0]), Path(paths[1])
    head = Path(paths[2]) if len(paths) == 3 else None
    for tool in LLAMA_TOOLS:
        if not (bin_dir / tool).is_file():
            raise ValueError(
                f"--peer llama.cpp: no {tool} in {bin_dir} (build it as benchmarks/llama_cpp.py's docstring says)"
            )
    for file in (model, head):
        if file is not None and not file.is_file():
            raise ValueError(f"--peer llama.cpp: no GGUF file {file}")
    label = f"llama.cpp {model.stem}"
    peers = [
        LlamaCppPeer(f"{label}, target alone", bin_dir, model, "alone", threads, tokenizer),
        LlamaCppPeer(f"{label}, lookup", bin_dir, model, "lookup", threads, tokenizer),
    ]
    if head is not None:
        peers.append(
            LlamaCppPeer(f"{label}, {head.stem}", bin_dir, model, "head", threads, tokenizer, head)
        )
    return peers


def transformers_peers(
    paths: list[str], stop_ids: tuple[int, ...], threads: int
) -> list[TransformersPeer]:
    if not paths or not all(p.isdigit() and int(p) > 0 for p in paths[1:]):
        raise ValueError(
            "--peer transformers=HF_DIR[,N...]: an HF folder, then prompt_lookup_num_tokens values"
        )
    folder = Path(paths[0])
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"--peer transformers: no config.json in {folder} (python -m weights.convert gguf writes one)"
        )
    lookups = [int(n) for n in paths[1:]] or list(PROMPT_LOOKUP)
    worker = TransformersWorker(folder, threads)
    peers = [
        TransformersPeer("transformers f32, target alone", worker, folder, 0, threads, stop_ids)
    ]
    for n in lookups:
        peers.append(
            TransformersPeer(
                f"transformers f32, prompt lookup {n}", worker, folder, n, threads, stop_ids
            )
        )
    return peers


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.spec_bench_peers transformers HF_DIR THREADS``: the transformers worker,
    which benchmarks.spec_bench --peer transformers=... starts (the peers run from there)."""
    parser = script_parser("spec_bench_peers", __doc__)
    parser.add_argument("worker", choices=["transformers"], help="the worker to serve")
    parser.add_argument("folder", help="the HF folder of the target")
    parser.add_argument("threads", type=int, help="torch CPU threads")
    args = parser.parse_args(argv)
    serve_transformers(args.folder, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
