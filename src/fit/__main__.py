"""`python -m src.fit [overrides] [--card GiB ...]`: does a setting fit a card? On a CPU, in seconds, no GPU.

The memory model (src/fit/model.py) predicts the setting's peak reserved VRAM term by term, fitted to the measured
trials of the stack in the MLflow store (first principles where none was measured), on the micro-batch the user's
own data makes at this max_seq_length; then, per card: fits or not with the margin, the largest max_seq_length and
per-device batch that fit, and the setting to run on that card, predicted from the model alone by the rule the sweep
searches with (src/fit/recommend.py): the memory levers combined with the longest max_seq_length the data needs,
predicted to keep the sweep's headroom margin even if the model under-predicts by its stated error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from src.fit.model import FITTED, TERMS, MemoryModel, Prediction
from src.fit.setting import Setting, peak_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m src.fit",
        description="The memory model's prediction of a setting's peak VRAM, and whether it fits a card.",
        epilog="example: python -m src.fit model=llama3_8b_synthetic data.max_seq_length=2048 --card 16 24 40 80",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m src.train")
    p.add_argument(
        "--card", type=float, nargs="+", default=None, help="card sizes in GiB (default hardware.vram_budget_gib)"
    )
    p.add_argument(
        "--model-file", type=Path, default=None, help="a fitted model (--save) instead of the MLflow history"
    )
    p.add_argument("--save", type=Path, default=None, help="write the fitted model to this JSON file")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    args = p.parse_args(argv)
    for card in args.card or []:
        if not card > 0:
            p.error(f"--card {card:g}: a card's memory in GiB, more than 0 (e.g. --card 24 80)")

    from src import redact
    from src.config import compose
    from src.fit.calibration import Lengths, calibrated, vocab_fallback

    try:  # with the sweeper's config: its headroom margin is the recommendation's
        cfg = compose(["hydra/sweeper=optuna", *args.overrides], hydra_config=True)
    except Exception as exc:
        print(f"error: {redact.redact_text(str(exc))}", file=sys.stderr)
        return 2
    if args.model_file is not None:
        if not args.model_file.exists():
            print(f"error: --model-file {args.model_file}: no such file (write one with --save)", file=sys.stderr)
            return 2
        try:
            model, note = model_file(args.model_file), f"fitted model from {args.model_file}"
        except ValueError as exc:
            print(f"error: --model-file {args.model_file}: {exc}", file=sys.stderr)
            return 2
    else:
        model, note = calibrated(cfg.tracking.uri, cfg.model.name)
    if args.save is not None:
        model.save(args.save)
    rows = Lengths().rows(cfg)
    lengths = None if rows is None else rows[0]
    try:
        vocab = vocab_fallback(cfg)
        setting = Setting.from_config(cfg, vocab_fallback=vocab)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cards = args.card or [float(cfg.hardware.vram_budget_gib)]
    answer = ask(model, setting, lengths, cards)
    answer["calibration"] = note
    margin = float(OmegaConf.select(cfg, "hydra.sweeper.headroom_margin"))
    for card, advice in zip(answer["cards"], recommendations(model, cfg, vocab, rows, cards, margin), strict=True):
        card.update(advice)
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(render(answer, setting, lengths))
    return 0


def model_file(path: Path) -> MemoryModel:
    """A fitted model's file (`--save`), checked before it is used: ValueError says what is wrong with it (a JSON
    without the model's keys read as every term 0 GiB and "FITS"). A file of an older model (fewer terms) is read with
    the terms it lacks at their first-principles values."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a fitted model's JSON ({exc}); write one with --save") from None
    keys = ("coefficients", "context_gib", "error")
    missing = [k for k in keys if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"not a fitted model: no {', '.join(missing)} (write one with --save)")
    coefficients = data["coefficients"]
    if not isinstance(coefficients, dict) or not coefficients or not set(coefficients) <= set(FITTED):
        raise ValueError(f"not a fitted model: its coefficients are some of {', '.join(FITTED)}")
    numbers = {f"coefficients.{k}": v for k, v in coefficients.items()} | {k: data[k] for k in keys[1:]}
    if data.get("error_over") is not None:
        numbers["error_over"] = data["error_over"]
    for name, pair in (data.get("errors") or {}).items():
        numbers |= {f"errors.{name}[{i}]": v for i, v in enumerate(pair)}
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{key}={value!r}: must be a number, at least 0")
    return MemoryModel.from_dict(data)


def ask(model: MemoryModel, setting: Setting, lengths: Any, cards: list[float]) -> dict[str, Any]:
    batch = peak_batch(lengths, setting)
    pred = model.predict(setting, batch)
    out: dict[str, Any] = {
        "terms_gib": pred.terms,
        "predicted_peak_vram_reserved_gib": pred.reserved_gib,
        "predicted_peak_vram_allocated_gib": pred.allocated_gib,
        # what decides a fit: peak allocated under expandable segments, peak reserved on the default allocator
        "predicted_needed_gib": pred.needed_gib,
        "cuda_context_gib": pred.context_gib,
        "predicted_on_card_gib": pred.device_gib,
        "error_frac": pred.error,  # the most it under-predicts, as a share of its prediction
        "error_over_frac": pred.error if pred.error_over is None else pred.error_over,
        "peak_micro_batch": {"rows": len(batch.rows), "tokens": batch.tokens},
        "cards": [],
    }
    for card in cards:
        out["cards"].append(
            {
                "card_gib": card,
                "verdict": verdict(pred, card),
                "margin_gib": card - pred.device_gib,
                "largest_max_seq_length": largest_seq(model, setting, lengths, card),
                "largest_batch": largest_batch(model, setting, lengths, card),
            }
        )
    return out


def verdict(pred: Prediction, card: float) -> str:
    """fits (even if the model underestimates by its error) | edge (within the model's error) | does not fit."""
    if pred.device_gib + pred.error * pred.needed_gib <= card:
        return "fits"
    if pred.certainly_over(card):
        return "does not fit"
    return "edge"


def largest_seq(model: MemoryModel, s: Setting, lengths: Any, card: float, step: int = 64) -> int | None:
    """The largest max_seq_length (a multiple of `step`, up to the model's context) predicted to fit at this batch;
    None if not even `step` fits. Beyond the data's longest row a padded batch grows no more."""
    best = None
    for seq in range(step, s.arch.max_positions + 1, step):
        t = s.with_knobs(max_seq_length=seq)
        if not model.predict(t, peak_batch(lengths, t)).fits(card):
            break
        best = seq
    return best


def largest_batch(model: MemoryModel, s: Setting, lengths: Any, card: float, limit: int = 256) -> int | None:
    best = None
    for b in range(1, limit + 1):
        t = s.with_knobs(batch=b)
        if not model.predict(t, peak_batch(lengths, t)).fits(card):
            break
        best = b
    return best


def recommendations(
    model: MemoryModel, cfg: Any, vocab: int | None, rows: Any, cards: list[float], margin: float
) -> list[dict[str, Any]]:
    """Per card, the setting to run there, predicted from the model alone by src/fit/recommend.py's rule (the one the
    sweep searches with): the recipe's levers combined with the longest max_seq_length the data needs (within
    preflight.max_truncated_answer_frac), predicted to keep the headroom margin of the card's pool (its memory less
    the CUDA context) even if the model under-predicts by its stated error; the fewest levers first. None fits: the
    closest (every lever)."""
    from src.data import truncation
    from src.fit import recommend
    from src.fit.calibration import configured

    lengths = None if rows is None else rows[0]
    recipe_length = int(cfg.data.max_seq_length)
    levers = recommend.levers(cfg, {})
    predicted: dict[tuple[str, ...], Prediction | None] = {}

    def predict(changes: list[str]) -> Prediction | None:
        if tuple(changes) not in predicted:
            try:
                s = Setting.from_config(configured(cfg, changes), vocab_fallback=vocab)
                predicted[tuple(changes)] = model.predict(s, peak_batch(lengths, s))
            except (ValueError, TypeError):  # a lever this model cannot describe
                predicted[tuple(changes)] = None
        return predicted[tuple(changes)]

    def cut(length: int) -> float:
        return 0.0 if rows is None else truncation(rows[0], rows[1], length)["truncated_answer_frac"]

    if lengths is None:  # the data is not readable here: only the recipe's length
        tried = [recipe_length]
    else:
        max_positions = Setting.from_config(cfg, vocab_fallback=vocab).arch.max_positions
        ladder = recommend.ladder([recipe_length], int(lengths.max()), max_positions)
        tried = recommend.lengths_to_try(ladder, cut, float(cfg.preflight.max_truncated_answer_frac))
    policy = float(cfg.preflight.max_truncated_answer_frac)
    recipe = predict([])
    out = []
    for card in cards:
        pool = card - model.context_gib
        if recipe is not None and recommend.fits_with_margin(recipe, pool, margin) and cut(recipe_length) <= policy:
            # The recipe needs no change here: none is recommended (a shorter length that still holds every row
            # would only save memory the card does not need).
            bound = recommend.under_bound(recipe)
            as_is = recommend.Candidate((), recipe_length, cut(recipe_length), recipe.needed_gib, bound)
            out.append({"recommended": _candidate(as_is, recipe_length), "closest": None, "headroom_margin": margin})
            continue
        found = recommend.candidates(predict, levers, tried, cut, pool, margin)
        best = found[0] if found else None
        closest = None if found else recommend.closest(predict, levers, tried, cut)
        if recipe is None or not recommend.fits_with_margin(recipe, pool, margin):
            why = (
                "the model cannot describe the recipe"
                if recipe is None
                else f"the recipe needs {recommend.under_bound(recipe):.2f} GiB if under-predicted, more than the card "
                f"keeps with the {margin:.0%} headroom margin"
            )
        else:
            why = (
                f"the recipe's max_seq_length={recipe_length} cuts {cut(recipe_length):.1%} of answers, more than "
                f"preflight.max_truncated_answer_frac={policy:g}"
            )
        out.append(
            {
                "recommended": _candidate(best, recipe_length),
                "closest": _candidate(closest, recipe_length),
                "headroom_margin": margin,
                "why": why,
            }
        )
    return out


def _candidate(c: Any, recipe_length: int) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "changes": c.changes,
        "words": c.words(recipe_length),
        "predicted_needed_gib": c.predicted_gib,
        "if_under_predicted_gib": c.bound_gib,
        "truncated_answer_frac": c.cut,
        "predicted": True,  # from the memory model alone: measure it (a sweep does)
    }


def render(answer: dict[str, Any], s: Setting, lengths: Any) -> str:
    knobs = (
        f"max_seq_length {s.max_seq_length} · batch {s.batch} · "
        f"{'checkpointing' if s.checkpointing else 'no checkpointing'} · attention {s.attention}"
        f"{' · packing' if s.packing else ''} · LoRA r {s.lora_r} on {len(s.lora_targets)} projections · "
        f"{'fp32' if s.upcast_non_quantized else 'bf16'} non-quantized weights · {s.optim}"
    )
    mb = answer["peak_micro_batch"]
    data = (
        "your data's rows unknown here: every row taken at max_seq_length"
        if lengths is None
        else f"your data's longest row: {int(max(lengths))} tokens"
    )
    err, over = answer["error_frac"], answer["error_over_frac"]
    lines = [
        f"setting: {knobs}",
        f"peak micro-batch: {mb['rows']} row(s), {mb['tokens']} tokens ({data})",
        f"memory model: {answer['calibration']}; it under-predicts by at most {err:.1%} and over-predicts by at most "
        f"{over:.1%} ({'expandable segments' if s.expandable_segments else 'the default allocator'})",
        "",
    ]
    needed = answer["predicted_needed_gib"]
    spread = f"(+{err * needed:.2f} / -{needed * over / (1 + over):.2f})"
    tensors = [name for name in TERMS if name != "allocator_cache"]
    cache = answer["terms_gib"]["allocator_cache"]
    for name in tensors if s.expandable_segments else TERMS:
        lines.append(f"  {name:<22}{answer['terms_gib'][name]:8.2f} GiB")
    if s.expandable_segments:
        lines += [
            f"  {'= peak allocated':<22}{needed:8.2f} GiB  {spread}  what the card must hold: expandable segments give "
            "their cache back when it presses",
            f"  {'  (+ allocator_cache':<22}{cache:8.2f} GiB  = {answer['predicted_peak_vram_reserved_gib']:.2f} GiB "
            "peak reserved where the card does not press)",
        ]
    else:
        lines.append(f"  {'= peak reserved':<22}{needed:8.2f} GiB  {spread}")
    lines += [
        f"  {'+ CUDA context':<22}{answer['cuda_context_gib']:8.2f} GiB",
        f"  {'= on the card':<22}{answer['predicted_on_card_gib']:8.2f} GiB",
        "",
    ]
    for c in answer["cards"]:
        card = c["card_gib"]
        margin = c["margin_gib"]
        how = f"{margin:.2f} GiB left ({margin / card:.0%})" if margin >= 0 else f"short by {-margin:.2f} GiB"
        seq = c["largest_max_seq_length"]
        seq_text = "none" if seq is None else str(seq)
        if seq is not None and lengths is not None and not s.packing and seq >= s.arch.max_positions:
            seq_text = f"any (the longest row, {int(max(lengths))} tokens, fits)"
        lines.append(
            f"{card:g} GiB card: {c['verdict'].upper()} — {how}; largest max_seq_length at batch {s.batch}: "
            f"{seq_text}; largest batch at max_seq_length {s.max_seq_length}: {c['largest_batch'] or 'none'}"
        )
        if "recommended" in c:
            lines.append(f"  {advice_words(c)}")
    return "\n".join(lines)


def advice_words(c: dict[str, Any]) -> str:
    """The card's recommended setting (or the closest), in one line, marked predicted."""
    margin = f"{c['headroom_margin']:.0%} headroom margin"
    best = c["recommended"]
    why = c.get("why") or "the recipe does not fit"
    if best is not None:
        if best["words"] == "recipe":
            return (
                f"no change needed (predicted): the recipe as it is keeps the {margin} — "
                f"{best['predicted_needed_gib']:.2f} GiB needed, {best['if_under_predicted_gib']:.2f} if the model "
                f"under-predicts by its error; cuts {best['truncated_answer_frac']:.1%} of answers"
            )
        return (
            f"recommended (predicted, from the memory model alone), as {why}: {best['words']} — "
            f"{best['predicted_needed_gib']:.2f} GiB needed, {best['if_under_predicted_gib']:.2f} if the model "
            f"under-predicts by its error (keeps the {margin}); cuts {best['truncated_answer_frac']:.1%} of answers"
        )
    closest = c["closest"]
    if closest is None:
        return f"recommended (predicted): none; {why}, and the model cannot describe the levers of this setting"
    return (
        f"recommended (predicted): none; {why}, and none of the levers' combinations is predicted to keep the "
        f"{margin}; the closest, {closest['words']}, is predicted to need {closest['predicted_needed_gib']:.2f} GiB "
        f"({closest['if_under_predicted_gib']:.2f} if under-predicted): measure it, or a larger card"
    )


if __name__ == "__main__":
    sys.exit(main())
