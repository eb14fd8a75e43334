"""The model card (README.md) written beside every export: the hub's metadata header, what the drafter is,
how it was trained, its real tau when the run measured it, and the commands that serve it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dflash_ddp.checkpoint.evaluations import best_record, read_evaluations
from dflash_ddp.drafter.optimizer import trains_nothing
from dflash_ddp.drafter.weighting import loss_gamma
from dflash_ddp.hub import hub_model_name

# The family terms' defaults, for a checkpoint's config from before a setting. TrainConfig's own defaults;
# written out because the card stands below the config (tests hold the two equal).
FAMILY_TERM_DEFAULTS = {
    "drafter": "dflash",
    "target_topk": 0,
    "confidence_alpha": 1.0,
    "dspark_ce_alpha": 0.1,
    "dspark_l1_alpha": 0.9,
    "lilicorr_ce_alpha": 0.25,
    "lilicorr_margin_alpha": 0.0,
    "lilicorr_margin": 2.0,
    "lilicorr_penalty_alpha": 0.25,
    "selector_loss_alpha": 1.0,
    "selector_top_k": 16,
}
ACCEPTANCE = "## Acceptance (real speculative decoding)"
MEASURED = "tau = tokens committed per target verify step, bonus included; greedy decoding"
OBJECTIVE_SETTINGS = (
    "num_anchors",
    "anchor_scale_tokens",
    "optimizer",
    "muon_orthogonalisation",
    "learning_rate",
    "warmup_ratio",
    "max_grad_norm",
    "seed",
)


def scored_against(cfg: dict) -> str:
    """The loss in words: the token's cross-entropy, or a divergence from the target's top-k distribution,
    and the terms of the drafter family's own parts (DFlash2's selector, DSpark's heads, LiLiCorr's
    correlator) with their weights (a checkpoint from before a setting: its default)."""
    cfg = FAMILY_TERM_DEFAULTS | cfg
    drafter, k = cfg["drafter"], cfg["target_topk"]
    if drafter == "dspark":
        confidence = cfg["confidence_alpha"]
        return (
            f"DSpark's own loss: {cfg['dspark_ce_alpha']:g} x the cross-entropy of the Markov-biased logits + "
            f"{cfg['dspark_l1_alpha']:g} x their L1 distance to the target's top-{k} next-token distribution"
            + (
                f" + {confidence:g} x the confidence head's BCE against the acceptance that distance implies"
                if confidence
                else ""
            )
        )
    if drafter == "lilicorr":
        terms = [f"{cfg['lilicorr_ce_alpha']:g} x its K-way cross-entropy given the true predecessor"]
        if cfg["lilicorr_margin_alpha"]:
            terms.append(f"{cfg['lilicorr_margin_alpha']:g} x a hinge of margin {cfg['lilicorr_margin']:g}")
        if cfg["lilicorr_penalty_alpha"]:
            terms.append(
                f"{cfg['lilicorr_penalty_alpha']:g} x a penalty on candidates the target's top-{k} ranks below "
                "the true one"
            )
        return "cross-entropy, plus the lattice correlator's " + " + ".join(terms)
    if drafter == "dflash2":
        alpha = cfg["selector_loss_alpha"]
        selector = (
            f"plus {alpha:g} x the candidate selector's cross-entropy over the LM head's top "
            f"{cfg['selector_top_k']}, the previous token teacher-forced"
            if alpha
            else "(the candidate selector left at its start, a no-op: --selector_loss_alpha 0)"
        )
        return f"{_dflash_loss(cfg)} {selector}"
    return _dflash_loss(cfg)


def _dflash_loss(cfg: dict) -> str:
    loss = cfg.get("loss", "ce")
    if loss == "ce":
        return "cross-entropy"
    name = {"kl": "KL divergence", "tv": "total variation"}[loss]
    mixed = f" plus {cfg['ce_weight']} x the token's cross-entropy" if cfg.get("ce_weight") else ""
    return f"{name} from the target's top-{cfg.get('target_topk')} next-token distribution{mixed}"


def weighted_by(cfg: dict, block: int) -> str:
    """How block positions weigh in the loss, in words."""
    if cfg.get("position_weighting") == "dpace":
        smoothing = cfg.get("dpace_smoothing", 0.5)
        return f"D-PACE (the drafter's own detached label probabilities, smoothed by {smoothing})"
    if cfg.get("position_weighting") == "auf":
        return "Spec-AUF (1 up to and including the drafter's first wrong position in the block, 0 after)"
    end = cfg.get("loss_gamma")
    end = f"{end:g}" if end is not None else f"{loss_gamma(block):g} (the paper's for block {block})"
    start = cfg.get("loss_gamma_start")
    if start is not None:
        return (
            f"exp(-(k-1)/gamma), gamma moving linearly from {start:g} at the first step to {end} at the last"
        )
    return f"exp(-(k-1)/gamma), gamma {end}"


def convention_lines(dflash: dict) -> list[str]:
    """The target's conventions the drafter computes with, where the target has any (Gemma)."""
    lines = []
    if dflash.get("input_embedding_scale"):
        lines.append(
            f"- input embeddings scaled by {dflash['input_embedding_scale']:g}, as the target scales its own"
        )
    if dflash.get("logit_scale"):
        lines.append(f"- logits multiplied by {dflash['logit_scale']:g}, as the target multiplies its own")
    if dflash.get("final_logit_softcapping"):
        lines.append(
            f"- logits soft-capped at {dflash['final_logit_softcapping']:g}, as the target caps its own"
        )
    return lines


def rendered_as_trained(stamp: dict) -> str:
    """The evaluate flags that render prompts as the training data was rendered (its template arguments)."""
    kwargs = stamp.get("chat_template_kwargs")
    return f" --chat_template_kwargs '{json.dumps(kwargs)}'" if kwargs else ""


def init_from_lines(record: dict | None) -> list[str]:
    """Where the drafter started (--init_from): the source, its digest, what was new or dropped."""
    if not record:
        return []
    at = f" at commit `{record['commit']}`" if record.get("commit") else ""
    line = (
        f"- started from `{record['source']}`{at} ({record['kind']}, {record['family']}, model.safetensors "
        f"sha256 `{record['sha256']}`)"
    )
    if record.get("new"):
        line += "; new parts, at a start that drafts as the source: " + ", ".join(
            f"`{n}`" for n in record["new"]
        )
    if record.get("dropped"):
        line += "; the source's parts dropped: " + ", ".join(f"`{n}`" for n in record["dropped"])
    return [line]


def source_card_section(source: Path, heading: str) -> list[str]:
    """The section headed exactly `heading` of the model card of an export being exported again, as it was
    written from the run (an export has no trainer_state.json to write it from); empty when absent. A `## `
    line inside a code block does not end it."""
    card = source / "README.md"
    lines = card.read_text(errors="replace").splitlines() if card.is_file() else []
    if heading not in lines:
        return []
    start = lines.index(heading)
    section, fenced = [heading], False
    for line in lines[start + 1 :]:
        fenced ^= line.startswith("```")
        if line.startswith("## ") and not fenced:
            break
        section.append(line)
    return ["\n".join(section).rstrip(), ""]


def weights_line(config: dict, source: Path, state: dict | None) -> str:
    """The weights' dtype, and where an export exported again in a wider dtype holds only the source's
    values (an fp32 export of a bf16 export is bf16 widened: the run's fp32 weights are in its checkpoints)."""
    dtype = config.get("dtype", config.get("torch_dtype", "?"))
    if state is None and (source / "config.json").is_file():
        was = json.loads((source / "config.json").read_text()).get("dtype")
        if was == "bfloat16" and dtype == "float32":
            return f"{dtype} (the bfloat16 values of the export it was made from, widened)"
    return dtype


def untrained_line(state: dict, cfg: dict) -> str:
    """What a checkpoint of step 0 (a --max_steps 0 run) holds: the source drafter, or random weights."""
    start = (
        "the drafter it started from, as loaded"
        if state.get("init_from")
        else f"a fresh drafter's random initialisation (seed {cfg.get('seed')})"
    )
    return f"- no optimizer step (a `--max_steps 0` run): {start}"


def target_type(stamp: dict) -> str:
    """`, model type X (checkpoint class Y)` of the target as the stamp records it (empty before it did)."""
    if not stamp.get("target_model_type"):
        return ""
    return f", model type `{stamp['target_model_type']}` (checkpoint class `{stamp['target_architecture']}`)"


def target_license(target_dir: Path | None) -> str | None:
    """The `license` of the target's own model card (its README.md metadata header), when there is one."""
    card = target_dir / "README.md" if target_dir else None
    if not card or not card.is_file():
        return None
    text = card.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    try:
        header = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return None
    value = header.get("license") if isinstance(header, dict) else None
    return str(value) if value else None


def run_evaluation(checkpoint: Path, state: dict | None) -> tuple[dict | None, str]:
    """The real-tau evaluation of this checkpoint the run kept, and where it comes from: its line of the
    run's eval.jsonl, else the final evaluation (eval.json) when this is the run's last checkpoint."""
    if state is None or checkpoint.parent.name != "checkpoints":
        return None, ""
    run_dir = checkpoint.parent.parent
    step = state.get("global_step")
    records, _ = read_evaluations(run_dir)
    mine = [r for r in records if r["step"] == step]
    if mine:
        return mine[-1], f"eval.jsonl of the run, step {step}"
    final = run_dir / "eval.json"
    if final.is_file() and step == state.get("total_steps"):
        try:
            report = json.loads(final.read_text())
        except (OSError, json.JSONDecodeError):
            return None, ""
        if report.get("step", step) == step:  # not one of an earlier end the run has since trained past
            return report, f"the run's final evaluation (eval.json, step {step})"
    best = best_record(records)
    if best:
        return (
            None,
            f"not evaluated; the run's best checkpoint is {best['checkpoint']} (tau {best['tau']:.2f})",
        )
    return None, ""


def tau_table(report: dict, family: str = "DFlash") -> list[str]:
    """Markdown rows of an evaluation: the full table of eval.json, or the one line of an eval.jsonl record,
    then tau by context length and the evaluation's notes."""
    if "dflash" not in report:  # an eval.jsonl record
        rows = [
            "| method | tau | output equals greedy |",
            "| --- | --- | --- |",
            f"| {family}, this drafter | {report['tau']:.2f} | {'yes' if report.get('lossless') else 'NO'} |",
        ]
    else:
        labels = {
            "dflash": f"{family}, this drafter",
            "dflash_sampled": f"{family}, this drafter, sampled at temperature 1.0",
            "transformers_dflash": "the same drafter in transformers' generate",
            "dflash_untrained": "an untrained drafter of the same shape",
            "prompt_lookup": "prompt lookup (transformers)",
        }
        rows = ["| method | tau | tokens/s vs greedy | mismatches |", "| --- | --- | --- | --- |"]
        for key, label in labels.items():
            entry = report.get(key)
            if entry and entry.get("tau") is not None:
                rows.append(
                    f"| {label} | {entry['tau']:.2f} | "
                    + ("-" if entry.get("speedup") is None else f"{entry['speedup']:.2f}x")
                    + f" | {entry['mismatches']} |"
                )
    by_context = report.get("tau_by_context") or {}
    if by_context:
        rows += ["", "tau by tokens of context before the block:", ""]
        rows += ["| context | " + " | ".join(by_context) + " |", "| --- |" + " --- |" * len(by_context)]
        rows.append("| tau | " + " | ".join(f"{tau:.2f}" for tau in by_context.values()) + " |")
    return rows + [f"\n{note}" for note in report.get("notes", [])]


def dspark_lines(config: dict) -> list[str]:
    """What a DSpark drafter adds to DFlash, with its own numbers."""
    rank, kind = config.get("markov_rank", 0), config.get("markov_head_type", "vanilla")
    heads = [
        f"a {kind} Markov head of rank {rank} (a bias on each drafted position's logits from the token "
        "before it)"
        if rank
        else "no Markov head"
    ]
    if config.get("enable_confidence_head"):
        heads.append("a confidence head (each position's predicted acceptance, for adaptive verification)")
    return [f"It is a DSpark drafter: DFlash's backbone with {' and '.join(heads)}.", ""]


def dspark_serving(target_ref: str, export: str, block: int, markov_head: str, confidence: bool) -> list[str]:
    """How a DSpark export is served: vLLM's DSpark method (its V2 runner, on GPUs), the block as its fill-in
    mode, for the vanilla Markov head vLLM serves (a gated or rnn head's card says it is served here only);
    a confidence head acts only under vLLM's adaptive verification, which is off unless asked."""
    ours = (
        "dflash_ddp's own decoding runs it "
        f"(`python -m dflash_ddp.evaluate --target_model {target_ref} --drafter {export} --data FILE`)."
    )
    if markov_head != "vanilla":
        return [
            "## Serving",
            "",
            f"With this export at `{export}`. Its {markov_head} Markov head (`--markov_head_type {markov_head}`) is "
            "not served by vLLM, whose DSpark loader builds the vanilla head only and refuses this head's "
            "weights by name; train with `--markov_head_type vanilla` to serve it there. transformers' "
            f"`generate` does not run DSpark drafters; {ours}",
            "",
        ]
    return [
        "## Serving",
        "",
        f"With this export at `{export}`. vLLM serves DSpark on its Model Runner V2 (GPUs; its CPU build refuses "
        f"it), with `sample_from_anchor: false` from this config: the anchor given, {block - 1} positions drafted.",
        "",
        "```bash",
        f"vllm serve {target_ref} --speculative-config "
        f'\'{{"method": "dspark", "model": "{export}", "num_speculative_tokens": {block - 1}'
        + (', "enable_adaptive_verification": true' if confidence else "")
        + "}'",
        "```",
        "",
        *(
            [
                "`enable_adaptive_verification` has vLLM size each request's verification from the confidence "
                "head's predicted acceptance; without it vLLM loads the head and verifies every drafted position.",
                "",
            ]
            if confidence
            else []
        ),
        f"transformers' `generate` does not run DSpark drafters; {ours}",
        "",
    ]


def dflash2_lines(dflash: dict) -> list[str]:
    """What a DFlash2 drafter adds to DFlash, with its own numbers."""
    return [
        "It is a DFlash2 drafter: per layer two grouped dynamic convolutions inside the block "
        f"({dflash['conv_kernel_size']} taps, groups of {dflash['conv_group_size']} channels), and a candidate "
        f"selector that drafts each position from the target LM head's top {dflash['selector_top_k']} tokens "
        f"given the token before it (codebooks of rank {dflash['selector_rank']} over the target's vocabulary).",
        "",
    ]


def lilicorr_lines(dflash: dict) -> list[str]:
    """What a LiLiCorr drafter adds to DFlash, with its own numbers."""
    width = dflash["lilicorr_hidden_size"] or "the drafter's"
    conv = (
        f" Its layers carry DFlash2's grouped convolutions ({dflash['conv_kernel_size']} taps, groups of "
        f"{dflash['conv_group_size']} channels)."
        if dflash.get("conv_kernel_size")
        else ""
    )
    return [
        "It is a [LiLiCorr](https://arxiv.org/abs/2608.20530) drafter: each drafted position keeps the target LM "
        f"head's top {dflash['lilicorr_candidate_topk']} tokens, a {dflash['lilicorr_num_layers']}-layer "
        f"correlator of width {width} scores the transitions between the candidates of adjacent positions, and "
        f"the draft is a walk through that lattice from the anchor.{conv} vLLM serves it on its V2 runner (GPU) "
        "with the target's full vocabulary (a pruned draft vocabulary is refused).",
        "",
    ]


def model_card(
    config: dict,
    checkpoint: Path,
    export_dir: Path,
    target_name: str | None,
    target_dir: Path | None,
) -> str:
    """README.md for the export in `export_dir` whose z-lab config.json is `config`, made from `checkpoint`
    (a training checkpoint, or an earlier export). `target_name` is the target as the run named it."""
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else None
    dflash = config["dflash_config"]
    block = config["block_size"]
    dflash2 = config["architectures"] == ["DFlash2DraftModel"]
    dspark = config["architectures"] == ["DSparkDraftModel"]
    lilicorr = config["architectures"] == ["LiLiCorrDraftModel"]
    family = "DFlash2" if dflash2 else "DSpark" if dspark else "LiLiCorr" if lilicorr else "DFlash"
    hub = hub_model_name(target_name) if target_name else None
    base_model = hub[0] if hub else None
    header = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": [
            "dflash",
            *(["dflash2"] if dflash2 else ["dspark"] if dspark else ["lilicorr"] if lilicorr else []),
            "speculative-decoding",
            "draft-model",
            "dflash_ddp",
        ],
    }
    if base_model:
        header["base_model"] = base_model
    license_name = target_license(target_dir)
    if license_name:
        header["license"] = license_name
    target_ref = base_model or target_name or "TARGET_MODEL"
    title = (
        f"{family} drafter for {base_model or Path(target_name).name}" if target_name else f"{family} drafter"
    )
    lines = ["---", yaml.safe_dump(header, sort_keys=False).rstrip(), "---", "", f"# {title}", ""]
    lines += [
        "A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter for speculative decoding: it reads "
        "hidden states of the frozen target and proposes a block of tokens in one forward pass, which the target "
        "verifies in one pass; greedy output is exactly the target's own. Trained with dflash_ddp (one torchrun "
        "job: target ranks stream hidden states to drafter ranks).",
        "",
        *(
            dflash2_lines(dflash)
            if dflash2
            else dspark_lines(config)
            if dspark
            else lilicorr_lines(dflash)
            if lilicorr
            else []
        ),
        "## The drafter",
        "",
        f"- block size {block} ({block - 1} drafted tokens per step, plus the target's bonus token)",
        f"- {config['num_hidden_layers']} layers, hidden size {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} KV heads), "
        f"MLP {config['intermediate_size']}; weights in {weights_line(config, checkpoint, state)}",
        f"- tapped target layers {dflash['target_layer_ids']} (the outputs of those decoder layers, "
        f"`hidden_states[L + 1]` in transformers), of {config['num_target_layers']}",
        f"- mask token id {dflash['mask_token_id']}"
        + (f" (`{dflash['mask_token']}`)" if dflash.get("mask_token") else ""),
        "- the target's embedding and LM head are shared: this repository holds only the drafter's own weights",
        *convention_lines(dflash),
        "",
    ]
    if dflash2:
        lines += [
            "The selector scores the target LM head's own logits: serve the target with its LM head unquantized "
            "(vLLM refuses a quantized head for DFlash2).",
            "",
        ]
    if state:
        cfg, fingerprints = state.get("config", {}), state.get("fingerprints", {})
        settings = {k: cfg[k] for k in OBJECTIVE_SETTINGS if k in cfg and not trains_nothing(cfg, k)}
        objective = ", ".join(f"{k} {v}" for k, v in settings.items())
        lines += [
            "## Training",
            "",
            f"- target: `{cfg.get('target_model', '?')}`"
            + (f" at commit `{fingerprints['target_commit']}`" if fingerprints.get("target_commit") else "")
            + target_type(config.get("dflash_ddp") or {})
            + f" (fingerprint `{fingerprints.get('target')}`)",
            f"- data: {', '.join(f'`{d}`' for d in cfg.get('data', []))} (fingerprint `{fingerprints.get('data')}`), "
            f"chat template arguments {json.dumps(cfg.get('chat_template_kwargs', {}))}",
            *init_from_lines(state.get("init_from")),
            *(
                [
                    f"- {state.get('global_step')} optimizer steps (epoch {state.get('epoch', '?')}), "
                    f"{state.get('tokens_seen', 0):,} tokens seen",
                    f"- objective: {scored_against(cfg)} at each block position after randomly drawn anchors on "
                    f"response tokens, weighted by {weighted_by(cfg, block)}"
                    + (f"; {objective}" if objective else ""),
                    *(
                        f"- the steps before step {change['step']} trained with other settings, changed on resume: "
                        + "; ".join(change["changes"])
                        for change in state.get("overrides", [])
                    ),
                ]
                if state.get("global_step")
                else [untrained_line(state, cfg)]
            ),
            "",
        ]
    else:
        lines += source_card_section(checkpoint, "## Training")
    report, source = run_evaluation(checkpoint, state)
    measured = source_card_section(checkpoint, ACCEPTANCE) if state is None else []
    carried = measured if any(MEASURED in part for part in measured) else []
    if carried:  # the source's measured table; an unmeasured source's card names the source: written anew
        lines += carried
    elif report:
        lines += [ACCEPTANCE, ""]
        lines += [
            f"{MEASURED}, from {source}:",
            "",
            *tau_table(report, family),
            "",
        ]
    else:
        lines += [ACCEPTANCE, ""]
        lines += [
            (source + "; m" if source else "M")
            + "easure it with `python -m dflash_ddp.evaluate --target_model "
            + f"{target_ref} --drafter {export_dir.resolve()} --data HELDOUT.jsonl"
            + rendered_as_trained(config.get("dflash_ddp") or {})
            + "`.",
            "",
        ]
    export = str(export_dir.resolve())
    if dspark:
        return "\n".join(
            lines
            + dspark_serving(
                target_ref,
                export,
                block,
                config.get("markov_head_type", "vanilla"),
                bool(config.get("enable_confidence_head")),
            )
        )
    lines += [
        "## Serving",
        "",
        f"With this export at `{export}` (once uploaded, its hub name works in its place). The engines count the "
        f"block differently: SGLang's `--speculative-num-draft-tokens` is the block size ({block}), vLLM's "
        f"`num_speculative_tokens` the drafted tokens per block, block size - 1 ({block - 1}).",
        "",
        "SGLang:",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target_ref} --speculative-algorithm DFLASH \\",
        f"    --speculative-draft-model-path {export} --speculative-num-draft-tokens {block} --dtype bfloat16",
        "```",
        "",
        "vLLM"
        + (
            " (v0.28.0 or later, Model Runner V2; the V1 runner refuses it in 0.32 and drafted it as plain"
            " DFlash before):"
            if dflash2
            else ":"
        ),
        "",
        "```bash",
        f"vllm serve {target_ref} --speculative-config "
        f'\'{{"method": "dflash", "model": "{export}", "num_speculative_tokens": {block - 1}}}\'',
        "```",
        "",
    ]
    if dflash2 or lilicorr:
        lines += [
            "transformers' `generate` runs DFlash drafters only; dflash_ddp's own decoding runs this one "
            f"(`python -m dflash_ddp.evaluate --target_model {target_ref} --drafter {export} --data FILE`).",
            "",
        ]
        return "\n".join(lines)
    lines += [
        'transformers (`generate(..., speculation_type="dflash")`, with dflash_ddp installed for the drafter class):',
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "from dflash_ddp.evaluation.decoding import as_transformers_assistant",
        "from dflash_ddp.serving.export import load_drafter",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target_ref}", dtype=torch.bfloat16, device_map="cuda")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target_ref}")',
        f'drafter = as_transformers_assistant(load_drafter("{export}", device="cuda"), target)',
        'messages = [{"role": "user", "content": "Explain speculative decoding in one paragraph."}]',
        "ids = tokenizer.apply_chat_template(",
        '    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True',
        ')["input_ids"].to("cuda")',
        'out = target.generate(ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=256, do_sample=False)',
        "print(tokenizer.decode(out[0, ids.shape[1]:]))",
        "```",
        "",
    ]
    return "\n".join(lines)
