"""Real speculative decoding (dflash_ddp.evaluate) on a tiny random Qwen3 target, CPU only.

The central property: greedy speculative decoding is lossless, whatever the drafter proposes.
"""

from __future__ import annotations

import copy
import json
import string
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.evaluate import main
from dflash_ddp.evaluation.decoding import (
    DecodeResult,
    as_transformers_assistant,
    greedy_generate,
    speculative_generate,
    tau_by_context,
    transformers_generate,
    untrained_drafter,
)
from dflash_ddp.evaluation.evaluate import check_compatibility, evaluate, load_checked_drafter, load_prompts
from dflash_ddp.evaluation.ties import logit_gap, tie_tolerance
from dflash_ddp.serving.export import load_drafter, save_drafter
from dflash_ddp.target_model.features import capture_layer_outputs, decoder_layers
from dflash_ddp.target_model.info import inspect_target

VOCAB, HIDDEN, LAYERS, BLOCK, MASK_ID, EOS_ID = 128, 64, 4, 4, 3, 2
TAPS = [1, 2]
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def make_target() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.1,  # larger than the default so that greedy outputs vary instead of repeating
        eos_token_id=EOS_ID,
    )
    return Qwen3ForCausalLM(config).eval()


def drafter_config(**overrides) -> DFlashDraftConfig:
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        num_target_layers=LAYERS,
        target_layer_ids=TAPS,
        mask_token_id=MASK_ID,
        block_size=BLOCK,
    )
    return DFlashDraftConfig(**(shape | overrides))


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a ChatML template whose vocabulary fits the tiny target."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<unk>"]
    chars = string.ascii_letters + string.digits + " .,:;?!'`()-_\n"
    vocab = {token: i for i, token in enumerate(specials + list(chars))}
    assert len(vocab) <= VOCAB and vocab["<|im_end|>"] == EOS_ID
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": specials[1:4]})
    fast.chat_template = CHATML
    return fast


def random_prompts(count: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 20, (count,), generator=gen)
    return [torch.randint(5, VOCAB, (int(n),), generator=gen).tolist() for n in lengths]


def fit_drafter(drafter: DFlashDraftModel, target: nn.Module, prompts, steps: int = 80) -> DFlashDraftModel:
    """Train the drafter on the target's own greedy continuations of `prompts`, every block of a sequence in
    one forward (queries see context strictly before their anchor and their own block), as DFlash trains."""
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    batches = []
    with torch.no_grad():
        for prompt in prompts:
            seq = torch.tensor(prompt + greedy_generate(target, prompt, 24).tokens)[None]
            with capture_layer_outputs(decoder_layers(target), TAPS, stop_after_last=False) as captured:
                target(input_ids=seq)
            feats = torch.cat([captured[i] for i in TAPS], dim=-1)
            anchors = torch.arange(len(prompt) - 1, seq.shape[1] - BLOCK + 1)
            pos = anchors[:, None] + torch.arange(BLOCK)
            block_ids = torch.full_like(pos, MASK_ID)
            block_ids[:, 0] = seq[0, anchors]
            q_block = torch.arange(pos.numel()) // BLOCK
            ctx = torch.arange(seq.shape[1])[None] < anchors[q_block][:, None]
            mask = torch.cat([ctx, q_block[:, None] == q_block[None]], dim=1)[None, None]
            positions = torch.cat([torch.arange(seq.shape[1]), pos.flatten()])[None]
            batches.append(
                (embed(block_ids.flatten()[None]), feats, positions, mask, seq[0, pos[:, 1:]].flatten())
            )
    drafter.train()
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for noise, feats, positions, mask, labels in batches:
            hidden = drafter(noise, feats, positions, attention_mask=mask).last_hidden_state
            hidden = hidden.view(-1, BLOCK, HIDDEN)[:, 1:].reshape(-1, HIDDEN)
            loss = loss + F.cross_entropy(head(hidden), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


class OracleDrafter(nn.Module):
    """Knows the greedy continuation: its output at block position k is the LM-head row of the true token at
    anchor+k, which the head maps back to that token. With `wrong_at` = k it drafts a wrong token there."""

    def __init__(self, target: nn.Module, sequence: list[int], wrong_at: int | None = None):
        super().__init__()
        self.config = SimpleNamespace(block_size=BLOCK, mask_token_id=MASK_ID, target_layer_ids=TAPS)
        self.rows = target.get_output_embeddings().weight
        self.sequence = torch.tensor(sequence)
        self.wrong_at = wrong_at

    bind_target = DFlashDraftModel.bind_target  # reads nothing of the target
    draft_tokens = DFlashDraftModel.draft_tokens  # each position's argmax under the LM head
    confidences = DFlashDraftModel.confidences  # none: it has no confidence head

    def forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask=None, cache=None):
        anchor_pos = int(position_ids[0, -BLOCK])
        truth = self.sequence[anchor_pos : anchor_pos + BLOCK].clone()
        if self.wrong_at is not None:
            truth[self.wrong_at] = (truth[self.wrong_at] + 1) % VOCAB
        return SimpleNamespace(last_hidden_state=self.rows[truth][None])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls gain nothing from threads, and on a shared 2-core machine two threads that wait for each
    # other made these tests about 100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def fitted(target):
    torch.manual_seed(1)
    return fit_drafter(DFlashDraftModel(drafter_config()), target, random_prompts(3, seed=7))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("target")
    target.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [
        [{"role": "user", "content": "What does `len` do?"}, {"role": "assistant", "content": "It counts."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Explain zip."},
            {"role": "assistant", "content": "It pairs items."},
            {"role": "user", "content": "And map?"},
            {"role": "assistant", "content": "It applies a function."},
        ],
        [
            {"role": "user", "content": "How do I sort a list in place?"},
            {"role": "assistant", "content": "sort()"},
        ],
    ]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


# ---------------------------------------------------------------------------------------------------------
# losslessness of our own loop
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["untrained", "fitted"])
def test_speculative_equals_greedy(target, fitted, which):
    drafter = untrained_drafter(drafter_config()) if which == "untrained" else fitted
    for prompt in random_prompts(4) + random_prompts(2, seed=7):  # the second set is what `fitted` saw
        for max_new in (1, 2, 13, 30):  # 13 and 30 are not multiples of the block size
            greedy = greedy_generate(target, prompt, max_new)
            spec = speculative_generate(target, drafter, prompt, max_new)
            assert spec.tokens == greedy.tokens
            assert len(spec.tokens) == max_new
            assert sum(spec.accepted) == len(spec.tokens) - 1  # the first token comes from the prefill
            assert all(1 <= a <= BLOCK for a in spec.accepted)
            assert spec.target_forwards == 1 + len(spec.accepted)


def test_fitted_drafter_accepts_more_than_untrained(target, fitted):
    prompts = random_prompts(3, seed=7)
    tau = {}
    for name, drafter in (("untrained", untrained_drafter(drafter_config())), ("fitted", fitted)):
        accepted = [a for p in prompts for a in speculative_generate(target, drafter, p, 24).accepted]
        tau[name] = sum(accepted) / len(accepted)
    assert tau["untrained"] >= 1.0
    assert tau["fitted"] > 2.5, tau  # about 3.8 of at most 4: the loop feeds the drafter as training did


def test_stops_at_eos(target):
    prompt = random_prompts(1, seed=3)[0]
    full = greedy_generate(target, prompt, 30).tokens
    eos = full[9]
    greedy = greedy_generate(target, prompt, 30, eos_token_ids=[eos])
    assert greedy.tokens == full[: full.index(eos) + 1]
    for drafter in (untrained_drafter(drafter_config()), OracleDrafter(target, prompt + full + [0] * BLOCK)):
        spec = speculative_generate(target, drafter, prompt, 30, eos_token_ids=[eos])
        assert spec.tokens == greedy.tokens
        assert sum(spec.accepted) == len(spec.tokens) - 1


# ---------------------------------------------------------------------------------------------------------
# oracle drafters: exact acceptance patterns
# ---------------------------------------------------------------------------------------------------------


def test_oracle_drafter_accepts_whole_blocks(target):
    rows = target.get_output_embeddings().weight
    assert torch.equal((rows @ rows.T).argmax(dim=-1), torch.arange(VOCAB))  # the oracle's premise
    max_new = 30
    for prompt in random_prompts(3, seed=5):
        truth = greedy_generate(target, prompt, max_new + BLOCK).tokens
        spec = speculative_generate(target, OracleDrafter(target, prompt + truth), prompt, max_new)
        assert spec.tokens == truth[:max_new]
        full, rest = divmod(max_new - 1, BLOCK)
        assert spec.accepted == [BLOCK] * full + ([rest] if rest else [])
        for wrong_at in range(1, BLOCK):  # drafts 1..wrong_at-1 accepted, then the bonus: wrong_at tokens
            spec = speculative_generate(
                target, OracleDrafter(target, prompt + truth, wrong_at), prompt, max_new
            )
            assert spec.tokens == truth[:max_new]
            assert spec.accepted[:-1] == [wrong_at] * (len(spec.accepted) - 1)


# ---------------------------------------------------------------------------------------------------------
# transformers' own DFlash generation with our drafter
# ---------------------------------------------------------------------------------------------------------


def test_transformers_dflash_equals_greedy_and_our_loop(target, fitted, tmp_path):
    save_drafter(fitted, tmp_path / "drafter")
    loaded = load_drafter(tmp_path / "drafter")
    drafts = []
    handle = loaded.register_forward_hook(lambda _m, _args, out: drafts[-1].append(out.last_hidden_state))
    try:
        for prompt in random_prompts(3) + random_prompts(2, seed=7):
            greedy = greedy_generate(target, prompt, 21)
            drafts.append([])
            ours = speculative_generate(target, loaded, prompt, 21)
            drafts.append([])
            theirs = transformers_generate(
                target, prompt, 21, assistant_model=loaded, speculation_type="dflash"
            )
            assert theirs.tokens == greedy.tokens == ours.tokens
            # The drafter got the same inputs (context features, positions, anchor) from both loops, so both
            # verified the same drafts with the same number of target forwards. transformers does not draft
            # when a single token is left to generate; our loop does.
            assert theirs.target_forwards == ours.target_forwards
            ours_out, theirs_out = drafts[-2], drafts[-1]
            assert len(ours_out) - 1 <= len(theirs_out) <= len(ours_out)
            for a, b in zip(ours_out, theirs_out, strict=False):
                torch.testing.assert_close(a, b)
    finally:
        handle.remove()


def test_prompt_lookup_equals_greedy(target):
    for prompt in random_prompts(3):
        greedy = greedy_generate(target, prompt, 17)
        lookup = transformers_generate(target, prompt, 17, prompt_lookup_num_tokens=BLOCK - 1)
        assert lookup.tokens == greedy.tokens
        assert 1 <= lookup.target_forwards <= len(greedy.tokens)


def test_assistant_follows_target_dtype_and_keeps_fp32_rope(target):
    drafter = untrained_drafter(drafter_config())
    assert as_transformers_assistant(drafter, target) is drafter
    bf16_target = make_target().to(torch.bfloat16)
    assistant = as_transformers_assistant(drafter, bf16_target)
    assert all(p.dtype == torch.bfloat16 for p in assistant.parameters())
    assert assistant.rotary_emb.inv_freq.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in drafter.parameters())  # the input is not modified
    prompt = random_prompts(1)[0]
    out = transformers_generate(bf16_target, prompt, 9, assistant_model=assistant, speculation_type="dflash")
    assert len(out.tokens) == 9


# ---------------------------------------------------------------------------------------------------------
# the report and the CLI
# ---------------------------------------------------------------------------------------------------------


def test_evaluate_report(target_dir, data_file, fitted):
    report = evaluate(target_dir, fitted, data_file, num_prompts=2, max_new_tokens=18, device="cpu")
    assert report["num_prompts"] == 2 and report["lossless"] and report["mismatched"] == []
    assert report["greedy"]["tokens"] > 0 and report["greedy"]["tokens_per_s"] > 0
    for name in ("dflash", "dflash_untrained", "prompt_lookup", "transformers_dflash"):
        entry = report[name]
        assert entry["mismatches"] == 0 and entry["tau"] >= 1.0 and entry["speedup"] > 0, name
        assert entry["tokens"] == report["greedy"]["tokens"]
    for name in ("dflash", "dflash_untrained"):
        histogram = report[name]["accept_histogram"]
        assert len(histogram) == BLOCK and sum(histogram) == report[name]["verify_steps"]
        committed = sum(k * c for k, c in enumerate(histogram, start=1))
        assert committed / report[name]["verify_steps"] == pytest.approx(report[name]["tau"])
    assert report["transformers_dflash"]["tau"] == pytest.approx(report["dflash"]["tau"])
    # the sampled row's answers are not greedy's: no rate against greedy's
    assert report["dflash_sampled"]["speedup"] is None and report["dflash_sampled"]["tokens_per_s"] > 0
    # the prompts are short: every block has under 2K tokens of context, so one bucket holds tau itself
    assert report["tau"] == report["dflash"]["tau"]
    assert report["tau_by_context"] == {"0-2K": pytest.approx(report["tau"])}
    assert report["dflash"]["verify_steps_by_context"] == {"0-2K": report["dflash"]["verify_steps"]}
    # the row at temperature 1.0: this drafter sampled, a tau of its own, never counted as a mismatch
    sampled = report["dflash_sampled"]
    assert sampled["tau"] >= 1.0 and sampled["mismatches"] == 0 and sampled["verify_steps"] > 0
    again = evaluate(target_dir, fitted, data_file, num_prompts=2, max_new_tokens=18, device="cpu")
    assert again["dflash_sampled"]["tokens"] == sampled["tokens"]  # seeded: the same samples each time


def test_a_difference_at_a_near_tie_of_the_targets_logits_is_told_apart_from_a_real_one(target):
    """A bf16 target flips its argmax where two tokens are closer than bf16 resolves (a batched verify rounds
    otherwise than one-token steps): such a difference is the target's own; any other is a loss."""
    prompt = random_prompts(1, seed=3)[0]
    greedy = greedy_generate(target, prompt, 6).tokens
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt + greedy[:2]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    real = logit_gap(target, prompt, greedy, greedy[:2] + [second], 2)
    assert real["logit_gap"] > real["tolerance"] > 0 and not real["near_tie"]
    tied = copy.deepcopy(target)  # the same two tokens, equally likely: the head gives them one row
    with torch.no_grad():
        tied.lm_head.weight[second] = tied.lm_head.weight[greedy[2]]
    tie = logit_gap(tied, prompt, greedy, greedy[:2] + [second], 2)
    assert tie["near_tie"] and tie["logit_gap"] == 0
    assert (
        logit_gap(target, prompt, greedy, greedy[:4], 4) is None
    )  # an output that ends early is never a tie
    # bf16 resolves logits near 20 to 1/8 (4 ulps: 0.5); float32 to 2**-19 per ulp
    assert tie_tolerance(20.0, torch.bfloat16) == 0.5
    assert tie_tolerance(20.0, torch.float32) == 4 * 2.0**-19


def test_tau_by_context_buckets_each_verify_step_by_the_tokens_before_its_block():
    results = [
        DecodeResult([0] * 9, 1.0, 4, accepted=[3, 1, 4], contexts=[100, 2047, 2048]),
        DecodeResult([0] * 11, 1.0, 3, accepted=[5, 5], contexts=[9000, 40000]),
    ]
    taus, steps = tau_by_context(results)
    assert list(taus) == ["0-2K", "2K-8K", "8K-32K", "32K+"]  # in order; 2048 tokens is the second bucket
    assert taus == {"0-2K": 2.0, "2K-8K": 4.0, "8K-32K": 5.0, "32K+": 5.0}
    assert steps == {"0-2K": 2, "2K-8K": 1, "8K-32K": 1, "32K+": 1}
    assert tau_by_context([DecodeResult([1], 1.0, 1)]) == ({}, {})  # no verify step: no bucket


def cli_args(target_dir, data_file, drafter_dir) -> list[str]:
    return ["--target_model", str(target_dir), "--drafter", str(drafter_dir), "--data", str(data_file)]


def test_cli_prints_table_and_writes_json(target_dir, data_file, fitted, tmp_path, capsys):
    save_drafter(fitted, tmp_path / "drafter")
    out = tmp_path / "report.json"
    argv = cli_args(target_dir, data_file, tmp_path / "drafter")
    code = main(argv + ["--num_prompts", "1", "--max_new_tokens", "9", "--device", "cpu", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tau" in printed and "speedup" in printed and "lossless" in printed
    assert "this drafter, T=1.0" in printed and "in distribution" in printed
    assert "tau by tokens of context before the block" in printed and "0-2K" in printed
    report = json.loads(out.read_text())
    assert report["lossless"] is True and set(report["tau_by_context"]) == {"0-2K"}


def test_cli_samples_at_a_temperature(target_dir, data_file, fitted, tmp_path, capsys):
    """--temperature 1.0: the target sampled alone and speculatively, the same seed the same report; a fitted
    drafter still commits more than one token per verify step; no token-for-token verdict."""
    save_drafter(fitted, tmp_path / "drafter")
    argv = cli_args(target_dir, data_file, tmp_path / "drafter")
    argv += ["--num_prompts", "2", "--max_new_tokens", "12", "--device", "cpu", "--temperature", "1.0"]
    reports = []
    for run in ("a", "b"):
        assert main(argv + ["--top_p", "0.9", "--seed", "3", "--json", str(tmp_path / f"{run}.json")]) == 0
        reports.append(json.loads((tmp_path / f"{run}.json").read_text()))
    assert "in distribution" in capsys.readouterr().out
    first, second = reports
    assert first["lossless"] is None and first["temperature"] == 1.0 and first["top_p"] == 0.9
    assert first["dflash"]["tau"] == second["dflash"]["tau"] > 1.0
    assert first["dflash"]["accept_histogram"] == second["dflash"]["accept_histogram"]
    assert "prompt_lookup" not in first and any("temperature 1" in note for note in first["notes"])
    assert main(argv[:-1] + ["-0.5"]) == 2 and "--temperature -0.5" in capsys.readouterr().err


def _run_cli(capsys, target_dir, drafter_dir, data_file) -> tuple[int, str]:
    code = main(["--target_model", str(target_dir), "--drafter", str(drafter_dir), "--data", str(data_file)])
    return code, capsys.readouterr().err


def test_bad_inputs_exit_2_with_clear_messages(target_dir, data_file, tmp_path, capsys):
    save_drafter(DFlashDraftModel(drafter_config(hidden_size=32)), tmp_path / "narrow")
    code, err = _run_cli(capsys, target_dir, tmp_path / "narrow", data_file)
    assert code == 2 and "hidden_size is 32" in err and "hidden_size is 64" in err

    save_drafter(DFlashDraftModel(drafter_config(target_layer_ids=[1, 4])), tmp_path / "deep")
    code, err = _run_cli(capsys, target_dir, tmp_path / "deep", data_file)
    assert code == 2 and "[4]" in err and "4 decoder layers" in err

    code, err = _run_cli(capsys, target_dir, tmp_path / "missing", data_file)
    assert (
        code == 2 and f"--drafter {tmp_path / 'missing'}: no such export, checkpoint or run directory" in err
    )
    (tmp_path / "empty").mkdir()
    code, err = _run_cli(capsys, target_dir, tmp_path / "empty", data_file)
    assert code == 2 and "no config.json" in err
    code, err = _run_cli(capsys, tmp_path / "no_target", tmp_path / "narrow", data_file)
    assert code == 2 and "not a directory" in err
    save_drafter(DFlashDraftModel(drafter_config()), tmp_path / "ok")
    code, err = _run_cli(capsys, target_dir, tmp_path / "ok", tmp_path / "missing.jsonl")
    assert code == 2 and "file not found" in err
    code = main(
        ["--target_model", str(target_dir), "--drafter", str(tmp_path / "ok"), "--data", str(data_file)]
        + ["--device", "tpu"]
    )
    assert code == 2 and "use auto, cpu or cuda" in capsys.readouterr().err
    argv = ["--target_model", str(target_dir), "--drafter", str(tmp_path / "ok"), "--data", str(data_file)]
    assert main([*argv, "--confidence_threshold", "0.5"]) == 2
    assert "has no confidence head (DSpark drafters" in capsys.readouterr().err
    assert main([*argv, "--confidence_threshold", "1.5"]) == 2
    assert "--confidence_threshold 1.5 must be in [0, 1]" in capsys.readouterr().err
    assert main([*argv, "--max_new_tokens", "1"]) == 2  # nothing would be measured
    assert "--max_new_tokens 1: at least 2" in capsys.readouterr().err
    assert main([*argv, "--json", str(tmp_path)]) == 2  # said before the evaluation, not after it
    assert f"--json {tmp_path}: a directory" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert main([*argv, "--json", str(tmp_path / "a_file" / "sub" / "r.json")]) == 2
    assert f"{tmp_path / 'a_file'} is a file, not a directory" in capsys.readouterr().err
    # sampling settings without a temperature would be ignored (greedy); each range named alone
    for flags, message in (
        (["--top_p", "0.5"], "--top_p and --seed only apply when sampling: also pass --temperature > 0"),
        (["--seed", "3"], "--top_p and --seed only apply when sampling"),
        (["--temperature", "1", "--top_p", "1.5"], "error: --top_p 1.5 must be in (0, 1]\n"),
        (["--temperature", "-1"], "error: --temperature -1.0 must be >= 0 (0: greedy)\n"),
        (["--vllm_python", str(tmp_path / "nope")], f"--vllm_python {tmp_path / 'nope'}: no such file"),
    ):
        assert main([*argv, *flags]) == 2
        assert message in capsys.readouterr().err, flags


def test_a_drafter_is_checked_against_the_tokenizer_it_was_trained_with(target_dir, tmp_path):
    """A drafter whose stamp names another tokenizer is refused (its token ids mean other text); a run
    directory stands for its latest checkpoint."""
    from dflash_ddp.checkpoint.manifest import write_manifest
    from dflash_ddp.files import fingerprint_files

    tokenizer = fingerprint_files(sorted(target_dir.glob("tokenizer*")))
    stamped = tmp_path / "stamped"
    save_drafter(DFlashDraftModel(drafter_config()), stamped, stamp={"tokenizer_fingerprint": "0" * 16})
    with pytest.raises(
        ValueError, match="was trained with another tokenizer than .*evaluate it with the target"
    ):
        load_checked_drafter(stamped, target_dir)
    run = tmp_path / "run"
    save_drafter(DFlashDraftModel(drafter_config()), run / "checkpoints" / "step-00000002")
    (run / "checkpoints" / "step-00000002" / "trainer_state.json").write_text(
        json.dumps({"fingerprints": {"tokenizer": tokenizer}})
    )
    for part in ("optimizer.pt", "scheduler.pt", "rng-rank0.pt"):  # a checkpoint's other files
        torch.save({}, run / "checkpoints" / "step-00000002" / part)
    write_manifest(run / "checkpoints" / "step-00000002", 2)
    (run / "checkpoints" / "latest").write_text("step-00000002\n")
    assert isinstance(load_checked_drafter(run, target_dir), DFlashDraftModel)


def test_a_conversation_that_ends_with_a_question_is_all_prompt(target_dir, tmp_path):
    """Rows ending with a user turn (or holding no answer) are prompts whole; a row ending with an answer is
    its prompt up to that answer."""
    from dflash_ddp.data.chat_template import load_target_tokenizer

    user, answer = {"role": "user", "content": "Explain zip."}, {"role": "assistant", "content": "It pairs."}
    follow_up = {"role": "user", "content": "And map?"}
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"messages": m}) + "\n" for m in ([user, answer, follow_up], [user], [user, answer])
        )
    )
    tokenizer = load_target_tokenizer(target_dir)
    ids = [p for _, p in load_prompts(tokenizer, path, 3)]

    def render(messages):
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])

    assert ids == [render([user, answer, follow_up]), render([user]), render([user])]


def test_check_compatibility_mask_token(target_dir):
    info = inspect_target(target_dir)
    check_compatibility(drafter_config(), info)
    with pytest.raises(ValueError, match="mask_token_id 128"):
        check_compatibility(drafter_config(mask_token_id=VOCAB), info)


def test_prompts_past_the_targets_positions_are_counted_in_a_note():
    """A prompt whose answer runs past max_position_embeddings is decoded out of the target's range (one that
    ends after prefill leaves no verify step): the report says how many, instead of nothing."""
    from dflash_ddp.evaluation.row_notes import past_positions_note

    target = SimpleNamespace(config=Qwen3Config(max_position_embeddings=64))
    prompts = [("a:1", list(range(40))), ("a:2", list(range(60))), ("a:3", list(range(10)))]
    assert past_positions_note(target, prompts, 16) == (
        "1 of 3 prompts run past the target's 64 positions (its max_position_embeddings) with --max_new_tokens: "
        "it answers them out of its range, and one that ends after prefill has no verify step to count"
    )
    assert past_positions_note(target, prompts[:1], 24) is None  # 40 + 24 = 64: within


def test_the_tools_beside_training_name_the_embedded_target_as_training_does(tmp_path):
    """`--target_model embedded` is the tiny target shipped in the package for evaluate and regenerate (export
    and the watcher parse it with the same type), as for train; a directory or hub name passes as given."""
    from dflash_ddp.evaluation.arguments import parse_arguments
    from dflash_ddp.hub import EMBEDDED_TARGET
    from dflash_ddp.regeneration.regenerate import parse_args

    embedded = str(EMBEDDED_TARGET)
    assert (EMBEDDED_TARGET / "config.json").is_file()
    evaluate_args = parse_arguments(["--target_model", "embedded", "--drafter", "d", "--data", "x.jsonl"])
    assert evaluate_args.target_model == embedded
    assert parse_arguments(["--target_model", "org/model", "--drafter", "d", "--data", "x"]).target_model == (
        "org/model"
    )
    data = tmp_path / "x.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    regenerate = parse_args(["--target_model", "embedded", "--data", str(data), "--out", str(tmp_path / "o")])
    assert regenerate.target_model == embedded
