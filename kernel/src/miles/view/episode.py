"""One dumped episode as HTML: its branches as a tree, each with its outcome and its tokens.

A dump row is an episode's primary branch with the others under ``branches`` (each with a
``branch``: ``branch_id``, ``parent_branch``, ``fork_turn``, ``cause``, ``role``, ``retried``;
``docs/design/trajectories.md``). The tree hangs each branch under the one it forked from; a
branch whose parent is not in the dump (a branch with no trained turn is no row) is drawn as a
root that says so. Every string from the dump goes through :func:`html.escape`: it is model
output and agent text, and the page must show it, never run it.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from miles.view.tokens import Decoder, RowTokens, row_tokens


def _text(value: Any) -> str:
    return escape(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def branch_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The episode's rows, primary first, nested ``branches`` flattened in order."""
    rows = [row]
    for child in row.get("branches") or []:
        if isinstance(child, dict):
            rows.extend(branch_rows(child))
    return rows


def _branch(row: dict[str, Any]) -> dict[str, Any]:
    branch = row.get("branch")
    return branch if isinstance(branch, dict) else {}


def branch_tree(rows: list[dict[str, Any]]) -> tuple[list[int], dict[int, list[int]]]:
    """``(roots, children)`` as positions in ``rows``: each branch under its ``parent_branch``."""
    by_id: dict[Any, int] = {}
    for k, row in enumerate(rows):
        by_id.setdefault(_branch(row).get("branch_id", f"row{k}"), k)
    roots: list[int] = []
    children: dict[int, list[int]] = {}
    for k, row in enumerate(rows):
        parent = by_id.get(_branch(row).get("parent_branch"))
        if parent is None or parent == k:
            roots.append(k)
        else:
            children.setdefault(parent, []).append(k)
    return roots, children


def episode_html(row: dict[str, Any], decoder: Decoder, max_tokens: int, *, open_: bool) -> str:
    rows = branch_rows(row)
    roots, children = branch_tree(rows)
    summary = [f"sample {_text(row.get('index'))}", f"group {_text(row.get('group'))}",
               _reward(row.get("reward")), _status(row)]
    if len(rows) > 1:
        summary.append(f"{len(rows)} branches")
    if row.get("role_rewards"):
        summary.append("role rewards " + ", ".join(
            f"{escape(str(role))} {_number(value)}" for role, value in row["role_rewards"].items()))
    out = [f'<details class="episode"{" open" if open_ else ""}><summary>{" · ".join(summary)}</summary>',
           f'<div class="prompt-msg"><b>prompt</b> {_prompt_html(row.get("prompt"))}</div>']
    if row.get("label") is not None:
        out.append(f'<div class="label-line"><b>label</b> {_text(row["label"])}</div>')
    out.append('<ul class="tree">')
    for k in roots:
        out.append(_node_html(rows, k, children, decoder, max_tokens))
    out.append("</ul></details>")
    return "\n".join(out)


def _node_html(rows: list[dict[str, Any]], k: int, children: dict[int, list[int]], decoder: Decoder, max_tokens: int) -> str:
    row = rows[k]
    branch = _branch(row)
    head = [f'<span class="bid">branch {_text(branch.get("branch_id", "-"))}</span>' if branch else '<span class="bid">trajectory</span>']
    if branch:
        cause = str(branch.get("cause", "root"))
        head.append(f'<span class="cause cause-{escape(cause, quote=True)}">{escape(cause)}</span>')
        head.append(f"role {_text(branch.get('role', 'agent'))}")
        if branch.get("parent_branch") is not None:
            fork = f"forked from branch {_text(branch['parent_branch'])}"
            if branch.get("fork_turn") is not None:
                fork += f" at turn {_text(branch['fork_turn'])}"
            if not any(k in v for v in children.values()):
                fork += " (not in the dump: it trained no turn)"
            head.append(fork)
        if branch.get("retried"):
            head.append('<span class="retried">retried (abandoned attempt)</span>')
    if k == 0:
        head.append("primary")
    head += [_reward(row.get("reward")), _status(row), f"{_text(row.get('response_tokens'))} response tokens"]
    if row.get("weight_versions"):
        head.append(f"weights {_text(row['weight_versions'])}")
    body = _tokens_html(row, decoder, max_tokens)
    kids = "".join(_node_html(rows, c, children, decoder, max_tokens) for c in children.get(k, []))
    return (f'<li><div class="node"><div class="node-head">{" · ".join(head)}</div>{body}</div>'
            + (f'<ul class="tree">{kids}</ul>' if kids else "") + "</li>")


def _reward(value: Any) -> str:
    return f'reward <span class="reward">{_number(value)}</span>'


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else _text(value)


def _status(row: dict[str, Any]) -> str:
    status = str(row.get("status"))
    text = f'<span class="status status-{escape(status, quote=True)}">{escape(status)}</span>'
    if row.get("exit_reason"):
        text += f" ({_text(row['exit_reason'])})"
    if row.get("exit_detail"):
        text += f' <span class="detail">{_text(row["exit_detail"])}</span>'
    return text


def _prompt_html(prompt: Any) -> str:
    """A string prompt as text; a message list one message a line, tool calls spelled out."""
    if not isinstance(prompt, list):
        return f'<span class="msg">{_text(prompt)}</span>'
    lines = []
    for message in prompt:
        if not isinstance(message, dict):
            lines.append(f'<div class="msg">{_text(message)}</div>')
            continue
        content = message.get("content")
        text = _text(content) if content not in (None, "") else ""
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            text += f' <span class="toolcall">{_text(function.get("name"))}({_text(function.get("arguments"))})</span>'
        lines.append(f'<div class="msg"><span class="role">{_text(message.get("role"))}</span> {text}</div>')
    return "".join(lines)


def _tokens_html(row: dict[str, Any], decoder: Decoder, max_tokens: int) -> str:
    tokens = row_tokens(row, decoder, max_tokens)
    if tokens is None:
        return (f'<div class="response"><b>response</b> <span class="msg">{_text(row.get("response", ""))}</span>'
                '<div class="note">No token ids in this dump (run.dump_tokens=false): no loss mask to show.</div></div>')
    return _token_runs_html(tokens)


def _token_runs_html(tokens: RowTokens) -> str:
    prompt_cut = f'<span class="cut">[{tokens.prompt_cut} earlier prompt tokens not shown]</span>' if tokens.prompt_cut else ""
    parts = [f'<details class="prompt-tokens"><summary>prompt tokens (context, not trained)</summary>'
             f'<pre class="tokens">{prompt_cut}<span class="ctx">{escape(tokens.prompt_text)}</span></pre></details>',
             '<pre class="tokens">']
    turn = 0
    for run in tokens.runs:
        if not run.trained:
            parts.append(f'<span class="ctx" title="context: tool results, template (loss mask 0)">{escape(run.text)}</span>')
            continue
        turn += 1
        parts.append(f'<span class="turn" title="model turn {turn} (loss mask 1)">')
        for t in run.tokens:
            tip = f"id {t.token_id}"
            if t.rollout_logprob is not None:
                tip += f", rollout log-prob {t.rollout_logprob:.4f}"
            if t.train_logprob is not None:
                tip += f", train log-prob {t.train_logprob:.4f}"
            band = t.gap_band
            cls = "tok" if band is None else f"tok gap{band}"
            parts.append(f'<span class="{cls}" title="{escape(tip, quote=True)}">{escape(t.text)}</span>')
        parts.append("</span>")
    if tokens.response_cut:
        parts.append(f'<span class="cut">[{tokens.response_cut} more response tokens not shown: --max-tokens]</span>')
    parts.append("</pre>")
    return "".join(parts)
