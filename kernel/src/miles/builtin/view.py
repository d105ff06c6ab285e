"""Built-in plugin ``view``: the ``miles view RUN_DIR`` command (a static HTML report of a run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles_contracts import CommandSpec, RunContext

from miles.hookspecs import hookimpl
from miles.registry import Register

DESCRIPTION = """\
Write one self-contained HTML file (no network, opens from disk) that shows a run: the learning
curves from metrics.jsonl, and per step each episode as a tree of branches (compactions, retries,
sub-agents) with its reward, per-role rewards, status and exit reason, and its tokens coloured by
loss mask (what was trained, what was context: prompt, tool results). Token ids need
run.dump_tokens=true; they are decoded with the run's tokenizer (model.name of its config.yaml, or
--tokenizer), or shown as ids when it does not load.

  miles view runs/calculator_agent                  # -> runs/calculator_agent/view.html
  miles view runs/calculator_agent --steps 3,7-9 --out /tmp/report.html
  miles view runs/calculator_agent --last 20 --max-samples 4 --max-tokens 256
"""


def _view(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles.view import ViewLimits, write_report

    limits = ViewLimits(steps=args.steps, last=args.last, max_samples=args.max_samples,
                        max_tokens=args.max_tokens, tokenizer=args.tokenizer)
    report = write_report(Path(args.run_dir), Path(args.out) if args.out else None, limits)
    print(f"miles view: {report.episodes} episode(s) of step(s) {', '.join(map(str, report.steps)) or 'none'}; "
          f"{report.decoder_note}", file=sys.stderr)
    print(report.path)
    return 0


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (<run.output_dir>/<run.name>)")
    p.add_argument("--out", metavar="FILE", help="where to write the page (default RUN_DIR/view.html)")
    p.add_argument("--steps", metavar="SPEC", help="steps to show: 3, 1,4 or 2-5 (default: the --last newest)")
    p.add_argument("--last", type=int, default=5, metavar="N", help="without --steps: the N newest dumped steps (0: all)")
    p.add_argument("--max-samples", type=int, default=16, metavar="N", help="episodes shown per step (default 16)")
    p.add_argument("--max-tokens", type=int, default=1024, metavar="N",
                   help="tokens shown per row, prompt and response each (default 1024)")
    p.add_argument("--tokenizer", metavar="FOLDER", help="decode with this tokenizer folder ('none': show ids)")


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("view", CommandSpec("write a static HTML report of a run: episodes as branch trees, loss masks, curves",
                                 _view, add_arguments=_args, description=DESCRIPTION))
