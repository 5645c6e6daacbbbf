"""Reading and writing Hugging Face-layout checkpoints (config.json + safetensors), and reading a
GGUF file (weights/gguf.py) or a folder of ``pytorch_model.bin`` shards as if it were one.

The model is built on the meta device (no memory), then each tensor is read from the
memory-mapped safetensors file, converted to the wanted dtype and device, and assigned
in place, so peak host memory stays near one copy of the weights. Each tensor is checked
for NaN and infinities as it is read (one min/max reduction, no temporary the size of
the tensor): a damaged file or a diverged training run is refused, never decoded.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model import ConfigError, Llama, ModelConfig
from speculative.serving.text import LLAMA2_CHAT
from weights.chat import ChatTemplateError, chat_template, template_source
from weights.gguf import GGUFError, GGUFFile, is_gguf
from weights.registry import marked_for_chat, resolve
from weights.tokenizer import JsonTokenizer, SentencePieceTokenizer, Tokenizer, TokenizerError


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, incomplete or does not match its config."""


class NonFiniteWeightsError(CheckpointError):
    """A tensor of a checkpoint holds NaN or infinities (or overflows the dtype it is loaded in).

    Under tensor parallelism each rank reads only its own slice, so unlike the other
    CheckpointErrors only some ranks may meet it."""


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def read_config(directory: str | os.PathLike) -> ModelConfig:
    """Parse ``directory/config.json`` (or a GGUF file's metadata) into a :class:`ModelConfig` (no
    weights read)."""
    directory = Path(directory)
    if is_gguf(directory):
        try:
            return ModelConfig.from_hf(gguf_file(directory).hf_config())
        except (ConfigError, GGUFError) as err:
            raise CheckpointError(f"{directory}: {err}") from None
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: an HF-layout checkpoint needs a config.json")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    try:
        return ModelConfig.from_hf(hf)
    except ConfigError as err:
        raise CheckpointError(f"{path}: {err}") from None


def weight_files(directory: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it: safetensors, else pytorch_model.bin (some
    published folders, vicuna-7b-v1.5's among them, have only those)."""
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index, single = directory / index, directory / single
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(
                    f"{index} is not a valid index (expected a 'weight_map' object)"
                ) from None
            files = {}
            for name, shard in weight_map.items():
                path = directory / shard
                if not path.is_file():
                    raise CheckpointError(
                        f"shard {shard} named in {index.name} is missing from {directory}"
                    )
                files[name] = path
            return files
        if single.is_file():
            return {name: single for name in _names_in(single)}
    raise CheckpointError(
        f"{directory} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def _names_in(path: Path) -> list[str]:
    if path.suffix == ".bin":
        return list(_pickled(path))
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None


def _pickled(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin's tensors, memory-mapped. weights_only: a pickle from a download may hold
    code, and this reads tensors and nothing else."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch.load raises many types for a damaged or foreign file
        raise CheckpointError(
            f"{path} is not a readable PyTorch weights file "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{path} does not hold a dict of tensors")
    return state


class _Held:
    """A tensor already in memory, read through the slicing interface of a safetensors slice."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


class _GGUFSlice:
    """A GGUF file's weight, read through the slicing interface of a safetensors slice: its shape from
    the tensor table, its values dequantized when they are read."""

    def __init__(self, file: GGUFFile, name: str, shape: tuple[int, ...]) -> None:
        self.file, self.name, self.shape = file, name, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.file.tensor(self.name)[index]


class _GGUFView:
    """A GGUF file opened as safe_open opens a file: a weight is dequantized when it is read, so that
    loading holds one weight in float32 at a time."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file
        self.shapes = file.shapes()

    def __enter__(self) -> _GGUFView:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get_slice(self, name: str) -> _GGUFSlice:
        return _GGUFSlice(self.file, name, self.shapes[name])


class _HeldFile:
    """Tensors in memory (a pytorch_model.bin's), opened as safe_open opens a file."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __enter__(self) -> _HeldFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tensors = {}

    def get_slice(self, name: str) -> _Held:
        return _Held(self.tensors[name])


def _open(path: Path) -> Any:
    if path.suffix == ".bin":
        return _HeldFile(_pickled(path))
    return safe_open(path, framework="pt", device="cpu")


def gguf_file(path: Path) -> GGUFFile:
    """A GGUF file opened (weights/gguf.py), its errors as CheckpointError. Opening parses the whole
    header and tensor table (seconds for a real model's file), and one run reads a file's config, its
    tokenizer, its generation config and its weights: the file opened last is kept while it is
    unchanged on disk (the same path, modification time and size)."""
    try:
        if not path.is_file():
            return GGUFFile(path)  # its error, as it words it
        stat = path.stat()
        return _opened_gguf(path, stat.st_mtime_ns, stat.st_size)
    except GGUFError as err:
        raise CheckpointError(str(err)) from None


@functools.lru_cache(maxsize=2)  # a target and a draft
def _opened_gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def read_tensors(
    directory: Path,
    config: ModelConfig,
    take: Callable[[str, Any], torch.Tensor],
    skip: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the checkpoint in ``directory``, as (HF name, tensor), after checking that the
    names and shapes are exactly those ``config`` implies.

    ``take(name, tensor_slice)`` reads one tensor from its memory-mapped safetensors slice (all of
    it, or the rows one tensor-parallel rank needs); broken files become CheckpointError. ``skip``:
    names whose shapes are checked but whose values are neither read nor yielded (a GGUF file's 4-bit
    matrices, which a loader takes as their own codes).
    """
    view: _GGUFView | None = None  # a GGUF file's tensors, each dequantized when it is read
    if is_gguf(directory):
        try:
            view = _GGUFView(gguf_file(directory))
        except GGUFError as err:
            raise CheckpointError(str(err)) from None
        files = dict.fromkeys(view.shapes, directory)
    else:
        files = weight_files(directory)
    # Checkpoints written before transformers made it a non-persistent buffer (the Llama-2 *-hf
    # repos among them: their index's total_size counts 32 x 64 float32 of it for 7B) also hold
    # each layer's rotary inverse frequencies. Those follow from config.json, so they are skipped.
    for name in [n for n in files if n.endswith(".self_attn.rotary_emb.inv_freq")]:
        del files[name]
    with torch.device("meta"):
        expected = {hf_name(n): tuple(p.shape) for n, p in Llama(config).named_parameters()}
    if config.tie_word_embeddings:  # the output head is the embedding, not a tensor of its own
        expected.pop("lm_head.weight", None)
        files.pop("lm_head.weight", None)  # some tied checkpoints store the head anyway
    unknown = sorted(set(files) - set(expected))
    if unknown:
        raise CheckpointError(
            f"{directory}: unknown tensors not in a Llama model: {', '.join(unknown[:5])}"
            + (" ..." if len(unknown) > 5 else "")
        )
    missing = sorted(set(expected) - set(files))
    if missing:
        raise CheckpointError(
            f"{directory}: missing tensors: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )

    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        try:
            with view if view is not None else _open(path) as f:
                for name in names:
                    tensor_slice = f.get_slice(name)
                    shape = tuple(tensor_slice.get_shape())
                    if shape != expected[name]:
                        raise CheckpointError(
                            f"{path.name}: tensor {name} has shape {list(shape)} but config.json "
                            f"implies {list(expected[name])}"
                        )
                    if name in skip:
                        continue
                    tensor = take(name, tensor_slice)
                    check_finite(path, name, tensor, tensor_slice)
                    yield name, tensor
        except GGUFError as err:  # worded by weights/gguf.py, the file named
            raise CheckpointError(str(err)) from None
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} is truncated or corrupt ({err})") from None


def check_finite(path: Path, name: str, tensor: torch.Tensor, tensor_slice: Any) -> None:
    """NonFiniteWeightsError if ``tensor`` (as loaded: converted, maybe one rank's slice) holds NaN or inf.

    aminmax propagates NaN and returns inf when there is one, and it allocates two scalars,
    where isfinite().all() would allocate a bool per element and run far slower on a CPU.
    Only when the check fails is more work done: counting, and reading the stored tensor
    again to tell damage on disk from a finite value that overflows the dtype loaded in.
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return
    low, high = torch.stack(torch.aminmax(tensor)).float().tolist()  # one device sync
    if math.isfinite(low) and math.isfinite(high):
        return
    stored = tensor_slice[:]
    bad = int((~torch.isfinite(stored)).sum()) if stored.is_floating_point() else 0
    if bad:
        raise NonFiniteWeightsError(
            f"{path}: tensor {name} holds {bad} non-finite values (NaN or inf) of "
            f"{stored.numel()}: the file is damaged or the weights diverged in training; "
            "download or train it again"
        )
    largest = float(stored.abs().max())
    dtype = str(tensor.dtype).removeprefix("torch.")
    raise NonFiniteWeightsError(
        f"{path}: tensor {name} has values up to {largest:.4g}, which overflow {dtype}; "
        "load it in float32 or bfloat16"
    )


def hf_name(name: str) -> str:
    """Our parameter name -> the HF LlamaForCausalLM tensor name."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def load_model(
    name_or_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Llama:
    """Load an HF-layout checkpoint (a registry name such as ``7b`` or a directory) for inference."""
    if dtype not in SUPPORTED_DTYPES:
        raise CheckpointError(
            f"dtype {dtype} is not supported; use float32, bfloat16, float16 or float64"
        )
    directory = resolve(name_or_path)
    config = read_config(directory)

    def take(name: str, tensor_slice: Any) -> torch.Tensor:
        return tensor_slice[:].to(device=device, dtype=dtype)

    return build_model(config, dict(read_tensors(directory, config, take)))


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> Llama:
    """A Llama for inference that uses ``tensors`` (keyed by HF name) as its weights, without copying:
    built on the meta device, then each parameter is assigned; a tied head shares the embedding."""
    with torch.device("meta"):
        model = Llama(config)
    state = {name.removeprefix("model."): t for name, t in tensors.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def save_model(
    model: Llama,
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``model`` as an HF-layout checkpoint that transformers' LlamaForCausalLM loads.

    ``dtype`` converts on the way out (float16 keeps shipped weights small);
    ``max_shard_bytes`` splits the weights into shards with an index file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Never write a checkpoint that is not the config's: layers prepacked, stacked, quantized or
    # sharded in place have other names or shapes, or are gone from the parameters.
    with torch.device("meta"):
        expected = {name: param.shape for name, param in Llama(model.config).named_parameters()}
    held = {name: param.shape for name, param in model.named_parameters()}
    if held != expected:
        raise ValueError(
            "the model's parameters are not those its config describes: some layers were prepacked, "
            "stacked, quantized or sharded in place (model/fast/prepack.py, model/fast/fuse.py, "
            "model/scale/quantize.py, model/scale/tensor_parallel.py); save it before that"
        )
    tensors = {}
    for name, param in model.named_parameters():  # tied weights appear once
        tensors[hf_name(name)] = param.detach().to(dtype or param.dtype).cpu().contiguous()
    out_dtype = next(iter(tensors.values())).dtype
    config = model.config.to_hf()
    config["torch_dtype"] = str(out_dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for stale in list(directory.glob("model*.safetensors")) + list(
        directory.glob("model.safetensors.index.json")
    ):
        stale.unlink()
    if max_shard_bytes is None:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        _normal_permissions(directory / "model.safetensors")
        return directory
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / filename, metadata={"format": "pt"})
        _normal_permissions(directory / filename)
        weight_map.update({name: filename for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def _normal_permissions(path: Path) -> None:
    """Give a file written by safetensors the mode open() would have given it (0644 under umask 022).

    safetensors' save_file creates its file with mode 0600, so without this the weights alone,
    of all the files of a checkpoint, would be unreadable to other users.
    """
    umask = os.umask(0)  # the only portable way to read the umask is to set it and put it back
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint's file ({} when the file is absent)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """The tokenizer stored with a checkpoint: ``tokenizer.model`` (SentencePiece) where there is one,
    else ``tokenizer.json``, or the one a GGUF file describes; with its chat format (``.chat``: the
    checkpoint's own template, Llama-2's for a Llama-2 chat model without one, else None)."""
    directory = resolve(name_or_path)
    try:
        if is_gguf(directory):
            gguf = gguf_file(directory)
            config = gguf.tokenizer_config()
            tokenizer: Tokenizer = JsonTokenizer(
                gguf.tokenizer_json(), config, origin=f"{directory}'s tokenizer"
            )
            template = config.get("chat_template")
            source = None
            if isinstance(template, str):
                source = (template, f"{directory}'s tokenizer.chat_template")
        else:
            config = read_json(directory / "tokenizer_config.json")
            if (directory / "tokenizer.model").is_file():
                tokenizer = SentencePieceTokenizer(directory / "tokenizer.model", config)
            elif (directory / "tokenizer.json").is_file():
                path = directory / "tokenizer.json"
                tokenizer = JsonTokenizer(
                    path.read_text(encoding="utf-8"), config, origin=str(path)
                )
            else:
                raise CheckpointError(
                    f"{directory} has no tokenizer: neither a SentencePiece tokenizer.model nor a "
                    "tokenizer.json"
                )
            source = template_source(directory, config)
        if source:
            tokenizer.chat = chat_template(source[0], config, source[1])
        elif tokenizer.kind == "sentencepiece" and marked_for_chat(directory):
            tokenizer.chat = LLAMA2_CHAT  # a Llama-2 chat model without a template of its own
        else:
            tokenizer.chat = None
    except (TokenizerError, ChatTemplateError, GGUFError, UnicodeDecodeError) as err:
        raise CheckpointError(str(err).splitlines()[0]) from None
    tokenizer.name = str(name_or_path)
    return tokenizer


def read_generation_config(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """generation_config.json ({} when there is none), or what a GGUF file says of the same."""
    directory = resolve(name_or_path)
    if is_gguf(directory):
        try:
            return gguf_file(directory).generation_config()
        except GGUFError as err:
            raise CheckpointError(str(err)) from None
    return read_json(directory / "generation_config.json")


def stop_ids(
    config: ModelConfig, generation: dict[str, Any], tokenizer: Tokenizer
) -> tuple[int, ...]:
    """Every id that ends a generation, in order, once each: config.json's eos_token_id (an int or a
    list), generation_config.json's, and the tokenizer's own EOS. Llama-3.1-Instruct ends a turn
    with <|eot_id|>, which only the lists name; stopping at the first id alone runs past the answer."""
    ids: list[int] = list(
        getattr(config, "eos_ids", ()) or ([config.eos_id] if config.eos_id is not None else [])
    )
    listed = generation.get("eos_token_id")
    for value in listed if isinstance(listed, list) else [listed]:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            ids.append(value)
    if tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return tuple(i for i in dict.fromkeys(ids) if i < config.vocab_size)


def sampling_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings a generation_config.json gives, as this project names them
    (temperature, top_k, top_p, max_new_tokens), only those it states. ``do_sample: false`` means
    greedy, as transformers reads it, whatever temperature it also states; values that cannot be
    right are left out rather than trusted."""
    out: dict[str, Any] = {}
    if generation.get("do_sample") is False:
        out["temperature"] = 0.0
    elif _number(generation.get("temperature")) is not None and generation["temperature"] >= 0:
        out["temperature"] = float(generation["temperature"])
    if _number(generation.get("top_p")) is not None and 0 < generation["top_p"] <= 1:
        out["top_p"] = float(generation["top_p"])
    for key, name in (("top_k", "top_k"), ("max_new_tokens", "max_new_tokens")):
        value = generation.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            out[name] = value
    if out.get("temperature") == 0.0:  # greedy: nothing else applies
        out = {k: v for k, v in out.items() if k not in ("top_k", "top_p")}
    return out


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None
