"""Hub names for targets and datasets, read the way a user's machine sees them: a hub cache laid out as
huggingface_hub writes it (models--org--name/refs/main, snapshots/<commit>/...), HF_HUB_OFFLINE=1, and the
real commands by name. No test reaches the network."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
import torch
import yaml
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file, save_file
from target_zoo import zoo_config
from transformers import AutoModelForCausalLM

from dflash_ddp import hub
from dflash_ddp.hub import (
    ModelSource,
    TextWeights,
    check_safetensors,
    hub_dataset_name,
    hub_model_name,
    locate_model,
    other_parts,
    resolve_data,
    split_files,
    weight_files,
)
from dflash_ddp.parallel.downloads import fetch_target_weights
from dflash_ddp.regenerate import main as regenerate_main
from dflash_ddp.setup.run import target_weights
from dflash_ddp.target_model import loading
from dflash_ddp.target_model.info import inspect_target
from dflash_ddp.target_model.loading import load_causal_lm, whole_target
from dflash_ddp.train import main as train_main

from conftest import build_tokenizer, conversation
from helpers import SMALL_JOB, as_flags, one_thread, torchrun_cmd, train_flags

COMMIT_A, COMMIT_B, DATA_COMMIT = "a" * 40, "b" * 40, "d" * 40
TIMEOUT_S = 900  # only catches a hang


def snapshot(cache: Path, repo: str, commit: str, kind: str = "models") -> Path:
    """An empty snapshot folder of `repo` at `commit`, named by refs/main."""
    root = cache / f"{kind}--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    folder = root / "snapshots" / commit
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def hub_cache(tmp_path, tiny_target, chat_data) -> Path:
    """A hub cache holding org/tiny (the tiny target in 1-layer shards with an index) and org/chat (a train
    split of 48 conversations in data/train-00000-of-00001.jsonl and a test split of 6)."""
    cache = tmp_path / "hub"
    folder = snapshot(cache, "org/tiny", COMMIT_A)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="150KB")
    for item in tiny_target.iterdir():
        if not item.name.endswith(".safetensors") and not (folder / item.name).exists():
            shutil.copy(item, folder / item.name)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    data = snapshot(cache, "org/chat", DATA_COMMIT, "datasets") / "data"
    data.mkdir()
    shutil.copy(chat_data, data / "train-00000-of-00001.jsonl")
    lines = chat_data.read_text().splitlines(keepends=True)
    (data / "test-00000-of-00001.jsonl").write_text("".join(lines[:6]))
    return cache


VISION_SHARD = "model-vision.safetensors"
# the zoo's wrappers and the modules beside their text model (a vision tower, Gemma 4's vision projector)
# (Mistral Large 3's files keep its text model at their top level, in Mistral's original names)
WRAPPERS = {
    "qwen3_5": ("model.visual",),
    "gemma4": ("model.embed_vision", "model.vision_tower"),
    "mistral_large4": ("patch_merger", "pre_mm_projector_norm", "vision_encoder", "vision_language_adapter"),
}


def wrapper_cache(tmp_path: Path, name: str) -> Path:
    """A hub cache holding org/vl: the zoo's tiny vision-language wrapper `name` as it ships (text model at
    `model.language_model` or at the top level, the modules WRAPPERS names beside it), resharded as a large
    wrapper is: those modules alone in their own shard, each text layer in one, the rest (embedding, final
    norm, LM head) in a last one."""
    cache = tmp_path / "hub"
    folder = snapshot(cache, "org/vl", COMMIT_A)
    model_class, config = zoo_config(name, len(build_tokenizer(folder)))
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path / "saved")
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in load_file(tmp_path / "saved" / "model.safetensors").items():
        layer = hub.LAYER_OF_WEIGHT.search(tensor_name)
        shard = (
            VISION_SHARD
            if tensor_name.startswith(tuple(f"{m}." for m in WRAPPERS[name]))
            else f"model-layer{layer.group(1)}.safetensors"
            if layer
            else "model-rest.safetensors"
        )
        shards.setdefault(shard, {})[tensor_name] = tensor
    weight_map, total = {}, 0
    for shard, tensors in shards.items():
        save_file(tensors, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for item in (tmp_path / "saved").glob("*.json"):  # config.json, generation_config.json
        shutil.copy(item, folder / item.name)
    return cache


@pytest.fixture
def vl_cache(tmp_path) -> Path:
    """wrapper_cache of the zoo's Qwen3.5 wrapper (Qwen3_5ForConditionalGeneration: vision at `model.visual`)."""
    return wrapper_cache(tmp_path, "qwen3_5")


def offline_env(cache: Path) -> dict:
    return os.environ | {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run(args: list[str], cache: Path, torchrun: int = 0) -> subprocess.CompletedProcess:
    cmd = [*torchrun_cmd(torchrun), *args] if torchrun else [sys.executable, *args]
    return subprocess.run(cmd, env=offline_env(cache), capture_output=True, text=True, timeout=TIMEOUT_S)


def shards_of_late_layers(folder: Path, first_unneeded: int) -> list[Path]:
    return [folder / f for f in set(_index(folder).values()) - set(weight_files(folder, first_unneeded))]


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


# ----------------------------------------------------------------------------------------------- names


def test_a_local_path_wins_over_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_model_name("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert hub_model_name("Qwen/Qwen3-8B@v1.0") == ("Qwen/Qwen3-8B", "v1.0")
    (tmp_path / "Qwen" / "Qwen3-8B").mkdir(parents=True)
    assert hub_model_name("Qwen/Qwen3-8B") is None  # a directory of that name is what the user meant
    assert hub_model_name("a/b/c") is None and hub_model_name("model") is None
    assert hub_dataset_name("org/chat") == ("org/chat", "train")
    assert hub_dataset_name("org/chat:test") == ("org/chat", "test")
    assert hub_dataset_name("data/*.jsonl") is None and hub_dataset_name("dir/file.jsonl") is None


def test_a_split_is_chosen_by_the_hubs_file_naming():
    files = [
        "README.md",
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/test.jsonl",
    ]
    assert split_files(files, "train") == files[1:3]
    assert split_files(files, "test") == ["data/test.jsonl"]
    assert split_files(["train/a.jsonl", "validation/b.jsonl"], "validation") == ["validation/b.jsonl"]
    assert split_files(["chats.jsonl", "more.jsonl"], "train") == [
        "chats.jsonl",
        "more.jsonl",
    ]  # no split named
    assert split_files(["chats.jsonl"], "test") == []


def test_only_the_shards_of_the_layers_a_run_needs_are_named(hub_cache):
    folder = hub_cache / "models--org--tiny" / "snapshots" / COMMIT_A
    index = _index(folder)
    needed = weight_files(folder, 2)
    for weight, file in index.items():
        layer = hub.LAYER_OF_WEIGHT.search(weight)
        if layer is None or int(layer.group(1)) < 2:
            assert file in needed, weight  # embedding, final norm, LM head and layers 0-1
    assert set(needed) < set(index.values())  # the later layers' shards are left out
    assert weight_files(folder, None) == sorted(set(index.values()))


@pytest.mark.parametrize("layers", ["model.layers", "transformer.h", "transformer.blocks"])
def test_the_layers_shards_are_found_under_each_familys_name_for_them(tmp_path, layers):
    """Llama's and most families keep their decoder layers at `model.layers`, GPT-2's family, Falcon and BLOOM
    at `transformer.h`, MPT at `transformer.blocks`: the later layers' shards are left out under each."""
    weight_map = {f"{layers}.{i}.mlp.weight": f"layer{i}.safetensors" for i in range(3)}
    weight_map |= {"embed.weight": "rest.safetensors", "lm_head.weight": "rest.safetensors"}
    (tmp_path / hub.WEIGHTS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert weight_files(tmp_path, 2) == ["layer0.safetensors", "layer1.safetensors", "rest.safetensors"]


def test_a_wrappers_vision_shards_are_never_named_for_target_ranks(vl_cache):
    """The text model's tensors are found from the config by the model's own classes (text_stack.py): the
    selection leaves the vision shard out, whatever the layers, and names it as the wrapper's other part."""
    folder = vl_cache / "models--org--vl" / "snapshots" / COMMIT_A
    info = inspect_target(folder)
    text = target_weights(info)
    assert info.architecture == "Qwen3_5ForConditionalGeneration"
    assert set(text.prefixes) >= {"model.language_model", "lm_head"}
    assert not any(text.holds(w) for w in _index(folder) if w.startswith("model.visual."))
    assert all(text.holds(w) for w in _index(folder) if not w.startswith("model.visual."))
    every = sorted(set(_index(folder).values()))
    # without the text model's names, every file outside the later layers is read: the vision shard too
    assert VISION_SHARD in weight_files(folder, 3)
    assert weight_files(folder, None, text) == [f for f in every if f != VISION_SHARD]
    assert weight_files(folder, 3, text) == sorted(
        ["model-rest.safetensors", *(f"model-layer{i}.safetensors" for i in range(3))]
    )
    assert other_parts(folder, text) == ([VISION_SHARD], ["model.visual"])
    # Mistral 3 keeps its LM head beside its text model, not inside it
    assert TextWeights.of("language_model.model", "language_model.model.embed_tokens.weight",
                          "language_model.lm_head.weight").prefixes == (
        "language_model.model", "language_model.model.embed_tokens", "language_model.lm_head"
    )  # fmt: skip


def test_a_download_of_a_wrapper_fetches_only_its_text_shards_and_says_what_it_skipped(
    vl_cache, tmp_path, monkeypatch, capsys
):
    """Online (the hub mocked): the files asked of the hub are the text model's shards of the layers run, the
    vision shard is not among them, the view target ranks load links no vision file and indexes no vision
    tensor, and one line says what was left out and how large it is."""
    folder = vl_cache / "models--org--vl" / "snapshots" / COMMIT_A
    vision = (folder / VISION_SHARD).read_bytes()
    (folder / VISION_SHARD).unlink()  # as in a cache that never held it
    asked: list[list[str]] = []

    class Info:
        size = 12_345_678

    def snapshot_download(repo_id, allow_patterns, **kwargs):
        asked.append(sorted(allow_patterns))
        if VISION_SHARD in allow_patterns:
            (folder / VISION_SHARD).write_bytes(vision)
        return str(folder)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(vl_cache))
    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(
        hub.HfApi, "get_paths_info", lambda self, repo, paths, revision: [Info()] * len(paths)
    )
    source = ModelSource("org/vl", folder, "org/vl", "main", COMMIT_A)
    info = inspect_target(folder)
    view = fetch_target_weights(source, 3, tmp_path / "views", together=False, text=target_weights(info))
    assert asked == [["model-layer0.safetensors", "model-layer1.safetensors", "model-layer2.safetensors",
                      "model-rest.safetensors"]]  # fmt: skip
    assert not (view / VISION_SHARD).exists() and (view / "model-layer0.safetensors").exists()
    assert not any(w.startswith("model.visual.") for w in _index(view))
    printed = capsys.readouterr().out
    assert (
        "--target_model org/vl: 1 weight file(s) (12.3 MB) hold only the checkpoint's parts outside its text "
        "model (model.visual): not downloaded"
    ) in printed
    # without `text` (a caller that loads the checkpoint's own class whole) every file
    assert fetch_target_weights(source, None, together=False) == folder
    assert VISION_SHARD in asked[-1]


@pytest.mark.parametrize("name", WRAPPERS)
def test_training_a_wrapper_by_hub_name_reads_no_vision_shard(name, tmp_path, monkeypatch, capsys):
    """The real command offline, the wrapper's vision shard gone from the cache (and, where the text model
    can be cut, the shard of the layer after the last tap): --plan says what the run leaves out, and two
    training steps load the text model and train. Gemma 4's text model is built whole (per-layer inputs): its
    every layer is read."""
    cache = wrapper_cache(tmp_path, name)
    folder = cache / "models--org--vl" / "snapshots" / COMMIT_A
    (folder / VISION_SHARD).unlink()
    layers = 4 if name == "gemma4" else 3  # taps 1, 2: layers 0-2 run
    if layers == 3:
        (folder / "model-layer3.safetensors").unlink()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(16)))
    out = tmp_path / "run"
    flags = train_flags("org/vl", data, out, target_layer_ids="1,2")
    skipped = (
        "1 weight file(s) (size unknown offline) hold only the checkpoint's parts outside its text model "
        f"({', '.join(WRAPPERS[name])}): not downloaded"
    )
    assert train_main([*flags, "--plan"]) == 0
    plan = capsys.readouterr().out
    assert f"{layers + 1} safetensors file(s)" in plan and skipped in plan, plan
    with one_thread():
        assert train_main([*flags, "--max_steps", "2"]) == 0
    assert f"--target_model org/vl: {skipped}" in capsys.readouterr().out
    assert (out / "checkpoints" / "step-00000002").is_dir()
    [view] = (out / "cache").glob("org--vl-*")
    assert sorted(p.name for p in view.glob("*.safetensors")) == sorted(
        ["model-rest.safetensors", *(f"model-layer{i}.safetensors" for i in range(layers))]
    )


def test_decoding_a_wrapper_by_hub_name_reads_no_vision_shard(tmp_path, monkeypatch):
    """The evaluation's target (whole_target) offline with the vision shard gone: a view of the text model's
    files, loaded as the causal LM the decoder runs, equal to the wrapper's own logits; regeneration with
    transformers runs from the same view."""
    cache = wrapper_cache(tmp_path, "qwen3_5")
    folder = cache / "models--org--vl" / "snapshots" / COMMIT_A
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        expected = load_causal_lm(inspect_target(folder), torch.device("cpu"), torch.float32)(ids).logits
    (folder / VISION_SHARD).unlink()
    info = whole_target("org/vl")
    assert info.path != folder and not (info.path / VISION_SHARD).exists()
    with torch.no_grad():
        logits = load_causal_lm(info, torch.device("cpu"), torch.float32)(ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(2)))
    out = tmp_path / "regenerated.jsonl"
    argv = ["--target_model", "org/vl", "--data", str(data), "--out", str(out), "--max_new_tokens", "4"]
    assert regenerate_main([*argv, "--keep_truncated"]) == 0
    assert len(out.read_text().splitlines()) == 2


# ----------------------------------------------------------------------------------------------- errors


def test_a_name_missing_from_the_cache_offline_names_the_cache_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as e:
        locate_model("org/absent")
    message = str(e.value)
    assert message.startswith("--target_model org/absent: not in the hub cache ")
    assert str(tmp_path / "empty") in message and "HF_HUB_OFFLINE=1" in message and "HF_HUB_CACHE" in message


def test_a_mistyped_local_data_path_says_no_such_path_exists_as_well(tmp_path, monkeypatch):
    """`--data mydata/train` read as a hub name when no such path exists: the error says both."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        resolve_data("mydata/train")
    assert str(e.value).startswith(
        "--data mydata/train: no such local file or directory, and as a hub dataset: "
    )
    assert "not in the hub cache" in str(e.value)
    assert hub_dataset_name("exports/train.JSONL") is None  # a data file's suffix in any case: a local path


@pytest.mark.processes
def test_the_real_command_offline_without_the_name_in_the_cache_is_one_line(tmp_path, chat_data):
    flags = as_flags(
        {"target_model": "org/absent", "data": chat_data, "output_dir": tmp_path / "run", **SMALL_JOB}
    )
    done = run(["-m", "dflash_ddp.train", *flags], tmp_path / "empty-cache")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: --target_model org/absent: not in the hub cache ")
    assert "HF_HUB_OFFLINE=1 is set" in line and str(tmp_path / "empty-cache") in line
    assert not (tmp_path / "run").exists()


def response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))


@pytest.mark.parametrize(
    "error,expected",
    [
        (
            RepositoryNotFoundError("404", response=response(404)),
            "no such model repository on the hub, or a private",
        ),
        (GatedRepoError("403", response=response(403)), "a gated model repository"),
        (RevisionNotFoundError("404", response=response(404)), "the repository has no revision 'v9'"),
    ],
)
def test_each_hub_refusal_is_one_line_saying_what_to_do(monkeypatch, error, expected):
    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(hub, "snapshot_download", refuse)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError) as e:
        locate_model("org/x@v9")
    assert str(e.value).startswith("--target_model org/x@v9: " + expected)
    assert "\n" not in str(e.value)
    if not isinstance(error, RevisionNotFoundError):
        assert "`hf auth login`" in str(e.value) and "HF_TOKEN" in str(e.value)


def test_a_mistyped_local_target_path_says_no_such_folder_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "snapshot_download", hub_unreachable)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ValueError) as e:
        locate_model("models/lama@v2")
    message = str(e.value)
    assert message.startswith(
        "--target_model models/lama@v2: no local folder models/lama (models/ exists: a typo?)"
    )
    assert "the hub cannot be reached" in message and "`hf download models/lama --revision v2`" in message
    assert "HF_HUB_OFFLINE" not in message  # not set: no advice to unset it


def hub_unreachable(*args, **kwargs):
    raise hub.LocalEntryNotFoundError("the hub cannot be reached")


def test_weight_files_missing_from_the_cache_are_all_named_with_the_command_that_fetches_them(
    hub_cache, monkeypatch
):
    folder = hub_cache / "models--org--tiny" / "snapshots" / COMMIT_A
    needed = weight_files(folder, 2)
    for shard in needed[:2]:
        (folder / shard).unlink()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = ModelSource("org/tiny@v2", folder, "org/tiny", "v2", COMMIT_A)
    with pytest.raises(ValueError) as e:
        hub.fetch_weights(source, 2)
    message = str(e.value)
    assert f"2 of the {len(needed)} weight file(s) this run reads are not in the hub cache" in message
    assert f"`hf download org/tiny {needed[0]} {needed[1]} --revision v2`" in message, message
    assert "HF_HUB_OFFLINE=1 is set" in message and "delete" not in message


def test_a_hub_repository_of_bin_weights_only_is_named_as_such(tmp_path, monkeypatch):
    """The download succeeds (it fetches the safetensors files there are: none), so the repository has none."""
    folder = snapshot(tmp_path / "hub", "org/binonly", COMMIT_A)
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: str(folder))
    monkeypatch.setattr(hub, "remote_sizes", lambda *a: 0)
    with pytest.raises(
        ValueError,
        match=r"not in the repository at main \(model\.safetensors\): a repository "
        r"of pickled \.bin weights only\?",
    ):
        hub.fetch_weights(ModelSource("org/binonly", folder, "org/binonly", "main", COMMIT_A), None)


def test_sharded_weights_without_their_index_are_refused(tiny_target, tmp_path):
    folder = tmp_path / "noindex"
    AutoModelForCausalLM.from_pretrained(tiny_target).save_pretrained(folder, max_shard_size="150KB")
    (folder / hub.WEIGHTS_INDEX).unlink()
    with pytest.raises(ValueError, match=r"safetensors file\(s\) .* and no model\.safetensors\.index\.json"):
        weight_files(folder, 2)


def test_a_local_snapshot_missing_shards_is_refused_naming_them_and_its_hub_name(hub_cache, tmp_path):
    """A local folder that is a partly downloaded snapshot: transformers would open every file its index names
    (a FileNotFoundError after the plan said it fits). Refused at start; a hub snapshot's folder is told its
    hub name, which reads only the shards a run needs. (Not read through a view: the run's target fingerprint
    would change once the folder is completed, refusing its resume.)"""
    snapshot_folder = hub_cache / "models--org--tiny" / "snapshots" / COMMIT_A
    for shard in shards_of_late_layers(snapshot_folder, 2):
        shard.unlink()
    with pytest.raises(ValueError) as refused:
        fetch_target_weights(ModelSource(str(snapshot_folder), snapshot_folder), 2, tmp_path / "views", False)
    message = str(refused.value)
    assert "weight file(s) the folder lacks" in message
    assert f"pass --target_model org/tiny@{COMMIT_A}, whose runs read only the shards they need" in message
    copied = tmp_path / "copied"
    shutil.copytree(snapshot_folder, copied)
    with pytest.raises(ValueError, match="the folder lacks .*; copy the whole model"):
        fetch_target_weights(ModelSource(str(copied), copied), 2, together=False)


def test_views_for_decoding_go_to_the_users_cache_when_the_hub_cache_is_read_only(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "shared" / "hub"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "mine"))
    (tmp_path / "shared" / "hub").mkdir(parents=True)
    assert loading.views_root() == tmp_path / "shared" / loading.VIEWS
    writable = os.access
    monkeypatch.setattr(
        loading.os,
        "access",
        lambda p, mode: not str(p).startswith(str(tmp_path / "shared")) and writable(p, mode),
    )
    assert loading.views_root() == tmp_path / "mine" / "dflash_ddp" / "views"


def test_a_disk_too_small_for_the_shards_is_refused_before_the_download(hub_cache, monkeypatch):
    folder = hub_cache / "models--org--tiny" / "snapshots" / COMMIT_A
    for shard in sorted(set(_index(folder).values()))[-2:]:
        (folder / shard).unlink()
    source = ModelSource("org/tiny", folder, "org/tiny", "main", COMMIT_A)

    class Info:
        size = 10**15

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(
        hub.HfApi, "get_paths_info", lambda self, repo, paths, revision: [Info()] * len(paths)
    )
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(
        ValueError, match=r"the 2 weight file\(s\) this run needs take 2000000\.0 GB and .* free"
    ):
        hub.fetch_weights(source, None)


@pytest.mark.processes
def test_a_cut_short_weights_file_is_named_with_how_to_fetch_it_again(tiny_target, tmp_path, chat_data):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"weight file .*model\.safetensors is cut short \(\d+ bytes"):
        check_safetensors(weights, str(target))
    weights.write_bytes(b"\x01\x02")  # not even a header length
    with pytest.raises(ValueError, match="is damaged"):
        check_safetensors(weights, str(target))
    # the real command: one line, no traceback (it was a 30-line SafetensorError from transformers)
    flags = as_flags({"target_model": target, "data": chat_data, "output_dir": tmp_path / "run", **SMALL_JOB})
    done = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.train", *flags, "--max_steps", "1"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"weight file {weights} is damaged" in line and "copy or download the model again" in line


# ----------------------------------------------------------------------------------------------- commands


@contextlib.contextmanager
def offline(monkeypatch, cache: Path):
    """Commands run in this process as offline_env's run: hub names read from `cache` alone, one thread."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with one_thread():
        yield


@pytest.mark.processes
def test_training_by_hub_names_offline_reads_only_the_shards_it_needs(
    hub_cache, tmp_path, monkeypatch, capsys
):
    """Colocated (the command in this process), then a 1 + 1 torchrun job (the real command, offline by its
    environment), both by hub name from the cache alone, with the shards of the layers after the last tap
    removed from the cache (so they cannot have been opened); the commit is in the run identity; after
    refs/main moves to another commit, the resume is refused with one line."""
    folder = hub_cache / "models--org--tiny" / "snapshots" / COMMIT_A
    late = shards_of_late_layers(folder, 4)  # default taps of a 6-layer target: [1, 2, 3]
    assert late
    for shard in late:
        shard.unlink()
    with offline(monkeypatch, hub_cache):
        out = tmp_path / "run"
        flags = as_flags({"target_model": "org/tiny", "data": "org/chat", "output_dir": out, **SMALL_JOB})
        assert train_main([*flags, "--max_steps", "2"]) == 0
        state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
        assert state["fingerprints"]["target_commit"] == COMMIT_A
        assert state["config"]["target_model"] == "org/tiny" and state["config"]["data"] == ["org/chat"]
        assert json.loads((out / "data_stats.json").read_text())["rows"] == 48  # the train split only

        split = tmp_path / "split"
        flags = as_flags(
            {"target_model": "org/tiny", "data": "org/chat:test", "output_dir": split, **SMALL_JOB}
        )
        done = run(["-m", "dflash_ddp.train", *flags, "--max_steps", "2"], hub_cache, torchrun=2)
        assert done.returncode == 0, done.stderr
        assert json.loads((split / "data_stats.json").read_text())["rows"] == 6

        # the branch moves to a new commit of the same files
        moved = snapshot(hub_cache, "org/tiny", COMMIT_B)
        for item in folder.iterdir():
            shutil.copy(item, moved / item.name)
        flags = as_flags({"target_model": "org/tiny", "data": "org/chat", "output_dir": out, **SMALL_JOB})
        capsys.readouterr()
        assert train_main([*flags, "--max_steps", "4"]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert (
            "belongs to a different run" in line
            and f"fingerprints.target_commit: checkpoint '{COMMIT_A}'" in line
        )
        assert f"pass --target_model org/tiny@{COMMIT_A}" in line
        pinned = as_flags(
            {"target_model": f"org/tiny@{COMMIT_A}", "data": "org/chat", "output_dir": out, **SMALL_JOB}
        )
        assert train_main([*pinned, "--max_steps", "4", "--resume_override", "max_steps"]) == 0


def test_evaluate_regenerate_and_export_take_hub_names(hub_cache, tmp_path, monkeypatch):
    """Each command in this process (the hub cache read as offline_env's commands read it): training with a
    final evaluation, the export, the evaluation of the export and regeneration."""
    from dflash_ddp.evaluate import main as evaluate_main
    from dflash_ddp.export import main as export_main

    with offline(monkeypatch, hub_cache):
        out = tmp_path / "run"
        flags = as_flags({"target_model": "org/tiny", "data": "org/chat", "output_dir": out, **SMALL_JOB})
        evaluation = ["--eval_data", "org/chat:test", "--eval_prompts", "2", "--eval_max_new_tokens", "8"]
        assert train_main([*flags, "--max_steps", "2", *evaluation]) == 0
        assert json.loads((out / "eval.json").read_text())["lossless"]

        export = tmp_path / "export"
        assert export_main([str(out), str(export)]) == 0
        card = (export / "README.md").read_text()
        header = yaml.safe_load(card.split("---")[1])
        assert header["base_model"] == "org/tiny" and header["license"] == "apache-2.0"
        assert {"dflash", "speculative-decoding"} <= set(header["tags"]) and header["library_name"]
        assert "| DFlash, this drafter |" in card  # the final evaluation's table
        assert "--speculative-algorithm DFLASH" in card and '"method": "dflash"' in card
        assert 'speculation_type="dflash"' in card and str(export.resolve()) in card
        assert f"at commit `{COMMIT_A}`" in card and "2 optimizer steps" in card
        stamp = json.loads((export / "config.json").read_text())["dflash_ddp"]
        assert stamp["target_model"] == "org/tiny" and stamp["target_commit"] == COMMIT_A
        assert load_file(export / "model.safetensors")

        evaluate = ["--target_model", "org/tiny", "--drafter", str(export), "--data", "org/chat:test"]
        assert evaluate_main([*evaluate, "--num_prompts", "2", "--max_new_tokens", "8"]) == 0

        regenerated = tmp_path / "regenerated.jsonl"
        regenerate = ["--target_model", "org/tiny", "--data", "org/chat:test", "--out", str(regenerated)]
        assert regenerate_main([*regenerate, "--max_new_tokens", "8"]) == 0
        settings = json.loads(regenerated.with_name(regenerated.name + ".settings.json").read_text())
        assert settings["target_model"] == f"org/tiny@{COMMIT_A}"
