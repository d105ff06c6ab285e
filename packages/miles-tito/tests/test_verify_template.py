"""``miles verify-template``: exit codes and reports on real templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from miles.cli.main import main

# Prefix-invariant, but each message's header carries its position: rendered after a window of the
# history, appended messages get different numbers than after the whole history.
NUMBERED = (
    "{% for m in messages %}<|im_start|>{{ m.role }} #{{ loop.index }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["verify-template", *args])
    return code, capsys.readouterr().out


def test_both_families_pass_and_the_stock_qwen3_template_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert verify(capsys, "chatml")[0] == 0
    assert verify(capsys, "qwen3")[0] == 0
    code, out = verify(capsys, "qwen3", "--stock")
    assert code == 1
    assert "BREAK single_tool_call" in out and "BREAK thinking" in out
    assert "(assistant) renders differently" in out


def test_a_template_file_with_a_family_and_json_output(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from miles_model_qwen3.chat import template

    path = tmp_path / "stock.jinja"
    path.write_text(template("qwen3_stock"))
    code, out = verify(capsys, str(path), "--family", "qwen3", "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert {b["case"] for b in report["breaks"]} >= {"thinking", "parallel_tool_calls", "long_tool_chain"}
    assert all(b["kind"] == "prefix" for b in report["breaks"])


def test_a_model_folder_uses_its_template_and_checks_token_boundaries(capsys: pytest.CaptureFixture[str], tiny_dense: Path) -> None:
    code, out = verify(capsys, str(tiny_dense), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["checked"] > 10
    assert report["token_differences"] == []  # ChatML splits at special tokens: same ids either way


def test_position_dependent_rendering_needs_the_full_render_check(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "numbered.jinja"
    path.write_text(NUMBERED)
    code, out = verify(capsys, str(path))
    assert code == 1 and "WINDOW" in out and "tito.render_check: full" in out
    assert verify(capsys, str(path), "--render-check", "full")[0] == 0


def test_unreadable_input_is_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify-template", "no-such-model-or-file"]) == 2
    assert "no-such-model-or-file" in capsys.readouterr().err
