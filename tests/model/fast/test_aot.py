"""Compiled steps kept on disk (model/fast/aot.py, weights/step_cache.py): built once, loaded by a later
process with the tokens of a fresh compile, and safe to reuse.

* a later process loads the entries a first one built, and decodes the same tokens; the default
  run uses them when they are there and --compile measured them faster than eager on this
  machine, stays eager when they measured slower or were not measured, and says what --compile
  would gain when nothing was measured;
* one build serves every length: the steps built for a short run decode a run at the model's
  whole context, and a cache longer than the one they were built with;
* stale entries (other weights, other threads) are not found; a foreign one (its manifest names
  another torch), a truncated or damaged file, an unparsable manifest and an entry whose probe
  call disagrees with the eager step are refused with one note line each, then rebuilt, or the
  run decodes eagerly;
* two processes building one entry leave one whole entry;
* a compile that cannot happen (a broken C++ compiler, an Inductor error) drops the compiled
  candidate with one line under --compile and is one error line under --compile force.

One tiny checkpoint (one layer, 32 wide), one shape, in Inductor's default mode
(SPECULATIVE_COMPILE_MODE=default: a package of autotuned kernels takes minutes to build
here; what these tests check does not depend on the kernels in it).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import serve
from model import call as calls
from model.fast import aot
from model.fast.compile import MODE_ENV, CompileError, NotCachedError, compile_for_decoding, install
from model.fast.fuse import fuse_projections
from speculative import autoregressive_generate
from tests.support.cli import ROOT, TARGET, main_error, main_ok
from tests.support.toy_models import far_from_argmax, random_llama
from weights import StepCache, load_model, save_model
from weights.step_cache import MANIFEST, PAYLOAD, EntryError

# Under pytest -n, the module's compiled cache (`built`) is built once, on one worker (pyproject.toml).
pytestmark = pytest.mark.xdist_group("test_aot")

MODE = "default"
RUN = ["--no-draft", "--prompt", "Once upon a time", "--max-new-tokens", "8", "--json"]


def subprocess_cli(
    *args: str, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """generate.py in a process of its own, one thread, Inductor's default mode; ``env`` values of
    None remove the variable."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", MODE_ENV: MODE, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=600,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny checkpoint, and the cache a first process filled with `--compile force`."""
    if not (TARGET / "tokenizer.model").is_file():
        pytest.skip("the shipped tokenizer is absent")
    folder = tmp_path_factory.mktemp("tiny")
    save_model(
        random_llama(
            vocab=2048,
            dim=32,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            hidden_dim=64,
            max_seq_len=128,
            seed=3,
        ),
        folder,
    )
    shutil.copy(TARGET / "tokenizer.model", folder)
    cache = tmp_path_factory.mktemp("cache")
    proc = subprocess_cli(
        "--target", str(folder), *RUN, "--compile", "force", "--cache-dir", str(cache)
    )
    assert proc.returncode == 0, proc.stderr
    (entry,) = StepCache(cache).entries()
    (records,) = StepCache(cache).measurements().values()
    (record,) = records.values()
    assert (
        record["model"] == "target"
        and record["compiled_ms"] > 0
        and record["eager_ms"]["prepacked"] > 0
    )
    # what a real model measures; the tests below check the decision
    mark_measured(StepCache(cache), faster=True)
    return {"folder": folder, "cache": cache, "first": json.loads(proc.stdout), "entry": entry}


def mark_measured(store: StepCache, faster: bool) -> None:
    """Make every record of ``store`` say that the compiled steps measured faster (or slower)."""
    known = store.measurements()
    for models in known.values():
        for record in models.values():
            record["faster"] = faster
    (store.root / "measured.json").write_text(json.dumps(known))


def stacked(folder: Path) -> torch.nn.Module:
    model = load_model(folder)
    fuse_projections(model)
    return model


def fresh_copy(built: dict[str, Any], tmp_path: Path) -> tuple[StepCache, dict[str, Any]]:
    """A cache of the built entry alone, to damage, and the entry's key."""
    shutil.copytree(built["cache"], tmp_path / "cache")
    return StepCache(tmp_path / "cache"), built["entry"].key


def load(
    folder: Path,
    store: StepCache,
    key: dict[str, Any],
    build: bool = False,
    notes: list[str] | None = None,
) -> torch.nn.Module:
    model = stacked(folder)
    compile_for_decoding(
        model,
        (key["width"],),
        (key["rows"],),
        16,
        mode=MODE,
        store=store,
        build=build,
        note=(notes if notes is not None else []).append,
    )
    return model


def greedy(model: torch.nn.Module) -> list[int]:
    return autoregressive_generate(model, [1, 5, 9], 12, temperature=0).tokens


# ----------------------------------------------------------------------------- reuse
def test_a_later_process_loads_the_entry_and_decodes_the_same_tokens(built: dict[str, Any]) -> None:
    """The first process built its one shape; a second process's default run finds it, loads it
    (the setup: line says so) and decodes the first's tokens."""
    first = built["first"]
    (line,) = first["settings"]["setup"]
    assert (
        line.startswith("target: prepacked ")
        and " ms per step at each decode width (compiled in" in line
    )
    assert line.endswith("kept in the cache) -> compiled (forced)"), line
    proc = subprocess_cli(
        "--target", str(built["folder"]), *RUN, "--cache-dir", str(built["cache"])
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    later = json.loads(proc.stdout)
    (line,) = later["settings"]["setup"]
    assert (
        "the default: measured faster here" in line
        and "loaded from the compiled-step cache in" in line
    ), line
    assert later["tokens"] == first["tokens"]


@pytest.mark.parametrize("record", ["slower", "none"])
def test_the_default_stays_eager_unless_the_steps_measured_faster(
    built: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    record: str,
) -> None:
    """The same cached entry, with a record that says the compiled steps were slower here, or
    with no record at all: the default run decodes eagerly, and says why."""
    store, _ = fresh_copy(built, tmp_path)
    if record == "slower":
        mark_measured(store, faster=False)
    else:
        (store.root / "measured.json").unlink()
    monkeypatch.setenv(MODE_ENV, MODE)
    out, _ = main_ok(
        capsys, ["--target", str(built["folder"]), *RUN, "--cache-dir", str(store.root)]
    )
    setup = json.loads(out)["settings"]["setup"]
    if record == "slower":
        (line,) = setup
        assert line.startswith(
            "target: prepacked (the default: the compiled steps measured slower here"
        ), line
    else:
        assert setup == "default"
        _, err = main_ok(
            capsys,
            [
                "--target",
                str(built["folder"]),
                *RUN[:-1],
                "--no-color",
                "--cache-dir",
                str(store.root),
            ],
        )
        assert any(
            "`--compile` builds them once" in line for line in err if line.startswith("note: ")
        ), err
    assert json.loads(out)["tokens"] == built["first"]["tokens"]


def test_one_build_serves_every_length(built: dict[str, Any], tmp_path: Path) -> None:
    """The shape built by the fixture's 8-token run serves a cache of the model's whole context
    (128): a greedy run to the end of the context through the loaded package, which agrees with
    the eager model, and nothing is built again."""
    store, key = fresh_copy(built, tmp_path)
    loaded = load(built["folder"], store, key)
    assert loaded.compiled.dynamic and loaded.compiled.cache_len == 128
    prompt = [1, 5, 9]
    tokens = autoregressive_generate(loaded, prompt, 128 - len(prompt), temperature=0).tokens
    assert len(tokens) == 128 - len(prompt) and loaded.compiled.built == 0
    # grown to the context, and its scratch slot
    assert loaded.layers[0].self_attn.cache.k.shape[2] == 129
    assert far_from_argmax(stacked(built["folder"]), prompt, tokens) == []


def test_loaded_steps_are_the_fresh_compile_s(built: dict[str, Any], tmp_path: Path) -> None:
    store, key = fresh_copy(built, tmp_path)
    loaded = load(built["folder"], store, key)
    assert loaded.compiled.loaded == 1 and loaded.compiled.built == 0
    eager = stacked(built["folder"])
    tokens = greedy(loaded)
    assert far_from_argmax(eager, [1, 5, 9], tokens) == []


def test_compile_cache_lists_and_clears(
    built: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, key = fresh_copy(built, tmp_path)
    out, _ = main_ok(capsys, ["--compile-cache", "--cache-dir", str(store.root)])
    lines = out.splitlines()
    assert lines[0].startswith(f"{store.root}: 1 entries") and len(lines) == 5
    assert (
        f"width {key['width']}" in lines[1]
        and f"model {key['model']}" in lines[1]
        and " MB " in lines[1]
    )
    assert lines[2].startswith("measured: 1 models on 1 machines") and lines[3].startswith("  on ")
    assert lines[4].startswith(f"    target {key['model'][:12]} torch.float32 {MODE}: prepacked ")
    assert "(faster: the default uses them); built in" in lines[4], lines[4]
    out, _ = main_ok(capsys, ["--compile-cache", "clear", "--cache-dir", str(store.root)])
    assert out.startswith("removed 1 entries") and store.entries() == []


def test_compile_at_the_model_s_full_context(
    built: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The regression of issue 37: `--compile --max-new-tokens 300` on a model of 128 positions,
    with a draft model (whose verification calls widen the cache a run needs past the context),
    measures, compiles and decodes to the end of the context, as eager and `--setup measure` do,
    with the same tokens; a later default run at full context loads what it built."""
    draft = tmp_path / "draft"
    save_model(
        random_llama(
            vocab=2048,
            dim=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            hidden_dim=32,
            max_seq_len=128,
            seed=4,
        ),
        draft,
    )
    shutil.copy(TARGET / "tokenizer.model", draft)
    monkeypatch.setenv(MODE_ENV, MODE)
    argv = [
        "--target",
        str(built["folder"]),
        "--draft",
        str(draft),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "300",
        "--json",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--gamma",
        "2",
    ]
    runs = {}
    for name, flags in {
        "eager": [],
        "measure": ["--setup", "measure"],
        "compile": ["--compile"],
        "force": ["--compile", "force"],
        "later": [],
    }.items():
        out, _ = main_ok(capsys, argv + flags)
        runs[name] = json.loads(out)
    assert runs["eager"]["prompt_tokens"] + len(runs["eager"]["tokens"]) == 128  # the whole context
    for name in ("measure", "compile", "force", "later"):
        assert runs[name]["tokens"] == runs["eager"]["tokens"], name
    assert all(line.endswith("-> compiled (forced)") for line in runs["force"]["settings"]["setup"])


def test_shared_packages_hold_no_weights_and_read_the_model_s_own(tmp_path: Path) -> None:
    """The "shared" mode (the CPU default for models of 1 GB or more): a package without its
    weights, handed the model's own tensors at load. Its file is smaller than the weights, it
    agrees with the eager step, and it reads the model's tensors where they are: a weight
    changed in place after loading changes the package's output as it changes the eager one's."""
    # 8 MB of weights: more than a package's code
    model = random_llama(
        vocab=2048,
        dim=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=512,
        max_seq_len=64,
        seed=5,
        std=0.05,
    )
    fuse_projections(model)
    reference = copy.deepcopy(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    store = StepCache(tmp_path)
    steps = compile_for_decoding(model, (1, 3), cache_len=16, mode="shared", store=store)
    assert steps.built == 2 and steps.dynamic
    assert all(entry.size < weights for entry in store.entries()), (
        weights,
        [e.size for e in store.entries()],
    )
    tokens = greedy(model)
    assert far_from_argmax(reference, [1, 5, 9], tokens) == []
    aot_runner = model.compiled.fn.runners[1, 1]
    assert aot.probe(model, aot_runner, 1, 1, False) < 1e-5
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place: the package must see it
    assert aot.probe(model, aot_runner, 1, 1, False) < 1e-5
    install(model, None)


# ----------------------------------------------------------------------------- stale, foreign, corrupted
def test_stale_entries_are_not_found(built: dict[str, Any], tmp_path: Path) -> None:
    """Other weights or another thread count make another key: nothing is found, nothing loads."""
    store, key = fresh_copy(built, tmp_path)
    other = stacked(built["folder"])
    with torch.no_grad():
        other.norm.weight[0] += 1e-3
    with pytest.raises(NotCachedError, match="1 of the 1 compiled shapes"):
        compile_for_decoding(other, (1,), cache_len=16, mode=MODE, store=store, build=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(NotCachedError):
            load(built["folder"], store, key)
    finally:
        torch.set_num_threads(threads)
    assert load(built["folder"], store, key).compiled.loaded == 1  # the entry itself is untouched


def damage(folder: Path, how: str) -> None:
    payload, manifest = folder / PAYLOAD, folder / MANIFEST
    if how == "truncated":
        payload.write_bytes(payload.read_bytes()[: payload.stat().st_size // 2])
    elif how == "damaged":
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
    elif how == "manifest":
        manifest.write_text("{not json")
    elif how == "foreign":
        content = json.loads(manifest.read_text())
        content["key"]["torch"] = "2.0.0"
        manifest.write_text(json.dumps(content))


@pytest.mark.parametrize(
    "how, reason",
    [
        ("truncated", "truncated or replaced"),
        ("damaged", "hash"),
        ("manifest", "does not parse"),
        ("foreign", "names another torch"),
    ],
)
def test_a_broken_entry_is_one_note_then_eager(
    built: dict[str, Any], tmp_path: Path, how: str, reason: str
) -> None:
    store, key = fresh_copy(built, tmp_path)
    damage(store.folder(key), how)
    with pytest.raises(EntryError, match=reason.split()[0]):
        store.find(key)
    notes: list[str] = []
    with pytest.raises(NotCachedError):
        load(built["folder"], store, key, notes=notes)
    assert len(notes) == 1 and reason in notes[0] and notes[0].endswith("decoding eagerly"), notes
    assert not store.folder(key).exists()  # discarded, to be rebuilt by the next --compile


def test_a_broken_entry_is_rebuilt_when_building(
    built: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With build, a truncated entry is compiled again (here: the good file copied back, as a build
    would write it) and then used."""
    store, key = fresh_copy(built, tmp_path)
    good = built["entry"].path / PAYLOAD
    damage(store.folder(key), "truncated")
    monkeypatch.setattr(aot, "build_package", lambda *args: shutil.copy(good, args[-1]))
    notes: list[str] = []
    model = load(built["folder"], store, key, build=True, notes=notes)
    assert len(notes) == 1 and "compiling it again" in notes[0]
    assert model.compiled.built == 1 and store.find(key) is not None
    assert far_from_argmax(stacked(built["folder"]), [1, 5, 9], greedy(model)) == []


def test_an_entry_whose_probe_disagrees_is_refused(built: dict[str, Any], tmp_path: Path) -> None:
    """The entry's file is whole and its manifest matches, but the package holds another model's
    weights (as a stale file put in place by hand would): the probe call at load catches it."""
    store, key = fresh_copy(built, tmp_path)
    other = stacked(built["folder"])
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    other.setup_cache(1, 16)
    other_key = aot.entry_key(other, key["rows"], key["width"], False, MODE)
    store.build(other_key, lambda path: shutil.copy(store.folder(key) / PAYLOAD, path))
    notes: list[str] = []
    with pytest.raises(NotCachedError):
        compile_for_decoding(
            other, (1,), cache_len=16, mode=MODE, store=store, build=False, note=notes.append
        )
    assert len(notes) == 1 and "its probe call differs from the eager step" in notes[0], notes
    assert store.find(other_key) is None


def test_the_default_run_notes_a_broken_entry_and_decodes_eagerly(
    built: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, key = fresh_copy(built, tmp_path)
    damage(store.folder(key), "truncated")
    monkeypatch.setenv(MODE_ENV, MODE)
    argv = ["--target", str(built["folder"]), *RUN[:-1], "--cache-dir", str(store.root)]
    _, err = main_ok(capsys, argv + ["--no-color"])
    notes = [line for line in err if line.startswith("note: ")]
    assert (
        len(notes) == 2
        and "refused (its file has" in notes[0]
        and notes[0].endswith("; decoding eagerly")
    )
    assert "`--compile` builds them again" in notes[1]  # and how to have them back
    # the broken entry is gone: eager, the compiled run's tokens
    out, _ = main_ok(capsys, argv + ["--json"])
    assert (
        json.loads(out)["settings"]["setup"] == "default"
        and json.loads(out)["tokens"] == built["first"]["tokens"]
    )


# ----------------------------------------------------------------------------- concurrent builders
BUILDER = textwrap.dedent("""
    import importlib.util, os, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("step_cache", {module!r})  # the module alone: no torch to import
    module = sys.modules["step_cache"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    StepCache = module.StepCache

    def make(path: Path) -> None:
        with open(path, "wb") as f:
            for _ in range(20):  # slowly, so that the other builder arrives meanwhile
                f.write(bytes(range(256)) * 400)
                f.flush()
                time.sleep(0.05)

    Path({ready!r} + str(os.getpid())).touch()
    while not Path({go!r}).exists():  # both start building together
        time.sleep(0.01)
    waited = []
    path = StepCache({cache!r}).build({{"model": "m", "width": 1}}, make, wait=lambda: waited.append(1))
    print(len(Path(path).read_bytes()), len(waited))
""")


def test_two_builders_of_one_entry_leave_one_whole_entry(tmp_path: Path) -> None:
    cache, flags = tmp_path / "cache", tmp_path / "flags"
    flags.mkdir()
    script = BUILDER.format(
        module=str(ROOT / "weights" / "step_cache.py"),
        cache=str(cache),
        ready=str(flags / "ready-"),
        go=str(flags / "go"),
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    while len(list(flags.glob("ready-*"))) < 2 and all(proc.poll() is None for proc in procs):
        time.sleep(0.01)
    (flags / "go").touch()
    results = [proc.communicate(timeout=120)[0].split() for proc in procs]
    tmp_path = cache
    assert all(proc.returncode == 0 for proc in procs)
    assert [r[0] for r in results] == [str(20 * 256 * 400)] * 2  # each got the whole file
    assert sorted(r[1] for r in results) == [
        "0",
        "1",
    ]  # one built, the other waited for it and read it
    store = StepCache(tmp_path)
    (entry,) = store.entries()
    assert entry.problem == "" and store.find({"model": "m", "width": 1}) is not None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]


# ----------------------------------------------------------------------------- a compile that cannot happen
def test_a_broken_compiler_drops_the_compiled_candidate_in_one_line(
    built: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["--target", str(built["folder"]), *RUN, "--cache-dir", str(tmp_path)]
    # what CXX=/bin/false sets
    with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/false")}):
        out, err = main_ok(capsys, argv + ["--compile"])
        (line,) = json.loads(out)["settings"]["setup"]
        assert "compiled dropped: no working C++ compiler: /bin/false does not run" in line
        assert json.loads(out)["tokens"] == built["first"]["tokens"]
        main_error(
            capsys, argv + ["--compile", "force"], "--compile force", "no working C++ compiler"
        )


def test_an_inductor_error_is_one_line(
    built: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("Inductor went wrong\n" + "  a long traceback\n" * 500)

    monkeypatch.setattr(aot, "build_package", broken)
    monkeypatch.setenv(MODE_ENV, MODE)
    argv = ["--target", str(built["folder"]), *RUN, "--cache-dir", str(tmp_path)]
    out, _ = main_ok(capsys, argv + ["--compile"])
    (line,) = json.loads(out)["settings"]["setup"]
    assert (
        "compiled dropped: compiling the Llama float32 step, 1 x 1 tokens failed (RuntimeError: Inductor went "
        "wrong)" in line
    )
    main_error(capsys, argv + ["--compile", "force"], "RuntimeError: Inductor went wrong")


def test_without_a_compiler_force_exits_2_in_one_line(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """A PATH without g++, in a real process: exit status 2, one line, no traceback."""
    proc = subprocess_cli(
        "--target",
        str(built["folder"]),
        *RUN,
        "--cache-dir",
        str(tmp_path),
        "--compile",
        "force",
        env={"PATH": str(tmp_path), "CXX": None},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --compile force: no working C++ compiler: g++ does not run "
        "(install g++, or set CXX)"
    ]
    # what a library caller gets
    with (
        torch._inductor.config.patch({"cpp.cxx": (None, str(tmp_path / "g++"))}),
        pytest.raises(CompileError, match="no working C.. compiler"),
    ):
        compile_for_decoding(stacked(built["folder"]), (1,), cache_len=16, mode=MODE)


def test_serve_py_builds_the_steps_once_and_a_later_start_loads_them(
    built: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve.py sets the pair up as generate.py does: --compile force keeps the server's steps
    (every batch size and width it calls) in the cache, and a later default start loads them
    and decodes the eager step's tokens."""
    monkeypatch.setenv(MODE_ENV, MODE)
    argv = [
        "--target",
        str(built["folder"]),
        "--no-draft",
        "--max-batch",
        "1",
        "--cache-dir",
        str(tmp_path),
    ]

    def start(*extra: str) -> tuple[Any, Any]:
        args = serve.build_parser().parse_args([*argv, *extra])
        serve.validate(args)
        pair, _, setups, _ = serve.load(args, torch.device("cpu"), torch.float32)
        return pair, setups

    _, first = start("--compile", "force")
    assert "kept in the cache" in first.lines[0], first.lines
    mark_measured(StepCache(tmp_path), faster=True)
    pair, later = start()
    (line,) = later.lines
    assert "loaded from the compiled-step cache" in line, line
    assert pair.target.compiled.loaded >= 1 and pair.target.compiled.built == 0
    assert far_from_argmax(stacked(built["folder"]), [1, 5, 9], greedy(pair.target)) == []


def test_packages_that_return_three_layers_inputs_load_again(tmp_path: Path) -> None:
    """The steps an EAGLE-3 head's target runs return the inputs of the layers it reads (a tuple
    of ids, JSON's list in the manifest): built once, found again by a later run, and equal
    to the eager call."""
    model = random_llama(
        vocab=64, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=64, seed=4
    )
    eager = copy.deepcopy(model)
    layers = (2, 2, 1)
    compile_for_decoding(
        model, (3,), (1,), 64, layers, "default", store=StepCache(tmp_path), build=True
    )
    again = copy.deepcopy(eager)
    steps = compile_for_decoding(
        again, (3,), (1,), 64, layers, "default", store=StepCache(tmp_path), build=False
    )
    assert steps.loaded and not steps.built
    tokens = torch.tensor([[5, 9, 2]])
    with torch.no_grad():
        for m in (again, eager):
            m.setup_cache(1, 32)
        got, want = (
            m(tokens, calls.chain(0, 3, "cpu"), return_hidden=layers) for m in (again, eager)
        )
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    assert got[1].shape == (1, 3, 96)


def test_a_plain_call_runs_through_steps_compiled_with_features(tmp_path: Path) -> None:
    """A feature head's target is compiled to return features too; a plain call (the target alone,
    as --compare's baseline runs it) goes through the same compiled step and drops them, rather
    than running eagerly on weights left unpacked, and gives the eager call's logits."""
    model = random_llama(
        vocab=64, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=64, seed=4
    )
    eager = copy.deepcopy(model)
    layers = (2, 2, 1)
    compile_for_decoding(
        model, (3,), (1,), 64, layers, "default", store=StepCache(tmp_path), build=True
    )
    calls_made = []
    real = model.compiled.fn
    model.compiled.fn = lambda *args: calls_made.append(args[-1]) or real(*args)
    tokens = torch.tensor([[5, 9, 2]])
    with torch.no_grad():
        for m in (model, eager):
            m.setup_cache(1, 32)
        got, want = (m(tokens, calls.chain(0, 3, "cpu")) for m in (model, eager))
    assert calls_made == [
        layers
    ]  # through the compiled step, asked for the features it was built with
    assert got.shape == want.shape == (1, 3, 64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
