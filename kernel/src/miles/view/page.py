"""The report document: header, learning curves, then each chosen step's episodes."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from miles.errors import MilesError
from miles.loop.run_dir import dumped_steps
from miles.view.curves import curves_html
from miles.view.episode import branch_rows, episode_html
from miles.view.run_folder import StepDump, choose_steps, model_name, read_metrics, read_step
from miles.view.tokens import Decoder, IdDecoder, load_decoder


@dataclass(frozen=True, slots=True)
class ViewLimits:
    """What the report shows: which steps (``steps`` spec, else the ``last`` newest), how many
    episodes per step and how many tokens per row (prompt and response each). The page says
    everything these cut."""

    steps: str | None = None
    last: int = 5
    max_samples: int = 16
    max_tokens: int = 1024
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        for name in ("last", "max_samples", "max_tokens"):
            if getattr(self, name) < 0:
                raise MilesError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Report:
    path: Path
    steps: list[int]
    episodes: int
    decoder_note: str


def write_report(run_dir: Path, out: Path | None = None, limits: ViewLimits = ViewLimits()) -> Report:
    """Write the report of ``run_dir`` to ``out`` (default ``<run_dir>/view.html``)."""
    if not run_dir.is_dir():
        raise MilesError(f"{run_dir} is not a folder; give a run folder (<run.output_dir>/<run.name>)")
    available = dumped_steps(run_dir)
    metrics = read_metrics(run_dir)
    if not available and not metrics:
        raise MilesError(f"{run_dir} holds neither samples/step_*.jsonl nor metrics.jsonl; is it a run folder?")
    steps = choose_steps(available, limits.steps, limits.last)
    dumps = [read_step(run_dir, s) for s in steps]
    has_tokens = any("tokens" in r for d in dumps for r in d.rows)
    model = model_name(run_dir)
    decoder: Decoder = load_decoder(run_dir, limits.tokenizer, model) if has_tokens else IdDecoder("no tokens in the dump")
    html = _document(run_dir, model, available, dumps, metrics, decoder, limits, has_tokens)
    path = out or run_dir / "view.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    shown = sum(min(len(d.rows), limits.max_samples) for d in dumps)
    return Report(path, steps, shown, decoder.note)


ERROR_SCRIPT = """window.addEventListener('error', function (e) {
  var box = document.getElementById('view-errors');
  box.hidden = false;
  box.appendChild(document.createTextNode('script error: ' + e.message + '\\n'));
});"""
"""Runs first: any later exception shows on the page (the browser test reads the DOM for it)."""

MAIN_SCRIPT = """(function () {
  function setAll(open) {
    document.querySelectorAll('details').forEach(function (d) { d.open = open; });
  }
  document.getElementById('expand-all').addEventListener('click', function () { setAll(true); });
  document.getElementById('collapse-all').addEventListener('click', function () { setAll(false); });
  var status = document.getElementById('view-status');
  status.textContent = 'report ready: ' + document.querySelectorAll('.episode').length + ' episodes';
  status.className = 'ready';
})();"""
"""The page works without it (details elements fold on their own); it adds expand/collapse all
and marks the page ready, the signal that the script ran to its end."""

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d1d1f; }
h1 { font-size: 1.4em; margin: 0 0 .3em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.6em; }
.note { color: #555; font-size: .92em; } .cut { color: #a33; font-style: italic; }
#view-errors { background: #fdd; color: #900; white-space: pre-wrap; padding: .5em; }
#view-status { font-size: .85em; color: #888; } #view-status.ready { color: #2a7; }
.curves { display: flex; flex-wrap: wrap; gap: .8em; }
.curve { margin: 0; border: 1px solid #ddd; padding: .3em; } .curve figcaption { font-size: .85em; font-weight: 600; }
.curve svg text { font-size: 10px; fill: #666; } .curve .axis { stroke: #bbb; }
.curve .line polyline { fill: none; stroke: #2364aa; stroke-width: 1.5; } .curve .dot circle { fill: #2364aa; }
.episode { border: 1px solid #ccc; border-radius: 4px; margin: .5em 0; padding: .3em .6em; }
.episode > summary { cursor: pointer; font-weight: 600; }
.tree { list-style: none; padding-left: 1.2em; border-left: 2px solid #e3e3e3; margin: .3em 0; }
.node { margin: .4em 0; } .node-head { font-size: .9em; background: #f4f4f6; padding: .15em .4em; border-radius: 3px; }
.bid { font-weight: 700; } .cause { padding: 0 .35em; border-radius: 3px; background: #ddd; }
.cause-compaction { background: #cfe3ff; } .cause-retry { background: #ffe1b3; } .cause-rewrite { background: #f3d1f5; }
.cause-subagent { background: #d2f2d5; } .cause-spurious { background: #ffc9c9; }
.retried { color: #a60; font-weight: 600; } .reward { font-weight: 700; }
.status-completed { color: #286; } .status-truncated { color: #a70; } .status-aborted, .status-failed { color: #b22; }
.detail { color: #666; font-style: italic; }
.msg { white-space: pre-wrap; } .role { font-weight: 600; color: #555; } .toolcall { background: #fff3c4; font-family: monospace; }
pre.tokens { white-space: pre-wrap; word-break: break-word; background: #fafafa; border: 1px solid #eee; padding: .4em; margin: .3em 0; }
.ctx { color: #777; background: #eee; } .turn .tok { background: #d7f5dc; }
.turn .tok.gap0 { background: #c8efcf; } .turn .tok.gap1 { background: #fff2a8; }
.turn .tok.gap2 { background: #ffcc80; } .turn .tok.gap3 { background: #ff9a9a; }
.legend span { padding: 0 .4em; margin-right: .4em; border: 1px solid #ddd; }
"""


def _hash(script: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"


def _document(run_dir: Path, model: str | None, available: list[int], dumps: list[StepDump], metrics: list[dict[str, Any]],
              decoder: Decoder, limits: ViewLimits, has_tokens: bool) -> str:
    policy = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
              f"script-src {_hash(ERROR_SCRIPT)} {_hash(MAIN_SCRIPT)}")
    shown = [d.step for d in dumps]
    head = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">',
        f"<title>miles view: {escape(run_dir.name)}</title><style>{CSS}</style></head><body>",
        f"<h1>Run {escape(run_dir.name)}</h1>",
        '<div id="view-errors" hidden></div><p id="view-status" class="pending">the report script did not run</p>',
        f'<p>model {escape(model or "(not in config.yaml)")} · folder <code>{escape(str(run_dir))}</code></p>',
        f'<p class="note">{_steps_note(available, shown, limits)}</p>',
    ]
    if has_tokens:
        head.append(f'<p class="note">{escape(decoder.note)}.</p>')
        head.append(_legend(any("train_logprobs" in r for d in dumps for row in d.rows for r in branch_rows(row))))
    elif dumps:
        head.append('<p class="note">The dumps hold no token ids (run.dump_tokens=false): responses are shown as text, '
                    "without loss mask or log-probs. Run with run.dump_tokens=true to see them.</p>")
    head.append('<p><button id="expand-all" type="button">expand all</button> '
                '<button id="collapse-all" type="button">collapse all</button></p>')
    body = ["<h2>Learning curves</h2>", curves_html(metrics)]
    for dump in dumps:
        body.append(_step_html(dump, decoder, limits))
    tail = [f"<script>{ERROR_SCRIPT}</script>", f"<script>{MAIN_SCRIPT}</script>", "</body></html>"]
    return "\n".join([*head, *body, *tail]) + "\n"


def _steps_note(available: list[int], shown: list[int], limits: ViewLimits) -> str:
    if not available:
        return "No sample dumps (samples/step_*.jsonl) in this run folder."
    text = f"Steps shown: {', '.join(map(str, shown)) or 'none'} of {len(available)} dumped ({available[0]}-{available[-1]})."
    if len(shown) < len(available):
        text += " Choose others with --steps (e.g. --steps 1,4-6) or --last N."
    text += f" At most {limits.max_samples} episodes a step and {limits.max_tokens} tokens a row (prompt and response each)."
    return text


def _legend(train_logprobs: bool) -> str:
    if train_logprobs:
        gaps = ('<span class="tok gap0">|train-rollout| &lt; 0.01</span><span class="tok gap1">&lt; 0.1</span>'
                '<span class="tok gap2">&lt; 0.5</span><span class="tok gap3">&ge; 0.5</span>')
        why = "Trained tokens are coloured by the gap between their train and rollout log-probs."
    else:
        gaps = '<span class="tok">trained (loss mask 1)</span>'
        why = ("The dumps hold rollout log-probs only: the learner does not record train log-probs per token (it logs their "
               "mean gap, train/train_rollout_logprob_abs_diff, in the curves), so tokens are coloured by loss mask only. "
               "Hover a trained token for its id and rollout log-prob.")
    return (f'<p class="legend"><span class="turn">{gaps}</span><span class="ctx">context (loss mask 0: prompt, '
            f'tool results, template)</span></p><p class="note">{why}</p>')


def _step_html(dump: StepDump, decoder: Decoder, limits: ViewLimits) -> str:
    rows = dump.rows[: limits.max_samples]
    rewards = [r["reward"] for r in dump.rows if isinstance(r.get("reward"), (int, float))]
    mean = f"mean reward {sum(rewards) / len(rewards):.4g}" if rewards else "no rewards"
    branched = sum(1 for r in dump.rows if r.get("branches"))
    out = [f'<section id="step-{dump.step}"><h2>Step {dump.step}</h2>',
           f'<p class="note">{len(dump.rows)} episodes ({branched} with several branches), {mean}.</p>']
    if dump.unreadable:
        out.append(f'<p class="cut">{dump.unreadable} line(s) of this dump are not JSON objects and are skipped.</p>')
    for k, row in enumerate(rows):
        out.append(episode_html(row, decoder, limits.max_tokens, open_=k == 0 or bool(row.get("branches"))))
    if len(dump.rows) > len(rows):
        out.append(f'<p class="cut">{len(dump.rows) - len(rows)} more episodes of this step not shown (--max-samples).</p>')
    out.append("</section>")
    return "\n".join(out)
