"""``miles verify-template MODEL_OR_TEMPLATE``: where does a chat template break prefix invariance?

``MODEL_OR_TEMPLATE`` is, in this order: a registered chat family (its TITO template, or with
``--stock`` the upstream one it fixes), a template file, or a model (``miles models list`` name or a
folder: its ``chat_template.jinja`` or ``tokenizer_config.json`` template). Exit code 0 when every
split point is prefix-invariant, 1 on a break, 2 when the input cannot be read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.errors import MilesError

if TYPE_CHECKING:
    from miles_contracts import RunContext


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODEL_OR_TEMPLATE", help="chat family name, template file, or model name/folder")
    parser.add_argument("--stock", action="store_true", help="check the family's stock (upstream) template instead of its fixed one")
    parser.add_argument("--family", help="family whose allowed roles and template kwargs apply to a template file or model")
    parser.add_argument("--tokenizer", help="model whose tokenizer checks token boundaries too (default: the model given, if any)")
    parser.add_argument("--render-check", choices=["window", "full"], default="window",
                        help="the tito.render_check the template will run under (window also checks window renders)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace, ctx: RunContext) -> int:
    """The command; chat families are those of ``ctx.kernel`` (the CLI's plugins)."""
    from miles_tito.verify.check import format_report, verify_template

    families = ctx.kernel.chat_families()
    family = families.get(args.family) if args.family else None
    tokenizer_source: Path | None = None
    if args.target in families:
        family = families.get(args.target)
        template = family.stock_template if args.stock else family.template
        if template is None:
            raise MilesError(f"chat family {family.name!r} has no stock template (its template is the upstream one)")
        label = f"{family.name} ({'stock' if args.stock else 'fixed'} template)"
    elif args.stock:
        raise MilesError(f"--stock needs a registered chat family; registered: {families.describe() or 'none'}")
    elif Path(args.target).is_file():
        template, label = Path(args.target).read_text(encoding="utf-8"), args.target
    else:
        tokenizer_source = _model_folder(args.target)
        template, label = _model_template(tokenizer_source), args.target
    if args.tokenizer:
        tokenizer_source = _model_folder(args.tokenizer)
    report = verify_template(
        template,
        label=label,
        template_kwargs=family.template_kwargs if family else None,
        allowed_append_roles=family.allowed_append_roles if family else frozenset({"user", "tool", "system"}),
        tokenizer=_tokenizer(tokenizer_source) if tokenizer_source else None,
        render_check=args.render_check,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def _model_folder(name: str) -> Path:
    from miles_models import resolve_model

    return resolve_model(name)


def _model_template(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # named templates: the default one is what chat uses
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise MilesError(f"{folder} has no chat template (no chat_template.jinja, none in tokenizer_config.json)")
    return template


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
