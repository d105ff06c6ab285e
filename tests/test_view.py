"""`miles view RUN_DIR`: the static HTML report of a run, checked in a real headless Chromium.

The run folder is made by hand (the issue allows a hand-made dump) in exactly the shape
``miles.loop.run_dir.dump_samples`` writes, with token ids from the SmolLM2 tokenizer (the tiny test
models'): one episode of four branches (root with a calculator call and its result, a retried
attempt, a sub-agent of another role, a compaction as the primary), per-role rewards, and model
text that tries HTML injection. The page is written by the real CLI in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
INJECTION = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def tokenizer_folder() -> Path:
    """SmolLM2's folder (the tiny test models' tokenizer), from the cache: no torch import."""
    from miles_models import pull

    return pull("smollm2-135m-instruct", progress=False)


def _row(tok: Any, prompt: str, pieces: list[tuple[str, int]], branch: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    """A dump row: ``pieces`` are (text, loss mask) stretches of the response."""
    prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
    response: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        ids = tok.encode(text, add_special_tokens=False).ids
        response += ids
        mask += [trained] * len(ids)
    row = {"index": 0, "group": 0, "prompt": [{"role": "user", "content": "What is 2+3?"}], "label": "5",
           "response": pieces[-1][0], "reward": 1.0, "status": "completed", "exit_reason": "stop",
           "exit_detail": None, "response_tokens": len(response), "weight_versions": [0],
           "tokens": prompt_ids + response, "loss_mask": mask,
           "rollout_logprobs": [-0.25 if m else 0.0 for m in mask], "token_versions": [0 if m else -1 for m in mask]}
    if branch is not None:
        row["branch"] = {"episode_id": "e1", "session_id": "s1", "role": "agent", "retried": False,
                         "parent_branch": None, "fork_turn": None, "cause": "root", **branch}
    row.update(fields)
    return row


def make_run(folder: Path, model: Path) -> Path:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call><|im_end|>'
    result = f"\n<|im_start|>tool\nCALC-RESULT 5 {INJECTION}<|im_end|>\n<|im_start|>assistant\n"
    root = _row(tok, prompt, [(call, 1), (result, 0), ("The answer is 5.<|im_end|>", 1)], {"branch_id": 0})
    retried = _row(tok, prompt, [("ABANDONED-ATTEMPT maybe 6<|im_end|>", 1)],
                   {"branch_id": 1, "parent_branch": 0, "fork_turn": 1, "cause": "retry", "retried": True})
    helper = _row(tok, "<|im_start|>user\nlook it up<|im_end|>\n<|im_start|>assistant\n", [("HELPER-SAYS five<|im_end|>", 1)],
                  {"branch_id": 3, "parent_branch": 0, "fork_turn": 0, "cause": "subagent", "role": "helper",
                   "session_id": "s2"}, reward=0.5)
    primary = _row(tok, "<|im_start|>user\nFound: five<|im_end|>\n<|im_start|>assistant\n",
                   [(f"COMPACTED-ANSWER 5 {INJECTION}<|im_end|>", 1)],
                   {"branch_id": 2, "parent_branch": 0, "fork_turn": 1, "cause": "compaction"},
                   branches=[root, retried, helper], role_rewards={"agent": 1.0, "helper": 0.5})
    truncated = _row(tok, prompt, [("TRUNCATED-REPLY 2 plus", 1)], None, index=1, reward=0.0, status="truncated",
                     exit_reason="timeout", exit_detail="agent_timeout 30s passed")
    run = folder / "branched"
    (run / "samples").mkdir(parents=True)
    (run / "config.yaml").write_text(f"model:\n  name: {model}\nrun:\n  name: branched\n")
    (run / "samples" / "step_000001.jsonl").write_text(json.dumps(truncated) + "\n")
    (run / "samples" / "step_000002.jsonl").write_text("\n".join(json.dumps(r) for r in (primary, truncated)) + "\n{torn\n")
    metrics = [{"step": s, "time": 0.0, "rollout/reward_mean": r, "train/loss": loss, "train/grad_norm": None}
               for s, r, loss in ((1, 0.0, 0.31), (2, 0.5, 0.12))]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    return run


def miles_view(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli.main", "view", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install -y chromium; .ci/run installs it)")
def test_report_of_a_branched_episode_renders_in_headless_chromium(tokenizer_folder: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path, tokenizer_folder)
    out = miles_view(str(run), "--out", str(tmp_path / "report.html"))
    assert out.returncode == 0, out.stderr
    page = tmp_path / "report.html"
    assert out.stdout.strip() == str(page)
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # self-contained: nothing to fetch

    assert CHROMIUM is not None
    browser = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0"]
    dumped = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    dom = dumped.stdout
    # no console output at all: script errors and Content-Security-Policy refusals both log there
    assert ":CONSOLE" not in dumped.stderr, dumped.stderr
    # the page's own script ran to its end, and its error hook caught nothing
    assert 'id="view-status" class="ready"' in dom and "report ready: 3 episodes" in dom
    assert '<div id="view-errors" hidden=""></div>' in dom
    # the injected markup is text on the page, never an element
    assert "pwned" not in dom.split("<title>")[1].split("</title>")[0]
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom and "<img src=\"x\"" not in dom
    # the episode's tree: the compaction (primary) under the root with the retry and the helper beside it
    for text in ("branch 0", "branch 1", "branch 2", "branch 3", "compaction", "subagent", "retried (abandoned attempt)",
                 "role helper", "forked from branch 0 at turn 1", "role rewards agent 1, helper 0.5", "4 branches"):
        assert text in dom, text
    assert dom.index("branch 0") < dom.index("branch 2") < dom.index("branch 3")
    # tokens decoded by the run's tokenizer: model turns trained, the tool result context
    text = re.sub(r"<[^>]+>", "", dom)  # trained tokens are one element each
    assert "ABANDONED-ATTEMPT maybe 6" in text and "HELPER-SAYS five" in text and "COMPACTED-ANSWER 5" in text
    assert 'title="context: tool results, template (loss mask 0)"' in dom and "CALC-RESULT 5" in dom
    assert "rollout log-prob -0.2500" in dom
    assert "train log-probs per token" in dom  # the dump has none: the page says it colours by mask only
    # outcome and exit reason, the torn line counted, the learning curves drawn
    assert "truncated" in dom and "(timeout)" in dom and "agent_timeout 30s passed" in dom
    assert "1 line(s) of this dump are not JSON objects" in dom
    assert "rollout/reward_mean" in dom and "<polyline" in dom

    shot = tmp_path / "view.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_caps_ids_fallback_and_bad_steps_are_reported(tokenizer_folder: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path, tokenizer_folder)
    page = tmp_path / "small.html"
    out = miles_view(str(run), "--steps", "2", "--max-samples", "1", "--max-tokens", "3", "--tokenizer", "none",
                     "--out", str(page))
    assert out.returncode == 0, out.stderr
    html = page.read_text()
    assert "token ids shown, not text: --tokenizer none" in html
    assert "1 more episodes of this step not shown (--max-samples)" in html
    assert "more response tokens not shown: --max-tokens" in html and "earlier prompt tokens not shown" in html
    assert 'id="step-1"' not in html and 'id="step-2"' in html

    missing = miles_view(str(run), "--steps", "2-4")
    assert missing.returncode == 2
    assert "no sample dump for step(s) 3-4; the run folder has 1-2" in missing.stderr


def test_train_logprobs_in_a_dump_colour_tokens_by_their_gap(tokenizer_folder: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path, tokenizer_folder)
    path = run / "samples" / "step_000001.jsonl"
    row = json.loads(path.read_text())
    row["train_logprobs"] = [lp - 0.7 for lp in row["rollout_logprobs"]]  # every trained token 0.7 apart
    path.write_text(json.dumps(row) + "\n")
    page = tmp_path / "gap.html"
    assert miles_view(str(run), "--steps", "1", "--out", str(page)).returncode == 0
    html = page.read_text()
    assert 'class="tok gap3"' in html and "train log-prob -0.9500" in html
    assert "coloured by the gap between their train and rollout log-probs" in html
