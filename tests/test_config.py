"""Configuration: precedence, strictness and clear errors."""

from pathlib import Path

import pytest

from dflash_ddp.config import EMBEDDED_PRESET, parse_config


def test_cli_overrides_yaml_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "target_model: /models/t\ndata: [a.jsonl, b.jsonl]\nblock_size: 10\nlearning_rate: 1e-4\n"
    )
    config, embedded = parse_config(
        ["--config", str(path), "--block_size", "8", "--target_layer_ids", "1,5,9"]
    )
    assert not embedded
    assert config.block_size == 8 and config.learning_rate == 1e-4
    assert config.data == ["a.jsonl", "b.jsonl"] and config.target_layer_ids == [1, 5, 9]
    assert config.num_anchors == 512  # paper default untouched


def test_a_list_setting_that_may_be_unset_takes_space_separated_values_as_help_says():
    flags = ["--target_layer_ids", "1", "5", "9", "--sliding_layers", "0", "1", "--sliding_window", "64"]
    config, _ = parse_config(flags)
    assert config.target_layer_ids == [1, 5, 9] and config.sliding_layers == [0, 1]
    with pytest.raises(ValueError, match="--block_size: takes one value"):
        parse_config(["--block_size", "8", "16"])


def test_no_target_uses_the_embedded_preset():
    config, embedded = parse_config(["--max_steps", "5"])
    assert embedded and config.target_model == EMBEDDED_PRESET["target_model"] and config.max_steps == 5


def test_list_flags_take_several_values_and_booleans_stand_alone():
    config, _ = parse_config(["--target_model", "t", "--data", "x.jsonl", "y.jsonl", "--plan"])
    assert config.data == ["x.jsonl", "y.jsonl"] and config.plan is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning_rat", "1"], "unknown key 'learning_rat' \\(did you mean 'learning_rate'\\?\\)"),
        (["--block_size", "1"], "--block_size 1: must be at least 2"),
        (["--block_size", "big"], "--block_size: expected int, got 'big'"),
        (["--max_steps", "-2"], "--max_steps -2: pass a positive number, 0 to save the starting drafter"),
        (["--attention", "fast"], "--attention fast"),
        (["--channel_backend", "mpi"], "--channel_backend mpi: choose auto"),
        (["--channel_backend", "nccl", "--device", "cpu"], "--channel_backend nccl needs GPUs"),
        (["--plan_gpu_memory", "141"], "--plan_gpu_memory 141.0 plans a run on other GPUs .* pass --plan"),
        (
            ["--plan", "--calibrate", "--plan_gpu_memory", "141"],
            "--calibrate times the ranks on this machine's devices .* drop --calibrate",
        ),
        (["--loss_chunk_size", "-1"], "--loss_chunk_size -1: must be at least 0"),
        (["--overlength", "cut"], "--overlength cut: choose truncate or drop"),
        (
            ["--chat_template_kwargs", "enable_thinking=false"],
            "--chat_template_kwargs: expected a JSON object",
        ),
        (["--num_proc", "-1"], "--num_proc -1: must be at least 0"),
        (["--chat_template_kwargs", '{"tokenize": true}'], "--chat_template_kwargs: tokenize cannot be set"),
        (["stray"], "unexpected argument 'stray'"),
        (["--lr", "1e-3"], "unknown key 'lr' \\(did you mean 'learning_rate'\\?\\)"),
        (["--batch_size", "8"], "unknown key 'batch_size' \\(did you mean 'tokens_per_batch'\\?\\)"),
        (
            ["--no_memory_check"],
            "unknown key 'no_memory_check' \\(to turn 'memory_check' off, give it false\\)",
        ),
        (["--data", "a.jsonl", "--data", "b.jsonl"], "--data is given twice: give it once"),
        (["--eval_data"], "--eval_data: missing value \\(a jsonl file, .*; --eval_data '' for none\\)"),
        (["--resume"], "--resume: missing value \\(auto \\(newest valid checkpoint\\) \\| never \\| PATH"),
        (["--chat_template"], "--chat_template: missing value \\(a file; --chat_template '' for none\\)"),
        (
            ["--num-anchors", "8"],
            "unknown key 'num-anchors' \\(did you mean 'num_anchors'\\? this project's names",
        ),
        (["--max-length", "8"], "unknown key 'max-length' \\(did you mean 'max_seq_len'\\?\\)"),
        (["--save-interval", "8"], "unknown key 'save-interval' \\(did you mean 'save_steps'\\?\\)"),
        (["--trust-remote-code"], "unknown key 'trust-remote-code' \\(none here: targets load through"),
        (["--loss", "jsd"], "--loss jsd: choose ce, kl or tv"),
        (["--loss", "tv"], "--loss tv trains against the target's top-k .* pass --target_topk K"),
        (["--target_topk", "8"], "--target_topk 8 makes the target ranks run every layer .* --loss kl"),
        (["--ce_weight", "0.1"], "--ce_weight 0.1 mixes the token's CE into --loss kl or tv"),
        (
            ["--drafter", "dspark", "--ce_weight", "0.5"],
            "--ce_weight 0.5 .* --drafter dspark does not train \\(its loss is its own: --dspark_ce_alpha",
        ),
        (
            ["--drafter", "lilicorr", "--ce_weight", "0.5"],
            "--lilicorr_ce_alpha weighs its CE\\); drop --ce_weight",
        ),
        (
            ["--drafter", "lilicorr", "--lilicorr_penalty_alpha", "0"],
            "--lilicorr_penalty_alpha 0 with --target_topk 64 .* nothing reads .* pass --target_topk 0 with it",
        ),
        (
            ["--loss", "kl", "--target_topk", "4", "--ce_weight", "2"],
            "--ce_weight 2.0: must be in \\[0, 1\\]",
        ),
        (["--target_topk", "-1"], "--target_topk -1: must be at least 0"),
        (["--anchor_rule", "anywhere"], "--anchor_rule anywhere: choose response or prompt_end"),
        (["--optimizer", "sgd"], "--optimizer sgd: choose adamw or muon"),
        (["--sliding_layers", "0"], "--sliding_layers \\[0\\] names the layers .* pass --sliding_window N"),
        (["--sliding_window", "8", "--block_size", "16"], "--sliding_window 8: .* at least --block_size 16"),
        (
            ["--sliding_window", "64", "--sliding_layers", "0,5", "--num_draft_layers", "5"],
            "--sliding_layers \\[0, 5\\]: \\[5\\] are not layers of the drafter \\(--num_draft_layers 5",
        ),
    ],
)
def test_bad_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_config(argv)


def test_yaml_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target_model: t\nnum_anchorz: 3\n")
    with pytest.raises(ValueError, match=f"{path}: unknown key 'num_anchorz'"):
        parse_config(["--config", str(path)])
    path.write_text("target_model: t\nnum_anchors: many\n")
    with pytest.raises(ValueError, match="key 'num_anchors': expected int"):
        parse_config(["--config", str(path)])
    with pytest.raises(ValueError, match="file not found"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])


def test_template_arguments_from_the_command_line_and_yaml(tmp_path):
    config, _ = parse_config(
        ["--target_model", "t", "--data", "d", "--chat_template_kwargs", '{"enable_thinking": false}']
    )
    assert config.chat_template_kwargs == {"enable_thinking": False}
    path = tmp_path / "c.yaml"
    path.write_text("target_model: t\ndata: [d]\nchat_template_kwargs: {enable_thinking: true}\n")
    assert parse_config(["--config", str(path)])[0].chat_template_kwargs == {"enable_thinking": True}


def test_list_flags_take_spaces_or_commas():
    config, _ = parse_config(
        ["--target_model", "t", "--data", "a.jsonl", "b.jsonl", "--resume_override", "max_steps,seed"]
    )
    assert config.data == ["a.jsonl", "b.jsonl"] and config.resume_override == ["max_steps", "seed"]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("max_grad_norm", "-1", "--max_grad_norm -1.0: must be a finite number > 0"),
        ("max_grad_norm", "0", "--max_grad_norm 0.0: must be a finite number > 0"),
        ("loss_gamma", "0", "--loss_gamma 0.0: must be a finite number > 0"),
        ("loss_gamma", "2", "--loss_gamma 2.0 sets the decay of --position_weighting decay"),
        ("loss_gamma_start", "-1", "--loss_gamma_start -1.0: must be a finite number > 0"),
        ("loss_gamma_start", "1", "--loss_gamma_start 1.0 sets the decay of --position_weighting decay"),
        ("learning_rate", "nan", "--learning_rate nan: must be a finite number > 0"),
        ("learning_rate", "inf", "--learning_rate inf: must be a finite number > 0"),
        ("dist_timeout", "inf", "--dist_timeout inf: must be a finite number of seconds"),
        ("dist_timeout", "nan", "--dist_timeout nan: must be a finite number of seconds"),
        ("warmup_ratio", "nan", "--warmup_ratio nan: must be in \\[0, 1\\)"),
        ("save_total_limit", "-1", "--save_total_limit -1: must be at least 0"),
        ("weight_decay", "-0.1", "--weight_decay -0.1: must be a finite number >= 0"),
        ("eval_prompts", "-1", "--eval_prompts -1: must be a positive integer"),
        ("eval_max_new_tokens", "0", "--eval_max_new_tokens 0: must be a positive integer"),
        ("logging_steps", "0", "--logging_steps 0: must be a positive integer"),
        ("drafter_ranks", "0", "--drafter_ranks 0: must be a positive integer"),
        ("seed", "-3", "--seed -3: must be in \\[0, 2\\^63\\)"),
        ("mask_token_id", "-1", "--mask_token_id -1: must be a token id >= 0"),
        ("resume_override", "learning_rte", "--resume_override learning_rte: not a setting it can override"),
        ("eval_data", "/nonexistent/heldout.jsonl", "--eval_data /nonexistent/heldout.jsonl: no such file"),
    ],
)
def test_numeric_and_path_flags_out_of_range_name_flag_value_and_range(flag, value, message):
    with pytest.raises(ValueError, match=message):
        parse_config(["--target_model", "t", "--data", "d", f"--{flag}", value])


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    afile = tmp_path / "results.txt"
    afile.write_text("x")
    for out in (afile, afile / "run"):
        with pytest.raises(ValueError, match=f"--output_dir {out}: {afile} is a file, not a directory"):
            parse_config(["--target_model", "t", "--data", "d", "--output_dir", str(out)])


def test_dspark_takes_the_references_top_64_unless_given(tmp_path):
    from dflash_ddp.cli_help import markdown_reference, usage

    assert parse_config(["--drafter", "dspark"])[0].target_topk == 64
    assert parse_config(["--drafter", "dspark", "--target_topk", "8"])[0].target_topk == 8
    path = tmp_path / "run.yaml"
    path.write_text("drafter: dspark\n")
    assert parse_config(["--config", str(path)])[0].target_topk == 64
    with pytest.raises(ValueError, match="--drafter dspark .*--target_topk 0.*leave it out \\(64"):
        parse_config(["--drafter", "dspark", "--target_topk", "0"])
    assert parse_config([])[0].target_topk == 0
    assert "value: 64" in next(
        line for line in usage(["--drafter", "dspark"]).splitlines() if "0 or an integer >= 1" in line
    )
    assert "| 0; with --drafter dspark: 64; with --drafter lilicorr: 64 |" in markdown_reference()
    assert parse_config(["--drafter", "lilicorr"])[0].target_topk == 64


def test_yaml_values_are_what_they_look_like(tmp_path):
    """YAML's null is a text setting's "none" (never the text 'None'), an optional one's unset; its yes/no
    are not numbers, a list is not a path; numbers' lists may be space-separated, as --help says."""
    path = tmp_path / "run.yaml"
    path.write_text("eval_data: null\ninit_from: ~\ngradient_checkpointing: unset\ntarget_layer_ids: 1 3\n")
    config, _ = parse_config(["--config", str(path)])
    assert config.eval_data == "" and config.init_from == "" and config.gradient_checkpointing is None
    assert config.target_layer_ids == [1, 3]
    assert parse_config(["--gradient_checkpointing"])[0].gradient_checkpointing is True  # a bare flag
    assert parse_config(["--max_steps", "1e3"])[0].max_steps == 1000  # a whole number, written as a float
    assert parse_config(["--eval_data="])[0].eval_data == ""  # `--key=`: the empty value
    for text, message in [
        ("max_steps: yes\n", "key 'max_steps': expected int, got True"),
        ("learning_rate: on\n", "key 'learning_rate': expected float, got True"),
        ("output_dir: [a, b]\n", "key 'output_dir': expected str, got \\['a', 'b'\\]"),
        ("data: {train: a.jsonl}\n", "key 'data': expected list, got \\{'train': 'a.jsonl'\\}"),
    ]:
        path.write_text("target_model: t\n" + text)
        with pytest.raises(ValueError, match=message):
            parse_config(["--config", str(path)])


def test_a_config_file_that_cannot_be_read_says_where(tmp_path):
    path = tmp_path / "run.yaml"
    for content, message in [
        (
            b"model:\n  block_size: 8\n",
            "'model' holds settings \\(block_size\\): settings are flat, write 'block_size: 8'",
        ),
        (b"1: foo\n", "unknown key '1'"),
        (b"# caf\xe9\nseed: 1\n", "not UTF-8 text"),
        (b"seed: 1\nfoo: [1\nbar: 2\n", "not valid YAML \\(line 3, column 4: "),
    ]:
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"{path}.*{message}"):
            parse_config(["--config", str(path)])
    with pytest.raises(ValueError, match="--config is given twice"):
        parse_config(["--config", str(path), "--config", str(path)])
    with pytest.raises(ValueError, match=f"--config {tmp_path}: a directory, not a file"):
        parse_config(["--config", str(tmp_path)])


def test_help_with_flags_that_do_not_parse_says_so():
    from dflash_ddp.cli_help import usage

    text = usage(["--config", "configs/qwen3-8b.yaml", "--lr", "1"])
    assert "NOTE: the flags given with --help do not parse (command line: unknown key 'lr'" in text
    assert "NOTE" not in usage(["--max_steps", "3"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--position_weighting", "decay", "--dpace_smoothing", "0.3"],
            "--dpace_smoothing 0.3 sets D-PACE's smoothing, which acts only with --position_weighting dpace "
            "\\(it is decay\\): it would be ignored; drop it, or pass --position_weighting dpace with it",
        ),
        (
            ["--drafter", "lilicorr", "--lilicorr_margin", "1"],
            "--lilicorr_margin 1.0 .* --lilicorr_margin_alpha",
        ),
        (
            ["--drafter", "dspark", "--markov_rank", "0", "--confidence_head_with_markov", "false"]
            + ["--markov_head_type", "rnn"],
            "--markov_head_type rnn sets the Markov head, which acts only with --markov_rank R > 0",
        ),
        (
            ["--drafter", "dspark", "--confidence_alpha", "0", "--confidence_head_with_markov", "false"],
            "--confidence_head_with_markov false .* --confidence_alpha W > 0 \\(it is 0\\)",
        ),
        (
            ["--optimizer", "adamw", "--muon_orthogonalisation", "polar_express_3"],
            "--muon_orthogonalisation polar_express_3 .* --optimizer muon \\(it is adamw\\)",
        ),
        (
            ["--max_steps", "5", "--num_epochs", "2"],
            "--num_epochs 2 .* --max_steps -1 \\(it is 5\\).* or pass --max_steps -1 with it",
        ),
        (
            ["--eval_data", "", "--eval_prompts", "3"],
            "--eval_prompts 3 .* drop it, or pass --eval_data FILE with it",
        ),
        (["--eval_data", "", "--eval_max_new_tokens", "8"], "--eval_max_new_tokens 8 .* --eval_data FILE"),
    ],
)
def test_a_setting_that_would_be_ignored_is_refused_naming_what_it_needs(argv, message):
    """A value changed from its default where what it sets is off would be recorded and never act."""
    with pytest.raises(ValueError, match=message):
        parse_config(argv)


def test_the_settings_that_act_only_with_another_are_taken_with_it():
    for argv in (
        ["--dpace_smoothing", "0.3"],
        ["--drafter", "lilicorr", "--lilicorr_margin_alpha", "0.1", "--lilicorr_margin", "1"],
        ["--drafter", "dspark", "--markov_head_type", "rnn"],
        ["--drafter", "dspark", "--markov_rank", "0", "--confidence_head_with_markov", "false"],
        ["--max_steps", "-1", "--num_epochs", "2"],
        ["--eval_prompts", "3", "--eval_max_new_tokens", "8"],
    ):
        parse_config(argv)


def test_a_config_file_keeps_its_defaults_and_names_its_key_when_it_would_be_ignored(tmp_path):
    """The shipped configs spell out num_epochs (the default): --max_steps beside them runs; a file's own
    value that would never act is named by file and key."""
    shipped = Path(__file__).resolve().parents[1] / "configs" / "qwen3-8b.yaml"
    parse_config(["--config", str(shipped), "--max_steps", "100"])
    config = tmp_path / "run.yaml"
    config.write_text("optimizer: adamw\nmuon_orthogonalisation: polar_express_3\n")
    with pytest.raises(
        ValueError, match=f"{config}: muon_orthogonalisation: polar_express_3 sets .* drop the key"
    ):
        parse_config(["--config", str(config)])
