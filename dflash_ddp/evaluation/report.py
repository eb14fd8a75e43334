"""The evaluation's report as people read it: the methods in order and their labels, and the rich tables of
tau, speed, the losslessness verdict, accepted lengths, tau by context and a confidence head's calibration.
"""

from __future__ import annotations

from dflash_ddp.evaluation.decoding import CONTEXT_BUCKETS

METHODS = ("dflash", "dflash_sampled", "dflash_untrained", "prompt_lookup", "transformers_dflash")

OWN_DECODING = ("dflash", "dflash_untrained")  # this project's decoder; the others are transformers'

METHOD_LABELS = {
    "greedy": "greedy (baseline)",
    "dflash": "DFlash, this drafter",
    "dflash_sampled": "DFlash, this drafter, T=1.0",
    "dflash_untrained": "DFlash, untrained drafter",
    "prompt_lookup": "prompt lookup (transformers)",
    "transformers_dflash": "DFlash in transformers generate",
}


def methods(found: dict) -> list[str]:
    """The METHODS that `found` (decoding results, or a report) has, in METHODS' order."""
    return [name for name in METHODS if name in found]


def print_report(report: dict, console=None) -> None:
    """The report as rich tables: methods (tau, speed, lossless) and the accepted-length histogram."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    family = report.get("drafter", "dflash")
    table = Table(
        title=(
            f"{family_label(family)} evaluation: {report['num_prompts']} prompts, max_new_tokens {report['max_new_tokens']}, "
            f"block_size {report['block_size']}, {report['device']} {report['dtype']}"
        )
    )
    for column in ("method", "tau", "tokens/s", "speedup", "equals greedy"):
        table.add_column(column, justify="left" if column == "method" else "right")
    sampled = report["lossless"] is None
    baseline = "target alone, sampled" if sampled else METHOD_LABELS["greedy"]
    table.add_row(baseline, "1.00", f"{report['greedy']['tokens_per_s']:.1f}", "1.00x", "-")
    for name in methods(report):
        entry = report[name]
        ok = report["num_prompts"] - entry["mismatches"]
        verdict = f"{ok}/{report['num_prompts']}" + ("" if entry["mismatches"] == 0 else " MISMATCH")
        verdict = "in distribution" if sampled or name == "dflash_sampled" else verdict
        table.add_row(
            method_label(name, family),
            "-" if entry["tau"] is None else f"{entry['tau']:.2f}",
            f"{entry['tokens_per_s']:.1f}",
            # none for the sampled row: its answers, of other lengths, are not greedy's to compare rates with
            "-" if entry["speedup"] is None else f"{entry['speedup']:.2f}x",
            verdict,
            style=None if entry["mismatches"] == 0 else "bold red",
        )
    console.print(table)
    for note in report.get("notes", []):
        console.print(note)

    histogram = Table(title="tokens committed per verify step (bonus included)")
    histogram.add_column("accepted", justify="right")
    for name in ("dflash", "dflash_untrained"):
        histogram.add_column(method_label(name, family), justify="right")
    totals = {name: max(1, sum(report[name]["accept_histogram"])) for name in ("dflash", "dflash_untrained")}
    for length in range(1, report["block_size"] + 1):
        cells = []
        for name in ("dflash", "dflash_untrained"):
            count = report[name]["accept_histogram"][length - 1]
            cells.append(f"{count} ({100 * count / totals[name]:.1f}%)")
        histogram.add_row(str(length), *cells)
    console.print(histogram)

    by_context = Table(title="tau by tokens of context before the block (prompt and generated)")
    by_context.add_column("context", justify="right")
    for name in ("dflash", "dflash_untrained"):
        by_context.add_column(f"{method_label(name, family)}: tau (verify steps)", justify="right")
    for _, _, bucket in CONTEXT_BUCKETS:
        cells = [
            f"{report[n]['tau_by_context'][bucket]:.2f} ({report[n]['verify_steps_by_context'][bucket]})"
            if bucket in report[n].get("tau_by_context", {})
            else "-"
            for n in ("dflash", "dflash_untrained")
        ]
        if cells != ["-", "-"]:
            by_context.add_row(bucket, *cells)
    console.print(by_context)

    calibration = report["dflash"].get("confidence_calibration")
    if calibration or report["dflash"].get("drafts_skipped"):
        table = Table(title="confidence head: predicted vs observed acceptance")
        for column in ("position", "predicted", "observed", "reached"):
            table.add_column(column, justify="right")
        for row in calibration or []:
            table.add_row(
                str(row["position"]), f"{row['predicted']:.3f}", f"{row['observed']:.3f}", str(row["reached"])
            )
        console.print(table)
        console.print(
            f"{report['dflash']['drafts_skipped']} drafts not verified (below --confidence_threshold)"
        )
    for m in report["mismatched"]:
        where = f"{m['method']} differs from greedy on {m['prompt']} at token {m['first_difference']}"
        if "logit_gap" in m:
            tie = "a near tie" if m["near_tie"] else "not a tie"
            where += (
                f" ({tie}: the target's logits {m['logit_gap']:.3g} apart, tolerance {m['tolerance']:.3g})"
            )
        console.print(where if m["near_tie"] else f"[bold red]{where}")
    if report["lossless"] is not None:  # None: sampled, lossless in distribution (said in the notes)
        own = [m for m in report["mismatched"] if m["method"] in OWN_DECODING]
        ties = sum(m["near_tie"] for m in own)
        cache = sum(m.get("target_cache_differs_at") is not None and not m["near_tie"] for m in own)
        if not report["lossless"]:
            console.print("[bold red]NOT lossless")
        elif cache:
            console.print(
                f"not checked token for token: {cache} output(s) leave greedy's where the target's own decoding "
                "with a KV cache leaves its cacheless forward (see the note); no drafter is to blame there"
            )
        elif ties:
            console.print(
                f"lossless up to the target's rounding: {ties} output(s) leave greedy's at a near tie"
            )
        else:
            console.print("lossless: every output of this project's decoding equals greedy")


def family_label(family: str) -> str:
    """A drafter family's name as people write it (dflash2 -> DFlash2, dspark -> DSpark, lilicorr -> LiLiCorr)."""
    return family.replace("dflash", "DFlash").replace("dspark", "DSpark").replace("lilicorr", "LiLiCorr")


def method_label(name: str, family: str) -> str:
    """The table's label of method `name` for a drafter of `family` (the drafter's rows say its family)."""
    label = METHOD_LABELS[name]
    return label if name == "transformers_dflash" else label.replace("DFlash,", f"{family_label(family)},")
