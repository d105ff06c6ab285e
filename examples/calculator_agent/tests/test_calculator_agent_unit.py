"""The example agent's pieces that need no model: its tool and its registration.

The agent itself runs end to end (real openai client, session server, engine) in
packages/miles-tito/tests/test_generators.py::test_agentic_trains_on_the_calculator_agents_exact_tokens.
"""

from __future__ import annotations

from calculator_agent.agent import CALCULATOR_TOOL, run_tool


def test_the_tool_answers_and_reports_mistakes_as_text() -> None:
    assert run_tool("calculator", '{"expression": "17 * 23"}') == "391"
    assert run_tool("calculator", '{"expression": "1 / 0"}') == "error: division by zero"
    assert run_tool("calculator", '{"expr": "1"}') == "error: 'expression' must be a string"
    assert run_tool("search", "{}").startswith("error: there is no tool named 'search'")
    assert CALCULATOR_TOOL["function"]["name"] == "calculator"


def test_the_agent_is_registered_by_its_entry_point() -> None:
    from miles.context import context_for
    from miles_contracts import AgentSpec

    entry = context_for().kernel.agents().entry("calculator_agent")
    assert entry.distribution == "miles-example-calculator-agent"
    assert isinstance(entry.obj, AgentSpec) and callable(entry.obj.run)
