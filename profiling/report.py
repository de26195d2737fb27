"""`tandem profile`: run the measurements, tune the verify widths, write report.json,
report.html (self-contained, plots embedded) and trace.json. The HTML is rendered from
report.json alone, so `render(report.json)` regenerates it anywhere."""

from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path

from tandem.engines.manifest import read_manifest
from tandem.engines.progress import Progress
from tandem.graph_kinds import VERIFY_GREEDY, GraphKind
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.runtime_settings import RUNTIME_SETTINGS
from tandem.profiling import measure
from tandem.profiling.tuning import choose_widths


def profile(engine_dir: str | Path, out: str | Path, prompts_file: str | None = None,
            batch_sizes: list[int] | None = None, max_tokens: int = 32, synthetic_acceptance: float | None = None,
            tune: bool = True, show_progress: bool = True) -> dict:
    engine_dir, out = Path(engine_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(engine_dir)
    rt = manifest["runtime"]
    batch_sizes = batch_sizes or rt["batch_sizes"]
    unknown = [b for b in batch_sizes if b not in rt["batch_sizes"]]
    if unknown:
        raise ValueError(f"batch sizes {unknown} have no engines here (built: {rt['batch_sizes']})")
    prompts = measure.load_prompts(prompts_file)
    started = time.time()
    llm = LLM(engine_dir, RuntimeConfig())
    spec_k = (max(rt["verify_widths"]) - 1) if rt["verify_widths"] and llm.mtp_layers else None
    reanchored = llm.mtp_layers if llm.mtp_mode == "chained" else 1  # head calls per re-anchor
    widths = sorted(rt["verify_widths"])
    n_latency = len(batch_sizes) * (1 + len(widths) + (max(widths, default=1) if llm.mtp_layers else 0))
    with Progress("latency", n_latency, show_progress) as bar:
        latency = measure.bucket_latencies(llm, batch_sizes, context=64, progress=bar)
    del llm
    runs = []
    modes = [False, True] if spec_k else [False]
    # rounds under a grammar cost their own (multi-call rounds, masks): measured apart where they can run
    grammars = (engine_dir / "tokenizer.json").exists()       # (llguidance compiles over the tokenizer)
    kinds = [False, True] if spec_k and synthetic_acceptance is None and grammars else [False]
    with Progress("generate", len(batch_sizes) * len(modes) * len(kinds), show_progress) as bar:
        for constrained in kinds:
            for b in batch_sizes:
                for spec in modes:
                    runs.append(measure.generation_run(
                        engine_dir, prompts, b, spec, max_tokens, synthetic_acceptance, spec_k,
                        trace=spec and b == batch_sizes[0] and not constrained, constrained=constrained))
                    bar.step(f"b{b} {'on' if spec else 'off'}{' schema' if constrained else ''}")
    free = [r for r in runs if not r["constrained"]]
    trace = next((r.pop("trace") for r in runs if "trace" in r), [])
    (out / "trace.json").write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    report = {
        "engine_dir": str(engine_dir), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.time() - started, 1), "device": measure.device(), "backend": manifest["backend"],
        "versions": manifest["versions"], "model": manifest["model"],
        "settings": {"batch_sizes": batch_sizes, "max_tokens": max_tokens, "prompts": len(prompts),
                     "prompts_file": str(prompts_file or measure.DEFAULT_PROMPTS), "spec_k": spec_k,
                     "synthetic_acceptance": synthetic_acceptance, "widths": widths},
        "latency": latency, "runs": runs, "speedup": _speedup(free), "aggregate": _aggregate(free),
        "trace_file": "trace.json",
    }
    if spec_k:
        report["tuning"] = _tune(report, batch_sizes, widths, reanchored)
        constrained = round_costs(report, batch_sizes, widths, reanchored, constrained=True) if len(kinds) > 1 \
            else {}
        report["constrained_round_seconds"] = {str(b): {str(w): s for (bb, w), s in constrained.items() if bb == b}
                                               for b in batch_sizes} if constrained else {}
        if tune:
            settings = {"verify_width_per_batch": {str(b): t["width"] for b, t in report["tuning"].items()},
                        "round_seconds_per_batch": {b: t["round_seconds"] for b, t in report["tuning"].items()},
                        "constrained_round_seconds_per_batch": report["constrained_round_seconds"],
                        "tuned_by": "tandem profile", "report": str(out / "report.json"),
                        "created": report["created"]}
            (engine_dir / RUNTIME_SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
            report["tuning_written_to"] = str(engine_dir / RUNTIME_SETTINGS)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    render(out / "report.json", out / "report.html")
    return report


def _speedup(runs: list[dict]) -> list[dict]:
    out = []
    for on in (r for r in runs if r["mode"] == "on"):
        off = next(r for r in runs if r["mode"] == "off" and r["batch"] == on["batch"])
        measured = on["decode_tokens_per_s"] / off["decode_tokens_per_s"]
        bound = on["accept_length"] * off["round_ms"] / on["round_ms"] if on["round_ms"] and off["round_ms"] else None
        out.append({"batch": on["batch"], "measured": round(measured, 3), "bound": round(bound, 3) if bound else None,
                    "of_bound": round(measured / bound, 3) if bound else None})
    return out


def _aggregate(runs: list[dict]) -> dict:
    """The seed's aggregate block, over every speculative run (or the plain ones if none)."""
    chosen = [r for r in runs if r["mode"] == "on"] or runs
    keys = ("n_requests", "total_predicted", "total_draft", "total_draft_accepted", "wall_s_total")
    agg = {k: sum(r["aggregate"][k] for r in chosen) for k in keys}
    agg["wall_s_total"] = round(agg["wall_s_total"], 3)
    drafted = agg["total_draft"]
    agg["aggregate_accept_rate"] = round(agg["total_draft_accepted"] / drafted, 4) if drafted else 0.0
    return agg


def _tune(report: dict, batch_sizes: list[int], widths: list[int], reanchored: int) -> dict:
    rounds = round_costs(report, batch_sizes, widths, reanchored)
    acceptance = next((r["acceptance_per_position"] for r in report["runs"]
                       if r["mode"] == "on" and not r.get("constrained")), [])
    tuning = {str(b): v for b, v in choose_widths(batch_sizes, widths, acceptance, rounds).items()}
    for b, t in tuning.items():
        t["round_seconds"] = {str(w): s for (bb, w), s in rounds.items() if str(bb) == b}
    return tuning


def round_costs(report: dict, batch_sizes: list[int], widths: list[int], reanchored: int,
                constrained: bool = False) -> dict:
    """Seconds per round at (batch, width): width 1 one plain decode step (a burst's step: the off
    run's decode time per token of a sequence), wider widths predicted from the engines' latencies
    and calibrated on the measured round at the widest width; of the runs under a grammar where
    `constrained` (their calls the same, each round's masks and multi-call drafting in the calibration)."""
    lat = {(x["graph"], x["batch"], x["rows"]): x["median_ms"] / 1e3 for x in report["latency"]}
    runs = [r for r in report["runs"] if r.get("constrained", False) == constrained]
    on_runs = [r for r in runs if r["mode"] == "on"]
    rounds = {}
    for b in batch_sizes:
        off = next(r for r in runs if r["mode"] == "off" and r["batch"] == b)
        on = next((r for r in on_runs if r["batch"] == b), None)
        rounds[(b, 1)] = b / off["decode_tokens_per_s"]   # (an off round is a burst of up to 16 steps)
        predicted = {}
        for w in widths:  # engine latencies of the round's calls
            draft = sum(lat.get((_HEAD_0, b, r), 0.0) for r in range(1, w - 1))
            reanchor = reanchored * lat.get((_HEAD_0, b, w), 0.0)
            predicted[w] = lat[(VERIFY_GREEDY.name, b, w)] + draft + reanchor
        # calibrate on the width the run used: its measured round includes host work and real contexts
        scale = (on["round_ms"] / 1e3) / predicted[max(widths)] if on and on["round_ms"] else 1.0
        for w in widths:
            rounds[(b, w)] = predicted[w] * scale
    return rounds


# ---- HTML -------------------------------------------------------------------------------

_HEAD_0 = GraphKind.mtp_head(0).name  # the head the latency table times


def _label(kind: GraphKind) -> str:
    return "verify" if kind.is_verify else "head" if kind.is_head else kind.name


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render(report_json: str | Path, out_html: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(Path(report_json).read_text())
    figures = []
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{_label(GraphKind.parse(x['graph']))} b{x['batch']} w{x['rows']}" for x in r["latency"]]
    ax.barh(labels, [x["median_ms"] for x in r["latency"]], xerr=[[0] * len(labels),
            [max(0.0, x["p90_ms"] - x["median_ms"]) for x in r["latency"]]])
    ax.set_xlabel("ms per call (median, bar to p90)")
    ax.tick_params(axis="y", labelsize=6)
    figures.append(("Engine latency per bucket", _png(fig)))
    plt.close(fig)
    free = [x for x in r["runs"] if not x.get("constrained")]
    on_runs = [x for x in free if x["mode"] == "on"]
    if on_runs:
        fig, ax = plt.subplots(figsize=(5, 3))
        for run in on_runs:
            ax.plot(range(1, len(run["acceptance_per_position"]) + 1), run["acceptance_per_position"], marker="o",
                    label=f"batch {run['batch']}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted share")
        ax.set_ylim(0, 1)
        ax.legend()
        figures.append(("Acceptance per draft position", _png(fig)))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3))
    for constrained in (False, True):
        for mode in ("off", "on"):
            pts = [(x["batch"], x["tokens_per_s"]) for x in r["runs"]
                   if x["mode"] == mode and bool(x.get("constrained")) == constrained]
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="--" if constrained else "-",
                        label=f"speculative {mode}{', JSON schema' if constrained else ''}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    figures.append(("Tokens/s, speculative decoding off and on", _png(fig)))
    plt.close(fig)

    runs_rows = [{"batch": x["batch"], "mode": x["mode"], "schema": "yes" if x.get("constrained") else "",
                  "tokens/s": x["tokens_per_s"],
                  "decode tokens/s": x["decode_tokens_per_s"], "round ms": x["round_ms"],
                  "accept length": x["accept_length"], "host share": x["host_share"],
                  **{f"{k} ms": v for k, v in x["phases_ms_per_round"].items()}} for x in r["runs"]]
    phase_cols = sorted({k for row in runs_rows for k in row if k.endswith(" ms") and k != "round ms"})
    categories = {}
    for run in on_runs:
        for cat, c in run["per_category"].items():
            categories.setdefault(cat, {"category": cat})[f"b{run['batch']} rate"] = c["rate"]
    tuning = [{"batch": b, "chosen width": t["width"], "gain over plain": t["gain_over_plain"],
               **{f"w{w} tok/s": v for w, v in t["tokens_per_s"].items()}} for b, t in r.get("tuning", {}).items()]
    sections = [
        "<h2>Device</h2>" + _table([{**r["device"], "backend": r["backend"], **r["versions"]}],
                                   list(r["device"]) + ["backend", *r["versions"]]),
        "<h2>Runs</h2><p>tokens/s: whole requests, prefill included; decode tokens/s: decode rounds only.</p>"
        + _table(runs_rows, ["batch", "mode", "schema", "tokens/s", "decode tokens/s", "round ms", "accept length",
                             "host share", *phase_cols]),
        "<h2>Decode speedup vs bound (accept_length x t_decode / t_round)</h2>"
        + _table(r["speedup"], ["batch", "measured", "bound", "of_bound"]),
        "<h2>Aggregate</h2><pre>" + html.escape(json.dumps(r["aggregate"], indent=2)) + "</pre>",
        "<h2>Acceptance per prompt category</h2>"
        + _table(list(categories.values()), ["category", *sorted({k for c in categories.values() for k in c
                                                                  if k != "category"})]),
        "<h2>Latency per bucket</h2>" + _table(r["latency"], ["graph", "batch", "rows", "median_ms", "p90_ms"]),
    ]
    if tuning:
        sections.append("<h2>Tuned verify width per batch size</h2>" + _table(tuning, list(tuning[0])))
    schema_costs = [{"batch": b, **{f"w{w} ms": round(sec * 1e3, 3) for w, sec in c.items()}}
                    for b, c in r.get("constrained_round_seconds", {}).items()]
    if schema_costs:
        sections.append("<h2>Round costs under a JSON schema (w1: a plain step with its mask)</h2>"
                        + _table(schema_costs, list(schema_costs[0])))
    plots = "".join(f"<h3>{html.escape(t)}</h3><img src='data:image/png;base64,{d}'/>" for t, d in figures)
    model = r["model"]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tandem profile</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}th{{background:#f3f3f3}}</style></head><body>
<h1>tandem profile: {html.escape(model.get('family', ''))} ({html.escape(model.get('architecture', ''))})</h1>
<p>{html.escape(r['engine_dir'])}, {r['created']}, {r['seconds']} s; settings
{html.escape(json.dumps(r['settings']))}</p>{''.join(sections)}{plots}</body></html>"""
    Path(out_html).write_text(page)
